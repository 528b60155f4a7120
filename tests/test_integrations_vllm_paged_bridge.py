"""sparse_framework.integrations.vllm.paged_bridge: any scoring algorithm inside vLLM through the
rebuild bridge, in plain torch (no vLLM needed). Paged caches with shuffled blocks that first
held other keys, written in prefill chunks with padding slots (`vllm_cases.fill`); the bridge
against Quest's own twin, against a reference with no paging (`vllm_cases.rebuilt_selection`)
and against float64 dense attention at a covering budget; and what it refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_cases import BASE, assert_selects_everything_and_attends_densely, fill, paged_case, rebuilt_selection

from sparse_framework.common.errors import ConfigError
from sparse_framework.config import load_config
from sparse_framework.integrations.vllm.paged import (
    CONFIG_ENV,
    PagedQuest,
    graph_safe,
    load_vllm_config,
    paged_algorithm,
)
from sparse_framework.integrations.vllm.paged_bridge import PagedBridge

# algorithm -> its options in these tests (PQCache: fewer centroids and iterations, for speed)
TOKEN_ALGORITHMS = {
    "pqcache": {"bits": 4, "iterations": 6},
    "dsa": {"source": "keys"},
}

shapes = dict(
    lens=st.lists(st.integers(1, 260), min_size=1, max_size=3),
    hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([16, 32]),
    bs=st.sampled_from([8, 16, 32]),
    seed=st.integers(0, 40),
)


def case(lens, hkv, group, dim, bs, seed, algo, chunk=37):  # type: ignore[no-untyped-def]
    """A paged case written into `algo`'s state as vLLM writes it."""
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=seed)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=chunk)
    return q, keys, values, table, k_cache, v_cache, state


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**shapes, top_k=st.sampled_from([16, 48, 96]), sink=st.sampled_from([0, 8]), recent=st.sampled_from([0, 16]),
       newest_in_top_k=st.booleans())
def test_the_bridge_over_quest_selects_what_quests_twin_does(
    lens, hkv, group, dim, bs, seed, top_k, sink, recent, newest_in_top_k
) -> None:
    """Quest rebuilt from the keys each step (the bridge) and Quest's bounds kept per block
    (`PagedQuest`), from the same paged writes: the same blocks. A first selection over fewer
    rows sizes the bridge's instance smaller, so the second re-makes it."""
    top_k = max(top_k, bs)
    config = load_vllm_config({**BASE, "top_k": top_k, "sink_tokens": sink, "recent_tokens": recent,
                               "extra": {"min_pages": 1, "newest_in_top_k": newest_in_top_k}}, block_size=bs)
    bridge, twin = PagedBridge(config), PagedQuest(config)
    q, _, _, table, _, _, state = case(lens, hkv, group, dim, bs, seed, bridge)
    *_, twin_state = case(lens, hkv, group, dim, bs, seed, twin)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    first = bridge.select(state, q[:1], table[:1], seq_lens[:1])
    got, want = bridge.select(state, q, table, seq_lens), twin.select(twin_state, q, table, seq_lens)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.lengths, want.lengths)
    assert torch.equal(first.indices, got.indices[:1, :, : first.indices.shape[-1]])


@pytest.mark.parametrize("algorithm", list(TOKEN_ALGORITHMS))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**shapes, top_k=st.sampled_from([16, 64, 128]), sink=st.sampled_from([0, 8]), recent=st.sampled_from([0, 16]))
def test_the_bridge_over_a_token_algorithm_equals_the_algorithm_without_paging(
    algorithm, lens, hkv, group, dim, bs, seed, top_k, sink, recent
) -> None:
    """PQCache and DSA over the keys (token-granular) through the bridge: the same blocks as
    the algorithm built on contiguous keys, its token scores max-pooled to blocks one by one
    (`rebuilt_selection`); whatever the shapes, a selection is valid whole blocks."""
    top_k = max(top_k, bs)  # at least a block (`load_vllm_config`)
    config = load_vllm_config({**BASE, "algorithm": algorithm, "top_k": top_k, "sink_tokens": sink,
                               "recent_tokens": recent, "extra": TOKEN_ALGORITHMS[algorithm]}, block_size=bs)
    bridge = PagedBridge(config)
    q, keys, _, table, _, _, state = case(lens, hkv, group, dim, bs, seed, bridge)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = bridge.select(state, q, table, seq_lens)
    got.validate(seq_lens)
    want = rebuilt_selection(config, lens, keys, q)
    assert torch.equal(got.indices, want.indices) and torch.equal(got.lengths, want.lengths)


