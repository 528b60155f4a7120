"""The `@triton.jit` code of a decoder layer's elementwise work (launched by `kernels/layer_ops.py`)."""

from __future__ import annotations

import triton
import triton.language as tl


# -- residual add + RMSNorm ------------------------------------------------------------------------
@triton.jit
def add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    N, s_x, s_res, s_out, s_res_out, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * s_res + cols, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * s_res_out + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=m)


# -- RoPE of q and k, v copied ---------------------------------------------------------------------
@triton.jit
def rope_qkv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out, k_out, v_out,
    s_q, s_k, s_v, s_cos, HQ, HKV,
    D: tl.constexpr, HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    if h < HQ + HKV:
        if h < HQ:
            src = q_ptr + t * s_q + h * D
            dst = q_out + (t * HQ + h) * D
        else:
            src = k_ptr + t * s_k + (h - HQ) * D
            dst = k_out + (t * HKV + h - HQ) * D
        x1 = tl.load(src + d)
        x2 = tl.load(src + HALF + d)
        c1 = tl.load(cos_ptr + t * s_cos + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * s_cos + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * s_cos + d).to(tl.float32)
        s2 = tl.load(sin_ptr + t * s_cos + HALF + d).to(tl.float32)
        dt = x1.dtype
        # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), in float32, rounded once
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(dst + d, (x1f * c1 - x2f * s1).to(dt))
        tl.store(dst + HALF + d, (x2f * c2 + x1f * s2).to(dt))
    else:
        dd = tl.arange(0, D)
        src = v_ptr + t * s_v + (h - HQ - HKV) * D
        tl.store(v_out + (t * HKV + h - HQ - HKV) * D + dd, tl.load(src + dd))


# -- SiLU(gate) * up -------------------------------------------------------------------------------
@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, N, s_gu, s_out, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    g = tl.load(gu_ptr + t * s_gu + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + t * s_gu + N + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + t * s_out + cols, (act * u.to(tl.float32)).to(g.dtype), mask=m)
