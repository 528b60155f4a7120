"""Triton kernels of the algorithms' scoring hot paths (`*_triton`), each with the signature
and float32 result of its torch reference in `kernels/reference_scores.py` (re-exported
here as `*_torch`):

  quest_scores          Σ_d max(q_d·min_d, q_d·max_d) per page, combined over a GQA group
                        (with `range_weight` w < 1: minus (1 − w)·Σ_d |q_d|·(max_d − min_d)/2)
  pqcache_scores        Σ_m q_m · centroid_m[code_m(t)] per token (q·centroid table gathered)
  snapkv_window_mass    the prompt's last w queries' causal softmax mass on the keys before them
  dsa_index_scores      DeepSeek's lightning indexer Σ_h w_h · ReLU(q_h · k_t), bf16 or fp8 keys
  dsa_index_scores_fp8q the same over fp8 keys, the raw queries quantised like the keys in
                        the kernel (what DSA runs with fp8 keys)
  dsa_prefill_index_scores  the indexer for a prefill chunk: n queries over one sequence's m
                        keys (the model's own keys, 16-bit or float32), [n, m]

Every Triton kernel streams the representation that grows with the context once, one
program per (row, head or group, block of pages/tokens), tails masked; head dims that are not
powers of two are padded through masks. On the CPU the Triton versions run only under
TRITON_INTERPRET=1 (tests). fp8 keys are stored as uint8 bit patterns of float8_e4m3fn with one
float32 scale per 128 values (`quantize_fp8_blocks`); the kernel decodes them with Triton's
fp8e4nv conversion where the GPU has it (sm_89+, and the interpreter) and with integer
arithmetic elsewhere.

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

import math
import os

import torch
import triton
import triton.language as tl

from . import pdl
from ..common.arith import cdiv
from .launch import launch
from .topk import check_first_pass, first_digit_histogram, window
from .reference_scores import (
    FP8_BLOCK,
    PQ_REDUCTIONS,
    REDUCTIONS,
    _check_dsa,
    _check_prefill_index,
    _check_dsa_fp8q,
    _check_quest,
    _check_snapkv,
    _group,
    _pq_table,
    dequantize_fp8_blocks,
    dsa_index_scores_fp8q_torch,
    dsa_index_scores_torch,
    dsa_prefill_index_scores_torch,
    pqcache_scores_torch,
    quantize_fp8_blocks,
    quest_scores_torch,
    snapkv_window_mass_torch,
)

# the torch twins are re-exported beside their kernels, so callers can pick either by name
__all__ = [
    "dequantize_fp8_blocks", "quantize_fp8_blocks",
    "quest_scores_torch", "quest_scores_triton", "pqcache_scores_torch", "pqcache_scores_triton",
    "snapkv_window_mass_torch", "snapkv_window_mass_triton", "dsa_index_scores_torch", "dsa_index_scores_triton",
    "dsa_index_scores_fp8q_torch", "dsa_index_scores_fp8q_triton",
    "dsa_prefill_index_scores_torch", "dsa_prefill_index_scores_triton",
]

# launch shapes (module attributes, so that tests and benchmarks can change them)
QUEST_TILE, QUEST_WARPS = 4096, 4  # page-bound elements per program: BLOCK_P = QUEST_TILE // padded head dim
PQ_BLOCK_N, PQ_WARPS = 512, 4  # tokens per program
SNAPKV_BLOCK_M, SNAPKV_BLOCK_N, SNAPKV_SPLIT = 64, 64, 2048  # pass 1: rows, keys per step, keys per program
SNAPKV_BLOCK_W, SNAPKV_BLOCK_K, SNAPKV_WARPS = 32, 128, 4  # pass 2: window rows per step, keys per program
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


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _launchable(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if tensors[0].device.type != "cuda" and not _interpreted():
        raise RuntimeError("the Triton scoring kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")


DOT_16BIT, DOT_SPLIT3, DOT_TF32X3, DOT_IEEE = 0, 1, 2, 3


def _dot_mode(a: torch.dtype, b: torch.dtype) -> tuple[int, tl.dtype]:
    """How a kernel multiplies queries of dtype `a` with keys of dtype `b` (uint8: fp8 bits),
    and the dtype the keys are converted to. Every mode accumulates in float32:
      DOT_16BIT   both the same 16-bit dtype (or fp8 keys, exact in it): exact products
      DOT_SPLIT3  float32 queries, keys exact in bf16 (bf16, fp8): the queries split into three
                  bf16 parts (24 significant bits, all of float32's) -> exact products
      DOT_TF32X3  other float32 operands, on tensor cores (~float32 accuracy); plain "ieee"
                  float32 dots are ~100x slower on an H100
      DOT_IEEE    the interpreter: everything in float32 (it multiplies bf16 tiles as their
                  uint16 storage, triton 3.9)"""
    if a == torch.float16 and b in (a, torch.uint8):
        return DOT_16BIT, tl.float16
    if _interpreted():
        return DOT_IEEE, tl.float32
    if a == torch.bfloat16 and b in (a, torch.uint8):
        return DOT_16BIT, tl.bfloat16
    if a == torch.float32 and b in (torch.bfloat16, torch.uint8):
        return DOT_SPLIT3, tl.bfloat16
    return DOT_TF32X3, tl.float32


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


def quest_scores_triton(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, slot_ids: torch.Tensor,
    n_pages: int, reduce: str = "max", range_weight: float = 1.0,
) -> torch.Tensor:
    """Triton version of `quest_scores_torch` (same arguments and result; range_weight 1
    compiles the paper's bound without the correction term)."""
    b, hkv, g, d = _check_quest(q, page_min, page_max, slot_ids, n_pages, reduce, range_weight)
    _launchable(q, page_min, page_max, slot_ids)
    if page_min.stride() != page_max.stride():
        raise ValueError("quest_scores: page_min and page_max must have the same strides")
    out = torch.empty(b, hkv, n_pages, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_d = _pow2(d)
    block_p = max(1, min(_pow2(n_pages), QUEST_TILE // block_d))
    grid = (b, hkv, cdiv(n_pages, block_p))
    use_pdl = pdl.enabled(q.device)
    launch(quest_scores_kernel, grid,
        q, page_min, page_max, slot_ids, out, n_pages, d, (1.0 - range_weight) / 2, *q.stride(), *page_min.stride(),
        HKV=hkv, G=g, REDUCE=REDUCTIONS[reduce], SHRINK=range_weight != 1.0, BLOCK_P=block_p, BLOCK_D=block_d, PDL=use_pdl,
        num_warps=QUEST_WARPS, launch_pdl=use_pdl,
    )
    return out


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


def pqcache_scores_triton(
    q: torch.Tensor, codebooks: torch.Tensor, codes: torch.Tensor, slot_ids: torch.Tensor,
    n: int, reduce: str = "sum",
) -> torch.Tensor:
    """Triton version of `pqcache_scores_torch`: the tiny q·centroid table in torch (for "sum"
    and "mean" one per KV head, from the group's summed / averaged queries), then one kernel
    streams the codes and gathers from it."""
    _launchable(q, codebooks, codes, slot_ids)
    fold = reduce in ("sum", "mean")
    table = _pq_table(q, codebooks, codes, slot_ids, n, reduce, fold=fold).contiguous()
    reduce = "sum" if fold else reduce  # a folded table has one row per KV head
    b, hkv, g, m, k = table.shape
    out = torch.empty(b, hkv, *((g,) if reduce == "none" else ()), n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_n = min(PQ_BLOCK_N, _pow2(n))
    grid = (b, hkv, cdiv(n, block_n))
    launch(pqcache_scores_kernel, grid,
        table, codes, slot_ids, out, n, *codes.stride(),
        HKV=hkv, G=g, M=m, K=k, REDUCE=PQ_REDUCTIONS[reduce], BLOCK_M=_pow2(m), BLOCK_N=block_n, num_warps=PQ_WARPS,
    )
    return out


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


def snapkv_window_mass_triton(q_window: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Triton version of `snapkv_window_mass_torch`, never materialising [Hq, w, n]: pass 1
    computes each (head, window row)'s logsumexp over key splits (combined in torch), pass 2
    sums exp(s - lse) over the window per (KV head, key block), for every head of the group."""
    w, hq, n, hkv, d = _check_snapkv(q_window, keys)
    group = _group(hq, hkv, "snapkv_window_mass")
    _launchable(q_window, keys)
    out = torch.empty(hq, n - w, dtype=torch.float32, device=keys.device)
    if n == w:
        return out
    mode, kdt = _dot_mode(q_window.dtype, keys.dtype)
    block_d = _pow2(d, 16)
    qk_scale = 1.4426950408889634 / math.sqrt(d)
    block_n = SNAPKV_BLOCK_N
    split = max(block_n, SNAPKV_SPLIT // block_n * block_n)
    n_splits = cdiv(n, split)
    part = torch.empty(hq, w, n_splits, dtype=torch.float32, device=keys.device)
    row_blocks = cdiv(group * w, SNAPKV_BLOCK_M)
    launch(snapkv_lse_kernel, (hkv * row_blocks, n_splits),
        q_window, keys, part, n, w, d, split, n_splits, qk_scale, *q_window.stride(), *keys.stride(),
        G=group, MODE=mode, KDT=kdt, BLOCK_M=SNAPKV_BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=SNAPKV_WARPS,
    )
    lse = part.logsumexp(-1).contiguous()  # [Hq, w]
    block_w = min(SNAPKV_BLOCK_W, _pow2(w, 16))
    launch(snapkv_mass_kernel, (hkv, cdiv(n - w, SNAPKV_BLOCK_K)),
        q_window, keys, lse, out, n, w, d, qk_scale, *q_window.stride(), *keys.stride(),
        G=group, MODE=mode, KDT=kdt, BLOCK_W=block_w, BLOCK_K=SNAPKV_BLOCK_K, BLOCK_D=block_d, num_warps=SNAPKV_WARPS,
    )
    return out


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
) -> torch.Tensor:
    """Launch `dsa_index_kernel` on checked arguments (quantize: fp8 keys, raw queries;
    first_pass: (hist, seq_lens, sink, recent) for top-k's pass 1, see the kernel)."""
    fp8 = k_scale is not None
    _launchable(index_q, weights, index_k, slot_ids, *([k_scale] if fp8 else []))
    out = torch.empty(b, n, dtype=torch.float32, device=index_q.device)
    if out.numel() == 0:
        return out
    scale = k_scale if fp8 else weights  # any tensor: unused without fp8
    native = fp8 and _fp8_native(index_q.device)
    fp8_dot = quantize and native and (FP8_DOT == "on" or (FP8_DOT == "auto" and not _interpreted()))
    # quantised queries meet the keys as e4m3 values, exact in float16 where no fp8 dot is used
    mode, kdt = _dot_mode(torch.float16 if quantize else index_q.dtype, index_k.dtype)
    tune = DSA_TUNING["fp8q" if quantize else "fp8" if fp8 else "16bit"]
    block_n = tune["block_n"]
    blocks = cdiv(n, block_n)  # per row
    steps = max(1, min(tune["steps"], blocks, cdiv(b * blocks, DSA_MIN_PROGRAMS)))
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
    slot_ids: torch.Tensor, n: int,
) -> torch.Tensor:
    """Triton version of `dsa_index_scores_torch`: per (row, block of tokens) the [H, Di] x
    [Di, BLOCK_N] dot, per 128-value block scaled for fp8 keys, ReLU, weighted head sum."""
    b, h, di, _ = _check_dsa(index_q, weights, index_k, k_scale, slot_ids, n)
    return _dsa_launch(index_q, weights, index_k, k_scale, slot_ids, n, b, h, di, quantize=False, pow2_scales=False)


def dsa_index_scores_fp8q_triton(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, k_scale: torch.Tensor,
    slot_ids: torch.Tensor, n: int, pow2_scales: bool = True,
    first_pass: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """Triton version of `dsa_index_scores_fp8q_torch` in one kernel: each program quantises
    its row's raw queries (any float dtype; weights too) like `quantize_fp8_blocks`, then
    scores its STEPS blocks of tokens with them; an fp8 tensor-core dot on sm_89+ GPUs.

    first_pass: (hist, seq_lens, sink_tokens, recent_tokens): also do the first radix pass of
    the top-k over these scores into hist (`topk.first_pass_buffer(B, device)`), for
    `topk_selection_triton(..., first_pass=hist)` with the same seq_lens and window."""
    b, h, di = _check_dsa_fp8q(index_q, weights, index_k, k_scale, slot_ids, n)
    if first_pass is not None:
        hist, lens, sink, recent = first_pass
        check_first_pass(hist, b, index_q.device, "dsa_index_scores")
        if lens.shape != (b,) or lens.device != index_q.device:
            raise ValueError(f"dsa_index_scores: first_pass needs seq_lens [{b}] on {index_q.device}, "
                             f"got {tuple(lens.shape)} on {lens.device}")
        first_pass = (hist, lens, *window(sink, recent))
    return _dsa_launch(index_q, weights, index_k, k_scale, slot_ids, n, b, h, di, quantize=True, pow2_scales=pow2_scales,
                       first_pass=first_pass)


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


def dsa_prefill_index_scores_triton(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
    """Triton version of `dsa_prefill_index_scores_torch`: index_q [n, H, Di], weights [n, H],
    index_k [m, Di] (the model's keys: bf16/fp16/float32) -> float32 [n, m]. 16-bit operands
    of one dtype multiply exactly on tensor cores with float32 sums (only the order of the
    sums differs from torch's float32); float32 ones by the `_dot_mode` rules."""
    n, h, di, m = _check_prefill_index(index_q, weights, index_k)
    _launchable(index_q, weights, index_k)
    out = torch.empty(n, m, dtype=torch.float32, device=index_q.device)
    if out.numel() == 0:
        return out
    mode, kdt = _dot_mode(index_q.dtype, index_k.dtype)
    tune = DSA_PREFILL_TUNING
    grid = (cdiv(m, tune["block_n"]), cdiv(n, tune["block_q"]))
    launch(dsa_prefill_index_kernel, grid, index_q, weights, index_k, out, n, m, h,
           *index_q.stride(), *weights.stride(), *index_k.stride(),
           DI=di, MODE=mode, KDT=kdt, BLOCK_Q=tune["block_q"], BLOCK_N=tune["block_n"], BLOCK_D=_pow2(di, 16),
           num_warps=tune["warps"])
    return out
