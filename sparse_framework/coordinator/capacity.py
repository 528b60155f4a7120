"""How many concurrent requests fit: everything resident vs the hierarchical store.

Resident: every token of every layer on the device. Hierarchical: per request what the store's
device pools reserve per request row (device_pools.py): in a sparse layer the larger of the
buffer and the room of a short prompt that decodes densely (`min_sparse_prompt_len`), dense
layers in full, plus the store's slot maps and the algorithm's representation on the device;
the full KV on the host, which then bounds too. So `max_requests` requests of `context_len`
plan exactly the device pool bytes a store with max_seq_len = context_len allocates.
Every size is the stored one (`KVLayout.bytes_per_token_per_layer`): an fp8 MLA latent
counts its 656-byte FlashMLA row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..common.layout import KVLayout
from ..config import SparseConfig, dense_layer_set
from ..kv_store.device_pools import buffer_pages, row_share_pages
from ..kv_store.fp8_host import host_bytes_per_token_per_layer

PRESETS: dict[str, KVLayout] = {
    "llama-3-8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
    "llama-3-70b": KVLayout(num_layers=80, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
    "deepseek-v3.2": KVLayout.mla(61, latent_dim=576, v_head_dim=512, dtype=torch.bfloat16),
    # V3.2 as served with FlashMLA's sparse decode: 656 bytes per token and layer, not 1152
    "deepseek-v3.2-fp8": KVLayout.mla(61, latent_dim=576, v_head_dim=512, dtype=torch.float8_e4m3fn),
}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class CapacityPlan:
    """Per-request bytes and request counts for one layout, context and config."""

    context_len: int
    device_buffer_tokens: int
    device_share_tokens: int  # device tokens per request row and sparse layer (>= the buffer)
    resident_device_bytes: int
    hierarchical_device_bytes: int
    buffer_kv_bytes: int  # the KV part of hierarchical_device_bytes (no maps, no representation)
    hierarchical_host_bytes: int
    resident_requests: int
    hierarchical_requests: int
    limited_by: str  # "device" or "host"

    @property
    def gain(self) -> float:
        """Concurrent requests, hierarchical over resident, all device overheads counted."""
        return self.hierarchical_requests / max(1, self.resident_requests)

    @property
    def kv_only_gain(self) -> float:
        """Device KV bytes per request, resident over hierarchical (the usual headline)."""
        return self.resident_device_bytes / self.buffer_kv_bytes

    def as_dict(self) -> dict:
        # no request fits resident: there is no ratio (null, not hierarchical_requests / 1)
        gain = self.gain if self.resident_requests else None
        return {**asdict(self), "gain": gain, "kv_only_gain": self.kv_only_gain}


def plan_capacity(
    layout: KVLayout, gpu_bytes: int, host_bytes: int, context_len: int, config: SparseConfig
) -> CapacityPlan:
    """Concurrent requests of `context_len` tokens that fit in `gpu_bytes` of device memory
    for KV (and `host_bytes` of host memory) in resident mode and in hierarchical mode."""
    algo = config.algorithm_class
    p = config.page_size
    unit = p if algo.granularity == "page" else 1
    streams = layout.num_kv_heads if algo.per_kv_head else 1
    per_layer = layout.bytes_per_token_per_layer
    full = _round_up(context_len, p)
    dense_layers = len(dense_layer_set(config, layout))
    sparse_layers = layout.num_layers - dense_layers
    buffer = buffer_pages(config.device_buffer_tokens, p, context_len) * p
    share = p * row_share_pages(device_buffer_tokens=config.device_buffer_tokens,
                                min_sparse_prompt_len=config.min_sparse_prompt_len, page_size=p, max_seq_len=context_len)
    maps = sparse_layers * streams * (4 * (full // unit + 1) + 12 * (buffer // unit + 1))
    representation = int(algo.representation_bytes_per_token(layout, config) * full * sparse_layers)
    resident = layout.num_layers * full * per_layer
    buffer_kv = sparse_layers * share * per_layer + dense_layers * full * per_layer
    device = buffer_kv + maps + representation
    host = layout.num_layers * full * host_bytes_per_token_per_layer(layout, config.host_kv_dtype)  # fp8: ~half
    by_device, by_host = gpu_bytes // device, host_bytes // host
    return CapacityPlan(
        context_len=context_len,
        device_buffer_tokens=buffer,
        device_share_tokens=share,
        resident_device_bytes=resident,
        hierarchical_device_bytes=device,
        buffer_kv_bytes=buffer_kv,
        hierarchical_host_bytes=host,
        resident_requests=gpu_bytes // resident,
        hierarchical_requests=min(by_device, by_host),
        limited_by="device" if by_device <= by_host else "host",
    )
