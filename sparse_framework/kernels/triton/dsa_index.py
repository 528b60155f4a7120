"""The `@triton.jit` code of DeepSeek's lightning indexer (launched by `kernels/dsa_index.py`):
fp8 decoding, the in-kernel query quantisation, the decode and prefill indexer kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .dot_modes import _dot
from .topk import first_digit_histogram


@triton.jit
def _e4m3_decode(bits, NATIVE: tl.constexpr, DST: tl.constexpr):
    """float8_e4m3fn bit patterns (uint8) -> DST (every e4m3 value is exact in float32, bf16
    and fp16). The integer path reads the NaN patterns (0x7f, 0xff) as ±480;
    `quantize_fp8_blocks` never writes them."""
    if NATIVE:
        out = bits.to(tl.float8e4nv, bitcast=True).to(DST)
    else:
        x = bits.to(tl.int32)
        sign = (x >> 7) << 31
        exp = (x >> 3) & 15
        mant = x & 7
        normal = (sign | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
        tiny = mant.to(tl.float32) * 0.001953125  # subnormal: mant · 2^-9
        out = tl.where(exp == 0, tl.where(sign != 0, -tiny, tiny), normal).to(DST)
    return out


@triton.jit
def _e4m3_round(x):
    """float32 x, |x| <= 448 -> the nearest float8_e4m3fn value (ties to even), as float32, in
    integer arithmetic: exact on every backend. The significand m (24 bits with the implicit
    one) loses s bits: 20 down to e4m3's 3 mantissa bits, more below 2^-6 where e4m3's
    subnormals step by 2^-9 (s >= 25 rounds everything to 0)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 255) - 127  # float32 zeros and subnormals: -127, they round to 0
    e_out = tl.maximum(e, -6)  # the exponent of the e4m3 step: 2^(e_out - 3)
    s = tl.minimum(20 + e_out - e, 25)
    m = (bits & 0x7FFFFF) | 0x800000
    r = (m + (1 << (s - 1)) - 1 + ((m >> s) & 1)) >> s  # m / 2^s rounded half to even, 0 .. 16
    step = ((e_out + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e_out - 3)
    mag = r.to(tl.float32) * step
    return tl.where(bits < 0, -mag, mag)


@triton.jit
def _quantize_e4m3_rows(x, POW2: tl.constexpr, HW_ROUND: tl.constexpr, DST: tl.constexpr):
    """`quantize_fp8_blocks` of each row of x (float32 [rows, 128]): scale = max(amax, 1e-4)
    / 448 (with POW2 rounded up to a power of two by `ceil_pow2`'s bit rule), values = x /
    scale clamped to ±448 and rounded to e4m3, ties to even. Divisions are IEEE (div_rn; a
    plain `/` is approximate on NVIDIA GPUs). HW_ROUND: the GPU's fp32 -> fp8e4nv conversion
    rounds (cvt.rn.satfinite, sm_89+); otherwise `_e4m3_round`, exact everywhere (the
    interpreter's conversion rounds ties away from zero). -> (values as DST, scales float32 [rows])."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4), 448.0)
    if POW2:
        scale = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        v = x * tl.math.div_rn(1.0, scale)[:, None]  # exact: a power of two
    else:
        v = tl.math.div_rn(x, scale[:, None])
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if not HW_ROUND:
        v = _e4m3_round(v)
    return v.to(DST), scale


@triton.jit
def dsa_index_kernel(
    q_ptr, w_ptr, k_ptr, scale_ptr, slot_ptr, out_ptr, hist_ptr, lens_ptr,
    n, H, sink, recent,
    s_qb, s_qh, s_qd, s_wb, s_wh, s_kr, s_kn, s_kd, s_sr, s_sn, s_sd,
    DI: tl.constexpr, FP8: tl.constexpr, NATIVE: tl.constexpr, MODE: tl.constexpr, KDT: tl.constexpr,
    QUANT_Q: tl.constexpr, POW2: tl.constexpr, FP8_DOT: tl.constexpr, HW_ROUND: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr,
    STAGES: tl.constexpr, HIST: tl.constexpr, PDL: tl.constexpr,
):
    """One program: STEPS blocks of BLOCK_N tokens of row b, in a pipelined loop (the head-dim
    chunks are unrolled, so the token loop is the innermost one).

    QUANT_Q (fp8 keys): the raw queries are quantised per (head, chunk of 128) once, before
    the loop, and kept as one tile per chunk (a tuple); each chunk's dot is then scaled by
    q_scale[h] · k_scale[t]. FP8_DOT: that dot multiplies the fp8 tiles on tensor cores;
    otherwise both operands are decoded to KDT (exact). Without QUANT_Q the queries are
    loaded, in their own dtype, chunk by chunk inside the loop.

    The FP8 dot puts the tokens on the M side, [BLOCK_N, Di] x [Di, H]: the MMA spreads M
    over the warps and N over the lanes, so the epilogue's sum over heads stays inside a warp.
    With the heads on M ([H, Di] x [Di, BLOCK_N], as before) that sum crossed the warps every
    block: 72 µs against 60.5 µs at 8 x 131072 tokens on an H100 (best launch shape of each).

    fp8 keys with one chunk (Di = 128, V3.2's): the scales are positive, so they commute with
    the ReLU: q_scale folds into the head weights and k_scale multiplies the token's sum,
    leaving the epilogue ReLU, weight and sum only.

    HIST: also top-k's first radix pass over these scores (kernels/topk.py,
    `first_digit_histogram`; row b of length lens[b], the sink and recent window forced),
    added into hist[b, 0:256] once per program: the top-k then skips that pass.

    PDL: waits for the previous kernel first (kernels/pdl.py)."""
    pdl.wait(PDL)
    CHUNKS: tl.constexpr = (DI + BLOCK_D - 1) // BLOCK_D
    FOLD: tl.constexpr = FP8 and CHUNKS == 1
    b = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    wts = tl.load(w_ptr + b * s_wb + h * s_wh, mask=h < H, other=0.0).to(tl.float32)
    q_row = q_ptr + b * s_qb + h[:, None] * s_qh
    q_tiles = ()
    q_scales = ()
    if QUANT_Q:
        for c in tl.static_range(CHUNKS):
            d = c * BLOCK_D + tl.arange(0, BLOCK_D)
            q = tl.load(q_row + d[None, :] * s_qd, mask=h[:, None] < H, other=0.0).to(tl.float32)
            q, q_scale = _quantize_e4m3_rows(q, POW2, HW_ROUND, tl.float8e4nv if FP8_DOT else KDT)
            q_tiles = q_tiles + (q,)
            q_scales = q_scales + (q_scale,)
        if FOLD:
            wts = wts * q_scales[0]
    first = tl.program_id(1) * (BLOCK_N * STEPS)
    if HIST:
        ln = tl.load(lens_ptr + b).to(tl.int32)
        hist = tl.zeros([256], tl.int32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        t = first + step * BLOCK_N + tl.arange(0, BLOCK_N)
        t_ok = t < n
        k_row = k_ptr + slot * s_kr + t[:, None].to(tl.int64) * s_kn
        s_row = scale_ptr + slot * s_sr + t.to(tl.int64) * s_sn
        if FP8_DOT:
            acc = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
        else:
            acc = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        for c in tl.static_range(CHUNKS):
            d = c * BLOCK_D + tl.arange(0, BLOCK_D)
            k = tl.load(k_row + d[None, :] * s_kd, mask=t_ok[:, None] & (d[None, :] < DI), other=0)
            if FP8_DOT:
                part = tl.dot(k.to(tl.float8e4nv, bitcast=True), tl.trans(q_tiles[c]))
            else:
                if QUANT_Q:
                    q = q_tiles[c]
                else:
                    q = tl.load(q_row + d[None, :] * s_qd, mask=(h[:, None] < H) & (d[None, :] < DI), other=0.0)
                if FP8:
                    k = _e4m3_decode(k, NATIVE, KDT)
                part = _dot(q, tl.trans(k.to(KDT)), MODE)
            if FP8 and not FOLD:
                k_scale = tl.load(s_row + c * s_sd, mask=t_ok, other=0.0)
                if FP8_DOT:
                    part = part * k_scale[:, None]
                    if QUANT_Q:
                        part = part * q_scales[c][None, :]
                else:
                    part = part * k_scale[None, :]
                    if QUANT_Q:
                        part = part * q_scales[c][:, None]
            acc += part
        if FP8_DOT:
            score = tl.sum(tl.maximum(acc, 0.0) * wts[None, :], axis=1)
        else:
            score = tl.sum(tl.maximum(acc, 0.0) * wts[:, None], axis=0)
        if FOLD:
            score = score * tl.load(s_row, mask=t_ok, other=0.0)
        tl.store(out_ptr + b * n + t, score, mask=t_ok)
        if HIST:
            hist += first_digit_histogram(score, t, ln, n, sink, recent, 1)
    if HIST:
        tl.atomic_add(hist_ptr + b.to(tl.int64) * 1024 + tl.arange(0, 256), hist, mask=hist > 0, sem="relaxed")


# -- DSA at prefill ----------------------------------------------------------------------------
@triton.jit
def dsa_prefill_index_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr, n, m, H,
    s_qn, s_qh, s_qd, s_wn, s_wh, s_km, s_kd,
    DI: tl.constexpr, MODE: tl.constexpr, KDT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_Q queries x BLOCK_N keys. The key tile is loaded once; per head
    the [BLOCK_Q, Di] x [Di, BLOCK_N] dot, ReLU, times the queries' weight for that head,
    summed into a float32 [BLOCK_Q, BLOCK_N] tile: the [n, H, m] float32 products torch
    makes (and reads twice more, for the ReLU and the head sum) never exist. Axis 0 of the
    grid walks the key blocks, so the programs running together share their query block
    (in L2) and stream the keys."""
    kb = tl.program_id(0)
    qb = tl.program_id(1)
    i = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    t = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    i_ok = i < n
    k = tl.load(k_ptr + t[:, None].to(tl.int64) * s_km + d[None, :] * s_kd,
                mask=(t[:, None] < m) & (d[None, :] < DI), other=0.0)
    kt = tl.trans(k.to(KDT))
    acc = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
    q_rows = q_ptr + i[:, None].to(tl.int64) * s_qn + d[None, :] * s_qd
    for h in range(H):
        q = tl.load(q_rows + h * s_qh, mask=i_ok[:, None] & (d[None, :] < DI), other=0.0)
        w = tl.load(w_ptr + i.to(tl.int64) * s_wn + h * s_wh, mask=i_ok, other=0.0).to(tl.float32)
        acc += tl.maximum(_dot(q, kt, MODE), 0.0) * w[:, None]
    tl.store(out_ptr + i[:, None].to(tl.int64) * m + t[None, :], acc, mask=i_ok[:, None] & (t[None, :] < m))
