"""`torch_ref`: the source of truth. Plain torch decode attention with float32 accumulation,
on any device: over FlashAttention metadata (paged; any page size, MHA, GQA, MLA) and over
FlashMLA metadata (token indices; MLA), from any float or fp8 cache, FlashMLA's packed fp8
MLA rows included."""

from __future__ import annotations

import math

import torch

from ..adaptors.flash_attention import FlashAttentionMetadata
from ..adaptors.flashmla import FlashMLAMetadata
from ..common.flashmla_format import NOPE_DIM, PACKED_BYTES, unpack_flashmla_fp8
from ..common.layout import FP8_DTYPES
from ..common.softmax import softcap_and_sink_softmax
from .base import AttentionBackend, fold_sinks


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [N, Hq, D]; k_cache: [num_pages, P, Hk, D]; v_cache: [num_pages, P, Hk, Dv] (Dv < D
    for MLA, where V is a prefix of the latent row); page_table: int32 [N, max_pages];
    cache_seqlens: int32 [N]. Each of the Hq // Hk query heads of a group reads KV head
    h = q_head // (Hq // Hk). A sequence of length 0 gives zeros. `softcap` and `sinks`
    ([Hq] or [N, Hq]): see `softcap_and_sink_softmax`. Returns float32 [N, Hq, Dv]."""
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
    hidden_scores = ~valid.view(n, 1, 1, -1)
    if softcap is None and sinks is None:
        scores = scores.masked_fill(hidden_scores, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty sequences: all -inf -> 0
    else:
        row_sinks = None if sinks is None else _per_row(sinks, n, hq).view(n, hk, group)
        probs = softcap_and_sink_softmax(scores, hidden_scores, softcap, row_sinks)
    out = torch.einsum("nhgt,nthd->nhgd", probs, v)
    return out.reshape(n, hq, dv)


def indexed_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int,
    *, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse attention over token indices (FlashMLA's sparse decode semantics).

    q: [N, s_q, Hq, D]; kv_cache: [num_tokens, Hk, D] rows (MLA: Hk = 1, the latent, whose
    first `v_dim` dims are V); indices: int [N, s_q, topk], row numbers into kv_cache, -1 for
    unused entries (never read). Query head h reads KV head h // (Hq // Hk). A query token
    with no valid index gives zeros. `softcap` and `sinks` ([Hq] or [N, Hq]): see
    `softcap_and_sink_softmax`. Returns float32 [N, s_q, Hq, v_dim]."""
    n, s_q, hq, d = q.shape
    hk = kv_cache.shape[1]
    valid = indices >= 0
    rows = kv_cache[torch.where(valid, indices, 0).long()].float()  # [N, s_q, topk, Hk, D]
    rows = rows.masked_fill(~valid[..., None, None], 0.0)
    group = hq // hk
    qg = q.float().view(n, s_q, hk, group, d)
    scores = torch.einsum("nshgd,nsthd->nshgt", qg, rows) * scale
    if softcap is None and sinks is None:
        scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    else:
        row_sinks = None if sinks is None else _per_row(sinks, n, hq).view(n, 1, hk, group).expand(n, s_q, hk, group)
        probs = softcap_and_sink_softmax(scores, ~valid[:, :, None, None, :], softcap, row_sinks)
    out = torch.einsum("nshgt,nsthd->nshgd", probs, rows[..., :v_dim])
    return out.reshape(n, s_q, hq, v_dim)


def _per_row(sinks: torch.Tensor, n: int, hq: int) -> torch.Tensor:
    """Sinks [Hq] (one per query head) or [N, Hq] (per sequence: heads folded into the
    batch) as [N, Hq] float32."""
    if sinks.dim() == 1:
        sinks = sinks.unsqueeze(0)
    if sinks.shape[-1] != hq or sinks.shape[0] not in (1, n) or sinks.dim() != 2:
        raise ValueError(f"sinks must be [{hq}] (one per query head) or [{n}, {hq}], got {list(sinks.shape)}")
    return sinks.float().expand(n, hq)


