"""SnapKV, retrievable (Li et al., NeurIPS 2024): the prompt's last queries vote on its keys.

At prefill the last `window` prompt queries attend (softmax, causal inside the window) to
the prompt; their weights on the keys before the window are summed over the window and
smoothed by a 1-D pooling (stride 1, padding kernel // 2). Facts from the original code:
the window's own tokens are always kept; the published LongBench setting is window 32,
kernel 7, max-pooling (the code's fallback is kernel 5, average-pooling, zero padding
counted). The original scores per query head after repeating KV; here the group's votes are
combined per KV head by `gqa_reduce` ("mean" by default, as kvpress's SnapKV averages).

Unlike the original nothing is evicted: the full KV stays in the store, and every decode
step selects from it. `decoded_tokens` says how the window and the decoded tokens count:
  "on_top" (default, the original's rule): the original compresses the prompt to
      max_capacity_prompt = C tokens, C − window best-voted ones plus the window, and appends
      every decoded token; so here the `top_k` best-voted prompt tokens (top_k = C − window)
      stay selected for the whole generation, and the window and every decoded token are
      kept on top, as a per-request forced tail. A fixed-width selection cannot grow for
      ever: the tail holds at most `max_tail_tokens` (default 1024, or what the device buffer
      leaves after sink + top_k + recent + 1 if less); past that its oldest tokens leave the
      tail and take top_k places ahead of the votes, as under "in_budget".
  "in_budget": the window and the decoded tokens score +inf and take top_k places first, so
      the voted tokens still selected fall as decoding goes on (at sink 16, recent 64, top_k
      256 and a 1000-token prompt: 256, then 188 at step 100, 88 at step 200, 0 at step 300).
Sink and recent tokens are forced in both.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..common.batch import Batch, Request, Selection
from ..common.layout import resolve_impl
from ..kernels.reference.scores import reduce_groups
from .base import NO_INPUTS, Inputs, ScoringAlgorithm, scoring_kernel


# the default cap of the forced tail (window + decoded tokens) under "on_top": LongBench's
# longest answers (512 tokens) and the window, with room to spare; the selection's static
# width, and so the device buffer it needs, grows by it
DEFAULT_TAIL_TOKENS = 1024


class SnapKVOptions(BaseModel):
    """SnapKV's extra-config (defaults: the published LongBench setting)."""

    model_config = ConfigDict(extra="forbid")

    window: int = Field(32, ge=1, description="observation window: the last prompt queries that vote")
    kernel_size: int = Field(7, ge=1, description="pooling kernel over positions (odd)")
    pooling: Literal["max", "avg"] = Field("max", description="max- or average-pooling of the votes")
    gqa_reduce: Literal["max", "sum", "mean"] = Field("mean", description="how a GQA group's votes combine")
    decoded_tokens: Literal["on_top", "in_budget"] = Field(
        "on_top",
        description="on_top (the original): the window and every decoded token are kept on top of the top_k "
        "best-voted prompt tokens for the whole generation; in_budget: they take top_k places first",
    )
    max_tail_tokens: int | None = Field(
        None, ge=0,
        description="on_top: most window + decoded tokens kept on top of top_k (the selection's width grows by "
        "it; older ones then take top_k places); default: 1024, or less if device_buffer_tokens leaves less "
        "after sink + top_k + recent + 1",
    )
    impl: Literal["auto", "torch", "triton"] = Field("auto", description="vote kernel: auto = triton on CUDA")

    @field_validator("kernel_size")
    @classmethod
    def _odd(cls, k: int) -> int:
        if k % 2 == 0:
            raise ValueError(f"kernel_size must be odd (padding kernel_size // 2 keeps every position), got {k}")
        return k


def snapkv_votes(keys: torch.Tensor, queries: torch.Tensor, options: SnapKVOptions, impl: str = "torch") -> torch.Tensor:
    """Pooled votes of one prompt: keys [L, Hkv, D], queries [L, Hq, D] (or only the last
    min(window, L) of them: all that is read) -> float32 [Hkv, L - window] (empty when the
    prompt is no longer than the window)."""
    n, hkv, _ = keys.shape
    w = min(options.window, n)
    votes = scoring_kernel("snapkv_window_mass", impl, keys.device)(queries[queries.shape[0] - w :], keys)  # [Hq, n - w]
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

    @classmethod
    def _scored_width(cls, config) -> int:  # type: ignore[no-untyped-def]
        """The width without the forced tail: sink + top_k + recent + 1 (ScoringAlgorithm's)."""
        return super().max_selected_tokens(config)

    @classmethod
    def tail_tokens(cls, config) -> int:  # type: ignore[no-untyped-def]
        """Window + decoded tokens kept on top of top_k at most (0 with "in_budget")."""
        o = config.extra_config
        if o.decoded_tokens == "in_budget":
            return 0
        if o.max_tail_tokens is not None:
            return o.max_tail_tokens
        return max(0, min(DEFAULT_TAIL_TOKENS, config.device_buffer_tokens - cls._scored_width(config)))

    @classmethod
    def max_selected_tokens(cls, config) -> int:  # type: ignore[no-untyped-def]
        return cls._scored_width(config) + cls.tail_tokens(config)

    @classmethod
    def check_config(cls, config) -> None:  # type: ignore[no-untyped-def]
        o = config.extra_config
        room = config.device_buffer_tokens - cls._scored_width(config)
        if o.decoded_tokens == "on_top" and o.max_tail_tokens is not None and o.max_tail_tokens > room:
            raise ValueError(
                f"`extra.max_tail_tokens` = {o.max_tail_tokens} does not fit the device buffer: "
                f"device_buffer_tokens ({config.device_buffer_tokens}) - sink - top_k - recent - 1 = {max(room, 0)}; "
                f"lower it, leave it unset, or raise device_buffer_tokens"
            )
        super().check_config(config)

    def __init__(self, config, layout, max_requests, max_seq_len) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, layout, max_requests, max_seq_len)
        shape = (layout.num_layers, max_requests, layout.num_kv_heads, max_seq_len)
        self.votes = torch.zeros(shape, dtype=torch.float32, device=layout.device)
        self.window_start = torch.zeros(layout.num_layers, max_requests, dtype=torch.long, device=layout.device)
        self.tail = self.tail_tokens(config)
        self.impl = resolve_impl(self.options.impl, layout.device)
        self.topk_impl = self.impl

    @property
    def prefill_query_rows(self) -> int:
        """The observation window: `build` reads only the prompt's last `window` queries."""
        return self.options.window

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

    def select(self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS) -> Selection:
        """"on_top": the window and the decoded tokens, the newest `tail` of them at most, are
        a forced tail on top of the top_k votes; "in_budget": ScoringAlgorithm's select."""
        if not self.tail:
            return super().select(layer, queries, batch, inputs=inputs)
        assert batch.slot_ids is not None and batch.seq_lens is not None
        scores = self.score(layer, queries, batch, inputs=inputs)
        start = self.window_start[layer, batch.slot_ids]
        tail_start = torch.maximum(start, batch.seq_lens.to(start.device).long() - self.tail)
        return self.top_units(scores, batch, tail_start=tail_start, extra_width_units=self.tail)

    def release(self, request: Request) -> None:
        """Nothing to free: the pooled rows of `request.slot` are overwritten on reuse."""
