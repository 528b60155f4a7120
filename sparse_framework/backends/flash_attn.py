"""`flash_attn`: the real FlashAttention kernels over our page table.

Which library is used, first found first:
  flash-attn 4  `flash_attn.cute.flash_attn_varlen_func(q, k, v, seqused_k=, page_table=)`
                (pure Python over nvidia-cutlass-dsl; on Hopper any page size, 128 takes the
                TMA path; no split-KV there)
  flash-attn 3  `flash_attn_interface.flash_attn_with_kvcache(q, k, v, cache_seqlens=,
                page_table=)` (the `hopper/` build)
flash-attn 2 alone is not enough: its paged KV needs pages of a multiple of 256 tokens, while
a sparse selection is made of pages of `page_size` (Quest) or single tokens (DSA), so it is
reported as unavailable with that reason.

The metadata is the FlashAttention adaptor's plan, used as it is: `page_table` and
`cache_seqlens` (= flash-attn 4's `seqused_k`); per-KV-head selections arrive with the KV heads
folded into the batch over the head-major buffer, so the kernel sees sequences of one KV head
and its group of query heads.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from ..adaptors.flash_attention import FlashAttentionMetadata
from ..common.errors import ConfigError
from ..common.layout import KVLayout
from .base import AttentionBackend, module_missing

INSTALL = 'pip install "sparse-framework[flash-attn]"'


def _import(name: str) -> Any:
    """The module, or the reason it cannot be imported ("ImportError: ..."; a broken CUDA or
    cutlass install raises other errors, which count as missing too)."""
    try:
        return importlib.import_module(name)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@cache
def _find_library() -> tuple[str, Callable[..., Any]] | str:
    """(version label, decode function) of the first usable library, or why there is none."""
    fa4 = _import("flash_attn.cute")
    if not isinstance(fa4, str):
        return "flash-attn 4", fa4.flash_attn_varlen_func
    fa3 = _import("flash_attn_interface")
    if not isinstance(fa3, str):
        return "flash-attn 3", fa3.flash_attn_with_kvcache
    if not isinstance(_import("flash_attn"), str):
        return (
            "only flash-attn 2 is installed, whose paged KV needs pages of a multiple of 256 "
            f"tokens (sparse selections use page_size or single tokens); {INSTALL} installs flash-attn 4"
        )
    return f"no flash-attn is installed (flash_attn.cute failed with {fa4}); {INSTALL}"


def _library() -> tuple[str, Callable[..., Any]]:
    """(version label, decode function), or ConfigError saying why there is none."""
    found = _find_library()
    if isinstance(found, str):
        raise ConfigError(f"backend 'flash_attn' is unavailable: {found}")
    return found


class FlashAttnBackend(AttentionBackend):
    """FlashAttention paged decode (flash-attn 4, else 3) over the adaptor's page table."""

    metadata_formats = ("flash_attention",)
    device_types = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        found = _find_library()
        return found if isinstance(found, str) else None

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """flash-attn 4 or 3 installed (looked up, not imported) and a CUDA GPU."""
        reasons = []
        if all(module_missing(m, INSTALL) for m in ("flash_attn_interface", "flash_attn")):
            reasons.append(f"flash_attn not installed ({INSTALL})")
        elif module_missing("flash_attn_interface", INSTALL) and module_missing("flash_attn.cute", INSTALL):
            reasons.append(f"only flash-attn 2 is installed, which cannot read sparse pages ({INSTALL})")
        if not torch.cuda.is_available():
            reasons.append("needs a CUDA GPU (none visible)")
        return not reasons, "; ".join(reasons)

    @classmethod
    def check_layout(cls, layout: KVLayout) -> None:
        super().check_layout(layout)
        if layout.is_mla:
            raise ConfigError(
                "serves MHA/GQA layouts only; for an MLA latent (head_dim "
                f"{layout.head_dim}) use backend 'flashmla', 'triton' or 'torch_ref'"
            )
        if not (8 <= layout.head_dim <= 256 and layout.head_dim % 8 == 0):
            raise ConfigError(
                f"needs head_dim a multiple of 8 in 8..256, got {layout.head_dim}"
            )

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: FlashAttentionMetadata,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        name, fn = _library()
        b, hq, d = q.shape
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        n = metadata.page_table.shape[0]
        # one query token per sequence; folded: each (request, KV head) with its query group
        qs = q.to(k_cache.dtype).reshape(n, 1, hq * b // n, d)
        if name == "flash-attn 4":
            out, _ = fn(
                qs, k_cache, v_cache, seqused_k=metadata.cache_seqlens,
                page_table=metadata.page_table, softmax_scale=scale,
            )
        else:
            out = fn(
                qs, k_cache, v_cache, cache_seqlens=metadata.cache_seqlens,
                page_table=metadata.page_table, softmax_scale=scale,
            )
            out = out[0] if isinstance(out, tuple) else out
        return out.reshape(b, hq, v_cache.shape[-1]).to(q.dtype)
