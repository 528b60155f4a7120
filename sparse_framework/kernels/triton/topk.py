"""The `@triton.jit` code of the top-k selection (launched by `kernels/topk.py`): the radix
passes, the write step and the fused kernel. The algorithm: docs/kernels.md, "Top-k"."""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl


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
    """float32 -> int32 whose signed order is the float order, NaN lowest (the rule:
    `kernels/topk.py`'s docstring); on the bits, not with float ops, which may flush subnormals on the GPU."""
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
    # tl.histogram costs as much for masked elements (docs/kernels.md, "Top-k"): a chunk with
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
