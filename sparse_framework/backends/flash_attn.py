"""`flash_attn`: the real FlashAttention kernels over our page table.

Which library is used, first found first:
  flash-attn 4  `flash_attn.cute.flash_attn_varlen_func(q, k, v, seqused_k=, page_table=)`
                (pure Python over nvidia-cutlass-dsl; on Hopper any page size, 128 takes the
                TMA path; no split-KV there)
  flash-attn 3  `flash_attn_interface.flash_attn_with_kvcache(q, k, v, cache_seqlens=,
                page_table=)` (the `hopper/` build)
  vLLM's FA3    `vllm.vllm_flash_attn.flash_attn_varlen_func(q, k, v, seqused_k=, block_table=,
                fa_version=3)`, one query per sequence: where vLLM is installed (its wheel
                carries FlashAttention 3 for Hopper); softcap, no sinks
flash-attn 2 alone is not enough: its paged KV needs pages of a multiple of 256 tokens, while
a sparse selection is made of pages of `page_size` (Quest) or single tokens (DSA), so it is
reported as unavailable with that reason.

The metadata is the FlashAttention adaptor's plan, used as it is: `page_table` and
`cache_seqlens` (= flash-attn 4's `seqused_k`); per-KV-head selections arrive with the KV heads
folded into the batch over the head-major buffer, so the kernel sees sequences of one KV head
and its group of query heads.

Attention options, found by the decode function's keywords (the libraries' public Python
interfaces: flash-attn 3's `flash_attn_with_kvcache` and 4's cute `flash_attn_varlen_func`):
  softcap  `softcap=` (flash-attn 3 and 4)
  sinks    `learnable_sink=` (flash-attn 4: bfloat16 [num_heads], the same for every sequence;
           with the KV heads folded into the batch the heads of a sequence differ by KV head,
           so the call is made once per KV head). flash-attn 3 has none.
A library without one raises UnsupportedFeatureError naming it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from ..adaptors.flash_attention import FlashAttentionMetadata
from ..common.errors import ConfigError, UnsupportedFeatureError
from ..common.layout import KVLayout
from .base import AttentionBackend, module_missing

# our option -> the decode function's keyword for it
LIBRARY_KEYWORDS = {"softcap": "softcap", "sinks": "learnable_sink"}

INSTALL = 'pip install -e ".[flash-attn]" (in a checkout of the repository)'


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
    try:
        return "vLLM's flash-attn 3", _vllm_fa3_decode(vllm_fa3_varlen())
    except Exception:  # no vLLM, or none with FA3 for this GPU: the messages below name flash-attn
        pass
    if not isinstance(_import("flash_attn"), str):
        return (
            "only flash-attn 2 is installed, whose paged KV needs pages of a multiple of 256 "
            f"tokens (sparse selections use page_size or single tokens); {INSTALL} installs flash-attn 4"
        )
    return f"no flash-attn is installed (flash_attn.cute failed with {fa4}); {INSTALL}"


def vllm_fa3_varlen() -> Callable[..., Any]:
    """vLLM's FlashAttention 3 varlen function pinned to version 3 (its default, 2, may be left
    out of vLLM's Hopper builds); ImportError (or the import's own error) saying why not."""
    module = importlib.import_module("vllm.vllm_flash_attn")
    if not module.is_fa_version_supported(3):
        raise ImportError(f"FA3 unsupported here: {module.fa_version_unsupported_reason(3)}")
    return functools.partial(module.flash_attn_varlen_func, fa_version=3)


def _vllm_fa3_decode(varlen: Callable[..., Any]) -> Callable[..., Any]:
    """flash-attn 3's `flash_attn_with_kvcache` decode call (q [n, 1, heads, D]) made through
    vLLM's varlen function: one query per sequence, the page table as its block table."""

    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, cache_seqlens: torch.Tensor,
               page_table: torch.Tensor, softmax_scale: float, softcap: float = 0.0) -> torch.Tensor:
        n, _, heads, d = q.shape
        starts = torch.arange(n + 1, dtype=torch.int32, device=q.device)
        out = varlen(q.reshape(n, heads, d), k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=starts,
                     max_seqlen_k=page_table.shape[1] * k_cache.shape[1], seqused_k=cache_seqlens,
                     block_table=page_table, softmax_scale=softmax_scale, causal=True, softcap=softcap)
        return out.view(n, 1, heads, -1)

    return decode


