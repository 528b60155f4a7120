"""Row copy between any two tensors a GPU can address — device memory or pinned host memory
(zero-copy over PCIe): `dst.flat[dst_off[i] : dst_off[i] + ROW] = src.flat[src_off[i] : ...]`
for every i with src_off[i] >= 0 and dst_off[i] >= 0. One program copies BLOCK rows of ROW elements, so that many
small rows are in flight at once, which is what saturates PCIe for random rows."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_off_ptr,
    dst_off_ptr,
    n_rows,
    ROW: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    in_range = rows < n_rows
    src = tl.load(src_off_ptr + rows, mask=in_range, other=-1)
    dst = tl.load(dst_off_ptr + rows, mask=in_range, other=-1)
    live = in_range & (src >= 0) & (dst >= 0)
    for start in range(0, ROW, COLS):
        cols = start + tl.arange(0, COLS)
        mask = live[:, None] & (cols[None, :] < ROW)
        values = tl.load(src_ptr + src[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst[:, None] + cols[None, :], values, mask=mask)
