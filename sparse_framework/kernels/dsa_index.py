"""Triton kernels of DeepSeek's lightning indexer (DSA), each with the signature and float32
result of its torch reference in `kernels/reference_scores.py`:

  dsa_index_scores      Σ_h w_h · ReLU(q_h · k_t) per token, bf16 or fp8 keys
  dsa_index_scores_fp8q the same over fp8 keys, the raw queries quantised like the keys in
                        the kernel (what DSA runs with fp8 keys)
  dsa_prefill_index_scores  the indexer for a prefill chunk: n queries over one sequence's m
                        keys (the model's own keys, 16-bit or float32), [n, m]

Its own module, apart from the other algorithms' scoring (`kernels/scoring.py`, which
re-exports these functions beside their torch twins), because it is the one family with fp8
keys: their decoding, the in-kernel query quantisation and its rounding, the fp8 dot and the
launch shapes tuned for them. The launch shapes and the fp8 dot switch are arguments of the
launchers (`tuning=`, `min_programs=`, `fp8_dot=`), by default the module constants below.

fp8 keys are stored as uint8 bit patterns of float8_e4m3fn with one float32 scale per 128
values (`quantize_fp8_blocks`); the kernel decodes them with Triton's fp8e4nv conversion
where the GPU has it (sm_89+, and the interpreter) and with integer arithmetic elsewhere.

DSA with fp8 keys quantises its queries too (DeepSeek's indexer does). Done in torch that is
~16 tiny kernels per step, costlier than they look next to a ~50 µs scoring pass, so
`dsa_index_scores_fp8q_triton` takes the raw queries and each program quantises its row's
[H, Di] tile once (bit-exact with `quantize_fp8_blocks`: IEEE divisions, power-of-two scales
by the same bit rule, e4m3 rounding ties to even), then loops over several token blocks with
it. On sm_89+ GPUs the quantised tile and the key bits meet in an fp8 tensor-core dot (keys
never decoded); elsewhere, and under the interpreter, both are decoded to float16 (exact).
Measured times: docs/algorithms.md (benchmarks/selection.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from . import pdl
from ..common.arith import cdiv
from .dot_modes import _dot, _dot_mode, _interpreted, _launchable, _pow2
from .launch import launch
from .topk import check_first_pass, first_digit_histogram, window
from .reference_scores import FP8_BLOCK, _check_dsa, _check_dsa_fp8q, _check_prefill_index

__all__ = ["dsa_index_scores_triton", "dsa_index_scores_fp8q_triton", "dsa_prefill_index_scores_triton"]

# launch shapes (the defaults of the launchers' `tuning` and `min_programs` arguments)
# DSA, per variant: tokens per block, blocks per program (one pipelined loop over them: the
# program's setup, for "fp8q" the query quantisation, is shared by all), its pipeline stages,
# warps. "16bit": bf16/fp16/float32 keys; "fp8": fp8 keys, the queries as given; "fp8q": fp8
# keys, queries quantised in the kernel (what DSA runs). "fp8q" is the fastest of 42 shapes
# at 8 x 131072 tokens on an H100 (54 µs, floor 46; `python benchmarks/tune_dsa_index.py`).
# Steps are cut where the grid would fall under DSA_MIN_PROGRAMS (2 per H100 SM): at 8 x
# 131072 tokens all 32 steps, for one request of 131072 tokens 4.
DSA_TUNING = {
    "16bit": {"block_n": 128, "steps": 1, "stages": 1, "warps": 4},
    "fp8": {"block_n": 128, "steps": 1, "stages": 1, "warps": 4},
    "fp8q": {"block_n": 128, "steps": 32, "stages": 3, "warps": 4},
}
DSA_MIN_PROGRAMS = 264
# the prefill indexer: queries and keys per program, warps
DSA_PREFILL_TUNING = {"block_q": 64, "block_n": 128, "warps": 4}
FP8_DECODE = "auto"  # "auto" | "native" (tl.float8e4nv) | "arith" (integer decode, any GPU)
# "fp8q" multiplies with an fp8 tensor-core dot where fp8 is native: "auto" (compiled only),
# "on" (also interpreted: tests), "off" (float16 dots of decoded values, exact)
FP8_DOT = "auto"


# -- DSA lightning indexer ---------------------------------------------------------------------


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


def _fp8_native(device: torch.device) -> bool:
    """Whether Triton's fp8e4nv type works here: sm_89+ GPUs and the interpreter."""
    if FP8_DECODE != "auto":
        return FP8_DECODE == "native"
    if device.type != "cuda":
        return True  # the interpreter converts fp8e4nv
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _dsa_launch(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, k_scale: torch.Tensor | None,
    slot_ids: torch.Tensor, n: int, b: int, h: int, di: int, quantize: bool, pow2_scales: bool,
    first_pass: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
    tuning: Mapping[str, int] | None = None, min_programs: int | None = None, fp8_dot: str | None = None,
) -> torch.Tensor:
    """Launch `dsa_index_kernel` on checked arguments (quantize: fp8 keys, raw queries;
    first_pass: (hist, seq_lens, sink, recent) for top-k's pass 1, see the kernel). The launch
    shape: `tuning` (block_n, steps, stages, warps; default the variant's DSA_TUNING entry),
    `min_programs` (default DSA_MIN_PROGRAMS), `fp8_dot` (default FP8_DOT)."""
    fp8 = k_scale is not None
    _launchable(index_q, weights, index_k, slot_ids, *([k_scale] if fp8 else []))
    out = torch.empty(b, n, dtype=torch.float32, device=index_q.device)
    if out.numel() == 0:
        return out
    scale = k_scale if fp8 else weights  # any tensor: unused without fp8
    native = fp8 and _fp8_native(index_q.device)
    fp8_dot = FP8_DOT if fp8_dot is None else fp8_dot
    fp8_dot = quantize and native and (fp8_dot == "on" or (fp8_dot == "auto" and not _interpreted()))
    # quantised queries meet the keys as e4m3 values, exact in float16 where no fp8 dot is used
    mode, kdt = _dot_mode(torch.float16 if quantize else index_q.dtype, index_k.dtype)
    tune = DSA_TUNING["fp8q" if quantize else "fp8" if fp8 else "16bit"] if tuning is None else tuning
    min_programs = DSA_MIN_PROGRAMS if min_programs is None else min_programs
    block_n = tune["block_n"]
    blocks = cdiv(n, block_n)  # per row
    steps = max(1, min(tune["steps"], blocks, cdiv(b * blocks, min_programs)))
    grid = (b, cdiv(n, block_n * steps))
    hist, lens, sink, recent = first_pass if first_pass is not None else (out, slot_ids, 0, 0)
    use_pdl = pdl.enabled(index_q.device)
    launch(dsa_index_kernel, grid,
        index_q, weights, index_k, scale, slot_ids, out, hist, lens, n, h, sink, recent,
        *index_q.stride(), *weights.stride(), *index_k.stride(), *(scale.stride() if fp8 else (0, 0, 0)),
        DI=di, FP8=fp8, NATIVE=native, MODE=mode, KDT=kdt,
        QUANT_Q=quantize, POW2=pow2_scales, FP8_DOT=fp8_dot, HW_ROUND=fp8_dot and not _interpreted(),
        BLOCK_H=_pow2(h, 16), BLOCK_D=FP8_BLOCK if fp8 else min(FP8_BLOCK, _pow2(di, 16)), BLOCK_N=block_n,
        STEPS=steps, STAGES=tune["stages"], HIST=first_pass is not None, PDL=use_pdl,
        num_warps=tune["warps"],
        launch_pdl=use_pdl,
    )
    return out


