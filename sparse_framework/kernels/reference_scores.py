"""The scoring kernels' torch twins, by their old name: they live in `kernels/reference/scores.py`
(which imports no Triton); the algorithms, the engine and the vLLM plugin import them from here."""

from __future__ import annotations

from .reference.scores import (
    FP8_BLOCK,
    FP8_MAX,
    PQ_REDUCTIONS,
    REDUCTIONS,
    ceil_pow2,
    dequantize_fp8_blocks,
    dsa_index_scores_fp8q_torch,
    dsa_index_scores_torch,
    dsa_prefill_index_scores_torch,
    pqcache_scores_torch,
    quantize_fp8_blocks,
    quest_paged_scores_torch,
    quest_scores_torch,
    reduce_groups,
    snapkv_window_mass_torch,
)

__all__ = [
    "FP8_BLOCK", "FP8_MAX", "PQ_REDUCTIONS", "REDUCTIONS", "ceil_pow2", "dequantize_fp8_blocks",
    "dsa_index_scores_fp8q_torch", "dsa_index_scores_torch", "dsa_prefill_index_scores_torch", "pqcache_scores_torch",
    "quantize_fp8_blocks", "quest_paged_scores_torch", "quest_scores_torch", "reduce_groups", "snapkv_window_mass_torch",
]