def _keywords(fn: Callable[..., Any]) -> frozenset[str]:
    """The keyword parameters of the library's decode function (empty if it has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return frozenset()
    return frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def _library() -> tuple[str, Callable[..., Any]]:
    """(version label, decode function), or ConfigError saying why there is none."""
    found = _find_library()
    if isinstance(found, str):
        raise ConfigError(f"backend 'flash_attn' is unavailable: {found}")
    return found


class FlashAttnBackend(AttentionBackend):
    """FlashAttention paged decode (flash-attn 4, else 3, else vLLM's 3) over the adaptor's page table."""

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
        if all(module_missing(m, INSTALL) for m in ("flash_attn_interface", "flash_attn", "vllm")):
            reasons.append(f"flash_attn not installed ({INSTALL})")
        elif all(module_missing(m, INSTALL) for m in ("flash_attn_interface", "flash_attn.cute", "vllm")):
            reasons.append(f"only flash-attn 2 is installed, which cannot read sparse pages ({INSTALL})")
        if not torch.cuda.is_available():
            reasons.append("needs a CUDA GPU (none visible)")
        return not reasons, "; ".join(reasons)

    supports_softcap = True  # where the installed library takes it: see check_attention_options
    supports_sinks = True

    @classmethod
    def check_attention_options(cls, softcap: float | None, sinks: torch.Tensor | None) -> None:
        """UnsupportedFeatureError naming each option the installed flash-attn's decode
        function takes no keyword for (see the module docstring)."""
        name, fn = _library()
        have = _keywords(fn)
        missing = [o for o, given in (("softcap", softcap is not None), ("sinks", sinks is not None))
                   if given and LIBRARY_KEYWORDS[o] not in have]
        if missing:
            what = " and ".join(f"{o} (its keyword {LIBRARY_KEYWORDS[o]!r})" for o in missing)
            raise UnsupportedFeatureError(
                f"cannot apply {what}: the installed {name} does not take it; use backend 'triton' or "
                "'torch_ref' for this model"
            )

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
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, Dv]; softcap and sinks ([Hq]) where the library takes them
        (UnsupportedFeatureError otherwise)."""
        name, fn = _library()
        if softcap is not None or sinks is not None:
            self.check_attention_options(softcap, sinks)
        b, hq, d = q.shape
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        n = metadata.page_table.shape[0]
        # one query token per sequence; folded: each (request, KV head) with its query group
        qs = q.to(k_cache.dtype).reshape(n, 1, hq * b // n, d)
        options: dict[str, Any] = {} if softcap is None else {"softcap": softcap}
        table, lens = metadata.page_table, metadata.cache_seqlens
        if sinks is None:
            out = _call(name, fn, qs, k_cache, v_cache, table, lens, scale, options)
        elif n == b:  # every sequence has all Hq heads: one sink per head, as the library takes it
            out = _call(name, fn, qs, k_cache, v_cache, table, lens, scale, {**options, "learnable_sink": _sink_arg(sinks)})
        else:  # folded: sequence i is KV head i % hk, whose group of heads has its own sinks
            hk = n // b
            groups = sinks.reshape(hk, -1)
            out = qs.new_empty(n, 1, qs.shape[2], v_cache.shape[-1])
            for h in range(hk):
                out[h::hk] = _call(name, fn, qs[h::hk], k_cache, v_cache, table[h::hk], lens[h::hk].contiguous(),
                                   scale, {**options, "learnable_sink": _sink_arg(groups[h])})
        return out.reshape(b, hq, v_cache.shape[-1]).to(q.dtype)


def _sink_arg(sinks: torch.Tensor) -> torch.Tensor:
    """flash-attn 4 takes the sinks as a contiguous bfloat16 vector (its interface asserts it)."""
    return sinks.to(torch.bfloat16).contiguous()


def _call(
    name: str, fn: Callable[..., Any], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    table: torch.Tensor, lens: torch.Tensor, scale: float, options: dict[str, Any],
) -> torch.Tensor:
    """One decode call of the library, [n, 1, heads, Dv]."""
    if name == "flash-attn 4":
        out, _ = fn(q, k_cache, v_cache, seqused_k=lens, page_table=table, softmax_scale=scale, **options)
        return out
    out = fn(q, k_cache, v_cache, cache_seqlens=lens, page_table=table, softmax_scale=scale, **options)
    return out[0] if isinstance(out, tuple) else out
