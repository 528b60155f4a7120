"""The `@triton.jit` code of Quest's scoring through a block table (launched by
`kernels/paged_scores.py`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .scoring import quest_group_bound


@triton.jit
def quest_paged_scores_kernel(
    q_ptr, lo_ptr, hi_ptr, table_ptr, out_ptr,
    n_pages, num_blocks, D, shrink,  # shrink = (1 - range_weight) / 2
    s_qb, s_qh, s_qd,
    s_tb, s_tp,
    s_pb, s_ph, s_pd,  # page_min and page_max share strides
    HKV: tl.constexpr, G: tl.constexpr, REDUCE: tl.constexpr, SHRINK: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    on = p < n_pages
    block = tl.load(table_ptr + b.to(tl.int64) * s_tb + p * s_tp, mask=on, other=0).to(tl.int64)
    block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
    live = on[:, None] & (d[None, :] < D)
    off = block[:, None] * s_pb + j * s_ph + d[None, :] * s_pd
    lo = tl.load(lo_ptr + off, mask=live, other=0.0).to(tl.float32)
    hi = tl.load(hi_ptr + off, mask=live, other=0.0).to(tl.float32)
    acc = quest_group_bound(q_ptr + b * s_qb + j * G * s_qh, s_qh, s_qd, lo, hi, d, D, shrink,
                            G=G, REDUCE=REDUCE, SHRINK=SHRINK, BLOCK_P=BLOCK_P)
    tl.store(out_ptr + (b * HKV + j) * n_pages + p, acc, mask=on)
