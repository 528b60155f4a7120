"""`torch_ref`: the source of truth. Plain torch paged decode attention over FlashAttention
metadata with float32 accumulation, on any device, any page size, MHA and GQA."""

from __future__ import annotations

import math

import torch

from ..adaptors.flash_attention import FlashAttentionMetadata
from .base import AttentionBackend


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [N, Hq, D]; k_cache: [num_pages, P, Hk, D]; v_cache: [num_pages, P, Hk, Dv] (Dv < D
    for MLA, where V is a prefix of the latent row); page_table: int32 [N, max_pages];
    cache_seqlens: int32 [N]. Each of the Hq // Hk query heads of a group reads KV head
    h = q_head // (Hq // Hk). A sequence of length 0 gives zeros. Returns float32 [N, Hq, Dv]."""
    n, hq, d = q.shape
    dv = v_cache.shape[-1]
    _, p, hk, _ = k_cache.shape
    max_tokens = page_table.shape[1] * p
    pos = torch.arange(max_tokens, device=q.device)
    rows = page_table.long().repeat_interleave(p, dim=1) * p + pos % p  # [N, T] flat row ids
    valid = pos < cache_seqlens.long().unsqueeze(1)
    rows = torch.where(valid, rows, 0)
    hidden = ~valid.view(n, -1, 1, 1)  # rows past a sequence: never read (may hold anything)
    k = k_cache.reshape(-1, hk, d)[rows].float().masked_fill(hidden, 0.0)  # [N, T, Hk, D]
    v = v_cache.reshape(-1, hk, dv)[rows].float().masked_fill(hidden, 0.0)
    group = hq // hk
    qg = q.float().view(n, hk, group, d)
    scores = torch.einsum("nhgd,nthd->nhgt", qg, k) * scale
    scores = scores.masked_fill(~valid.view(n, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty sequences: all -inf -> 0
    out = torch.einsum("nhgt,nthd->nhgd", probs, v)
    return out.reshape(n, hq, dv)


def indexed_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
) -> torch.Tensor:
    """Sparse attention over token indices (FlashMLA's sparse decode semantics).

    q: [N, s_q, Hq, D]; kv_cache: [num_tokens, Hk, D] rows (MLA: Hk = 1, the latent, whose
    first `v_dim` dims are V); indices: int [N, s_q, topk], row numbers into kv_cache, -1 for
    unused entries (never read). Query head h reads KV head h // (Hq // Hk). A query token
    with no valid index gives zeros. Returns float32 [N, s_q, Hq, v_dim]."""
    n, s_q, hq, d = q.shape
    hk = kv_cache.shape[1]
    valid = indices >= 0
    rows = kv_cache[torch.where(valid, indices, 0).long()].float()  # [N, s_q, topk, Hk, D]
    rows = rows.masked_fill(~valid[..., None, None], 0.0)
    group = hq // hk
    qg = q.float().view(n, s_q, hk, group, d)
    scores = torch.einsum("nshgd,nsthd->nshgt", qg, rows) * scale
    scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("nshgt,nsthd->nshgd", probs, rows[..., :v_dim])
    return out.reshape(n, s_q, hq, v_dim)


class TorchRefBackend(AttentionBackend):
    """Reference paged decode attention (CPU and CUDA)."""

    metadata_formats = ("flash_attention",)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: FlashAttentionMetadata,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        b, hq, d = q.shape
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        if metadata.heads_folded:
            hk = metadata.page_table.shape[0] // b
            q = q.reshape(b * hk, hq // hk, d)  # each (request, KV head) its group of heads
        out = paged_attention(q, k_cache, v_cache, metadata.page_table, metadata.cache_seqlens, scale)
        return out.reshape(b, hq, v_cache.shape[-1]).to(q.dtype)
