"""Device pools per layer kind: sized from what the configuration needs, one clear
CapacityError when a dense fallback cannot fit, stats and logs that say how they were sized."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import HIERARCHICAL_ALWAYS

from sparse_framework import Batch, CapacityError, KVLayout, Request
from sparse_framework.config import dense_layer_set
from sparse_framework.config import load_config
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.coordinator.capacity import PRESETS
from sparse_framework.kv_store.device_pools import DENSE_LAYERS, RESIDENT, SPARSE_LAYERS, size_device_pools

GiB = 2**30


def sizing_for(config: dict, layout: KVLayout, max_requests: int, max_seq_len: int, capacity: int | None = None):
    cfg = load_config(config)
    return size_device_pools(
        num_layers=layout.num_layers, dense_layers=dense_layer_set(cfg, layout.num_layers), page_size=cfg.page_size,
        device_buffer_tokens=cfg.device_buffer_tokens, min_sparse_prompt_len=cfg.min_sparse_prompt_len,
        max_requests=max_requests, max_seq_len=max_seq_len, resident_only=cfg.store == "resident",
        capacity_tokens=capacity,
    )


def test_llama3_8b_8x16k_quest_defaults_take_far_less_than_the_dense_cache() -> None:
    """The H100 case of issue 19: 8 x 16K, Quest defaults (two dense first layers, buffer 4096,
    min_sparse_prompt_len 2048). Before: every layer's pool max_requests x max_seq_len, the
    dense cache's size. Now: 30 sparse layers x 8 x 4096 tokens + 2 dense layers x 8 x 16K."""
    layout = PRESETS["llama-3-8b"]
    per_layer = layout.bytes_per_token_per_layer  # 8 heads x 128 x bf16 x (K, V) = 4096
    pools = {p.kind: p for p in sizing_for({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest"}, layout, 8, 16384)}
    dense_cache = 32 * 8 * 16384 * per_layer
    assert dense_cache == 16 * GiB
    assert pools[DENSE_LAYERS].layers == (0, 1) and pools[DENSE_LAYERS].tokens == 8 * 16384
    assert len(pools[SPARSE_LAYERS].layers) == 30 and pools[SPARSE_LAYERS].tokens == 8 * 4096
    total = sum(p.bytes(layout) for p in pools.values())
    assert total == (30 * 8 * 4096 + 2 * 8 * 16384) * per_layer  # 4.75 GiB
    assert total < 0.3 * dense_cache


@pytest.mark.parametrize("config, sparse_tokens", [
    ({"device_buffer_tokens": 128, "min_sparse_prompt_len": 0}, 128),  # buffers only
    ({"device_buffer_tokens": 128, "min_sparse_prompt_len": 300}, 304),  # a short dense prompt's room
    ({"device_buffer_tokens": 128, "min_sparse_prompt_len": 5000}, 512),  # never more than max_seq_len
    ({"device_buffer_tokens": 4096, "min_sparse_prompt_len": 0}, 512),  # nor a buffer beyond it
])
def test_sparse_layers_pool_holds_a_buffer_or_a_short_prompt_per_row(config, sparse_tokens) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8)
    cfg = {**HIERARCHICAL_ALWAYS, "top_k": 32, "page_size": 8, "dense_layers": [2], "extra": {"dense_first_layers": 0}, **config}
    coord = SparseCoordinator(cfg, layout, max_requests=4, max_seq_len=512)
    pools = {p["kind"]: p for p in coord.memory_stats()}
    assert pools[SPARSE_LAYERS]["tokens_per_layer"] == 4 * sparse_tokens
    assert pools[SPARSE_LAYERS]["layers"] == 2 and pools[DENSE_LAYERS]["layers"] == 1
    assert pools[DENSE_LAYERS]["tokens_per_layer"] == 4 * 512  # dense layers: every token
    row = 2 * 8 * 2 * 4  # K and V, 2 heads x 8 dims, float32
    assert pools[SPARSE_LAYERS]["bytes"] == 2 * 4 * sparse_tokens * row
    # the tensors are what the stats say
    store = coord.store
    assert store.head_major  # Quest selects per KV head: [kv_heads, slots, dim]
    assert store.layer_buffers(0)[0].shape == (2, 4 * sparse_tokens, 8)
    assert store.layer_buffers(2)[0].shape == (2, 4 * 512, 8)
    assert store.layer_slots(0) == 4 * sparse_tokens and store.layer_slots(2) == 4 * 512


def test_resident_store_keeps_one_full_pool_and_device_capacity_tokens_replaces_it() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)
    cfg = {"store": "resident", "top_k": 32, "page_size": 8, "device_buffer_tokens": 128, "dense_layers": [0],
           "extra": {"dense_first_layers": 0}}
    coord = SparseCoordinator(cfg, layout, max_requests=2, max_seq_len=100, host_capacity_tokens=0)
    (pool, host) = coord.memory_stats()
    assert pool["kind"] == RESIDENT and pool["layers"] == 2 and pool["tokens_per_layer"] == 2 * 104
    assert host["kind"] == "host" and host["bytes"] == 0
    smaller = SparseCoordinator(cfg, layout, max_requests=2, max_seq_len=100, device_capacity_tokens=50,
                                host_capacity_tokens=0)
    assert smaller.memory_stats()[0]["tokens_per_layer"] == 56  # whole pages
    assert "device_capacity_tokens 50" in smaller.memory_stats()[0]["rule"]


def _driver(coord: SparseCoordinator, requests: list[Request], steps: int, seed: int = 0) -> None:
    """Prefill the requests, then decode `steps` steps (random q/k/v)."""
    lay = coord.layout
    g = torch.Generator().manual_seed(seed)
    for r in requests:
        coord.on_request_begin(r)
    batch = Batch(requests, is_prefill=True)
    coord.forward_begin(batch)
    n = sum(r.prompt_len for r in requests)
    for layer in range(lay.num_layers):
        q = torch.randn(n, 2 * lay.num_kv_heads, lay.head_dim, generator=g)
        k, v = (torch.randn(n, lay.num_kv_heads, lay.head_dim, generator=g) for _ in range(2))
        coord.attention_begin(layer, q, k, v, batch)
        coord.attention_end(layer, None, batch)
    coord.forward_end(batch)
    for _ in range(steps):
        batch = Batch(requests)
        coord.forward_begin(batch)
        for layer in range(lay.num_layers):
            q = torch.randn(len(requests), 2 * lay.num_kv_heads, lay.head_dim, generator=g)
            k, v = (torch.randn(len(requests), lay.num_kv_heads, lay.head_dim, generator=g) for _ in range(2))
            meta = coord.attention_begin(layer, q, k, v, batch)
            coord.attend(layer, q, meta)
            coord.attention_end(layer, None, batch)
        coord.forward_end(batch)


SMALL = {**HIERARCHICAL_ALWAYS, "top_k": 16, "page_size": 4, "device_buffer_tokens": 48, "min_sparse_prompt_len": 32,
         "sink_tokens": 4, "recent_tokens": 8, "extra": {"dense_first_layers": 0}}


def test_short_prompts_that_outgrow_their_room_get_one_clear_capacity_error() -> None:
    """Rows share a layer's pages: a dense-mode request may grow past its row's share while
    pages are free; when none are, forward_begin raises a CapacityError naming the settings
    and changes nothing."""
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)
    coord = SparseCoordinator(SMALL, layout, max_requests=2, max_seq_len=200)
    assert coord.store.layer_slots(0) == 2 * 48  # max(48, 32) per row
    a, b = Request("a", 20), Request("b", 20)  # both decode densely (20 < 32)
    _driver(coord, [a, b], steps=28)  # 48 tokens each: the whole pool
    assert coord.store.dev_alloc[0].free == 0
    with pytest.raises(CapacityError) as err:
        coord.forward_begin(Batch([a]))
    msg = str(err.value)
    for words in ("sparse layers full in layer 0", "request(s) 'a' needs 1 more pages", "min_sparse_prompt_len (32)",
                  "device_capacity_tokens (now 96 tokens per layer; max_requests x max_seq_len = 400 fits any mix)"):
        assert words in msg, msg
    assert a.seq_len == 48  # nothing changed
    coord.on_request_end(b)
    c = Request("c", 40)  # sparse (40 >= 32): its buffer takes b's pages
    coord.on_request_begin(c)
    assert coord.store.device_tokens(c) == 48
    # a sparse request whose buffer does not fit: the buffer's settings are named
    small = SparseCoordinator(SMALL, layout, max_requests=2, max_seq_len=200, device_capacity_tokens=40)
    with pytest.raises(CapacityError, match=r"buffer of device_buffer_tokens \(48\).*raise device_capacity_tokens"):
        small.on_request_begin(Request("d", 40))


