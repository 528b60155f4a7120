"""The attention backend the plugin registers over vLLM's FlashAttention backend (`FLASH_ATTN`)
on CUDA. Written against vLLM 0.26.0's `vllm/v1/attention/backends/flash_attn.py`; run on one
H100 with vLLM 0.26.0 (docs/vllm.md, "What the H100 showed").

`register()` in `__init__.py` names `SparseFlashAttentionBackend` by its class path over
`AttentionBackendEnum.FLASH_ATTN`: vLLM's CUDA platform resolves each candidate backend through
that enum (`backend.get_class()`), FLASH_ATTN first on Hopper, and `Attention.__init__` maps
`get_name()` back to the enum, so the subclass keeps the name "FLASH_ATTN". Prefill, chunked
prefill, prefix caching, cascade attention, dense layers and short contexts are vLLM's own
`FlashAttentionImpl.forward`; decode rows of sparse layers go through
`sparse_impl.SparseDecodeMixin` and are attended by vLLM's own `flash_attn_varlen_func` over
the rewritten block table (`fa_layout.attend_paged`).

What the subclasses change, and why:

- backend: `get_required_kv_cache_layout()` is "HND". vLLM's default FlashAttention layout is
  NHD ([blocks, tokens, heads, K|V] in memory), where block b of head h is not one run of
  memory; with HND it is, and the whole selection (a table per request and KV head) goes to
  one kernel call over the cache folded to one KV head per page (page b * Hkv + h). vLLM asks
  each selected backend for a layout (`_cached_get_attn_backend` -> `set_kv_cache_layout`) and
  its FlashAttention kernels read HND already (the layout NIXL transfers use). If the cache
  still is not head-major (a padded block stride, a connector that forces NHD), the decode
  falls back to one call per KV head over strided views (`fa_layout.per_head_kv`).
- metadata builder: vLLM's, plus the step's sparse rows planned on the host once per step
  (`paged.decode_rows`, from `query_start_loc_cpu` and the CPU bound of the lengths), so that
  a layer's forward makes no host sync; and `AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`:
  when vLLM captures full graphs (its default `FULL_AND_PIECEWISE`), a batch of one-token
  decodes is planned `static` (every row, shapes from the block table alone:
  `PagedAlgorithm.select_static`), so the selection, the page-table rewrite and the FlashAttention
  call are captured in vLLM's decode graph and replayed with the rest of the model. Mixed
  batches (prefill chunks) run vLLM's piecewise graphs with attention eager, through the
  host plan. `cudagraph_mode` PIECEWISE (or `enforce_eager`) keeps every step eager in the
  attention: the plugin's first H100 run, 4x slower than vLLM dense at 16K x 8, was that. A
  twin that cannot be captured (`PagedAlgorithm.graph_safe` False: the rebuild bridge of
  `paged_bridge.py`) declares `AttentionCGSupport.NEVER` instead, and vLLM runs PIECEWISE.
  The FlashAttention call takes vLLM's own split count (`max_num_splits`: fixed when graphs
  are on, as vLLM's own decode).
- impl: `FlashAttentionImpl` with the mixin; layers with a sliding window, ALiBi, sinks, an fp8
  KV cache, decode context parallelism, or (per step) dynamic causality, PrefixLM ranges or
  R-SWA stay vLLM's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm import envs
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from ...adaptors.flash_attention import FlashAttentionMetadata as PageTable
from .fa_layout import FlashDecodeCall, attend_paged, is_head_major
from .paged import DIAGNOSTICS, DecodeRows, decode_rows, graph_safe
from .sparse_impl import SparseDecodeMixin, plugin_config

logger = logging.getLogger("vllm.plugins.sparse_framework")

__all__ = ["SparseFlashAttentionBackend", "SparseFlashAttentionImpl", "SparseFlashAttentionMetadataBuilder"]

PLAN_ATTR = "sparse_decode_rows"
"""The attribute of a FlashAttentionMetadata that holds the builder's `DecodeRows`."""


def plan_step(
    common: CommonAttentionMetadata, min_len: int, device: torch.device, *, full_graphs: bool = False
) -> DecodeRows:
    """This step's sparse rows from vLLM's common metadata, on the host: query_start_loc_cpu
    always; the lengths from `seq_lens_cpu_upper_bound` (exact for one-token rows), else, when
    `min_sparse_prompt_len` needs them, one copy of seq_lens (a host sync per step, not per
    layer). full_graphs (vLLM captures full graphs): a uniform single-token decode batch is
    planned static instead, every row, no host work (a step of the captured shape, replayed;
    one beyond the captured sizes, eager, selects the same)."""
    if full_graphs and common.max_query_len == 1:
        return DecodeRows.uniform(common.num_reqs)
    lens = getattr(common, "seq_lens_cpu_upper_bound", None)
    if lens is None and min_len > 1:
        lens = common.seq_lens.cpu()
    return decode_rows(common.query_start_loc_cpu, lens, min_len, device, max_seq_len=common.max_seq_len)


class SparseFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """vLLM's FlashAttention metadata with the step's sparse rows (`PLAN_ATTR`); full CUDA
    graphs for uniform single-token decode batches only (module docstring)."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """UNIFORM_SINGLE_TOKEN_DECODE; NEVER when the configured twin cannot be captured
        (`PagedAlgorithm.graph_safe` False: the rebuild bridge reads the lengths on the host),
        which makes vLLM lower its default FULL_AND_PIECEWISE to PIECEWISE (attention eager)
        and refuse an explicit FULL, so that no full graph is ever planned static for it."""
        config = plugin_config()
        if config is not None and not graph_safe(config):
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> FlashAttentionMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        config = plugin_config()
        min_len = config.min_sparse_prompt_len if config is not None else 0
        full_graphs = bool(getattr(self, "use_full_cuda_graph", False))  # vLLM's FA builder sets it
        setattr(md, PLAN_ATTR, plan_step(common_attn_metadata, min_len, self.device, full_graphs=full_graphs))
        return md


class SparseFlashAttentionImpl(SparseDecodeMixin, FlashAttentionImpl):
    """vLLM's FlashAttention with decode through the framework's algorithm
    (`sparse_impl.SparseDecodeMixin`), attended by vLLM's `flash_attn_varlen_func`."""

    def _backend_dense_reason(self) -> str | None:
        from vllm.utils.torch_utils import is_quantized_kv_cache

        for what, present in (
            ("a sliding window", tuple(self.sliding_window) != (-1, -1)),
            ("ALiBi", self.alibi_slopes is not None),
            ("attention sinks", self.sinks is not None),
            (f"a quantized KV cache ({self.kv_cache_dtype})", is_quantized_kv_cache(self.kv_cache_dtype)),
            ("decode context parallelism", getattr(self, "dcp_world_size", 1) > 1),
            ("no FlashAttention version", self.vllm_flash_attn_version is None),
        ):
            if present:
                return what
        return None

    def _step_dense_reason(self, md: FlashAttentionMetadata) -> str | None:
        if md.causal is not True:
            return "non-causal or per-sequence causal metadata"
        if getattr(md, "mm_prefix_range_tensor", None) is not None:
            return "PrefixLM ranges"
        if getattr(md, "rswa_prefix_lens", None) is not None:
            return "R-SWA"
        return None

    def _decode_rows(self, md: FlashAttentionMetadata) -> DecodeRows:
        plan = getattr(md, PLAN_ATTR, None)
        if plan is None:  # metadata not made by our builder: plan here (a host sync per layer)
            min_len = self.config.min_sparse_prompt_len if self.config is not None else 0
            plan = decode_rows(md.query_start_loc.cpu(), md.seq_lens.cpu(), min_len, md.seq_lens.device)
        return plan

    def _varlen_func(self) -> Any:
        """vLLM's `flash_attn_varlen_func` (imported when first needed: fa_utils defines it on
        CUDA only). Tests replace this method."""
        from vllm.v1.attention.backends import fa_utils

        func = getattr(fa_utils, "flash_attn_varlen_func", None)
        if func is None:
            raise RuntimeError("vLLM's flash_attn_varlen_func is not available on this platform (fa_utils)")
        return func

    def _attend(
        self, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, metadata: PageTable, md: FlashAttentionMetadata
    ) -> torch.Tensor:
        varlen = self._varlen_func()
        # as vLLM's own calls: its builder's bound (fixed under full graphs, 1 when batch
        # invariant, 0 = FlashAttention's heuristics otherwise)
        num_splits = 1 if envs.VLLM_BATCH_INVARIANT else getattr(md, "max_num_splits", 0)

        def run(call: FlashDecodeCall) -> torch.Tensor:
            return varlen(
                q=call.q, k=call.k, v=call.v, max_seqlen_q=1, cu_seqlens_q=call.cu_seqlens_q,
                max_seqlen_k=call.max_seqlen_k, seqused_k=call.seqused_k, block_table=call.block_table,
                softmax_scale=self.scale, causal=True, softcap=self.logits_soft_cap,
                fa_version=self.vllm_flash_attn_version, num_splits=num_splits,
            )

        return attend_paged(q, kv_cache, metadata, self.num_kv_heads, self.head_size, run)

    def _diagnostics(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        head_major = is_head_major(kv_cache)
        if not head_major:
            logger.warning("sparse_framework: the FlashAttention KV cache is not head-major (strides %s): one "
                           "kernel call per KV head instead of one folded call", kv_cache.stride())
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        try:
            layout = get_kv_cache_layout()
        except Exception as exc:  # no vLLM config in this context (tests)
            layout = f"unknown ({type(exc).__name__})"
        return {**super()._diagnostics(kv_cache), "kv_cache_layout": layout, "head_major": head_major,
                "decode_calls_per_layer": 1 if head_major else self.num_kv_heads,
                "fa_version": self.vllm_flash_attn_version, "batch_invariant": bool(envs.VLLM_BATCH_INVARIANT)}


class SparseFlashAttentionBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend with the framework's sparse decode. Registered over
    `FLASH_ATTN`, so `get_name()` stays "FLASH_ATTN" (vLLM maps it back to the enum); the KV
    cache shape and kernels are vLLM's, the layout head-major (module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[SparseFlashAttentionImpl]:
        return SparseFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SparseFlashAttentionMetadataBuilder]:
        return SparseFlashAttentionMetadataBuilder

    @classmethod
    def get_required_kv_cache_layout(cls) -> str | None:
        return "HND"

