"""The `@triton.jit` code of Quest's append of page bounds (launched by `kernels/page_bounds.py`)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl


@triton.jit
def append_page_bounds_kernel(
    min_ptr, max_ptr, rows_ptr, lens_ptr, keys_ptr,
    s_r, s_h, s_p,  # page_min / page_max of one layer: [requests, kv_heads, pages, dim], dim contiguous
    s_kb, s_kh, s_kd,  # keys [batch, kv_heads, dim]
    D, P: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    r = tl.load(rows_ptr + b).to(tl.int64)
    pos = tl.load(lens_ptr + b).to(tl.int64) - 1
    page = pos // P
    d = tl.arange(0, BLOCK_D)
    m = d < D
    key = tl.load(keys_ptr + b * s_kb + h * s_kh + d * s_kd, mask=m)  # in the bounds' dtype
    off = r * s_r + h * s_h + page * s_p + d
    # compared in float32 (exact: the result is one of two values of the bounds' dtype; the
    # interpreter compares bfloat16 by its bits); a new page's first token ignores what it reads
    k32 = key.to(tl.float32)
    open_page = pos % P != 0
    lo = tl.where(open_page, tl.minimum(tl.load(min_ptr + off, mask=m).to(tl.float32), k32), k32)
    hi = tl.where(open_page, tl.maximum(tl.load(max_ptr + off, mask=m).to(tl.float32), k32), k32)
    tl.store(min_ptr + off, lo, mask=m)
    tl.store(max_ptr + off, hi, mask=m)
