"""`_dot`, the product of query and key tiles in the mode `kernels/dot_modes.py`'s `_dot_mode`
picks for their dtypes (the modes are described there)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    """a [M, K] @ b [K, N] -> float32, b already in the mode's key dtype (see `_dot_mode`)."""
    if MODE == 0:
        out = tl.dot(a, b)
    elif MODE == 1:
        a = a.to(tl.float32)
        a1 = a.to(tl.bfloat16)
        rest = a - a1.to(tl.float32)
        a2 = rest.to(tl.bfloat16)
        a3 = (rest - a2.to(tl.float32)).to(tl.bfloat16)
        out = tl.dot(a3, b)
        out = tl.dot(a2, b, out)
        out = tl.dot(a1, b, out)
    elif MODE == 2:
        out = tl.dot(a.to(tl.float32), b, input_precision="tf32x3")
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return out