class TorchRefBackend(AttentionBackend):
    """Reference decode attention (CPU and CUDA) over FlashAttention page tables (paged) or
    FlashMLA indices (token rows). A FlashMLA-format cache (uint8 rows of 656 bytes: the fp8
    MLA layout) is dequantised first, only the rows the metadata reads, so the result is
    attention over exactly the values FlashMLA's kernel sees."""

    metadata_formats = ("flash_attention", "flashmla")
    dtypes = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)
    supports_softcap = True
    supports_sinks = True

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: FlashAttentionMetadata | FlashMLAMetadata,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, Dv]; with FlashMLA metadata also q [B, s_q, Hq, D] ->
        [B, s_q, Hq, Dv] (several query tokens per request). softcap: a float > 0 or None;
        sinks: [Hq] or None (see `softcap_and_sink_softmax`)."""
        d = q.shape[-1]
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        packed = _is_flashmla_packed(k_cache)
        if isinstance(metadata, FlashMLAMetadata):
            return self._run_indexed(q, k_cache, v_cache, metadata, scale, packed, softcap, sinks)
        b, hq, d = q.shape
        table = metadata.page_table
        if packed:  # dequantise the pages the table reads, renumbered 0..n-1
            k_cache, table = _unpack_used_pages(k_cache, table, metadata.cache_seqlens)
            v_cache = k_cache[..., :NOPE_DIM]
        if metadata.heads_folded:
            hk = metadata.page_table.shape[0] // b
            q = q.reshape(b * hk, hq // hk, d)  # each (request, KV head) its group of heads
            sinks = None if sinks is None else fold_sinks(sinks, b, hk)
        out = paged_attention(q, k_cache, v_cache, table, metadata.cache_seqlens, scale, softcap=softcap, sinks=sinks)
        return out.reshape(b, hq, v_cache.shape[-1]).to(q.dtype)

    @staticmethod
    def _run_indexed(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: FlashMLAMetadata,
        scale: float, packed: bool, softcap: float | None, sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        if v_cache.data_ptr() != k_cache.data_ptr():
            raise ValueError("FlashMLA metadata needs an MLA cache: V must be the first dims of the latent rows (k_cache)")
        single = q.dim() == 3
        q4 = q.unsqueeze(1) if single else q  # [B, s_q, Hq, D]
        indices = metadata.indices
        if packed:  # dequantise only the rows the indices name, renumbered 0..n-1
            kv, indices = _unpack_used_rows(k_cache.reshape(-1, k_cache.shape[2], k_cache.shape[-1]), indices)
            v_dim = NOPE_DIM
        else:
            kv, v_dim = k_cache.reshape(-1, k_cache.shape[2], k_cache.shape[-1]), v_cache.shape[-1]
        out = indexed_attention(q4, kv, indices, scale, v_dim, softcap=softcap, sinks=sinks).to(q.dtype)
        return out[:, 0] if single else out


def _is_flashmla_packed(cache: torch.Tensor) -> bool:
    """A uint8 cache whose rows are FlashMLA's 656-byte FP8 format (the fp8 MLA store)."""
    return cache.dtype == torch.uint8 and cache.shape[-1] == PACKED_BYTES


def _unpack_used_pages(
    k_cache: torch.Tensor, page_table: torch.Tensor, cache_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages a table reads (first ceil(len / P) entries per row), unpacked to float32
    [n, P, Hk, 576], and the table renumbered into them (entries not read: 0)."""
    p = k_cache.shape[1]
    read = torch.arange(page_table.shape[1], device=page_table.device) < (
        (cache_seqlens.long() + p - 1) // p
    ).unsqueeze(1)
    return _unpack_used(k_cache, page_table, read, unused=0)


def _unpack_used_rows(rows: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows [N, Hk, 656] that indices name (>= 0), unpacked to float32 [n, Hk, 576], and
    the indices renumbered into them (-1 kept)."""
    return _unpack_used(rows, indices, indices >= 0, unused=-1)


def _unpack_used(
    blocks: torch.Tensor, ids: torch.Tensor, read: torch.Tensor, *, unused: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block of `blocks` that `ids[read]` names, once, unpacked from FlashMLA's format,
    and `ids` renumbered into them (`unused` where not read)."""
    used, inverse = torch.unique(ids[read].long(), return_inverse=True)
    if used.numel() == 0:  # nothing is read; keep one block so that gathers stay in range
        used = torch.zeros(1, dtype=torch.long, device=ids.device)
    renumbered = torch.full_like(ids, unused)
    renumbered[read] = inverse.to(ids.dtype)
    return unpack_flashmla_fp8(blocks[used]), renumbered
