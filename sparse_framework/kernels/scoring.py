"""Triton kernels of the algorithms' scoring hot paths (`*_triton`), each with the signature
and float32 result of its torch reference in `kernels/reference/scores.py` (re-exported
here as `*_torch`):

  quest_scores          Σ_d max(q_d·min_d, q_d·max_d) per page, combined over a GQA group
                        (with `range_weight` w < 1: minus (1 − w)·Σ_d |q_d|·(max_d − min_d)/2)
  pqcache_scores        Σ_m q_m · centroid_m[code_m(t)] per token (q·centroid table gathered)
  snapkv_window_mass    the prompt's last w queries' causal softmax mass on the keys before them
  dsa_index_scores      DeepSeek's lightning indexer Σ_h w_h · ReLU(q_h · k_t), bf16 or fp8 keys
  dsa_index_scores_fp8q the same over fp8 keys, the raw queries quantised like the keys in
                        the kernel (what DSA runs)
  dsa_prefill_index_scores  the indexer for a prefill chunk, [n, m]

This module holds the first three kernels and is where every scoring function is found by
name (`algorithms.base.scoring_kernel`, benchmarks/selection.py). DSA's indexer kernels live
in `kernels/dsa_index.py` (fp8 keys, in-kernel query quantisation, their own launch shapes
and fp8 switches, which are set there) and are re-exported here; the dot modes and launch
checks every scoring kernel shares are in `kernels/dot_modes.py`.

Every Triton kernel streams the representation that grows with the context once, one
program per (row, head or group, block of pages/tokens), tails masked; head dims that are not
powers of two are padded through masks. On the CPU the Triton versions run only under
TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import math

import torch

from . import pdl
from ..common.arith import cdiv
from .dot_modes import _dot_mode, _launchable, _pow2
from .dsa_index import dsa_index_scores_fp8q_triton, dsa_index_scores_triton, dsa_prefill_index_scores_triton
from .launch import launch
from .triton.scoring import pqcache_scores_kernel, quest_scores_kernel, snapkv_lse_kernel, snapkv_mass_kernel
from .reference.scores import (
    PQ_REDUCTIONS,
    REDUCTIONS,
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


# -- Quest -------------------------------------------------------------------------------------


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
