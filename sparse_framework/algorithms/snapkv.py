"""SnapKV, retrievable (Li et al., NeurIPS 2024): the prompt's last queries vote on its keys.

At prefill the last `window` prompt queries attend (softmax, causal inside the window) to
the prompt; their weights on the keys before the window are summed over the window and
smoothed by a 1-D pooling (stride 1, padding kernel // 2). Facts from the original code:
the window's own tokens are always kept; the published LongBench setting is window 32,
kernel 7, max-pooling (the code's fallback is kernel 5, average-pooling, zero padding
counted). The original scores per query head after repeating KV; here the group's votes are
combined per KV head by `gqa_reduce` ("mean" by default, as kvpress's SnapKV averages).

Unlike the original nothing is evicted: the full KV stays in the store, and the selection of
every decode step is the prompt's best-voted positions plus the window and the decode tokens
so far (scored +inf, so they are kept first), within the budget, plus sink and recent tokens.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..common.batch import Batch, Request
from ..common.layout import resolve_impl
from ..kernels.reference_scores import reduce_groups
from .base import NO_INPUTS, Inputs, ScoringAlgorithm, scoring_kernel


class SnapKVOptions(BaseModel):
    """SnapKV's extra-config (defaults: the published LongBench setting)."""

    model_config = ConfigDict(extra="forbid")

    window: int = Field(32, ge=1, description="observation window: the last prompt queries that vote")
    kernel_size: int = Field(7, ge=1, description="pooling kernel over positions (odd)")
    pooling: Literal["max", "avg"] = Field("max", description="max- or average-pooling of the votes")
    gqa_reduce: Literal["max", "sum", "mean"] = Field("mean", description="how a GQA group's votes combine")
    impl: Literal["auto", "torch", "triton"] = Field("auto", description="vote kernel: auto = triton on CUDA")

    @field_validator("kernel_size")
    @classmethod
    def _odd(cls, k: int) -> int:
        if k % 2 == 0:
            raise ValueError(f"kernel_size must be odd (padding kernel_size // 2 keeps every position), got {k}")
        return k


def snapkv_votes(keys: torch.Tensor, queries: torch.Tensor, options: SnapKVOptions, impl: str = "torch") -> torch.Tensor:
    """Pooled votes of one prompt: keys [L, Hkv, D], queries [L, Hq, D] -> float32
    [Hkv, L - window] (empty when the prompt is no longer than the window)."""
    n, hkv, _ = keys.shape
    w = min(options.window, n)
    votes = scoring_kernel("snapkv_window_mass", impl, keys.device)(queries[n - w :], keys)  # [Hq, n - w]
    if votes.shape[-1]:
        pool = torch.nn.functional.max_pool1d if options.pooling == "max" else torch.nn.functional.avg_pool1d
        votes = pool(votes.unsqueeze(1), options.kernel_size, stride=1, padding=options.kernel_size // 2).squeeze(1)
    return reduce_groups(votes.unsqueeze(0), hkv, options.gqa_reduce)[0]


class SnapKV(ScoringAlgorithm):
    """Token-granular, one selection per KV head; votes pooled as [layers, max_requests,
    kv_heads, max_seq_len] float32, with each request's window start."""

    Config = SnapKVOptions
    granularity = "token"
    per_kv_head = True
    needs_prefill_queries = True

    @classmethod
    def representation_bytes_per_token(cls, layout, config) -> float:  # type: ignore[no-untyped-def]
        """One float32 vote per KV head."""
        return 4.0 * layout.num_kv_heads

    def __init__(self, config, layout, max_requests, max_seq_len) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, layout, max_requests, max_seq_len)
        shape = (layout.num_layers, max_requests, layout.num_kv_heads, max_seq_len)
        self.votes = torch.zeros(shape, dtype=torch.float32, device=layout.device)
        self.window_start = torch.zeros(layout.num_layers, max_requests, dtype=torch.long, device=layout.device)
        self.impl = resolve_impl(self.options.impl, layout.device)
        self.topk_impl = self.impl

    def build(
        self, layer: int, request: Request, keys: torch.Tensor, queries: torch.Tensor | None = None, *, inputs: Inputs = NO_INPUTS
    ) -> None:
        if queries is None:
            raise ValueError("SnapKV needs the prompt's queries at prefill (needs_prefill_queries)")
        votes = snapkv_votes(keys, queries, self.options, self.impl)  # type: ignore[arg-type]
        self.votes[layer, request.slot, :, : votes.shape[-1]] = votes
        self.window_start[layer, request.slot] = votes.shape[-1]

    def append(self, layer: int, batch: Batch, keys: torch.Tensor, *, inputs: Inputs = NO_INPUTS) -> None:
        """Decode tokens need no representation: every position from the window on scores
        +inf in `score`."""

    def score(
        self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS
    ) -> torch.Tensor:
        assert batch.slot_ids is not None
        n = batch.max_seq_len
        votes = self.votes[layer, batch.slot_ids, :, :n]  # [B, Hkv, n]
        start = self.window_start[layer, batch.slot_ids].view(-1, 1, 1)
        later = torch.arange(n, device=votes.device).view(1, 1, -1) >= start
        return votes.masked_fill(later, float("inf"))

    def release(self, request: Request) -> None:
        """Nothing to free: the pooled rows of `request.slot` are overwritten on reuse."""
