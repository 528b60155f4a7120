"""FlashAttention paged-KV metadata: `page_table` + `cache_seqlens`.

Semantics are those of `flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...,
block_table=...)` (flash-attn 2/3) and of flash-attn 4's `seqused_k` + `page_table`:
sequence i attends to the first `cache_seqlens[i]` rows of the concatenation of pages
`page_table[i, 0], page_table[i, 1], ...` of `k_cache` [num_pages, page_size, heads, dim];
entries past `ceil(cache_seqlens[i] / page_size)` are never read.

A page table is per sequence, so per-KV-head selections fold the KV heads into the batch:
folded sequence b*H + h holds request b's selection for KV head h, with one KV head and the
G query heads of its group, over the head-major view of the buffer
[H * num_pages, page_size, 1, dim] in which page p of head h is number h * num_pages + p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.layout import resolve_impl
from .base import BackendAdaptor


@dataclass
class FlashAttentionMetadata:
    """page_table: int32 [N, max_pages]; cache_seqlens: int32 [N]; N = batch (plain) or
    batch * num_kv_heads (`heads_folded`)."""

    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    page_size: int
    heads_folded: bool

    def sglang(self) -> dict[str, torch.Tensor]:
        """The names SGLang's FlashAttention backend reads from its forward metadata."""
        cu = torch.zeros(self.cache_seqlens.numel() + 1, dtype=torch.int32, device=self.cache_seqlens.device)
        cu[1:] = self.cache_seqlens.cumsum(0)
        return {"page_table": self.page_table, "cache_seqlens_int32": self.cache_seqlens, "cu_seqlens_k": cu}


class FlashAttentionAdaptor(BackendAdaptor):
    """Physical slots → FlashAttention page table. The slots of each run of `page_size`
    entries must be one whole aligned page (the coordinator guarantees it: page-granular
    algorithms select whole logical pages, and token-granular ones use page_size 1)."""

    def plan(
        self, slots: torch.Tensor, lengths: torch.Tensor, *, page_size: int, num_slots: int
    ) -> FlashAttentionMetadata:
        table, seqlens = _page_table(slots)(slots, lengths, page_size, num_slots)
        return FlashAttentionMetadata(
            page_table=table,
            cache_seqlens=seqlens,
            page_size=page_size,
            heads_folded=slots.shape[1] > 1,
        )


def page_table_torch(
    slots: torch.Tensor, lengths: torch.Tensor, page_size: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection slots [B, H, W] (runs of `page_size` slots are whole aligned pages) and
    lengths [B, H] -> (page_table int32 [B * H, ceil(W / page_size)], cache_seqlens int32
    [B * H]). With H > 1 the KV heads are folded into the batch over a head-major buffer:
    page p of head h is page h * (num_slots // page_size) + p. Unused entries are 0."""
    b, h, width = slots.shape
    first = slots[..., ::page_size].long()  # first slot of every page run
    pages = first.div(page_size, rounding_mode="floor")
    used = torch.arange(pages.shape[-1], device=slots.device) < (
        (lengths.long() + page_size - 1) // page_size
    ).unsqueeze(-1)
    if h > 1:
        pages = pages + torch.arange(h, device=slots.device).view(1, h, 1) * (num_slots // page_size)
    table = torch.where(used, pages, 0).to(torch.int32).reshape(b * h, -1)
    return table, lengths.reshape(b * h).to(torch.int32)


def _page_table(slots: torch.Tensor):  # type: ignore[no-untyped-def]
    """The page-table builder for where the slots live: one Triton kernel on CUDA
    (kernels/decode_slots.py, imported only then), torch elsewhere."""
    if resolve_impl("auto", slots.device) == "triton":
        from ..kernels.decode_slots import page_table_triton
        return page_table_triton
    return page_table_torch


def check_page_runs(slots: torch.Tensor, lengths: torch.Tensor, page_size: int) -> None:
    """Raise ValueError unless every run of `page_size` valid slots is one aligned page
    (host sync: for tests and debugging)."""
    width = slots.shape[-1]
    pos = torch.arange(width, device=slots.device)
    valid = pos < lengths.unsqueeze(-1)
    first = slots[..., ::page_size].repeat_interleave(page_size, dim=-1)[..., :width]
    expected = first + (pos % page_size)
    aligned = (first % page_size == 0) | ~valid
    if bool(((slots != expected) & valid).any()) or not bool(aligned.all()):
        raise ValueError(f"slots are not whole aligned pages of size {page_size}")
