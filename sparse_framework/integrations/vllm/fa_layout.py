"""vLLM's FlashAttention KV cache seen as pages of one KV head, in plain torch (no vLLM import).

vLLM 0.26's FlashAttention backend keeps one layer's cache as the logical tensor
[num_blocks, num_kv_heads, block_size, 2 * head_size] (K in the first head_size columns, V in
the last), laid out in memory by `get_kv_cache_stride_order`: "NHD" (vLLM's default:
[blocks, tokens, heads, 2D]) or "HND" ([blocks, heads, tokens, 2D], the logical order). Its
forward reads `kv_cache.transpose(1, 2).split(head_size, -1)` as FlashAttention's paged K and
V, [num_pages, page_size, heads, D] with those strides.

A sparse decode has one block table per (request, KV head), while a FlashAttention block table
is per sequence and shared by the KV heads. Two ways to give each KV head its own table:

- fold (one kernel call): when the cache is head-major, i.e. stride(blocks) == num_kv_heads *
  stride(heads) (HND, which the plugin's backend asks vLLM for), block b of head h is one run
  of block_size rows at (b * Hkv + h) * stride(heads): a cache of one KV head whose page
  b * Hkv + h is that run. Each (request, KV head) becomes one sequence of its G query heads,
  the FlashAttention adaptor's head-folded page table (`paged.folded_page_table`).
- per KV head (Hkv kernel calls): any layout; head h's K is the strided view
  `cache[:, h:h+1]` of one KV head whose page b is block b, and the table is the selected
  block ids. Taken when the cache is not head-major (NHD, a padded block stride).

`attend_paged` builds the calls and stitches their outputs; what runs a call is passed in
(vLLM's `flash_attn_varlen_func` in `backend_cuda.py`, a torch reference in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...adaptors.flash_attention import FlashAttentionMetadata


@dataclass
class FlashDecodeCall:
    """One `flash_attn_varlen_func` call of single-token queries over paged K/V.

    q: [N, G', D] contiguous (one query token per sequence); k, v: [num_pages, page_size,
    Hk', D] views of the cache (last stride 1); block_table: int32 [N, max_pages];
    seqused_k: int32 [N]; max_seqlen_k: an upper bound of seqused_k; cu_seqlens_q: int32
    [N + 1] = 0..N. The call's output [N, G', D] fills query heads `heads` of the N' = N or
    N / Hkv requests' output, as `place` says."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor
    seqused_k: torch.Tensor
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor
    heads: slice
    folded: bool


def _check(kv_cache: torch.Tensor, head_size: int) -> None:
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            "expected vLLM's FlashAttention cache [num_blocks, num_kv_heads, block_size, 2 * head_size] "
            f"with head_size {head_size}, got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"the cache's last dimension must be contiguous, got strides {kv_cache.stride()}")


def is_head_major(kv_cache: torch.Tensor) -> bool:
    """Whether block b of KV head h sits at (b * Hkv + h) * stride(heads): the fold applies."""
    nb, hk = kv_cache.shape[:2]
    return hk == 1 or nb == 1 or kv_cache.stride(0) == hk * kv_cache.stride(1)


def folded_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a head-major cache as pages of one KV head: [num_blocks * Hkv, block_size, 1,
    D] views, page b * Hkv + h = block b's head h. No copy (raises if not head-major)."""
    _check(kv_cache, head_size)
    if not is_head_major(kv_cache):
        raise ValueError(f"the cache is not head-major (strides {kv_cache.stride()}): use per_head_kv")
    nb, hk, bs, _ = kv_cache.shape
    page = kv_cache.stride(1) if hk > 1 else kv_cache.stride(0)
    # the size-1 head dimension gets the canonical stride D: FlashAttention 3 reads pages
    # through TMA descriptors, which want every stride but the innermost 16-byte aligned
    shape, stride = (nb * hk, bs, 1, head_size), (page, kv_cache.stride(2), head_size, 1)
    k = kv_cache.as_strided(shape, stride, kv_cache.storage_offset())
    v = kv_cache.as_strided(shape, stride, kv_cache.storage_offset() + head_size)
    return k, v


