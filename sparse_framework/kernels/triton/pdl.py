"""`wait`, the PDL wait every kernel launched with `launch_pdl=True` runs first (the contract:
kernels/pdl.py, which decides when to launch with PDL)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait(PDL: tl.constexpr):
    """With PDL: wait for the predecessor kernel (its writes visible), then let the successor
    launch. Without: nothing (the launch itself waited)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
