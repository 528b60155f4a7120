"""Key-norm top-k: attend to the tokens whose keys have the smallest L2 norm.

Devoto et al. ("A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
EMNLP 2024) observed that in trained decoder LLMs the keys with a *low* L2 norm tend to
draw high attention, and compress the cache by keeping them (kvpress ships the same rule as
KnormPress). The score needs no query and no model change: one float per token and KV head,
computed once when the key arrives.

Here nothing is evicted: the full KV stays in the store and every decode step selects, per
KV head, the sink tokens, the recent window, the newest token and the `top_k` lowest-norm
tokens of the rest (`prefer="high"` keeps the highest-norm ones instead). The top-k, the
forced tokens and the padding are `ScoringAlgorithm`'s; this module only keeps the norms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from sparse_framework import Batch, KVLayout, Request
from sparse_framework.algorithms.base import NO_INPUTS, Inputs, ScoringAlgorithm

if TYPE_CHECKING:
    from sparse_framework.config import SparseConfig


class KeyNormOptions(BaseModel):
    """KeyNorm's extra-config (the `extra` object of a config with `"algorithm": "keynorm"`)."""

    # extra="forbid": a misspelt option is an error naming the allowed ones, not a silent default
    model_config = ConfigDict(extra="forbid")

    prefer: Literal["low", "high"] = Field(
        "low",
        description="keep the lowest-norm keys (low: the paper's rule) or the highest-norm ones (high)",
    )
    dense_first_layers: int = Field(
        0, ge=0, description="the first layers attend densely (a per-layer list goes in dense_layers)"
    )


class KeyNorm(ScoringAlgorithm):
    """Token-granular, one selection per KV head; key norms pooled as float32
    [num_layers, max_requests, num_kv_heads, max_seq_len]."""

    Config = KeyNormOptions
    granularity = "token"  # top_k counts tokens; "page" would select whole pages
    per_kv_head = True  # each KV head has its own keys, so its own norms and selection
    needs_prefill_queries = False  # the score ignores queries
    options: KeyNormOptions  # set by the base class from the validated `extra`

    @classmethod
    def own_dense_layers(cls, config: SparseConfig, num_layers: int) -> set[int]:
        """Layers the recipe keeps dense, on top of `config.dense_layers`."""
        options = config.extra_config
        assert isinstance(options, KeyNormOptions)
        return set(range(min(options.dense_first_layers, num_layers)))

    @classmethod
    def representation_bytes_per_token(cls, layout: KVLayout, config: SparseConfig) -> float:
        """One float32 norm per KV head (read by `sparse-framework plan`)."""
        return 4.0 * layout.num_kv_heads

    def __init__(self, config: SparseConfig, layout: KVLayout, max_requests: int, max_seq_len: int) -> None:
        super().__init__(config, layout, max_requests, max_seq_len)
        # Pooled by request slot and allocated once: decode steps allocate nothing, and a
        # finished request's rows are simply overwritten by the next one in that slot.
        shape = (layout.num_layers, max_requests, layout.num_kv_heads, max_seq_len)
        self.norms = torch.zeros(shape, dtype=torch.float32, device=layout.device)

    def build(
        self,
        layer: int,
        request: Request,
        keys: torch.Tensor,
        queries: torch.Tensor | None = None,
        *,
        inputs: Inputs = NO_INPUTS,
    ) -> None:
        """Norms of the prompt's keys [L, Hkv, D] (float32 even for low-precision KV)."""
        n = keys.shape[0]
        self.norms[layer, request.slot, :, :n] = key_norms(keys).transpose(0, 1)

    def append(self, layer: int, batch: Batch, keys: torch.Tensor, *, inputs: Inputs = NO_INPUTS) -> None:
        """Norm of each request's new key [B, Hkv, D], at position seq_len - 1."""
        assert batch.seq_lens is not None and batch.slot_ids is not None  # filled by forward_begin
        pos = batch.seq_lens.long() - 1
        self.norms[layer, batch.slot_ids, :, pos] = key_norms(keys)

    def score(self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS) -> torch.Tensor:
        """float32 [B, Hkv, max_seq_len]: higher is kept first. Positions at or past a
        request's length hold stale values; the base class ignores them."""
        assert batch.slot_ids is not None
        norms = self.norms[layer, batch.slot_ids, :, : batch.max_seq_len]
        return -norms if self.options.prefer == "low" else norms

    def release(self, request: Request) -> None:
        """Nothing to free: the pooled rows of `request.slot` are overwritten on reuse."""


def key_norms(keys: torch.Tensor) -> torch.Tensor:
    """L2 norm over the last dimension, in float32 (fp8 and bf16 keys are upcast first)."""
    return torch.linalg.vector_norm(keys.float(), dim=-1)
