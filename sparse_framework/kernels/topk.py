"""Triton version of `algorithms.base.topk_selection`: unit scores -> a Selection, with an
exact radix select instead of torch.topk and a prefix-sum compaction, all on the device.

Why: at decode the selection has few rows and long ones (DSA: 8 rows x 131072 tokens, top
2048; Quest: 64 rows x 8192 pages, top 128). torch.topk parallelises poorly over so few rows,
and the torch path runs ~15 full-size elementwise ops besides: 0.2-0.9 ms on an H100, more
than the scoring kernels. Here every kernel runs on a (row, chunk) grid — several hundred
programs whatever the row count — and reads the scores, which sit in L2, once.

Semantics (identical to the torch path): a unit is *forced* if it holds a sink token, a token
of the recent window or the newest token; the other valid units (id * unit < length) are
*eligible*; the `budget_units` best eligible units are kept besides the forced ones. NaN ranks
as -finfo.max, ±inf as ±finfo.max (so NaN, -inf and -finfo.max tie), -0.0 equals +0.0. The
kept unit ids, ascending, are cut to `min(width_units, n_units)` and expanded to tokens.
Ties at the threshold — eligible units scoring exactly the budget-th best score — are broken
deterministically: the lowest unit ids win. (torch.topk may keep other tied units; the set
of kept *scores* is the same.)

Algorithm, per row r = (request, head), on a grid (rows, chunks of BLOCK units):
  key      each float32's bits map to an int32 whose signed order is the float order (flip
           the 31 low bits of negatives; integer ops only, so no subnormal is flushed); its
           unsigned bits u = key ^ 0x80000000 are the radix digits
  pass 1   histogram of u's top 11 bits over the eligible units, into hist[r, 0:2048]
  pass 2   prologue: every program picks digit D1 from the row's pass-1 histogram (the digit
           whose bucket holds the need-th largest key, need = min(budget, eligible)); then a
           histogram of the next 11 bits of the units whose top digit is D1
  pass 3   the same with the 22-bit prefix P = (D1, D2) and the low 10 bits; each program also
           records its chunk's `sure` count (forced units, and eligible ones whose prefix is
           above P: kept whatever the last digit) and `suffix[d]`, its candidates (prefix P)
           whose last digit is >= d — so no later pass must re-count the chunk
  write    picks D3: threshold thr = the need-th largest key, n_tie = how many units equal to
           it are kept. Every chunk's kept count is sure + suffix[D3 + 1] + its share of the
           ties (suffix[D3] - suffix[D3 + 1] tied units, the quota going to earlier chunks
           first); their exclusive prefix and a cumsum inside the chunk give each kept unit its
           output slot. Tokens and the -1 padding are written; chunk 0 writes the row's length
Each program keeps its histogram in shared memory (tl.histogram) and adds it to the row's
int32 histogram with one masked atomic per non-empty bin, so global atomics never contend per
element. Every digit choice is recomputed from the histogram by each program of the row
(2048 ints from L2) instead of by a separate launch; chunk 0 stores it in `state` for the
next kernel. Launches per call: 1 memset (the histograms) + 4 kernels, each reading the
scores once; no host sync, every buffer sized from shapes (the largest: `suffix`, 4 KiB per
program), so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..batch import Selection

__all__ = ["topk_selection_triton"]

# launch shapes (module attributes, so that tests and benchmarks can change them): BLOCK units
# per program, the largest power of two in [MIN_BLOCK, MAX_BLOCK] that still gives about
# TARGET_PROGRAMS programs (2 per H100 SM) — or BLOCK_OVERRIDE when set (tests: small blocks
# exercise many chunks per row).
MIN_BLOCK, MAX_BLOCK, TARGET_PROGRAMS, MAX_CHUNKS = 256, 4096, 256, 1024
BLOCK_OVERRIDE: int | None = None

# radix digits: 11 + 11 + 10 bits; per-row histogram offsets in `hist`
_HIST_ROW = 2048 + 2048 + 1024
_STATE_ROW = 8  # per row: D1, need1, prefix (D1, D2), need2; 4 spare (the kernels index row * 8)


@triton.jit
def _chunk(scores_ptr, lens_ptr, row, chunk, n_units, H, s_b, s_h, s_n, sink, recent,
           UNIT: tl.constexpr, BLOCK: tl.constexpr):
    """This program's units: ids, the row's length, forced / eligible masks and order keys
    (keys of ineligible units are meaningless). Mirrors topk_selection's masks exactly."""
    b = row // H
    h = row - b * H
    ln = tl.load(lens_ptr + b).to(tl.int32)
    ids = chunk * BLOCK + tl.arange(0, BLOCK)
    tok = ids * UNIT
    valid = (ids < n_units) & (tok < ln)
    last = tl.maximum(ln - 1, 0) // UNIT  # only used where valid, i.e. ln >= 1
    recent_start = tl.maximum(ln - recent, 0) // UNIT
    forced = valid & ((tok < sink) | (ids >= recent_start) | (ids == last))
    eligible = valid & ~forced
    off = b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + ids.to(tl.int64) * s_n
    x = tl.load(scores_ptr + off, mask=eligible, other=0.0)
    # on the bits, not with float ops, which may flush subnormals to zero on the GPU
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    neg_max = -8388609  # 0xFF7FFFFF: -finfo.max
    bits = tl.where(mag > 0x7F800000, neg_max, bits)  # NaN ranks last, like nan_to_num(nan=-max)
    bits = tl.where(mag == 0x7F800000, tl.where(bits < 0, neg_max, 0x7F7FFFFF), bits)  # ±inf -> ±max
    bits = tl.where(mag == 0, 0, bits)  # -0.0 == +0.0 in torch's comparisons: one key
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int order == float order
    return ids, ln, forced, eligible, key


