"""Triton kernels of DeepSeek's lightning indexer (DSA), each with the signature and float32
result of its torch reference in `kernels/reference/scores.py`:

  dsa_index_scores      Σ_h w_h · ReLU(q_h · k_t) per token, bf16 or fp8 keys
  dsa_index_scores_fp8q the same over fp8 keys, the raw queries quantised like the keys in
                        the kernel (what DSA runs with fp8 keys)
  dsa_prefill_index_scores  the indexer for a prefill chunk: n queries over one sequence's m
                        keys (the model's own keys, 16-bit or float32), [n, m]

Its own module (`kernels/scoring.py` re-exports these functions) because it is the one family
with fp8 keys: why, how they are decoded and how the queries are quantised in the kernel:
docs/kernels.md, "DSA's lightning indexer". The launch shapes and the fp8 dot switch are
arguments of the launchers (`tuning=`, `min_programs=`, `fp8_dot=`), by default the module
constants below; FP8_DECODE picks the key decoding.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import pdl
from ..common.arith import cdiv
from .dot_modes import _dot_mode, _interpreted, _launchable, _pow2
from .launch import launch
from .topk import check_first_pass, window
from .reference.scores import FP8_BLOCK, _check_dsa, _check_dsa_fp8q, _check_prefill_index
from .triton.dsa_index import dsa_index_kernel, dsa_prefill_index_kernel

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