def per_head_kv(kv_cache: torch.Tensor, head_size: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of KV head `head` alone, any layout: [num_blocks, block_size, 1, D] views,
    page b = block b."""
    _check(kv_cache, head_size)
    nb, _, bs, _ = kv_cache.shape
    shape, stride = (nb, bs, 1, head_size), (kv_cache.stride(0), kv_cache.stride(2), head_size, 1)
    base = kv_cache.storage_offset() + head * kv_cache.stride(1)
    return kv_cache.as_strided(shape, stride, base), kv_cache.as_strided(shape, stride, base + head_size)


def decode_calls(
    q: torch.Tensor, kv_cache: torch.Tensor, metadata: FlashAttentionMetadata, num_kv_heads: int, head_size: int
) -> list[FlashDecodeCall]:
    """The calls that attend q [n, Hq, D] (one decode token per request) over the selection in
    `metadata` (`paged.folded_page_table`: page_table int32 [n * Hkv, W], page b * Hkv + h for
    block b of head h; cache_seqlens int32 [n * Hkv]): one folded call when the cache is
    head-major, else one per KV head."""
    n, hq, d = q.shape
    if hq % num_kv_heads or metadata.page_table.shape[0] != n * num_kv_heads:
        raise ValueError(
            f"q has {hq} heads for {num_kv_heads} KV heads and the table {metadata.page_table.shape[0]} rows "
            f"(expected n * Hkv = {n * num_kv_heads})"
        )
    group = hq // num_kv_heads
    width = metadata.page_table.shape[1] * kv_cache.shape[2]
    table, seqlens = metadata.page_table.contiguous(), metadata.cache_seqlens.to(torch.int32).contiguous()
    if is_head_major(kv_cache):
        k, v = folded_kv(kv_cache, head_size)
        starts = torch.arange(n * num_kv_heads + 1, dtype=torch.int32, device=q.device)
        return [FlashDecodeCall(q.reshape(n * num_kv_heads, group, d).contiguous(), k, v, table, seqlens, width,
                                starts, slice(None), folded=True)]
    starts = torch.arange(n + 1, dtype=torch.int32, device=q.device)
    blocks = table.view(n, num_kv_heads, -1)
    lens = seqlens.view(n, num_kv_heads)
    calls = []
    for h in range(num_kv_heads):
        k, v = per_head_kv(kv_cache, head_size, h)
        # folded page b * Hkv + h -> block b; unused entries (0) stay in range and are never read
        ids = ((blocks[:, h] - h).clamp(min=0) // num_kv_heads).to(torch.int32).contiguous()
        heads = slice(h * group, (h + 1) * group)
        calls.append(FlashDecodeCall(q[:, heads].contiguous(), k, v, ids, lens[:, h].contiguous(), width, starts,
                                     heads, folded=False))
    return calls


def attend_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: FlashAttentionMetadata,
    num_kv_heads: int,
    head_size: int,
    run: Callable[[FlashDecodeCall], torch.Tensor],
) -> torch.Tensor:
    """Attention of q [n, Hq, D] over the selected pages of vLLM's FlashAttention cache:
    [n, Hq, D] in q's dtype. `run(call)` runs one `FlashDecodeCall` and returns [N, G', D]."""
    n, hq, d = q.shape
    calls = decode_calls(q, kv_cache, metadata, num_kv_heads, head_size)
    if len(calls) == 1 and calls[0].folded:
        return run(calls[0]).reshape(n, hq, d)
    out = torch.empty_like(q)
    for call in calls:
        out[:, call.heads] = run(call)
    return out


def reference_call(call: FlashDecodeCall, *, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """What `flash_attn_varlen_func` computes for a `FlashDecodeCall` (one causal query per
    sequence over its first seqused_k paged rows; query head j reads KV head j // (G' / Hk')),
    in float32, in q's dtype: the reference the CPU tests hold the plumbing to."""
    n, heads, d = call.q.shape
    page_size, hk = call.k.shape[1], call.k.shape[2]
    out = torch.zeros(n, heads, d, dtype=torch.float32, device=call.q.device)
    for i in range(n):
        length = int(call.seqused_k[i])
        if length == 0:
            continue
        pages = call.block_table[i, : -(-length // page_size)].long()
        k = call.k[pages].reshape(-1, hk, d)[:length].float().repeat_interleave(heads // hk, dim=1)
        v = call.v[pages].reshape(-1, hk, d)[:length].float().repeat_interleave(heads // hk, dim=1)
        logits = torch.einsum("hd,nhd->hn", call.q[i].float(), k) * scale
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), v)
    return out.to(call.q.dtype)
