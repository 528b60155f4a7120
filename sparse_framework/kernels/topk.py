"""Triton version of `algorithms.base.topk_selection`: unit scores -> a Selection, with an
exact radix select instead of torch.topk and a prefix-sum compaction, all on the device, with
the torch path's semantics (ties at the threshold: the lowest unit ids win).

Why: at decode the selection has few long rows, over which torch.topk parallelises poorly;
here every kernel runs on a (row, chunk) grid and reads the scores once. The semantics, the
algorithm (four 8-bit radix passes and a prefix-sum compaction, fused into one cooperative
launch where the grid fits) and why 8-bit digits: docs/kernels.md, "Top-k". This module is
the launch code; the `@triton.jit` code is kernels/triton/topk.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..common.batch import Selection
from . import pdl
from ..common.arith import cdiv
from .launch import launch
from .triton.topk import _topk_fused_kernel, _topk_hist_kernel, _topk_write_kernel, first_digit_histogram

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
