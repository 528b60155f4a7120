"""What every sparse vLLM attention impl does, whatever kernel attends (CPU or FlashAttention).

`SparseDecodeMixin` goes before vLLM's own impl class in the bases
(`class SparseCPUAttentionImpl(SparseDecodeMixin, CPUAttentionBackendImpl)`), so that
`super()` is vLLM's impl. Per layer and step:

  do_kv_cache_update  vLLM's own cache write, then the K rows folded into the layer's
                      per-block representation (`PagedAlgorithm.write`, no host sync).
  forward             decode rows (one query token, context >= `min_sparse_prompt_len`) of a
                      sparse layer: select blocks per KV head, rewrite the block table for the
                      cache folded to one KV head per page, attend with the backend's kernel
                      (`_attend`). Everything else goes to vLLM's own forward unchanged; in a
                      step that mixes both, vLLM's forward runs for all rows first and the
                      sparse rows' outputs are then replaced. A uniform decode batch planned
                      `static` (the CUDA builder, when vLLM captures full graphs) takes every
                      row with shapes fixed by the metadata (`PagedAlgorithm.select_static`), so
                      that the whole sparse decode is captured in vLLM's decode graph.

A backend supplies `_attend` (its kernel over the folded table), `_decode_rows` (the step's
rows, `paged.DecodeRows`), `_backend_dense_reason` (what makes a layer dense for good) and
`_step_dense_reason` (what makes one step's metadata unsuitable).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType

from ...adaptors.flash_attention import FlashAttentionMetadata
from ...config import SparseConfig
from .paged import (
    CONFIG_ENV,
    DIAGNOSTICS,
    STATS,
    PagedAlgorithm,
    PagedState,
    DecodeRows,
    config_source,
    folded_page_table,
    load_vllm_config,
    paged_algorithm,
    sparse_layers,
)

logger = logging.getLogger("vllm.plugins.sparse_framework")


@functools.lru_cache(maxsize=8)
def _config(source: str, block_size: int | None) -> SparseConfig:
    return load_vllm_config(source, block_size)


def plugin_config(block_size: int | None = None) -> SparseConfig | None:
    """The config from SPARSE_FRAMEWORK_VLLM_CONFIG (parsed once per value), None if unset."""
    source = config_source()
    return None if source is None else _config(source, block_size)


class SparseDecodeMixin:
    """The framework's sparse decode over vLLM's paged cache (module docstring). One instance
    per attention layer; its per-block representation is created on the first K write (it
    needs the cache's block count) and re-created if vLLM re-allocates the cache."""

    # set by vLLM's impl __init__ (both backends name them so)
    num_kv_heads: int
    num_heads: int
    head_size: int
    attn_type: Any
    kv_sharing_target_layer_name: str | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config()
        self._init_sparse(plugin_config(vllm_config.cache_config.block_size),
                          vllm_config.model_config.get_total_num_hidden_layers())

    def _init_sparse(self, config: SparseConfig | None, num_layers: int) -> None:
        """The plugin's part of __init__, apart so that tests can build an impl without vLLM's
        config context. block_size may still be unknown (None) when vLLM builds the model: the
        cache's own block size is checked on the first write (`_state_for`)."""
        self.config = config
        self.num_layers = num_layers
        self.algorithm: PagedAlgorithm | None = None if config is None else paged_algorithm(config)
        self.state: PagedState | None = None
        self._cache_key: tuple[int, tuple[int, ...]] | None = None
        self._sparse: bool | None = None  # decided on the first call, when the layer name is known
        self.dense_reason = self._dense_reason()

    # -- what a backend supplies --------------------------------------------------------------

    def _backend_dense_reason(self) -> str | None:
        """Why this backend's impl can never decode sparsely in this layer, or None."""
        return None

    def _step_dense_reason(self, md: Any) -> str | None:
        """Why this step's metadata rules the sparse path out (non-causal, ...), or None."""
        return None

    def _decode_rows(self, md: Any) -> DecodeRows:
        """This step's sparse decode rows from the backend's metadata (each backend's own: the
        CPU and CUDA backends keep them differently)."""
        raise NotImplementedError

    def _attend(
        self, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, metadata: FlashAttentionMetadata, md: Any
    ) -> torch.Tensor:
        """Attention of q [n, Hq, D] over the folded table `metadata`: [n, Hq, D] (each
        backend's own: vLLM's CPU kernel, or FlashAttention's varlen kernel). md: vLLM's
        metadata of the step (for the kernel's own settings, e.g. FlashAttention's splits)."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------

    def _dense_reason(self) -> str | None:
        """Why this layer can never decode sparsely here, or None."""
        if self.config is None:
            return f"{CONFIG_ENV} is not set"
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        if self.kv_sharing_target_layer_name is not None:
            return "a KV cache shared with another layer"
        return self._backend_dense_reason()

    def _is_sparse(self, layer: Any) -> bool:
        if self._sparse is None:
            self._sparse = False
            if self.dense_reason is None and self.config is not None:
                index = extract_layer_index(layer.layer_name)
                self._sparse = index in sparse_layers(self.config, self.num_layers)
        return self._sparse

    def _state_for(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> PagedState:
        nb, hk, bs = kv_cache.shape[:3]
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if self.state is None or self._cache_key != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "sparse_framework's vLLM backend was asked to allocate its block bounds during CUDA-graph "
                    "capture: the KV-cache write is being captured (splitting_ops without "
                    "vllm::unified_kv_cache_update?). Use vLLM's default compilation_config or enforce_eager=True"
                )
            if self.config is not None and bs != self.config.page_size:  # kernel block size != the manager's
                self.config = _config(config_source() or "{}", bs)
                self.algorithm = paged_algorithm(self.config)
            assert self.algorithm is not None
            self.state = self.algorithm.new_state(nb, hk, self.head_size, dtype, kv_cache.device)
            self._cache_key = key
        return self.state

    def do_kv_cache_update(
        self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)  # type: ignore[misc]
        if kv_cache.numel() == 0 or not self._is_sparse(layer):
            return
        assert self.algorithm is not None
        state = self._state_for(kv_cache, key.dtype)
        self.algorithm.write(state, slot_mapping, key)
        STATS.add_device("kv_writes", min(slot_mapping.shape[0], key.shape[0]), kv_cache.device)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dense = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if attn_metadata is None:  # vLLM's profiling and warm-up runs
            return super().forward(*dense)  # type: ignore[misc]
        STATS.forward_calls += 1
        plan = self._decode_rows(attn_metadata)  # planned once per step (the GPU builder) or cheap (CPU)
        if plan.count == 0 or not self._sparse_step(layer, attn_metadata, kv_cache):
            STATS.dense_calls += 1
            STATS.add_device("dense_rows", plan.decode_rows, kv_cache.device)
            return super().forward(*dense)  # type: ignore[misc]
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing and not plan.static:
            raise RuntimeError(
                "sparse_framework's vLLM backend is being captured in a CUDA graph for a batch that is not a uniform "
                "single-token decode: only those have a selection of fixed shapes. Its metadata builder declares "
                "AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE; use cudagraph_mode FULL_AND_PIECEWISE (vLLM's "
                "default), FULL_DECODE_ONLY, PIECEWISE or NONE"
            )
        num_reqs = attn_metadata.seq_lens.shape[0]
        if plan.count < num_reqs:  # prefill or dense rows too: vLLM attends all, sparse rows replaced below
            super().forward(*dense)  # type: ignore[misc]
            STATS.mixed_calls += 1
        assert self.config is not None
        if STATS.sparse_calls == 0:
            logger.info("sparse_framework: first sparse decode (%s, %s, top_k %d, page = block of %d%s)",
                        layer.layer_name, self.config.algorithm, self.config.top_k, self.config.page_size,
                        ", static shapes for full CUDA graphs" if plan.static else "")
        STATS.sparse_calls += 1
        if plan.static:  # every row, in order (one query token each): shapes from the metadata alone
            out = self._sparse_decode(layer, query[: plan.count], kv_cache, attn_metadata, plan)
            output[: plan.count].copy_(out.to(output.dtype))
        else:
            out = self._sparse_decode(layer, query[plan.tokens], kv_cache, attn_metadata, plan)
            output.index_copy_(0, plan.tokens, out.to(output.dtype))
        return output

    def _sparse_step(self, layer: Any, md: Any, kv_cache: torch.Tensor) -> bool:
        """Whether this layer decodes this step's planned rows sparsely."""
        if not self._is_sparse(layer) or kv_cache.numel() == 0 or self.state is None:
            return False
        return self._step_dense_reason(md) is None

    def _sparse_decode(
        self, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, md: Any, plan: DecodeRows
    ) -> torch.Tensor:
        assert self.algorithm is not None and self.state is not None and self.config is not None
        device = kv_cache.device
        if plan.static:
            block_table, seq_lens = md.block_table[: plan.count], md.seq_lens[: plan.count]
            min_len = self.config.min_sparse_prompt_len
            selection = self.algorithm.select_static(self.state, q, block_table, seq_lens, min_len)
            sparse = seq_lens >= max(min_len, 1)  # rows below min_len got all their blocks (dense)
            STATS.add_device("sparse_rows", sparse.sum(), device)
            STATS.add_device("dense_rows", ((seq_lens > 0) & ~sparse).sum(), device)
            counted: torch.Tensor | None = sparse.view(-1, 1)
        else:
            block_table, seq_lens = md.block_table[plan.rows], md.seq_lens[plan.rows]
            selection = self.algorithm.select(self.state, q, block_table, seq_lens, max_seq_len=plan.max_seq_len)
            STATS.add_device("sparse_rows", plan.count, device)
            STATS.add_device("dense_rows", plan.decode_rows - plan.count, device)
            counted = None  # every planned row is sparse
        metadata = folded_page_table(selection, block_table, self.num_kv_heads, self.state.block_size)
        per_row = self.num_kv_heads // selection.lengths.shape[1]
        lengths, contexts = selection.lengths, seq_lens.view(-1, 1)
        if counted is not None:
            lengths, contexts = lengths * counted, contexts * counted
        STATS.add_device("selected_tokens", lengths.sum() * per_row, device)
        STATS.add_device("context_tokens", contexts.sum() * self.num_kv_heads, device)
        if "impl" not in DIAGNOSTICS:
            DIAGNOSTICS.update(self._diagnostics(kv_cache))
        return self._attend(layer, q, kv_cache, metadata, md)

    def _diagnostics(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        """What the first sparse decode found (`paged.DIAGNOSTICS`)."""
        assert self.config is not None and self.state is not None
        return {
            "impl": f"{type(self).__module__}.{type(self).__qualname__}",
            "kv_cache_shape": list(kv_cache.shape),
            "kv_cache_stride": list(kv_cache.stride()),
            "kv_cache_dtype": str(kv_cache.dtype),
            "device": str(kv_cache.device),
            "block_size": self.state.block_size,
            "num_kv_heads": self.num_kv_heads,
            "num_heads": self.num_heads,
            "head_size": self.head_size,
            "algorithm": type(self.algorithm).__name__,
            "representation_dtype": str(self.state.dtype),
            "top_k": self.config.top_k,
            "sparse_layers": len(sparse_layers(self.config, self.num_layers)),
            "num_layers": self.num_layers,
        }