def dsa_index_scores_triton(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, k_scale: torch.Tensor | None,
    slot_ids: torch.Tensor, n: int, *, tuning: Mapping[str, int] | None = None, min_programs: int | None = None,
) -> torch.Tensor:
    """Triton version of `dsa_index_scores_torch`: per (row, block of tokens) the [H, Di] x
    [Di, BLOCK_N] dot, per 128-value block scaled for fp8 keys, ReLU, weighted head sum.
    `tuning`, `min_programs`: the launch shape (`_dsa_launch`)."""
    b, h, di, _ = _check_dsa(index_q, weights, index_k, k_scale, slot_ids, n)
    return _dsa_launch(index_q, weights, index_k, k_scale, slot_ids, n, b, h, di, quantize=False, pow2_scales=False,
                       tuning=tuning, min_programs=min_programs)


def dsa_index_scores_fp8q_triton(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, k_scale: torch.Tensor,
    slot_ids: torch.Tensor, n: int, pow2_scales: bool = True,
    first_pass: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
    *, tuning: Mapping[str, int] | None = None, min_programs: int | None = None, fp8_dot: str | None = None,
) -> torch.Tensor:
    """Triton version of `dsa_index_scores_fp8q_torch` in one kernel: each program quantises
    its row's raw queries (any float dtype; weights too) like `quantize_fp8_blocks`, then
    scores its STEPS blocks of tokens with them; an fp8 tensor-core dot on sm_89+ GPUs.

    first_pass: (hist, seq_lens, sink_tokens, recent_tokens): also do the first radix pass of
    the top-k over these scores into hist (`topk.first_pass_buffer(B, device)`), for
    `topk_selection_triton(..., first_pass=hist)` with the same seq_lens and window.

    The launch shape: `tuning` (block_n, steps, stages, warps: DSA_TUNING["fp8q"]'s keys),
    `min_programs`, and `fp8_dot` ("auto", "on", "off"); None: the module constants."""
    b, h, di = _check_dsa_fp8q(index_q, weights, index_k, k_scale, slot_ids, n)
    if first_pass is not None:
        hist, lens, sink, recent = first_pass
        check_first_pass(hist, b, index_q.device, "dsa_index_scores")
        if lens.shape != (b,) or lens.device != index_q.device:
            raise ValueError(f"dsa_index_scores: first_pass needs seq_lens [{b}] on {index_q.device}, "
                             f"got {tuple(lens.shape)} on {lens.device}")
        first_pass = (hist, lens, *window(sink, recent))
    return _dsa_launch(index_q, weights, index_k, k_scale, slot_ids, n, b, h, di, quantize=True, pow2_scales=pow2_scales,
                       first_pass=first_pass, tuning=tuning, min_programs=min_programs, fp8_dot=fp8_dot)


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


