"""Capacity planning: resident vs hierarchical request counts."""

from __future__ import annotations

import pytest
import torch

from helpers import HIERARCHICAL_ALWAYS

from sparse_framework import KVLayout, load_config
from sparse_framework.coordinator.capacity import PRESETS, plan_capacity

GiB = 2**30


def test_llama_16k_top2048_matches_the_hand_computation() -> None:
    layout = PRESETS["llama-3-8b"]
    cfg = load_config({**HIERARCHICAL_ALWAYS, "top_k": 2048, "device_buffer_tokens": 2144, "extra": {"dense_first_layers": 0}})
    plan = plan_capacity(layout, 60 * GiB, 1024 * GiB, 16384, cfg)
    per_layer = 2 * 8 * 128 * 2  # K + V, 8 heads x 128 dims, bf16
    assert plan.resident_device_bytes == 32 * 16384 * per_layer
    assert plan.buffer_kv_bytes == 32 * 2144 * per_layer
    maps = 32 * 8 * (4 * (16384 // 16 + 1) + 12 * (2144 // 16 + 1))  # Quest: per KV head, page units
    representation = 32 * 16384 * 2 * 8 * 128 * 2 // 16  # page min + max keys
    assert plan.hierarchical_device_bytes == plan.buffer_kv_bytes + maps + representation
    assert plan.resident_requests == 60 * GiB // plan.resident_device_bytes == 30
    assert plan.hierarchical_requests == 60 * GiB // plan.hierarchical_device_bytes
    assert plan.kv_only_gain == pytest.approx(16384 / 2144)  # the ~7.5x anchor
    assert plan.limited_by == "device" and plan.gain > 5


def test_host_memory_can_be_the_limit() -> None:
    cfg = load_config({**HIERARCHICAL_ALWAYS, "top_k": 2048})
    plan = plan_capacity(PRESETS["deepseek-v3.2"], 80 * GiB, 16 * GiB, 131072, cfg)
    assert plan.limited_by == "host"
    assert plan.hierarchical_requests == 16 * GiB // plan.hierarchical_host_bytes


def test_dense_layers_cost_full_context_and_short_contexts_cap_the_buffer() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    cfg = load_config({**HIERARCHICAL_ALWAYS, "top_k": 64, "page_size": 8, "device_buffer_tokens": 256, "dense_layers": [0],
                       "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}})
    plan = plan_capacity(layout, GiB, GiB, 1000, cfg)
    per_layer = 2 * 8 * 2
    assert plan.buffer_kv_bytes == 3 * 256 * per_layer + 1 * 1000 * per_layer
    # Quest's own recipe adds its first two layers: config [0] and recipe {0, 1} -> 2 dense layers
    recipe = plan_capacity(layout, GiB, GiB, 1000, load_config({**cfg.model_dump(), "extra": {}}))
    assert recipe.buffer_kv_bytes == 2 * 256 * per_layer + 2 * 1000 * per_layer
    short = plan_capacity(layout, GiB, GiB, 100, cfg)
    assert short.device_buffer_tokens == 104  # never more than the (page-rounded) context


def test_fp8_mla_counts_flashmla_rows_of_656_bytes() -> None:
    """DeepSeek V3.2 with FlashMLA's FP8 cache: every KV byte counted is the 656-byte row
    (512 e4m3 + 4 fp32 scales + 64 bf16 RoPE), not 576 raw fp8 bytes nor 1152 bf16 ones."""
    fp8, bf16 = PRESETS["deepseek-v3.2-fp8"], PRESETS["deepseek-v3.2"]
    assert fp8.bytes_per_token_per_layer == 656 and fp8.bytes_per_token == 61 * 656
    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": 2048, "page_size": 64, "device_buffer_tokens": 4096})
    plan = plan_capacity(fp8, 80 * GiB, 1024 * GiB, 65536, cfg)
    assert plan.resident_device_bytes == 61 * 65536 * 656
    assert plan.hierarchical_host_bytes == 61 * 65536 * 656
    assert plan.buffer_kv_bytes == 61 * 4096 * 656
    ref = plan_capacity(bf16, 80 * GiB, 1024 * GiB, 65536, cfg)
    assert ref.buffer_kv_bytes == 61 * 4096 * 1152
    assert plan.hierarchical_requests > ref.hierarchical_requests


def test_a_context_that_decodes_densely_plans_its_full_length_in_every_layer() -> None:
    """Below min_sparse_prompt_len a request keeps every token on the device: the store's
    sparse-layer pool reserves that room per row, and the plan counts it."""
    layout = KVLayout(num_layers=4, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    per_layer = 2 * 8 * 2
    cfg = load_config({**HIERARCHICAL_ALWAYS, "top_k": 64, "page_size": 8, "device_buffer_tokens": 256, "min_sparse_prompt_len": 2048,
                       "extra": {"dense_first_layers": 0}})
    plan = plan_capacity(layout, GiB, GiB, 1000, cfg)
    assert plan.device_share_tokens == 1000 and plan.buffer_kv_bytes == 4 * 1000 * per_layer
    long = plan_capacity(layout, GiB, GiB, 8192, cfg)  # sparse: the share is min_sparse_prompt_len's room
    assert long.device_share_tokens == 2048 and long.buffer_kv_bytes == 4 * 2048 * per_layer


@pytest.mark.parametrize("config", [
    {"extra": {}},  # Quest's recipe: two dense first layers
    {"extra": {"dense_first_layers": 0}},
    {"extra": {"dense_first_layers": 0}, "min_sparse_prompt_len": 300, "device_buffer_tokens": 128},
    {"extra": {"dense_first_layers": 0}, "min_sparse_prompt_len": 0, "device_buffer_tokens": 136},
])
def test_the_plan_counts_the_device_pool_bytes_the_store_allocates(config) -> None:
    from sparse_framework.coordinator.core import SparseCoordinator

    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    cfg = load_config({**HIERARCHICAL_ALWAYS, "top_k": 32, "page_size": 8, "device_buffer_tokens": 128, **config})
    max_requests, context = 3, 512
    coord = SparseCoordinator(cfg, layout, max_requests=max_requests, max_seq_len=context)
    device = sum(p["bytes"] for p in coord.memory_stats() if p["kind"] != "host")
    plan = plan_capacity(layout, GiB, GiB, context, cfg)
    assert plan.buffer_kv_bytes * max_requests == device


def test_fp8_host_rows_about_double_the_host_bound_requests() -> None:
    """host_kv_dtype fp8_e4m3: the host keeps (128 + 1) bytes per KV head row (e4m3 values and
    the scale's exponent byte) against 256 in bf16, so where the host bounds, 1.98x the
    requests; the device side is unchanged."""
    layout = PRESETS["llama-3-8b"]
    cfg = {**HIERARCHICAL_ALWAYS, "top_k": 2048, "device_buffer_tokens": 2144, "extra": {"dense_first_layers": 0}}
    bf16 = plan_capacity(layout, 60 * GiB, 128 * GiB, 32768, load_config(cfg))
    fp8 = plan_capacity(layout, 60 * GiB, 128 * GiB, 32768, load_config({**cfg, "host_kv_dtype": "fp8_e4m3"}))
    assert bf16.hierarchical_host_bytes == 32 * 32768 * 2 * 8 * 128 * 2
    assert fp8.hierarchical_host_bytes == 32 * 32768 * 2 * 8 * 129
    assert bf16.limited_by == fp8.limited_by == "host"
    assert fp8.hierarchical_device_bytes == bf16.hierarchical_device_bytes
    assert (bf16.hierarchical_requests, fp8.hierarchical_requests) == (32, 63)  # 128 GiB / 4 GiB, / 2.02 GiB
