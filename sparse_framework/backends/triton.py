"""`triton`: our own Triton sparse decode kernels (kernels/sparse_decode.py).

Serves two metadata formats:
  flash_attention  the FlashAttention adaptor's page_table + cache_seqlens, plain or with the
                   KV heads folded into the batch -> `paged_decode` (any page size, GQA)
  flashmla         an object with `indices` int32 [B, s_q, topk]: row numbers into k_cache
                   viewed as [-1, heads, D], -1 unused -> `indexed_decode` (MLA: V is the
                   strided first 512 dims of the latent, read from the K tile)

Runs on CUDA; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1, for tests), which
is far too slow for anything else. Triton is imported when the backend is checked or run,
never when this module is imported, so the package works where Triton is not installed.
"""

from __future__ import annotations

import importlib
import math
import os
from functools import cache
from typing import Any

import torch

from ..common.errors import ConfigError
from ..common.layout import KVLayout
from .base import AttentionBackend, fold_sinks, module_missing

MAX_HEAD_DIM = 576  # the kernel keeps a [rows, head dim] query tile and a [rows, v dim] accumulator in registers

CPU_NEEDS_INTERPRETER = (
    "needs CUDA: on the CPU the Triton kernels run only under the interpreter, "
    "TRITON_INTERPRET=1 (for tests; far too slow otherwise); use backend 'torch_ref' on the CPU"
)


@cache
def _triton_missing() -> str | None:
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install
        return f"triton cannot be imported ({type(exc).__name__}: {exc}); pip install triton"
    return None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(AttentionBackend):
    """Flash-decoding over a page table (FlashAttention metadata) or over row indices (FlashMLA
    metadata), float32 accumulation, output in q's dtype."""

    metadata_formats = ("flash_attention", "flashmla")
    device_types = ("cuda", "cpu")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supports_softcap = True
    supports_sinks = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _triton_missing()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """Triton installed, and a CUDA GPU (or the interpreter, TRITON_INTERPRET=1, for tests)."""
        reasons = [r for r in (module_missing("triton", "pip install triton"),) if r]
        if not torch.cuda.is_available() and not _interpreted():
            reasons.append("needs a CUDA GPU (none visible; TRITON_INTERPRET=1 runs it slowly on the CPU, for tests)")
        return not reasons, "; ".join(reasons)

    @classmethod
    def check_layout(cls, layout: KVLayout) -> None:
        reason = cls.unavailable_reason()
        if reason:
            raise ConfigError(f"is unavailable: {reason}")
        if layout.is_fp8:
            raise ConfigError(
                f"reads float32, float16 and bfloat16 caches, not {layout.dtype} (fp8 K/V or latent rows)"
            )
        if torch.device(layout.device).type == "cpu" and not _interpreted():
            raise ConfigError(CPU_NEEDS_INTERPRETER)
        super().check_layout(layout)
        if layout.head_dim > MAX_HEAD_DIM:
            raise ConfigError(f"supports head_dim up to {MAX_HEAD_DIM} (MLA's latent), not {layout.head_dim}")

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, Dv] in q's dtype; also q [B, s_q, Hq, D] -> [B, s_q, Hq, Dv]
        (several query tokens per request: FlashMLA indices per token, or causal over the
        newest s_q rows of a page table). softcap (> 0) and sinks ([Hq]) as torch_ref's."""
        reason = _triton_missing()
        if reason:
            raise ConfigError(f"backend triton is unavailable: {reason}")
        if q.device.type == "cpu" and not _interpreted():
            raise ConfigError(f"backend triton {CPU_NEEDS_INTERPRETER}")
        from ..kernels import sparse_decode  # imports triton

        single = q.dim() == 3  # one query token per request (the coordinator's decode steps)
        q4 = q.unsqueeze(1) if single else q  # [B, s_q, Hq, D]
        b, s_q, hq, d = q4.shape
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        indices = getattr(metadata, "indices", None)
        if indices is not None:  # FlashMLA: row numbers, one list per query token
            if k_cache.dim() == 3:  # rows [num_tokens, heads, D]: pages of one row
                k_cache, v_cache = k_cache.unsqueeze(1), v_cache.unsqueeze(1)
            out = sparse_decode.indexed_decode(q4, k_cache, v_cache, indices, scale, softcap=softcap, sinks=sinks)
        elif hasattr(metadata, "page_table") and hasattr(metadata, "cache_seqlens"):
            table, lens = metadata.page_table, metadata.cache_seqlens
            if getattr(metadata, "heads_folded", False):
                # each (request, KV head) is a sequence of one KV head with its group of heads
                hk = table.shape[0] // b
                qf = q4.reshape(b, s_q, hk, hq // hk, d).transpose(1, 2).reshape(b * hk, s_q, hq // hk, d)
                folded = None if sinks is None else fold_sinks(sinks, b, hk)
                out = sparse_decode.paged_decode(qf, k_cache, v_cache, table, lens, scale, softcap=softcap, sinks=folded)
                out = out.view(b, hk, s_q, hq // hk, -1).transpose(1, 2).reshape(b, s_q, hq, -1)
            else:
                out = sparse_decode.paged_decode(q4, k_cache, v_cache, table, lens, scale, softcap=softcap, sinks=sinks)
        else:
            raise TypeError(
                "backend triton runs FlashAttention metadata (page_table, cache_seqlens) or FlashMLA "
                f"metadata (indices), got {type(metadata).__name__}"
            )
        return out[:, 0] if single else out
