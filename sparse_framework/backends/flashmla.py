"""`flashmla`: FlashMLA's token-sparse MLA decode kernel over the store's FP8 cache.

FlashMLA (https://github.com/deepseek-ai/FlashMLA) is the kernel DeepSeek V3.2 decodes with:
`flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched_meta,
num_splits, softmax_scale=, causal=False, is_fp8_kvcache=True, indices=)` attends each query
token to the cache rows its `indices` name. What it accepts (flash_mla_interface.py and
csrc/api/sparse_decode.h, checked at commit 9241ae3, and its 2025-09 first sparse release):

  q        bfloat16 [batch, s_q, h_q, 576], h_q 64 or 128 (the kernels are instantiated for
           those two head counts only)
  k_cache  [num_blocks, page_block_size, 1, 656] uint8/fp8/int8: the "FP8 with scale" rows
           (one latent KV head, each page block contiguous); sparse decode has no bf16 cache
  indices  int32 [batch, s_q, topk], topk a multiple of 64, -1 for unused entries
  head_dim_v 512; returns (out bfloat16 [batch, s_q, h_q, 512], lse)

Three generations of the Python API are handled: the 2025-09 release (get_mla_metadata takes
cache_seqlens and the head counts and returns scheduler tensors; block_table and cache_seqlens
are required and page_block_size must be 64), the 2026 releases (get_mla_metadata() returns an
empty FlashMLASchedMeta, filled on the first call; block_table / cache_seqlens ignored) and
SGLang's `sgl-flash-mla` wheel, which keeps the V3.2 format on its `use_legacy=True` side
(`kv_format="V32"`). Calling get_mla_metadata with the old positional arguments and passing the
scheduler state back works for all three; `use_legacy` / `kv_format` are passed when the
installed function takes them.

Query-head counts below 128 other than 64 are zero-padded up to the next count the kernel has
(64 or 128; the padded heads' outputs are dropped): heads are independent, a zero query only
attends uniformly within its own head.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

import torch

from ..adaptors.flashmla import PAGE_BLOCK, TOPK_BLOCK, FlashMLAMetadata
from ..common.errors import ConfigError
from ..common.flashmla_format import LATENT_DIM, NOPE_DIM, PACKED_BYTES
from ..common.layout import KVLayout
from .base import AttentionBackend, module_missing

KERNEL_HEADS = (64, 128)  # DISPATCH_NUM_HEADS / DecodeFeatures::HEAD_64, HEAD_128

INSTALL = (
    "FlashMLA is built from source on a CUDA machine (SM90 or SM100, CUDA 12.8+): "
    "`git clone https://github.com/deepseek-ai/FlashMLA.git flash-mla && cd flash-mla && "
    "git submodule update --init --recursive && pip install -v .` (a release that still has the "
    "V3.2 FP8 sparse decode: SGLang's fork says upstream dropped it, with SM90, on 2026-09-30); "
    "or `pip install -e \".[flashmla]\"` (in a checkout of the repository): SGLang's prebuilt wheel "
    "`sgl-flash-mla` of it (needs torch >= 2.14.1 and CUDA 13.1+)"
)


def _import_flash_mla() -> tuple[ModuleType | None, str | None]:
    """(the flash_mla module, None), or (None, why not). Not cached: cheap when the package is
    missing, and a test may install a stand-in."""
    try:
        import flash_mla  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or its CUDA extension failing to load (OSError, ...)
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    missing = [n for n in ("get_mla_metadata", "flash_mla_with_kvcache") if not hasattr(flash_mla, n)]
    if missing:
        return None, f"the installed flash_mla has no {', '.join(missing)}"
    return flash_mla, None


class FlashMLABackend(AttentionBackend):
    """FlashMLA sparse decode (CUDA only, fp8 MLA layout, FlashMLA indices)."""

    metadata_formats = ("flashmla",)
    device_types = ("cuda",)
    dtypes = (torch.float8_e4m3fn,)
    head_dims = (LATENT_DIM,)

    def __init__(self) -> None:
        # scheduler state per call shape: FlashMLA allows reusing it while the shapes (and
        # topk_length, which is never passed here) stay the same; it never depends on indices
        self._sched: dict[tuple, tuple[Any, Any]] = {}
        self._api: tuple[ModuleType, bool, dict[str, Any]] | None = None

    def _api_of(self, fm: ModuleType) -> tuple[bool, dict[str, Any]]:
        """(2025-09 API?, extra keyword arguments) of the installed flash_mla, read once from
        its signatures."""
        if self._api is None or self._api[0] is not fm:
            old = "cache_seqlens" in inspect.signature(fm.get_mla_metadata).parameters
            params = inspect.signature(fm.flash_mla_with_kvcache).parameters
            extra: dict[str, Any] = {}
            if "use_legacy" in params:  # sgl-flash-mla: the V3.2 format lives on its legacy side
                extra["use_legacy"] = True
            if "kv_format" in params:
                extra["kv_format"] = "V32"
            self._api = (fm, old, extra)
        return self._api[1], self._api[2]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        _, why = _import_flash_mla()
        if why is None:
            return None
        return f"the `flash_mla` package (FlashMLA) cannot be imported ({why}). {INSTALL}"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """flash_mla installed (looked up, not imported) and a CUDA GPU (SM90 or SM100)."""
        reasons = [r for r in (module_missing("flash_mla", "built from source: docs/backends.md"),) if r]
        if not torch.cuda.is_available():
            reasons.append("needs a CUDA GPU, SM90 or SM100 (none visible)")
        elif torch.cuda.get_device_capability()[0] not in (9, 10):
            major, minor = torch.cuda.get_device_capability()
            reasons.append(f"needs an SM90 or SM100 GPU, this one is SM{major}{minor}")
        return not reasons, "; ".join(reasons)

    @classmethod
    def check_layout(cls, layout: KVLayout) -> None:
        reason = cls.unavailable_reason()
        if reason:
            raise ConfigError(f"is unavailable: {reason}")
        if not layout.is_mla or (layout.head_dim, layout.v_head_dim) != (LATENT_DIM, NOPE_DIM):
            raise ConfigError(
                f"runs MLA decode only: needs KVLayout.mla with head_dim {LATENT_DIM} and v_head_dim {NOPE_DIM}; "
                f"got kind {layout.kind!r}, head_dim {layout.head_dim}, v_head_dim {layout.v_head_dim}"
            )
        if layout.dtype not in cls.dtypes:
            raise ConfigError(
                f"reads only FlashMLA's FP8 cache (656 bytes per token; its sparse decode has no bf16 cache): "
                f"set the KV layout's dtype to torch.float8_e4m3fn, not {layout.dtype}"
            )
        device_type = torch.device(layout.device).type
        if device_type not in cls.device_types:
            raise ConfigError(f"runs on cuda only (FlashMLA's kernels), not on device {device_type!r}")

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: FlashMLAMetadata,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [B, Hq, 576] -> [B, Hq, 512] (or [B, s_q, Hq, 576] -> [B, s_q, Hq, 512]) in q's
        dtype; k_cache the store's uint8 view [pages, page_size, 1, 656] (v_cache, the same
        rows, is not read: V is the dequantised NoPE part)."""
        fm, why = _import_flash_mla()
        if fm is None:
            raise RuntimeError(f"backend 'flashmla': the `flash_mla` package cannot be imported ({why}). {INSTALL}")
        if not isinstance(metadata, FlashMLAMetadata):
            raise TypeError(f"backend 'flashmla' consumes FlashMLAMetadata, got {type(metadata).__name__}")
        single = q.dim() == 3
        q4 = q.unsqueeze(1) if single else q
        if q4.dim() != 4 or q4.shape[-1] != LATENT_DIM:
            raise ValueError(f"q must be [batch, q_heads, {LATENT_DIM}] or [batch, s_q, q_heads, {LATENT_DIM}], got {list(q.shape)}")
        b, s_q, hq, _ = q4.shape
        heads = _kernel_heads(hq)
        indices = metadata.indices
        if tuple(indices.shape[:2]) != (b, s_q) or indices.shape[-1] % TOPK_BLOCK:
            raise ValueError(
                f"indices must be int32 [{b}, {s_q}, topk] with topk a multiple of {TOPK_BLOCK}, got {list(indices.shape)}"
            )
        cache = _kernel_cache(k_cache, metadata)
        old_api, extra = self._api_of(fm)
        if old_api and metadata.page_block_size != PAGE_BLOCK:
            raise ValueError(
                f"this FlashMLA release needs page_block_size {PAGE_BLOCK}, but the device pool's "
                f"{metadata.num_slots} rows are not a multiple of {PAGE_BLOCK}: size it in multiples of "
                f"{PAGE_BLOCK} tokens (page_size / device_capacity_tokens) or install a newer FlashMLA"
            )
        qk = q4.to(torch.bfloat16)
        if heads != hq:
            qk = torch.nn.functional.pad(qk, (0, 0, 0, heads - hq))
        qk = qk.contiguous()
        indices = indices.to(torch.int32).contiguous()
        topk = indices.shape[-1]
        # dense-path arguments: the 2025-09 release requires them; later ones ignore them
        cache_seqlens = torch.full((b,), topk, dtype=torch.int32, device=q.device)
        block_table = torch.zeros((b, 1), dtype=torch.int32, device=q.device)
        key = (q.device, b, s_q, heads, metadata.page_block_size, topk)
        if key not in self._sched:
            if len(self._sched) > 64:
                self._sched.clear()
            self._sched[key] = fm.get_mla_metadata(cache_seqlens, s_q * heads, 1, heads, True, topk)
        sched, splits = self._sched[key]
        try:
            out, _lse = fm.flash_mla_with_kvcache(
                qk, cache, block_table, cache_seqlens, NOPE_DIM, sched, splits,
                softmax_scale=scale, causal=False, is_fp8_kvcache=True, indices=indices, **extra,
            )
        except (RuntimeError, AssertionError) as exc:
            raise RuntimeError(
                f"FlashMLA sparse decode failed: {exc} (called with DeepSeek V3.2's FP8 cache, {PACKED_BYTES} "
                f"bytes per token, page_block_size {metadata.page_block_size}, h_q {heads}, topk {topk}; "
                "per SGLang's fork, upstream FlashMLA dropped this format on 2026-09-30: use sgl-flash-mla or an "
                "earlier FlashMLA)"
            ) from exc
        out = out[:, :, :hq].to(q.dtype)
        return out[:, 0] if single else out