def test_a_short_prompt_without_room_names_min_sparse_prompt_len() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)
    cfg = {**SMALL, "min_sparse_prompt_len": 100}
    coord = SparseCoordinator(cfg, layout, max_requests=2, max_seq_len=200, device_capacity_tokens=120)
    coord.on_request_begin(Request("a", 90))
    with pytest.raises(CapacityError) as err:
        coord.on_request_begin(Request("b", 90))
    assert "decodes densely" in str(err.value) and "lower min_sparse_prompt_len" in str(err.value)
    assert "b" not in coord.requests and coord.store.device_tokens(coord.requests["a"]) == 92


def test_stats_and_logs_say_how_the_pools_were_sized_and_what_they_hold(caplog) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=8)
    cfg = {**SMALL, "dense_layers": [0]}
    with caplog.at_level(logging.INFO, logger="sparse_framework.kv_store"):
        coord = SparseCoordinator(cfg, layout, max_requests=2, max_seq_len=200)
    text = caplog.text
    assert "device KV pool of the sparse layers: 2 layer(s) x 96 tokens" in text
    assert "device KV pool of the dense layers: 1 layer(s) x 400 tokens" in text
    a, b = Request("a", 20), Request("b", 60)  # a dense, b sparse
    _driver(coord, [a, b], steps=3)
    pools = {p["kind"]: p for p in coord.memory_stats()}
    row = 2 * 8 * 4  # K + V, float32
    # dense layer 0: every token of both; sparse layers: a's 23 tokens (6 pages) and b's buffer (48)
    assert pools[DENSE_LAYERS]["used_tokens"] == 24 + 64
    assert pools[SPARSE_LAYERS]["used_tokens"] == 2 * (24 + 48)
    assert pools[SPARSE_LAYERS]["used_bytes"] == pools[SPARSE_LAYERS]["used_tokens"] * row
    assert pools["host"]["used_tokens"] == 3 * 64  # only the sparse request, every layer
    assert "max_requests 2 x 48 tokens" in pools[SPARSE_LAYERS]["rule"]
    assert coord.store.device_bytes() == (pools[DENSE_LAYERS]["used_bytes"] + pools[SPARSE_LAYERS]["used_bytes"])
    assert [s["pool"] for s in coord.store.stats()] == [DENSE_LAYERS, SPARSE_LAYERS, SPARSE_LAYERS]


