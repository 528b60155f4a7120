"""Quest's decode-time append of the new key into its page's min/max bounds, in one launch.

Why: the torch form (`algorithms/quest.py`, `append_page_bounds`) is 12 small ops per sparse
layer (position, page, "fresh page" mask, two gathers, min, max, two `where`, two scatters);
on the H100 each is a kernel of a few microseconds inside the step's graph, ~360 per step of a
32-layer model — about 1 ms of a 10 ms Quest step (docs/engine.md, issue 33's timeline). Here
one program per (request, KV head) reads the new key once and updates both bounds of its page.

The torch twin is the reference (tests/test_kernels_page_bounds.py compares them under
TRITON_INTERPRET=1 on random shapes and dtypes). No host sync: the append stays inside a
captured decode graph. On sm_90+ it launches with PDL (kernels/pdl.py).
"""

from __future__ import annotations

import os

import torch

from ..common.arith import pow2
from . import pdl
from .launch import launch
from .triton.page_bounds import append_page_bounds_kernel

__all__ = ["append_page_bounds_triton"]


def append_page_bounds_triton(
    page_min: torch.Tensor, page_max: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
    keys: torch.Tensor, page_size: int,
) -> None:
    """`append_page_bounds` in one kernel: page_min/page_max [requests, kv_heads, pages, dim]
    (one layer, same strides, dim contiguous) take each row's new key (keys [batch, kv_heads,
    dim], any float dtype, cast to the bounds' dtype) at position seq_lens - 1 of state `rows`."""
    if page_min.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("append_page_bounds_triton needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    if page_min.stride() != page_max.stride() or page_min.stride(-1) != 1 or page_min.dtype != page_max.dtype:
        raise ValueError("append_page_bounds: page_min and page_max must share dtype and strides, dim contiguous")
    # cast by torch (round to nearest even; Triton's interpreter rounds otherwise): a no-op for the
    # engine, whose keys come in the layout's dtype
    keys = keys.to(page_min.dtype)
    b, h, d = keys.shape
    if b == 0:
        return
    use_pdl = pdl.enabled(keys.device)
    launch(append_page_bounds_kernel, (b, h),
        page_min, page_max, rows, seq_lens, keys,
        page_min.stride(0), page_min.stride(1), page_min.stride(2), *keys.stride(),
        d, P=page_size, BLOCK_D=pow2(d), PDL=use_pdl, launch_pdl=use_pdl,
    )