def _kernel_heads(hq: int) -> int:
    """The query-head count to run the kernel with: 64 or 128, padding fewer heads up."""
    for n in KERNEL_HEADS:
        if hq <= n:
            return n
    raise ValueError(
        f"FlashMLA's sparse decode runs {' or '.join(map(str, KERNEL_HEADS))} query heads (fewer are padded); "
        f"got {hq}: split the heads into groups of at most {KERNEL_HEADS[-1]}"
    )


def _kernel_cache(k_cache: torch.Tensor, metadata: FlashMLAMetadata) -> torch.Tensor:
    """The layer's pool as FlashMLA's k_cache [rows // page_block_size, page_block_size, 1, 656]
    (a view: the pool is one contiguous run of rows, so any block size tiles it)."""
    if k_cache.dtype != torch.uint8 or k_cache.shape[-1] != PACKED_BYTES or k_cache.shape[-2] != 1:
        raise ValueError(
            f"backend 'flashmla' reads FlashMLA's packed FP8 rows: k_cache must be uint8 [pages, page_size, 1, "
            f"{PACKED_BYTES}] (a KV layout of dtype float8_e4m3fn), got {k_cache.dtype} {list(k_cache.shape)}"
        )
    rows = k_cache.numel() // PACKED_BYTES
    if rows != metadata.num_slots or not k_cache.is_contiguous():
        raise ValueError(
            f"k_cache holds {rows} rows{'' if k_cache.is_contiguous() else ' (not contiguous)'}, the metadata was "
            f"planned for a contiguous pool of {metadata.num_slots}"
        )
    return k_cache.reshape(-1, metadata.page_block_size, 1, PACKED_BYTES)