def test_host_pinning_fills_zeros_and_logs_large_pools(monkeypatch, caplog) -> None:
    """pinned.py on the CPU: the huge-page region (registration stubbed: no CUDA here) comes
    back zero-filled in the asked shape and dtype, logs size, progress and rate for a pool
    above LOG_BYTES, and nothing for a small one."""
    from sparse_framework.kv_store import pinned

    registered = []
    monkeypatch.setattr(pinned._Region, "register", lambda self: registered.append(self.nbytes))
    monkeypatch.setattr(pinned, "LOG_BYTES", 1 << 20)
    monkeypatch.setattr(pinned, "CHUNK", 1 << 18)
    monkeypatch.setattr(pinned, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="sparse_framework.kv_store.pinned"):
        small = pinned.pinned_zeros((3, 5), torch.bfloat16, "host KV pool")
        assert caplog.text == ""
        big = pinned.pinned_zeros((2, 1 << 20), torch.float16, "host KV pool")
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16 and not small.any()
    assert big.shape == (2, 1 << 20) and big.dtype == torch.float16 and not big.any()
    assert registered == [30, 4 << 20]
    assert "pinning 0.0 GiB of host memory for the host KV pool" in caplog.text
    assert "(50%)" in caplog.text and "huge pages + cudaHostRegister" in caplog.text
    big[1, 7] = 3.0  # writable, the exact size
    assert float(big.sum()) == 3.0


def test_a_registered_host_pool_stays_registered_while_any_view_of_it_lives(monkeypatch) -> None:
    """The region is released (cudaHostUnregister) when the last tensor over it is gone, not
    when the tensor object pinned_zeros returned is collected: the store keeps views of its
    pools, and the GPU reading unregistered memory would read garbage or fault."""
    import gc

    from sparse_framework.kv_store import pinned

    released = []
    monkeypatch.setattr(pinned._Region, "register", lambda self: (setattr(self, "registered", True),
                                                                   pinned._LIVE.__setitem__(self.ptr, self.nbytes)))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: type("R", (), {"cudaHostUnregister": staticmethod(released.append)}))
    pool = pinned.pinned_zeros((4, 1024), torch.float32, "host KV pool")
    view = pool[1:].view(3, 32, 32)
    assert pinned.is_gpu_readable(view) and not pinned.is_gpu_readable(torch.zeros(4))
    start = pool.data_ptr()
    del pool
    gc.collect()
    assert released == [] and pinned.is_gpu_readable(view)
    view.fill_(2.0)  # the memory is still mapped
    assert float(view.sum()) == 2.0 * 3 * 1024
    del view
    gc.collect()
    assert released == [start] and start not in pinned._LIVE
