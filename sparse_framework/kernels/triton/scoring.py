"""The `@triton.jit` code of Quest's, PQCache's and SnapKV's scoring (launched by
`kernels/scoring.py`); `quest_group_bound` is shared with `paged_scores.py` here."""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .dot_modes import _dot


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
