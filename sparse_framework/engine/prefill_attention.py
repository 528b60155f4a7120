"""Which kernel a prefill chunk attends with: flash-attn's varlen kernel where installed, else
SDPA.

A chunk's n queries are the last n of the m staged prompt positions (`staging.chunk_attention`
says how the SDPA path does it): causal attention aligned to the bottom right of the [n, m]
score matrix, query i seeing keys 0..m-n+i. flash-attn's varlen kernels (2.1+, 3 and 4) align
a causal mask exactly so when a sequence has fewer queries than keys, so a chunk is one call
with `cu_seqlens_q = [0, n]`, `cu_seqlens_k = [0, m]` and no mask tensor at all; SDPA needs an
[n, m] boolean mask for a chunk that is not the whole prompt, and with a mask it cannot take its
flash kernel. Chunks are attended one call each: a step holds a few (the token budget over
prompts of thousands of tokens) and their prefixes are separate staging spans.

`EngineConfig.prefill_attention`:
  "auto"        flash-attn's varlen kernel for a chunk that is not its whole prompt (n < m, where
                SDPA needs a mask and falls off its flash kernel: flash-attn 4 measured 2.2x
                faster there on the H100), SDPA's causal kernel for a whole prompt (n == m, no
                mask: within 5% of flash-attn 4, 644 vs 680 TFLOP/s at 16K and 606 vs 592 at
                8K, benchmarks/results/prefill_attention_h100.json, and no JIT compilation);
                SDPA for all where no flash-attn is installed
  "flash_attn"  flash-attn's varlen kernel for every chunk (an error if none is installed)
  "sdpa"        SDPA for every chunk, never looking for flash-attn
Which library, first found first:
  flash-attn 4  `flash_attn.cute.flash_attn_varlen_func` (returns (out, lse))
  flash-attn 3  `flash_attn_interface.flash_attn_varlen_func` (the `hopper/` build)
  flash-attn 2  `flash_attn.flash_attn_varlen_func`
  vLLM's FA3    `vllm.vllm_flash_attn.flash_attn_varlen_func(..., fa_version=3)`: where vLLM is
                installed beside the engine (its wheel carries a FlashAttention 3 build for
                Hopper), a user has the fast path without building flash-attn
Each needs CUDA and fp16/bf16; anything else (the CPU, float32) takes SDPA.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from ..backends.flash_attn import vllm_fa3_varlen
from ..common.errors import ConfigError
from ..common.transfer import to_device
from .staging import chunk_attention

log = logging.getLogger(__name__)
CHOICES = ("auto", "flash_attn", "sdpa")
INSTALL = 'pip install -e ".[gpu]" (in a checkout of the repository)'
_LIBRARIES = (("flash-attn 4", "flash_attn.cute"), ("flash-attn 3", "flash_attn_interface"),
              ("flash-attn 2", "flash_attn"))

# (q, k, v, scale) -> out: a full-attention layer's chunk over its staged prefix (sliding or
# soft-capped layers take staging.chunk_attention, which applies those terms)
ChunkAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@cache
def find_varlen() -> tuple[str, Callable[..., Any]] | str:
    """(library label, its flash_attn_varlen_func), or why none can be used."""
    reasons = []
    for label, module in _LIBRARIES:
        try:
            fn = getattr(importlib.import_module(module), "flash_attn_varlen_func")
        except Exception as exc:  # ImportError, or a broken CUDA / cutlass install
            reasons.append(f"{module}: {type(exc).__name__}: {exc}".splitlines()[0])
            continue
        return label, fn
    try:
        return "vLLM's flash-attn 3", vllm_fa3_varlen()
    except Exception as exc:  # no vLLM, or a vLLM without FA3 for this GPU
        reasons.append(f"vllm.vllm_flash_attn: {type(exc).__name__}: {exc}".splitlines()[0])
    return "no flash-attn with a varlen kernel is installed (" + "; ".join(reasons) + f"); {INSTALL}"


def choose(mode: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ChunkAttention]:
    """(label, chunk attention) for an engine on `device` with activations of `dtype`."""
    if mode not in CHOICES:
        raise ConfigError(f"EngineConfig.prefill_attention must be one of {', '.join(CHOICES)}, got {mode!r}")
    if mode == "sdpa":
        return "sdpa", chunk_attention
    usable = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    found = find_varlen() if usable else None
    if isinstance(found, tuple):
        label, fn = found
        if mode == "flash_attn":
            return label, lambda q, k, v, scale=None: flash_chunk_attention(fn, q, k, v, scale)
        return f"{label} (sdpa for whole prompts)", lambda q, k, v, scale=None: (
            chunk_attention(q, k, v, scale) if q.shape[0] == k.shape[0] else flash_chunk_attention(fn, q, k, v, scale))
    if mode == "flash_attn":
        why = found if isinstance(found, str) else f"it needs a CUDA device and fp16/bf16 (got {device.type}, {dtype})"
        raise ConfigError(f"EngineConfig.prefill_attention='flash_attn': {why}")
    if usable:
        _say_slow_path_once()
    return "sdpa", chunk_attention


@cache
def _say_slow_path_once() -> None:
    """The one start-up line of an engine that falls back to the slow chunked-prefill path."""
    log.warning("prefill: no flash-attn installed, so a prompt's chunks after its first attend through SDPA with a "
                "mask (about 2x slower on an H100; whole prompts are unaffected); for the fast path: %s", INSTALL)


def flash_chunk_attention(
    fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """`chunk_attention` through a flash-attn varlen function `fn`: q [n, Hq, D], k and v
    [m, Hkv, D] (the staged prefix, n <= m) -> [n, Hq, D]; logits scaled by `scale` (None:
    1/sqrt(D))."""
    n, m = q.shape[0], k.shape[0]
    if n > m:
        raise ValueError(f"chunk_attention: {n} queries but only {m} keys")
    lens = to_device([0, n, 0, m], torch.int32, q.device)
    out = fn(q, k, v, cu_seqlens_q=lens[:2], cu_seqlens_k=lens[2:], max_seqlen_q=n, max_seqlen_k=m,
             softmax_scale=1 / math.sqrt(q.shape[-1]) if scale is None else scale, causal=True)
    return out[0] if isinstance(out, tuple) else out