def dsa_prefill_index_scores_triton(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, *, tuning: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """Triton version of `dsa_prefill_index_scores_torch`: index_q [n, H, Di], weights [n, H],
    index_k [m, Di] (the model's keys: bf16/fp16/float32) -> float32 [n, m]. 16-bit operands
    of one dtype multiply exactly on tensor cores with float32 sums (only the order of the
    sums differs from torch's float32); float32 ones by the `_dot_mode` rules. `tuning`:
    block_q, block_n, warps (default DSA_PREFILL_TUNING)."""
    n, h, di, m = _check_prefill_index(index_q, weights, index_k)
    _launchable(index_q, weights, index_k)
    out = torch.empty(n, m, dtype=torch.float32, device=index_q.device)
    if out.numel() == 0:
        return out
    mode, kdt = _dot_mode(index_q.dtype, index_k.dtype)
    tune = DSA_PREFILL_TUNING if tuning is None else tuning
    grid = (cdiv(m, tune["block_n"]), cdiv(n, tune["block_q"]))
    launch(dsa_prefill_index_kernel, grid, index_q, weights, index_k, out, n, m, h,
           *index_q.stride(), *weights.stride(), *index_k.stride(),
           DI=di, MODE=mode, KDT=kdt, BLOCK_Q=tune["block_q"], BLOCK_N=tune["block_n"], BLOCK_D=_pow2(di, 16),
           num_warps=tune["warps"])
    return out
