"""Triton kernels of the algorithms' scoring hot paths (`*_triton`), each with the signature
and float32 result of its torch reference in `kernels/reference_scores.py` (re-exported
here as `*_torch`):

  quest_scores          Σ_d max(q_d·min_d, q_d·max_d) per page, combined over a GQA group
                        (with `range_weight` w < 1: minus (1 − w)·Σ_d |q_d|·(max_d − min_d)/2)
  pqcache_scores        Σ_m q_m · centroid_m[code_m(t)] per token (q·centroid table gathered)
  snapkv_window_mass    the prompt's last w queries' causal softmax mass on the keys before them
  dsa_index_scores      DeepSeek's lightning indexer Σ_h w_h · ReLU(q_h · k_t), bf16 or fp8 keys
  dsa_index_scores_fp8q the same over fp8 keys, the raw queries quantised like the keys in
                        the kernel (what DSA runs)
  dsa_prefill_index_scores  the indexer for a prefill chunk, [n, m]

This module holds the first three kernels and is where every scoring function is found by
name (`algorithms.base.scoring_kernel`, benchmarks/selection.py). DSA's indexer kernels live
in `kernels/dsa_index.py` (fp8 keys, in-kernel query quantisation, their own launch shapes
and fp8 switches, which are set there) and are re-exported here; the dot modes and launch
checks every scoring kernel shares are in `kernels/dot_modes.py`.

Every Triton kernel streams the representation that grows with the context once, one
program per (row, head or group, block of pages/tokens), tails masked; head dims that are not
powers of two are padded through masks. On the CPU the Triton versions run only under
TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import pdl
from ..common.arith import cdiv
from .dot_modes import _dot, _dot_mode, _launchable, _pow2
from .dsa_index import dsa_index_scores_fp8q_triton, dsa_index_scores_triton, dsa_prefill_index_scores_triton
from .launch import launch
from .reference_scores import (
    PQ_REDUCTIONS,
    REDUCTIONS,
    _check_quest,
    _check_snapkv,
    _group,
    _pq_table,
    dequantize_fp8_blocks,
    dsa_index_scores_fp8q_torch,
    dsa_index_scores_torch,
    dsa_prefill_index_scores_torch,
    pqcache_scores_torch,
    quantize_fp8_blocks,
    quest_scores_torch,
    snapkv_window_mass_torch,
)

# the torch twins are re-exported beside their kernels, so callers can pick either by name
__all__ = [
    "dequantize_fp8_blocks", "quantize_fp8_blocks",
    "quest_scores_torch", "quest_scores_triton", "pqcache_scores_torch", "pqcache_scores_triton",
    "snapkv_window_mass_torch", "snapkv_window_mass_triton", "dsa_index_scores_torch", "dsa_index_scores_triton",
    "dsa_index_scores_fp8q_torch", "dsa_index_scores_fp8q_triton",
    "dsa_prefill_index_scores_torch", "dsa_prefill_index_scores_triton",
]

# launch shapes (module attributes, so that tests and benchmarks can change them)
QUEST_TILE, QUEST_WARPS = 4096, 4  # page-bound elements per program: BLOCK_P = QUEST_TILE // padded head dim
PQ_BLOCK_N, PQ_WARPS = 512, 4  # tokens per program
SNAPKV_BLOCK_M, SNAPKV_BLOCK_N, SNAPKV_SPLIT = 64, 64, 2048  # pass 1: rows, keys per step, keys per program
SNAPKV_BLOCK_W, SNAPKV_BLOCK_K, SNAPKV_WARPS = 32, 128, 4  # pass 2: window rows per step, keys per program


# -- Quest -------------------------------------------------------------------------------------
@triton.jit
def quest_group_bound(
    q_ptr, s_qh, s_qd, lo, hi, d, D, shrink,
    G: tl.constexpr, REDUCE: tl.constexpr, SHRINK: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """[BLOCK_P] float32: the bounds lo/hi [BLOCK_P, BLOCK_D] (float32) scored by the G query
    heads at q_ptr (head stride s_qh, dim stride s_qd), reduced over the group (0 max, 1 sum,
    2 mean). Shared by the slot-indexed and the block-table (paged_scores.py) kernels."""
    if REDUCE == 0:
        acc = tl.full([BLOCK_P], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_P], tl.float32)
    for g in tl.static_range(G):
        q = tl.load(q_ptr + g * s_qh + d * s_qd, mask=d < D, other=0.0).to(tl.float32)
        terms = tl.maximum(q[None, :] * lo, q[None, :] * hi)
        if SHRINK:
            terms = terms - shrink * (tl.abs(q)[None, :] * (hi - lo))
        bound = tl.sum(terms, axis=1)
        if REDUCE == 0:
            acc = tl.maximum(acc, bound)
        else:
            acc += bound
    if REDUCE == 2:
        acc = acc / G
    return acc


@triton.jit
def quest_scores_kernel(
    q_ptr, lo_ptr, hi_ptr, slot_ptr, out_ptr,
    n_pages, D, shrink,  # shrink = (1 - range_weight) / 2
    s_qb, s_qh, s_qd,
    s_pr, s_ph, s_pp, s_pd,  # page_min and page_max share strides
    HKV: tl.constexpr, G: tl.constexpr, REDUCE: tl.constexpr, SHRINK: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = (p[:, None] < n_pages) & (d[None, :] < D)
    off = slot * s_pr + j * s_ph + p[:, None].to(tl.int64) * s_pp + d[None, :] * s_pd
    lo = tl.load(lo_ptr + off, mask=live, other=0.0).to(tl.float32)
    hi = tl.load(hi_ptr + off, mask=live, other=0.0).to(tl.float32)
    acc = quest_group_bound(q_ptr + b * s_qb + j * G * s_qh, s_qh, s_qd, lo, hi, d, D, shrink,
                            G=G, REDUCE=REDUCE, SHRINK=SHRINK, BLOCK_P=BLOCK_P)
    tl.store(out_ptr + (b * HKV + j) * n_pages + p, acc, mask=p < n_pages)


def quest_scores_triton(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, slot_ids: torch.Tensor,
    n_pages: int, reduce: str = "max", range_weight: float = 1.0,
) -> torch.Tensor:
    """Triton version of `quest_scores_torch` (same arguments and result; range_weight 1
    compiles the paper's bound without the correction term)."""
    b, hkv, g, d = _check_quest(q, page_min, page_max, slot_ids, n_pages, reduce, range_weight)
    _launchable(q, page_min, page_max, slot_ids)
    if page_min.stride() != page_max.stride():
        raise ValueError("quest_scores: page_min and page_max must have the same strides")
    out = torch.empty(b, hkv, n_pages, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_d = _pow2(d)
    block_p = max(1, min(_pow2(n_pages), QUEST_TILE // block_d))
    grid = (b, hkv, cdiv(n_pages, block_p))
    use_pdl = pdl.enabled(q.device)
    launch(quest_scores_kernel, grid,
        q, page_min, page_max, slot_ids, out, n_pages, d, (1.0 - range_weight) / 2, *q.stride(), *page_min.stride(),
        HKV=hkv, G=g, REDUCE=REDUCTIONS[reduce], SHRINK=range_weight != 1.0, BLOCK_P=block_p, BLOCK_D=block_d, PDL=use_pdl,
        num_warps=QUEST_WARPS, launch_pdl=use_pdl,
    )
    return out


# -- PQCache -----------------------------------------------------------------------------------
@triton.jit
def pqcache_scores_kernel(
    table_ptr,  # float32 [B, Hkv, G, M, K], contiguous
    codes_ptr, slot_ptr, out_ptr,
    n,
    s_cr, s_ch, s_cn, s_cm,
    HKV: tl.constexpr, G: tl.constexpr, M: tl.constexpr, K: tl.constexpr, REDUCE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = (t[:, None] < n) & (m[None, :] < M)
    codes = tl.load(codes_ptr + slot * s_cr + j * s_ch + t[:, None].to(tl.int64) * s_cn + m[None, :] * s_cm,
                    mask=live, other=0).to(tl.int32)
    entry = m[None, :] * K + codes  # [BLOCK_N, BLOCK_M] into one head's [M, K] table
    table = table_ptr + (b * HKV + j) * (G * M * K)
    if REDUCE == 0:
        acc = tl.full([BLOCK_N], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], tl.float32)
    for g in tl.static_range(G):
        s = tl.sum(tl.load(table + g * M * K + entry, mask=live, other=0.0), axis=1)
        if REDUCE == 3:  # none: one row per query head, out [B, Hkv, G, n]
            tl.store(out_ptr + ((b * HKV + j) * G + g) * n + t, s, mask=t < n)
        elif REDUCE == 0:
            acc = tl.maximum(acc, s)
        else:
            acc += s
    if REDUCE == 2:
        acc = acc / G
    if REDUCE != 3:
        tl.store(out_ptr + (b * HKV + j) * n + t, acc, mask=t < n)


def pqcache_scores_triton(
    q: torch.Tensor, codebooks: torch.Tensor, codes: torch.Tensor, slot_ids: torch.Tensor,
    n: int, reduce: str = "sum",
) -> torch.Tensor:
    """Triton version of `pqcache_scores_torch`: the tiny q·centroid table in torch (for "sum"
    and "mean" one per KV head, from the group's summed / averaged queries), then one kernel
    streams the codes and gathers from it."""
    _launchable(q, codebooks, codes, slot_ids)
    fold = reduce in ("sum", "mean")
    table = _pq_table(q, codebooks, codes, slot_ids, n, reduce, fold=fold).contiguous()
    reduce = "sum" if fold else reduce  # a folded table has one row per KV head
    b, hkv, g, m, k = table.shape
    out = torch.empty(b, hkv, *((g,) if reduce == "none" else ()), n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_n = min(PQ_BLOCK_N, _pow2(n))
    grid = (b, hkv, cdiv(n, block_n))
    launch(pqcache_scores_kernel, grid,
        table, codes, slot_ids, out, n, *codes.stride(),
        HKV=hkv, G=g, M=m, K=k, REDUCE=PQ_REDUCTIONS[reduce], BLOCK_M=_pow2(m), BLOCK_N=block_n, num_warps=PQ_WARPS,
    )
    return out


# -- SnapKV ------------------------------------------------------------------------------------
@triton.jit
def snapkv_lse_kernel(
    q_ptr, k_ptr, part_ptr,  # part: float32 [Hq, w, n_splits] natural-log partial logsumexp
    n, w, D, split, n_splits, qk_scale,  # qk_scale = log2(e) / sqrt(D)
    s_qw, s_qh, s_qd, s_kn, s_kh, s_kd,
    G: tl.constexpr, MODE: tl.constexpr, KDT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Pass 1: rows r = g·w + i of KV head j (query head j·G+g, window row i) against the
    keys of one split, with an online max / sum in base 2."""
    n_row_blocks = tl.cdiv(G * w, BLOCK_M)
    j = tl.program_id(0) // n_row_blocks
    r = (tl.program_id(0) % n_row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    sp = tl.program_id(1)
    row_ok = r < G * w
    g = r // w
    i = r % w
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + i[:, None] * s_qw + (j * G + g)[:, None] * s_qh + d[None, :] * s_qd,
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    last = n - w + i  # the last key each row sees (causal)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    start = sp * split
    end = tl.minimum(start + split, n)
    for k0 in range(start, end, BLOCK_N):
        t = k0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + t[:, None].to(tl.int64) * s_kn + j * s_kh + d[None, :] * s_kd,
                    mask=(t[:, None] < end) & (d[None, :] < D), other=0.0)
        s = _dot(q, tl.trans(k.to(KDT)), MODE)
        seen = row_ok[:, None] & (t[None, :] <= last[:, None]) & (t[None, :] < end)
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), axis=1)
        m_i = m_new
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.maximum(l_i, 1.0))) * 0.6931471805599453, float("-inf"))  # l >= 1 once seen
    tl.store(part_ptr + ((j * G + g) * w + i) * n_splits + sp, lse, mask=row_ok)


@triton.jit
def snapkv_mass_kernel(
    q_ptr, k_ptr, lse_ptr, out_ptr,  # lse: float32 [Hq, w] (natural log); out: float32 [Hq, n - w]
    n, w, D, qk_scale,
    s_qw, s_qh, s_qd, s_kn, s_kh, s_kd,
    G: tl.constexpr, MODE: tl.constexpr, KDT: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Pass 2: one block of keys before the window (seen by every window row) of KV head j;
    per query head of the group the probabilities exp(s - lse) summed over the window."""
    j = tl.program_id(0)
    n_out = n - w
    t = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_ptr + t[:, None].to(tl.int64) * s_kn + j * s_kh + d[None, :] * s_kd,
                mask=(t[:, None] < n_out) & (d[None, :] < D), other=0.0)
    kt = tl.trans(k.to(KDT))
    for g in range(G):
        h = j * G + g
        acc = tl.zeros([BLOCK_K], tl.float32)
        for i0 in range(0, w, BLOCK_W):
            i = i0 + tl.arange(0, BLOCK_W)
            row_ok = i < w
            q = tl.load(q_ptr + i[:, None] * s_qw + h * s_qh + d[None, :] * s_qd,
                        mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
            s = _dot(q, kt, MODE)
            lse = tl.load(lse_ptr + h * w + i, mask=row_ok, other=float("inf")) * 1.4426950408889634
            acc += tl.sum(tl.exp2(s * qk_scale - lse[:, None]), axis=0)
        tl.store(out_ptr + h * n_out + t, acc, mask=t < n_out)


def snapkv_window_mass_triton(q_window: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Triton version of `snapkv_window_mass_torch`, never materialising [Hq, w, n]: pass 1
    computes each (head, window row)'s logsumexp over key splits (combined in torch), pass 2
    sums exp(s - lse) over the window per (KV head, key block), for every head of the group."""
    w, hq, n, hkv, d = _check_snapkv(q_window, keys)
    group = _group(hq, hkv, "snapkv_window_mass")
    _launchable(q_window, keys)
    out = torch.empty(hq, n - w, dtype=torch.float32, device=keys.device)
    if n == w:
        return out
    mode, kdt = _dot_mode(q_window.dtype, keys.dtype)
    block_d = _pow2(d, 16)
    qk_scale = 1.4426950408889634 / math.sqrt(d)
    block_n = SNAPKV_BLOCK_N
    split = max(block_n, SNAPKV_SPLIT // block_n * block_n)
    n_splits = cdiv(n, split)
    part = torch.empty(hq, w, n_splits, dtype=torch.float32, device=keys.device)
    row_blocks = cdiv(group * w, SNAPKV_BLOCK_M)
    launch(snapkv_lse_kernel, (hkv * row_blocks, n_splits),
        q_window, keys, part, n, w, d, split, n_splits, qk_scale, *q_window.stride(), *keys.stride(),
        G=group, MODE=mode, KDT=kdt, BLOCK_M=SNAPKV_BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=SNAPKV_WARPS,
    )
    lse = part.logsumexp(-1).contiguous()  # [Hq, w]
    block_w = min(SNAPKV_BLOCK_W, _pow2(w, 16))
    launch(snapkv_mass_kernel, (hkv, cdiv(n - w, SNAPKV_BLOCK_K)),
        q_window, keys, lse, out, n, w, d, qk_scale, *q_window.stride(), *keys.stride(),
        G=group, MODE=mode, KDT=kdt, BLOCK_W=block_w, BLOCK_K=SNAPKV_BLOCK_K, BLOCK_D=block_d, num_warps=SNAPKV_WARPS,
    )
    return out
