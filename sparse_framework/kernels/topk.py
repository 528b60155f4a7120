"""Triton version of `algorithms.base.topk_selection`: unit scores -> a Selection, with an
exact radix select instead of torch.topk and a prefix-sum compaction, all on the device.

Why: at decode the selection has few rows and long ones (DSA: 8 rows x 131072 tokens, top
2048; Quest: 64 rows x 8192 pages, top 128). torch.topk parallelises poorly over so few rows,
and the torch path runs ~15 full-size elementwise ops besides: 0.2-0.9 ms on an H100, more
than the scoring kernels. Here every kernel runs on a (row, chunk) grid — several hundred
programs whatever the row count — and reads the scores, which sit in L2, once.

Semantics (identical to the torch path): a unit is *forced* if it holds a sink token, a token
of the recent window or the newest token; the other valid units (id * unit < length) are
*eligible*; the `budget_units` best eligible units are kept besides the forced ones. Two
variants (see `topk_selection`): a per-row forced tail (`tail_start`, SnapKV's window and
decoded tokens), and the newest unit counted inside the budget (`newest_forced=False`: it is
forced only by the sink or recent window, else eligible and ranked above every score). NaN ranks
as -finfo.max, ±inf as ±finfo.max (so NaN, -inf and -finfo.max tie), -0.0 equals +0.0. The
kept unit ids, ascending, are cut to `min(width_units, n_units)` and expanded to tokens.
Ties at the threshold — eligible units scoring exactly the budget-th best score — are broken
deterministically: the lowest unit ids win. (torch.topk may keep other tied units; the set
of kept *scores* is the same.)

The algorithm (a radix select in four 8-bit passes and a prefix-sum compaction, fused into one
cooperative launch where the grid fits), and why 8-bit digits: docs/kernels.md, "Top-k".
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..common.batch import Selection
from . import pdl
from ..common.arith import cdiv
from .launch import launch

__all__ = ["topk_selection_triton", "first_pass_buffer", "check_first_pass", "first_digit_histogram", "window"]

# launch shapes: BLOCK units per program, the largest power of two in [MIN_BLOCK, MAX_BLOCK]
# that still gives about TARGET_PROGRAMS programs (2 per H100 SM); warps per program: 8 for
# blocks of 2048 units or more, else 4. `topk_selection_triton(block=, warps=)` overrides
# both per call (benchmarks/tune_topk.py); BLOCK_OVERRIDE / WARPS_OVERRIDE are the defaults of
# those arguments (None: the rule; tests set small blocks to exercise many chunks per row
# through the algorithms' `topk_selection`, which passes no shape).
MIN_BLOCK, MAX_BLOCK, TARGET_PROGRAMS, MAX_CHUNKS = 256, 4096, 256, 1024
BLOCK_OVERRIDE: int | None = None
WARPS_OVERRIDE: int | None = None

# "auto": on CUDA, the four passes and the write step run as one cooperative kernel
# (`_topk_fused_kernel`, row barriers where the kernels would end) when all its programs fit
# on the GPU at once (`_fused_shape`); "off": five kernels. The default of
# `topk_selection_triton(fused=)`.
FUSED = "auto"
_FUSED_SHAPES: dict[tuple, tuple[int, int] | None] = {}


# radix digits: 4 x 8 bits (256 bins; the kernels spell these numbers out); per row, `hist`
# holds the 4 histograms, `state` the prefix and rank chosen after passes 1, 2 and 3
_NB, _PASSES = 256, 4
_HIST_ROW = _PASSES * _NB
_STATE_ROW = 8  # (prefix, need) x 3, then 2 spare (the kernels index row * 8)


@triton.jit
def _masks(ids, ln, n_units, sink, recent, tail, UNIT: tl.constexpr, NEWEST_FORCED: tl.constexpr = True):
    """(forced, eligible) masks of units `ids` of a row of length ln. Mirrors topk_selection's.
    tail: the row's forced tail start (ln when it has none); NEWEST_FORCED False: the newest
    unit is forced only by the sink or the recent window / tail (else it is eligible)."""
    tok = ids * UNIT
    valid = (ids < n_units) & (tok < ln)
    last = tl.maximum(ln - 1, 0) // UNIT  # only used where valid, i.e. ln >= 1
    # the first unit holding a token of the recent window or of the tail (none when either is
    # empty: with a partial last unit, ln // UNIT is that unit)
    none = ln // UNIT + 1
    recent_start = tl.where(recent > 0, tl.maximum(ln - recent, 0) // UNIT, none)
    recent_start = tl.minimum(recent_start, tl.where(tail < ln, tl.maximum(tail, 0) // UNIT, none))
    if NEWEST_FORCED:
        forced = valid & ((tok < sink) | (ids >= recent_start) | (ids == last))
    else:
        forced = valid & ((tok < sink) | (ids >= recent_start))
    return forced, valid & ~forced


@triton.jit
def first_digit_histogram(x, ids, ln, n_units, sink, recent, UNIT: tl.constexpr):
    """Pass 1 for a producer of the scores (DSA's indexer kernel, kernels/dsa_index.py): the
    histogram [256] of the top radix digit of float32 scores x of units `ids` of a row of
    length ln, over its eligible units. Added into hist[row, 0:256] and handed to
    `topk_selection_triton(first_pass=hist)`, it replaces that launch."""
    forced, eligible = _masks(ids, ln, n_units, sink, recent, ln, UNIT)
    digit = ((_order_key(x) ^ -2147483648) >> 24) & 0xFF
    return tl.histogram(digit, 256, mask=eligible)


@triton.jit
def _order_key(x):
    """float32 -> int32 whose signed order is the float order, NaN lowest (see the module
    docstring); on the bits, not with float ops, which may flush subnormals on the GPU."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    neg_max = -8388609  # 0xFF7FFFFF: -finfo.max
    bits = tl.where(mag > 0x7F800000, neg_max, bits)  # NaN ranks last, like nan_to_num(nan=-max)
    bits = tl.where(mag == 0x7F800000, tl.where(bits < 0, neg_max, 0x7F7FFFFF), bits)  # ±inf -> ±max
    bits = tl.where(mag == 0, 0, bits)  # -0.0 == +0.0 in torch's comparisons: one key
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int order == float order


@triton.jit
def _chunk(scores_ptr, lens_ptr, row, chunk, n_units, H, s_b, s_h, s_n, sink, recent, tail_ptr,
           UNIT: tl.constexpr, BLOCK: tl.constexpr, HAS_TAIL: tl.constexpr, NEWEST_FORCED: tl.constexpr):
    """This program's units: ids, the row's length, forced / eligible masks and order keys
    (keys of ineligible units are meaningless). Mirrors topk_selection's masks exactly:
    HAS_TAIL reads the row's forced tail start from tail_ptr; without NEWEST_FORCED an
    eligible newest unit gets the key of +inf's bits, above every score's key (each maps to
    at most finfo.max's), so it is the first unit the budget keeps."""
    b = row // H
    h = row - b * H
    ln = tl.load(lens_ptr + b).to(tl.int32)
    tail = ln
    if HAS_TAIL:
        tail = tl.load(tail_ptr + b).to(tl.int32)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    forced, eligible = _masks(ids, ln, n_units, sink, recent, tail, UNIT, NEWEST_FORCED)
    off = b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + ids.to(tl.int64) * s_n
    x = tl.load(scores_ptr + off, mask=eligible, other=0.0)
    key = _order_key(x)
    if not NEWEST_FORCED:
        key = tl.where(ids == tl.maximum(ln - 1, 0) // UNIT, 0x7F800000, key)
    return ids, ln, forced, eligible, key


@triton.jit
def _pick(h, need):
    """From a bucket's digit histogram h and the rank `need` (>= 0, <= h.sum()) of the wanted
    key among the bucket's largest: the digit D holding it (the top digit when need is 0)
    and its rank among D's keys. D = the largest digit with Σ_{d >= D} h[d] >= need."""
    at_or_above = tl.cumsum(h, 0, reverse=True)  # Σ_{d' >= d} h[d'], non-increasing
    digit = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1  # at_or_above[0] >= need
    above = tl.max(tl.where(at_or_above < need, at_or_above, 0), 0)  # at_or_above[D + 1], or 0
    return digit, need - above


@triton.jit
def _pass_histogram(u, eligible, forced, hist_row, state_row, sure_ptr, suffix_ptr, slot, prefix, need, budget,
                    write_state, PASS: tl.constexpr):
    """Radix pass PASS (1 to 4) of one chunk, whose unsigned order bits are u: the histogram
    of digit PASS (bits [32 - 8 PASS, 40 - 8 PASS) of u) of the eligible keys that match the
    prefix chosen so far, added into hist_row[PASS - 1]. Before it (PASS > 1), the digit of the
    previous pass is picked from that pass's complete histogram: (prefix, need) in, out.
    write_state: store (prefix, need) in state_row for a later kernel (chunk 0 does). Pass 4
    also leaves what the write step needs of this chunk once the last digit is known:
    sure[slot] = units kept whatever it is (forced, or a 24-bit prefix above the threshold's),
    and suffix[slot, d] = the chunk's candidates (the threshold's prefix) whose last digit is
    >= d."""
    SHIFT: tl.constexpr = 32 - 8 * PASS
    digit = (u >> SHIFT) & 0xFF
    high = u  # unused in pass 1
    if PASS == 1:
        match = eligible
    else:
        # the bucket of the need-th largest key, from the previous pass's (complete) histogram
        h = tl.load(hist_row + (PASS - 2) * 256 + tl.arange(0, 256), cache_modifier=".cg")
        if PASS == 2:
            need = tl.minimum(tl.sum(h, 0), budget)  # min(budget, eligible units)
        d, need = _pick(h, need)
        prefix = prefix * 256 + d  # the top 8 (PASS - 1) bits of the wanted key
        if write_state:
            tl.store(state_row + 2 * (PASS - 2), prefix)
            tl.store(state_row + 2 * (PASS - 2) + 1, need)
        high = (u >> (SHIFT + 8)) & ((1 << (8 * PASS - 8)) - 1)
        match = eligible & (high == prefix)
    # tl.histogram costs as much for masked elements (see the module docstring): a chunk with
    # no unit in the bucket (most chunks by pass 4; in pass 1, those past the length) skips it
    n_match = tl.sum(match.to(tl.int32), 0)
    hist = tl.full([256], 0, tl.int32)
    if n_match > 0:
        hist = tl.histogram(digit, 256, mask=match)
        tl.atomic_add(hist_row + (PASS - 1) * 256 + tl.arange(0, 256), hist, mask=hist > 0, sem="relaxed")
    if PASS == 4:
        tl.store(sure_ptr + slot, tl.sum((forced | (eligible & (high > prefix))).to(tl.int32), 0))
        suffix = n_match - (tl.cumsum(hist, 0) - hist)
        tl.store(suffix_ptr + slot.to(tl.int64) * 256 + tl.arange(0, 256), suffix)
    return prefix, need


@triton.jit
def _topk_hist_kernel(
    scores_ptr, lens_ptr, hist_ptr, state_ptr, sure_ptr, suffix_ptr,
    n_units, H, s_b, s_h, s_n, sink, recent, tail_ptr, budget,
    PASS: tl.constexpr, UNIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    HAS_TAIL: tl.constexpr, NEWEST_FORCED: tl.constexpr,
):
    """Radix pass PASS (1 to 4) of a (row, chunk) program (`_pass_histogram`); the prefix and
    rank chosen so far come from `state`, which the row's chunk 0 extends.

    PDL (kernels/pdl.py): EARLY loads the chunk's scores before waiting for the previous
    kernel, which must then not be the scores' producer."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    hist_row = hist_ptr + row.to(tl.int64) * 1024
    state_row = state_ptr + row * 8
    if not EARLY:
        pdl.wait(PDL)
    ids, ln, forced, eligible, key = _chunk(scores_ptr, lens_ptr, row, chunk, n_units, H, s_b, s_h, s_n,
                                            sink, recent, tail_ptr, UNIT, BLOCK, HAS_TAIL, NEWEST_FORCED)
    if EARLY:
        pdl.wait(PDL)
    u = key ^ -2147483648  # unsigned order bits (as int32; digits are masked after >>)
    prefix = 0
    need = 0
    if PASS > 2:
        prefix = tl.load(state_row + 2 * (PASS - 3))
        need = tl.load(state_row + 2 * (PASS - 3) + 1)
    _pass_histogram(u, eligible, forced, hist_row, state_row, sure_ptr, suffix_ptr, row * tl.num_programs(1) + chunk,
                    prefix, need, budget, chunk == 0, PASS)


@triton.jit
def _write_chunk(row, chunk, ids, ln, forced, eligible, key, prefix, need, hist_row, sure_ptr, suffix_ptr,
                 out_ptr, lengths_ptr, n_units, n_chunks, width,
                 UNIT: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr):
    """The write step of one chunk, once pass 4 is complete: fix the threshold (the last
    digit), count every chunk's kept units from pass 4's records, and write this chunk's kept
    units, ascending, at slots after those of the row's earlier chunks; -1 padding after the
    row's last kept unit; chunk 0 writes the length."""
    d4, n_tie = _pick(tl.load(hist_row + 768 + tl.arange(0, 256), cache_modifier=".cg"), need)
    # unsigned bits (prefix, d4) back to the signed key: u - 2^31, exact in int64
    thr = ((prefix.to(tl.int64) * 256 + d4) - 2147483648).to(tl.int32)

    c = tl.arange(0, CBLOCK)
    live = c < n_chunks
    slots = row * n_chunks + c
    at_or_above = tl.load(suffix_ptr + slots.to(tl.int64) * 256 + d4, mask=live, other=0, cache_modifier=".cg")
    above = tl.load(suffix_ptr + slots.to(tl.int64) * 256 + tl.minimum(d4 + 1, 255), mask=live, other=0,
                    cache_modifier=".cg")
    above = tl.where(d4 < 255, above, 0)  # nothing lies above the top digit
    tied = at_or_above - above
    tied_before = tl.cumsum(tied, 0) - tied
    kept = tl.load(sure_ptr + slots, mask=live, other=0, cache_modifier=".cg") + above
    kept += tl.minimum(tl.maximum(n_tie - tied_before, 0), tied)  # ties: lowest ids first
    base = tl.sum(tl.where(c < chunk, kept, 0), 0)
    total = tl.sum(kept, 0)
    my_tied_before = tl.sum(tl.where(c < chunk, tied, 0), 0)

    is_tie = eligible & (key == thr)
    sure = forced | (eligible & (key > thr))  # kept whatever the ties (forced units are not eligible)
    quota = tl.maximum(n_tie - my_tied_before, 0)  # this chunk's ties that are kept: its first `quota`
    if BLOCK <= 16384:
        # one scan for both counts: sure units in the high bits, ties in the low 16 (< 2^14 each)
        both = tl.cumsum(sure.to(tl.int32) * 65536 + is_tie.to(tl.int32), 0)
        ties_incl = both & 0xFFFF
        sure_incl = both >> 16
    else:
        ties_incl = tl.cumsum(is_tie.to(tl.int32), 0)
        sure_incl = tl.cumsum(sure.to(tl.int32), 0)
    keep = sure | (is_tie & (ties_incl <= quota))
    slot = base + sure_incl + tl.minimum(ties_incl, quota) - 1
    ok = keep & (slot < width)
    out_row = out_ptr + row.to(tl.int64) * (width * UNIT)
    for o in range(UNIT):
        t = ids * UNIT + o
        tl.store(out_row + slot * UNIT + o, tl.where(t < ln, t, -1), mask=ok)

    # -1 after the kept units, shared by the row's programs
    n_out = tl.minimum(total, width)
    end = width * UNIT
    for start in range(n_out * UNIT + chunk * BLOCK, end, n_chunks * BLOCK):
        p = start + tl.arange(0, BLOCK)
        tl.store(out_row + p, tl.full([BLOCK], -1, tl.int32), mask=p < end)
    if chunk == 0:
        # kept units are whole except a partial last unit (length % UNIT != 0): it is forced
        # (the newest token's) and the highest valid id, so it is the row's last kept unit
        n_valid = (ln + UNIT - 1) // UNIT
        partial = (ln % UNIT != 0) & (n_valid <= n_units) & (total > 0) & (total <= width)
        tl.store(lengths_ptr + row, n_out * UNIT - tl.where(partial, UNIT - ln % UNIT, 0))


@triton.jit
def _topk_write_kernel(
    scores_ptr, lens_ptr, hist_ptr, state_ptr, sure_ptr, suffix_ptr, out_ptr, lengths_ptr,
    n_units, H, s_b, s_h, s_n, sink, recent, tail_ptr, n_chunks, width,
    UNIT: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr, PDL: tl.constexpr,
    HAS_TAIL: tl.constexpr, NEWEST_FORCED: tl.constexpr,
):
    """`_write_chunk` of a (row, chunk) program after the four passes' kernels. With PDL the
    chunk's scores are loaded before the wait (the previous kernel is pass 4)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids, ln, forced, eligible, key = _chunk(scores_ptr, lens_ptr, row, chunk, n_units, H, s_b, s_h, s_n,
                                            sink, recent, tail_ptr, UNIT, BLOCK, HAS_TAIL, NEWEST_FORCED)
    pdl.wait(PDL)
    prefix = tl.load(state_ptr + row * 8 + 4)
    need = tl.load(state_ptr + row * 8 + 5)
    _write_chunk(row, chunk, ids, ln, forced, eligible, key, prefix, need, hist_ptr + row.to(tl.int64) * 1024,
                 sure_ptr, suffix_ptr, out_ptr, lengths_ptr, n_units, n_chunks, width, UNIT, BLOCK, CBLOCK)


@triton.jit
def _row_barrier(count_ptr, n):
    """Block until n programs have arrived at this counter (zero before the first arrives).
    Every program that arrives must be resident: the fused kernel is launched cooperatively.
    The CTA barrier first: every thread's histogram atomics of the phase precede the
    release, so the programs that acquire after the last arrival see them."""
    tl.debug_barrier()
    seen = tl.atomic_add(count_ptr, 1, sem="release", scope="gpu") + 1
    while seen < n:  # (polling with volatile loads and one acquire after was slower on an H100)
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _topk_fused_kernel(
    scores_ptr, lens_ptr, hist_ptr, sync_ptr, sure_ptr, suffix_ptr, out_ptr, lengths_ptr,
    n_units, H, s_b, s_h, s_n, sink, recent, tail_ptr, budget, n_chunks, width,
    UNIT: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr, PDL: tl.constexpr,
    HAS_TAIL: tl.constexpr, NEWEST_FORCED: tl.constexpr,
):
    """The four passes and the write step in one cooperative launch: a (row, chunk) program
    keeps its chunk's keys in registers, and the row's programs meet at a barrier
    (`_row_barrier`, counters sync[row, 0:4]) where the separate kernels would end. The
    scores are loaded before the PDL wait (the previous launch is the histograms' memset)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    hist_row = hist_ptr + row.to(tl.int64) * 1024
    sync_row = sync_ptr + row * 4
    ids, ln, forced, eligible, key = _chunk(scores_ptr, lens_ptr, row, chunk, n_units, H, s_b, s_h, s_n,
                                            sink, recent, tail_ptr, UNIT, BLOCK, HAS_TAIL, NEWEST_FORCED)
    pdl.wait(PDL)
    u = key ^ -2147483648
    slot = row * n_chunks + chunk
    prefix = 0
    need = 0
    for p in tl.static_range(1, 5):
        prefix, need = _pass_histogram(u, eligible, forced, hist_row, hist_row, sure_ptr, suffix_ptr, slot,
                                       prefix, need, budget, False, p)
        _row_barrier(sync_row + p - 1, n_chunks)
    _write_chunk(row, chunk, ids, ln, forced, eligible, key, prefix, need, hist_row, sure_ptr, suffix_ptr,
                 out_ptr, lengths_ptr, n_units, n_chunks, width, UNIT, BLOCK, CBLOCK)


def _fused_wanted(device: torch.device, fused: str | None = None) -> bool:
    fused = FUSED if fused is None else fused
    if fused not in ("auto", "off"):
        raise ValueError(f"kernels.topk.FUSED must be 'auto' or 'off', got {fused!r}")
    return fused == "auto" and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def _warps(block: int, warps: int | None = None) -> int:
    """Warps per program: `warps`, else WARPS_OVERRIDE, else 8 for blocks of 2048 units or more."""
    return warps or WARPS_OVERRIDE or (8 if block >= 2048 else 4)


def _fused_shape(device: torch.device, rows: int, n_units: int, unit: int, block: int, use_pdl: bool,
                 call: Callable[[int, int], tuple[tuple, dict]], variant: tuple = (),
                 warps: int | None = None) -> tuple[int, int] | None:
    """(BLOCK, warps) of the fused kernel for this problem — the five kernels' shape — or None
    to use the five kernels: None unless all its programs are resident on the GPU at once, the
    cooperative launch's condition, judged from the compiled kernel's registers and shared
    memory (compiled, not launched, the first time a shape is asked about; remembered).

    Not tried, because measured slower than the five kernels at 8 x 131072 (DSA) on an H100:
    the DSA shape with registers capped at 128 so that two programs share an SM (39.2 against
    38.6 µs), half-size 4-warp programs (40.2), one program per SM with twice the keys (65.9)."""
    warps = _warps(block, warps)
    key = (device.index, rows, n_units, unit, block, use_pdl, warps, variant)
    if key in _FUSED_SHAPES:
        return _FUSED_SHAPES[key]
    props = torch.cuda.get_device_properties(device)
    args, opts = call(block, warps)
    compiled = _topk_fused_kernel.warmup(*args, grid=(rows, cdiv(n_units, block)), **opts)
    chosen = None
    try:
        compiled._init_handles()  # loads the module: n_regs is known from then on
        n_regs, shared = int(compiled.n_regs), int(getattr(compiled.metadata, "shared", 0))
    except AttributeError:  # another Triton's CompiledKernel: do not guess, use the five kernels
        n_regs = None
    if n_regs is not None:
        regs = warps * 32 * (-(-max(n_regs, 1) // 8) * 8)  # allocated per warp in 8-register steps
        per_sm = min(
            getattr(props, "regs_per_multiprocessor", 65536) // regs,
            getattr(props, "max_threads_per_multi_processor", 2048) // (warps * 32),
            getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // (shared + 1024) if shared else 32,
            32,
        )
        if per_sm * props.multi_processor_count >= rows * cdiv(n_units, block):
            chosen = (block, warps)
    _FUSED_SHAPES[key] = chosen
    return chosen


def first_pass_buffer(rows: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed histograms of `rows` score rows, for a producer that does pass 1 itself."""
    return torch.zeros(rows * _HIST_ROW, dtype=torch.int32, device=device)


def check_first_pass(hist: torch.Tensor, rows: int, device: torch.device, who: str) -> None:
    """Raise ValueError unless hist is a `first_pass_buffer(rows, device)`: the producer
    writes rows * 1024 int32 histograms into it, the top-k reads them."""
    if hist.shape != (rows * _HIST_ROW,) or hist.dtype != torch.int32 or hist.device != device:
        raise ValueError(f"{who}: first_pass must be first_pass_buffer({rows}, {device}), got "
                         f"{hist.dtype} {tuple(hist.shape)} on {hist.device}")


def window(sink_tokens: int, recent_tokens: int) -> tuple[int, int]:
    """The sink and recent-window sizes as the kernels take them (clamped to [0, 2^31 - 1])."""
    int32_max = 2**31 - 1
    return min(max(sink_tokens, 0), int32_max), min(max(recent_tokens, 0), int32_max)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block(rows: int, n_units: int, block: int | None = None) -> int:
    """Units per program: `block`, else BLOCK_OVERRIDE, else the rule (see MIN_BLOCK)."""
    if block is not None:
        return block
    if BLOCK_OVERRIDE is not None:
        return BLOCK_OVERRIDE
    block = min(MAX_BLOCK, _pow2(n_units))
    while block > MIN_BLOCK and rows * cdiv(n_units, block) < TARGET_PROGRAMS:
        block //= 2
    return max(block, _pow2(cdiv(n_units, MAX_CHUNKS)))  # huge rows: cap the chunk count


def topk_selection_triton(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    unit: int,
    budget_units: int,
    sink_tokens: int,
    recent_tokens: int,
    width_units: int,
    first_pass: torch.Tensor | None = None,
    newest_forced: bool = True,
    tail_start: torch.Tensor | None = None,
    block: int | None = None,
    warps: int | None = None,
    fused: str | None = None,
) -> Selection:
    """Triton version of `topk_selection` (same arguments and result; ties at the threshold
    keep the lowest unit ids). scores: float32 [B, H, n_units] on CUDA (or the CPU under
    TRITON_INTERPRET=1), any strides; seq_lens: int [B].

    The launch shape, per call: `block` units per program (a power of two), `warps` per
    program, `fused` "auto" or "off" (None: BLOCK_OVERRIDE / the rule, WARPS_OVERRIDE / the
    rule, FUSED). The selection is the same whatever the shape.

    first_pass: a `first_pass_buffer` whose rows' first 256 entries the producer of the scores
    has filled with `first_digit_histogram` (same seq_lens, sink and recent window, clamped by
    `window`): pass 1 is then skipped (its launch and the memset); only with the default
    newest_forced and no tail_start, the rules `first_digit_histogram` follows."""
    if scores.dim() != 3:
        raise ValueError(f"topk_selection: scores must be [B, H, n_units], got {tuple(scores.shape)}")
    if unit < 1:
        raise ValueError(f"topk_selection: unit must be >= 1, got {unit}")
    b, h, n_units = scores.shape
    device = scores.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton top-k selection needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    width = max(0, min(width_units, n_units))
    rows = b * h
    indices = torch.empty(b, h, width * unit, dtype=torch.int32, device=device)
    if rows == 0 or width == 0:
        return Selection(indices=indices, lengths=torch.zeros(b, h, dtype=torch.int32, device=device), page_size=unit)
    block = _block(rows, n_units, block)
    n_chunks = cdiv(n_units, block)
    if n_chunks * block * unit >= 2**31:
        raise ValueError(f"topk_selection: {n_units} units of {unit} tokens overflow int32 token ids")
    lengths = torch.empty(b, h, dtype=torch.int32, device=device)
    scores = scores if scores.dtype == torch.float32 else scores.float()
    lens = seq_lens.to(device=device)
    if lens.dtype not in (torch.int32, torch.int64):
        lens = lens.to(torch.int64)
    budget = max(0, min(budget_units, n_units))
    sink, recent = window(sink_tokens, recent_tokens)
    if first_pass is not None and (tail_start is not None or not newest_forced):
        raise ValueError("topk_selection: first_pass needs the default newest_forced and no tail_start")
    tails = lens if tail_start is None else tail_start.to(device=device, dtype=torch.int64).clamp(-1, 2**31 - 1)
    if tails.shape != (b,):
        raise ValueError(f"topk_selection: tail_start must be [B] = [{b}], got {tuple(tails.shape)}")
    common = (n_units, h, *scores.stride(), sink, recent, tails)
    rules = dict(HAS_TAIL=tail_start is not None, NEWEST_FORCED=newest_forced)
    use_pdl = pdl.enabled(device)
    if first_pass is None and _fused_wanted(device, fused):

        def fused_call(blk: int, warps: int) -> tuple[tuple, dict]:
            chunks = cdiv(n_units, blk)
            # the one memset: the histograms, then the row barriers' counters
            zeroed = torch.zeros(rows * (_HIST_ROW + _PASSES), dtype=torch.int32, device=device)
            records = torch.empty(rows * chunks * (1 + _NB), dtype=torch.int32, device=device)  # sure, suffix
            args = (scores, lens, zeroed[: rows * _HIST_ROW], zeroed[rows * _HIST_ROW:], records[: rows * chunks],
                    records[rows * chunks:], indices, lengths, *common, budget, chunks, width)
            return args, dict(UNIT=unit, BLOCK=blk, CBLOCK=_pow2(chunks), PDL=use_pdl, num_warps=warps, **rules,
                              launch_pdl=use_pdl, launch_cooperative_grid=True)

        shape = _fused_shape(device, rows, n_units, unit, block, use_pdl, fused_call, tuple(rules.values()), warps)
        if shape is not None:
            args, opts = fused_call(*shape)
            launch(_topk_fused_kernel, (rows, cdiv(n_units, shape[0])), *args, **opts)
            return Selection(indices=indices, lengths=lengths, page_size=unit)
    if first_pass is None:
        hist = first_pass_buffer(rows, device)  # the one memset
    else:
        check_first_pass(first_pass, rows, device, "topk_selection")
        hist = first_pass
    # written before they are read: state by each row's chunk 0, the rest by every program
    scratch = torch.empty(rows * (_STATE_ROW + n_chunks * (1 + _NB)), dtype=torch.int32, device=device)
    state = scratch[: rows * _STATE_ROW]
    sure = scratch[rows * _STATE_ROW: rows * (_STATE_ROW + n_chunks)]
    suffix = scratch[rows * (_STATE_ROW + n_chunks):]
    grid = (rows, n_chunks)
    warps = _warps(block, warps)
    first = 1 if first_pass is None else 2
    for p in range(first, _PASSES + 1):
        # the scores may be read before the wait unless the previous kernel wrote them (pass
        # 1 follows the memset; pass 2 after a fused first pass follows the scores' producer)
        launch(_topk_hist_kernel, grid, scores, lens, hist, state, sure, suffix, *common, budget,
                                PASS=p, UNIT=unit, BLOCK=block, PDL=use_pdl, EARLY=p == 1 or p > first, **rules,
                                num_warps=warps, launch_pdl=use_pdl)
    launch(_topk_write_kernel, grid, scores, lens, hist, state, sure, suffix, indices, lengths, *common, n_chunks, width,
                             UNIT=unit, BLOCK=block, CBLOCK=_pow2(n_chunks), PDL=use_pdl, **rules,
                             num_warps=warps, launch_pdl=use_pdl)
    return Selection(indices=indices, lengths=lengths, page_size=unit)