@triton.jit
def _pick(h, NB: tl.constexpr, need):
    """From a bucket's digit histogram h [NB] and the rank `need` (>= 0, <= h.sum()) of the
    wanted key among the bucket's largest: the digit D holding it (NB - 1 when need is 0)
    and its rank among D's keys. D = the largest digit with Σ_{d >= D} h[d] >= need."""
    d = tl.arange(0, NB)
    at_or_above = tl.sum(h, 0) - (tl.cumsum(h, 0) - h)
    digit = tl.max(tl.where(at_or_above >= need, d, -1), 0)
    above = tl.sum(tl.where(d > digit, h, 0), 0)
    return digit, need - above


@triton.jit
def _topk_hist_kernel(
    scores_ptr, lens_ptr, hist_ptr, state_ptr, sure_ptr, suffix_ptr,
    n_units, H, s_b, s_h, s_n, sink, recent, budget,
    PASS: tl.constexpr, UNIT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Radix pass PASS (1, 2, 3): the histogram of one digit of the eligible keys that match
    the prefix chosen so far, added into hist[row]. Pass 3 also leaves what the write kernel
    needs of this chunk once the last digit is known: sure[row, chunk] = units kept whatever
    it is (forced, or a 22-bit prefix above the threshold's), and suffix[row, chunk, d] = the
    chunk's candidates (the threshold's prefix) whose last digit is >= d."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    hist_row = hist_ptr + row.to(tl.int64) * 5120
    state_row = state_ptr + row * 8
    ids, ln, forced, eligible, key = _chunk(scores_ptr, lens_ptr, row, chunk, n_units, H, s_b, s_h, s_n,
                                            sink, recent, UNIT, BLOCK)
    u = key ^ -2147483648  # unsigned order bits (as int32; digits are masked after >>)
    if PASS == 1:
        hist = tl.histogram((u >> 21) & 0x7FF, 2048, mask=eligible)
        tl.atomic_add(hist_row + tl.arange(0, 2048), hist, mask=hist > 0, sem="relaxed")
    elif PASS == 2:
        h1 = tl.load(hist_row + tl.arange(0, 2048))
        need0 = tl.minimum(tl.sum(h1, 0), budget)  # min(budget, eligible units)
        d1, need1 = _pick(h1, 2048, need0)
        if chunk == 0:
            tl.store(state_row + 0, d1)
            tl.store(state_row + 1, need1)
        match = eligible & (((u >> 21) & 0x7FF) == d1)
        hist = tl.histogram((u >> 10) & 0x7FF, 2048, mask=match)
        tl.atomic_add(hist_row + 2048 + tl.arange(0, 2048), hist, mask=hist > 0, sem="relaxed")
    else:
        d1 = tl.load(state_row + 0)
        need1 = tl.load(state_row + 1)
        d2, need2 = _pick(tl.load(hist_row + 2048 + tl.arange(0, 2048)), 2048, need1)
        prefix = d1 * 2048 + d2
        if chunk == 0:
            tl.store(state_row + 2, prefix)
            tl.store(state_row + 3, need2)
        high = (u >> 10) & 0x3FFFFF
        match = eligible & (high == prefix)
        hist = tl.histogram(u & 0x3FF, 1024, mask=match)
        tl.atomic_add(hist_row + 4096 + tl.arange(0, 1024), hist, mask=hist > 0, sem="relaxed")
        slot = row * tl.num_programs(1) + chunk
        tl.store(sure_ptr + slot, tl.sum((forced | (eligible & (high > prefix))).to(tl.int32), 0))
        suffix = tl.sum(hist, 0) - (tl.cumsum(hist, 0) - hist)
        tl.store(suffix_ptr + slot.to(tl.int64) * 1024 + tl.arange(0, 1024), suffix)


@triton.jit
def _topk_write_kernel(
    scores_ptr, lens_ptr, hist_ptr, state_ptr, sure_ptr, suffix_ptr, out_ptr, lengths_ptr,
    n_units, H, s_b, s_h, s_n, sink, recent, n_chunks, width,
    UNIT: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr,
):
    """Fix the threshold (the last digit), count every chunk's kept units from pass 3's
    records, and write this chunk's kept units, ascending, at slots after those of the row's
    earlier chunks; -1 padding after the row's last kept unit; chunk 0 writes the length."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    prefix = tl.load(state_ptr + row * 8 + 2)
    need2 = tl.load(state_ptr + row * 8 + 3)
    d3, n_tie = _pick(tl.load(hist_ptr + row.to(tl.int64) * 5120 + 4096 + tl.arange(0, 1024)), 1024, need2)
    # unsigned bits (prefix, d3) back to the signed key: u - 2^31, exact in int64
    thr = ((prefix.to(tl.int64) * 1024 + d3) - 2147483648).to(tl.int32)

    c = tl.arange(0, CBLOCK)
    live = c < n_chunks
    slots = row * n_chunks + c
    at_or_above = tl.load(suffix_ptr + slots.to(tl.int64) * 1024 + d3, mask=live, other=0)
    above = tl.load(suffix_ptr + slots.to(tl.int64) * 1024 + tl.minimum(d3 + 1, 1023), mask=live, other=0)
    above = tl.where(d3 < 1023, above, 0)  # nothing lies above the top digit
    tied = at_or_above - above
    tied_before = tl.cumsum(tied, 0) - tied
    kept = tl.load(sure_ptr + slots, mask=live, other=0) + above
    kept += tl.minimum(tl.maximum(n_tie - tied_before, 0), tied)  # ties: lowest ids first
    base = tl.sum(tl.where(c < chunk, kept, 0), 0)
    total = tl.sum(kept, 0)
    my_tied_before = tl.sum(tl.where(c < chunk, tied, 0), 0)

    ids, ln, forced, eligible, key = _chunk(scores_ptr, lens_ptr, row, chunk, n_units, H, s_b, s_h, s_n,
                                            sink, recent, UNIT, BLOCK)
    is_tie = eligible & (key == thr)
    tie_rank = my_tied_before + tl.cumsum(is_tie.to(tl.int32), 0) - 1
    keep = forced | (eligible & (key > thr)) | (is_tie & (tie_rank < n_tie))
    slot = base + tl.cumsum(keep.to(tl.int32), 0) - 1
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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block(rows: int, n_units: int) -> int:
    if BLOCK_OVERRIDE is not None:
        return BLOCK_OVERRIDE
    block = min(MAX_BLOCK, _pow2(n_units))
    while block > MIN_BLOCK and rows * triton.cdiv(n_units, block) < TARGET_PROGRAMS:
        block //= 2
    return max(block, _pow2(triton.cdiv(n_units, MAX_CHUNKS)))  # huge rows: cap the chunk count


def topk_selection_triton(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    unit: int,
    budget_units: int,
    sink_tokens: int,
    recent_tokens: int,
    width_units: int,
) -> Selection:
    """Triton version of `topk_selection` (same arguments and result; ties at the threshold
    keep the lowest unit ids). scores: float32 [B, H, n_units] on CUDA (or the CPU under
    TRITON_INTERPRET=1), any strides; seq_lens: int [B]."""
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
    block = _block(rows, n_units)
    n_chunks = triton.cdiv(n_units, block)
    if n_chunks * block * unit >= 2**31:
        raise ValueError(f"topk_selection: {n_units} units of {unit} tokens overflow int32 token ids")
    lengths = torch.empty(b, h, dtype=torch.int32, device=device)
    scores = scores if scores.dtype == torch.float32 else scores.float()
    lens = seq_lens.to(device=device)
    if lens.dtype not in (torch.int32, torch.int64):
        lens = lens.to(torch.int64)
    hist = torch.zeros(rows * _HIST_ROW, dtype=torch.int32, device=device)  # the one memset
    # written before they are read: state by each row's chunk 0, the rest by every program
    scratch = torch.empty(rows * (_STATE_ROW + n_chunks * (1 + 1024)), dtype=torch.int32, device=device)
    state = scratch[: rows * _STATE_ROW]
    sure = scratch[rows * _STATE_ROW: rows * (_STATE_ROW + n_chunks)]
    suffix = scratch[rows * (_STATE_ROW + n_chunks):]
    int32_max = 2**31 - 1
    budget = max(0, min(budget_units, n_units))
    sink, recent = min(max(sink_tokens, 0), int32_max), min(max(recent_tokens, 0), int32_max)
    grid = (rows, n_chunks)
    warps = 8 if block >= 2048 else 4
    common = (n_units, h, *scores.stride(), sink, recent)
    for p in (1, 2, 3):
        _topk_hist_kernel[grid](scores, lens, hist, state, sure, suffix, *common, budget,
                                PASS=p, UNIT=unit, BLOCK=block, num_warps=warps)
    _topk_write_kernel[grid](scores, lens, hist, state, sure, suffix, indices, lengths, *common, n_chunks, width,
                             UNIT=unit, BLOCK=block, CBLOCK=_pow2(n_chunks), num_warps=warps)
    return Selection(indices=indices, lengths=lengths, page_size=unit)