@pytest.mark.parametrize("algorithm, extra", [("quest", {}), *TOKEN_ALGORITHMS.items()])
@pytest.mark.parametrize("lens, hkv, group, dim, bs", [([300, 45, 1, 200], 3, 3, 32, 32), ([513, 97], 1, 4, 16, 16)])
def test_a_covering_budget_through_the_bridge_is_dense_attention(algorithm, extra, lens, hkv, group, dim, bs) -> None:
    covering = -(-max(lens) // bs) * bs
    config = load_vllm_config({**BASE, "algorithm": algorithm, "top_k": covering, "extra": extra}, block_size=bs)
    bridge = PagedBridge(config)
    q, keys, values, table, k_cache, v_cache, state = case(lens, hkv, group, dim, bs, 5, bridge, chunk=bs)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    assert_selects_everything_and_attends_densely(bridge.select(state, q, table, seq_lens), seq_lens, q, keys, values,
                                                  table, k_cache, v_cache, bs)


def test_the_config_takes_pqcache_through_the_bridge_and_keeps_registered_twins() -> None:
    pq = load_vllm_config({**BASE, "algorithm": "pqcache", "top_k": 64}, block_size=16)
    assert type(paged_algorithm(pq)) is PagedBridge and not graph_safe(pq)
    quest = load_vllm_config({**BASE, "top_k": 64}, block_size=16)  # a registered twin wins over the bridge
    assert type(paged_algorithm(quest)) is PagedQuest and graph_safe(quest)
    dsa = load_vllm_config({**BASE, "algorithm": "dsa", "top_k": 64, "extra": {"source": "keys"}}, block_size=16)
    assert type(paged_algorithm(dsa)).__name__ == "PagedKeyMass"


@pytest.mark.parametrize("config, says", [
    ({"algorithm": "snapkv"}, ["`algorithm` = 'snapkv'", "needs_prefill_queries", "prompt's queries",
                               "runs through the rebuild bridge"]),
    ({"algorithm": "dsa"}, ["`extra.source` = 'indexer'", "indexer keys"]),  # DSA's twin refuses, and decides
    ({"algorithm": "pqcache", "top_k": 8}, ["`top_k` = 8", "one KV block (16 tokens)"]),
])
def test_the_config_refuses_what_the_bridge_cannot_run(config: dict, says: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_vllm_config({**BASE, **config}, block_size=16)
    assert str(info.value).startswith(CONFIG_ENV)
    for part in says:
        assert part in str(info.value)


def test_the_bridge_refuses_model_inputs_at_the_first_write_and_static_selection() -> None:
    """DSA with its indexer asks the model for tensors beside K (`prefill_inputs`), known from
    an instance only: the bridge's first K write (new_state) raises; its select_static (a full
    CUDA graph's path) is never meant to run."""
    indexer = load_config({"algorithm": "dsa", "page_size": 16, "top_k": 64, "extra": {"key_dtype": "bfloat16"}})
    assert PagedBridge.refuses(indexer) is None
    with pytest.raises(ConfigError, match=f"{CONFIG_ENV}.*'dsa'.*index_k.*twin"):
        PagedBridge(indexer).new_state(4, 1, 16, torch.float32, "cpu")
    assert "needs_prefill_queries" in (PagedBridge.refuses(load_config({"algorithm": "snapkv"})) or "")
    config = load_vllm_config({**BASE, "algorithm": "pqcache", "top_k": 64}, block_size=16)
    bridge = PagedBridge(config)
    state = bridge.new_state(4, 1, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="PIECEWISE"):
        bridge.select_static(state, torch.zeros(1, 1, 16), torch.zeros(1, 4, dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32), 0)
