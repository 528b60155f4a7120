"""FlashMLA sparse-decode metadata: `indices` [batch, s_q, topk] of physical token rows.

Semantics are those of FlashMLA's `flash_mla_with_kvcache(q, k_cache, ..., indices=...)`
(its README and flash_mla_interface.py): query token j of sequence i attends to the tokens
`indices[i, j, :]` of `k_cache` [num_blocks, page_block_size, 1, 656], where an index is
`block * page_block_size + offset` and -1 marks an unused entry (read as nothing). No block
table and no sequence lengths are involved: the indices already name physical rows.

The store's device pool of one layer is one contiguous run of rows (token-major; an MLA
layout has a single latent KV head), and the coordinator's physical slots are exactly those
row numbers (`page * page_size + offset`). So the indices are the slots, whatever page size the
selection used, and any block size that tiles the pool addresses them identically. The plan
names 64-row blocks whenever the pool's rows are a multiple of 64, because FlashMLA's first
sparse release (2025-09) accepts only `page_block_size == 64` (later ones accept any); otherwise
it keeps the selection's page size.

FlashMLA processes `topk` in blocks of 64 (its sm90 and sm100 decode kernels assert
`topk % 64 == 0`), so rows are padded with -1 to a multiple of 64 (at least 64).

Several query tokens per request (speculative decoding / MTP, s_q > 1) give each query token
its own selection: build slots [batch, s_q, width] (row (i, j) = query token j of request i,
-1 padded) and lengths [batch, s_q], and call `plan_query_tokens`; q is then
[batch, s_q, q_heads, 576]. The coordinator's decode steps have one query token per request,
so `plan` makes s_q = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..common.errors import ConfigError
from .base import BackendAdaptor

if TYPE_CHECKING:
    from ..common.settings import SparseSettings
    from ..common.layout import KVLayout

TOPK_BLOCK = 64  # FlashMLA's decode kernels: topk % 64 == 0 (TOPK_BLOCK_SIZE / B_TOPK)
PAGE_BLOCK = 64  # the only page_block_size of FlashMLA's 2025-09 sparse release
HEAD_DIM = 576  # d_qk of the V3.2 latent FlashMLA's 656-byte cache holds
V_HEAD_DIM = 512  # FlashMLA's head_dim_v: the only value it accepts


@dataclass
class FlashMLAMetadata:
    """indices: int32 [batch, s_q, topk], physical rows (block * page_block_size + offset) of
    the layer's device pool, -1 for unused entries; the valid ones come first, `lengths`
    [batch, s_q] of them. page_block_size: the block size of the k_cache view the indices are
    meant for ([num_slots // page_block_size, page_block_size, 1, dim]); num_slots: rows of that
    pool (the layer's whole device buffer)."""

    indices: torch.Tensor
    lengths: torch.Tensor
    page_block_size: int
    num_slots: int

    @property
    def topk(self) -> int:
        return int(self.indices.shape[-1])

    @property
    def s_q(self) -> int:
        return int(self.indices.shape[1])


class FlashMLAAdaptor(BackendAdaptor):
    """Physical slots → FlashMLA `indices`. Pure torch, no host synchronisation."""

    @classmethod
    def check_config(cls, config: SparseSettings) -> None:
        """Nothing in the config itself is out of FlashMLA's reach: indices are token rows, so
        every page size and granularity maps to them; the layout is checked in check_layout."""

    @classmethod
    def check_layout(cls, layout: KVLayout, config: SparseSettings) -> None:
        """FlashMLA's sparse decode is MLA in MQA form: one latent KV head of 576 dims whose
        first 512 are V. (Per-KV-head algorithms are fine: with one KV head their selection is
        one per request.)"""
        where = f"adaptor 'flashmla' (algorithm {config.algorithm!r})"
        if not layout.is_mla:
            raise ConfigError(
                f"{where} needs an MLA KV layout (KVLayout.mla: one latent KV head of {HEAD_DIM} dims); "
                f"got kind {layout.kind!r} with {layout.num_kv_heads} KV heads of {layout.head_dim} dims; "
                "use adaptor 'flash_attention' for MHA/GQA"
            )
        if layout.head_dim != HEAD_DIM:
            raise ConfigError(
                f"{where} needs head_dim {HEAD_DIM} (DeepSeek's 512 + 64 RoPE latent, FlashMLA's d_qk), "
                f"got {layout.head_dim}"
            )
        if layout.v_head_dim != V_HEAD_DIM:
            raise ConfigError(f"{where} needs v_head_dim {V_HEAD_DIM} (FlashMLA's head_dim_v), got {layout.v_head_dim}")

    def plan(
        self, slots: torch.Tensor, lengths: torch.Tensor, *, page_size: int, num_slots: int
    ) -> FlashMLAMetadata:
        """slots int32 [batch, 1, width] (one selection per request) -> s_q = 1 indices."""
        if slots.dim() != 3 or slots.shape[1] != 1:
            raise ValueError(
                "FlashMLA takes one selection per request (MQA over one latent KV head): slots must be "
                f"[batch, 1, width], got {list(slots.shape)}"
            )
        return plan_query_tokens(slots, lengths, page_size=page_size, num_slots=num_slots)


def plan_query_tokens(
    slots: torch.Tensor, lengths: torch.Tensor, *, page_size: int, num_slots: int
) -> FlashMLAMetadata:
    """FlashMLA metadata for s_q query tokens per request: slots int32 [batch, s_q, width],
    row (i, j) the physical slots query token j of request i attends to (valid ones first,
    then -1); lengths int32 [batch, s_q]."""
    if slots.dim() != 3 or lengths.shape != slots.shape[:2]:
        raise ValueError(
            f"slots must be [batch, s_q, width] and lengths [batch, s_q]; got {list(slots.shape)} and {list(lengths.shape)}"
        )
    if page_size < 1 or num_slots % page_size:
        raise ValueError(f"num_slots ({num_slots}) must be whole pages of page_size ({page_size})")
    if num_slots > 2**31 - 1:
        raise ValueError(f"FlashMLA indices are int32: a layer's pool of {num_slots} rows is too large")
    b, s_q, width = slots.shape
    topk = max(TOPK_BLOCK, -(-width // TOPK_BLOCK) * TOPK_BLOCK)
    indices = torch.full((b, s_q, topk), -1, dtype=torch.int32, device=slots.device)
    pos = torch.arange(width, device=slots.device)
    valid = pos < lengths.to(slots.device).long().unsqueeze(-1)
    indices[..., :width] = torch.where(valid, slots, -1).to(torch.int32)
    block = PAGE_BLOCK if num_slots % PAGE_BLOCK == 0 else page_size
    return FlashMLAMetadata(indices=indices, lengths=lengths.to(torch.int32), page_block_size=block, num_slots=num_slots)
