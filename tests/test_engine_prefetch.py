"""Prefetch (SparseConfig.prefetch "early_query"): each sparse layer's selection predicted one
layer early and swapped in ahead (coordinator.prefetch, HierarchicalKVStore.prefetch, the
model's `early_query`). A prefetch may only move rows into the buffer: the tokens must equal a
run without it, whatever the shapes; the prediction must reach the store and take misses off
the layer's own swap-in; bad uses are refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import run_batch

from sparse_framework import Batch, KVLayout, Request
from sparse_framework.common.errors import ConfigError, HookOrderError
from sparse_framework.config import load_config
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.engine import Engine, EngineConfig, SamplingParams
from sparse_framework.engine.models import ModelConfig, random_model

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}


def quest(prefetch: str, page: int, top_k: int, buffer: int) -> dict:
    return {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "backend": "torch_ref", "top_k": top_k, "page_size": page,
            "device_buffer_tokens": buffer, "min_sparse_prompt_len": 64, "sink_tokens": page, "recent_tokens": page,
            "extra": {"dense_first_layers": 1}, "prefetch": prefetch}


def run(model, config: ModelConfig, sparse: dict, prompts: list[list[int]], tokens: int, **engine):  # type: ignore[no-untyped-def]
    engine = Engine(model, config, sparse, EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=256,
                                                        max_model_len=max(map(len, prompts)) + tokens + 8, **engine))
    outs = run_batch(engine, prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    stats = engine.runner.coord.store.stats()
    counts = {k: sum(s.get(k, 0) for s in stats) for k in ("hits", "misses", "prefetch_rows", "bytes_in")}
    return outs, {**counts, "spills": engine.runner.coord.store.spill_count}


def test_prefetch_on_the_hybrid_store_under_pressure_changes_no_token() -> None:
    """The hybrid store's spilled requests take the prefetch as the hierarchical store's do (the
    plan kernel's whole rows take none): the same tokens with and without it, rows prefetched."""
    config = ModelConfig.from_hf(TINY)
    model = random_model(config, torch.float32, seed=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (200, 150, 260)]
    page, top_k = 4, 32
    hybrid = {**quest("off", page, top_k, top_k + 4 * page), "store": "hybrid"}
    off, s_off = run(model, config, hybrid, prompts, 16, device_capacity_tokens=400)
    on, s_on = run(model, config, {**hybrid, "prefetch": "early_query"}, prompts, 16, device_capacity_tokens=400)
    assert on == off
    assert s_on["spills"] > 0 and s_on["prefetch_rows"] > 0 and s_off["prefetch_rows"] == 0


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(page=st.sampled_from([4, 16]), top_k=st.sampled_from([32, 64]), extra_buffer=st.sampled_from([0, 64]),
       lens=st.lists(st.integers(90, 300), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_prefetch_changes_no_token_and_takes_misses_off_the_layers_own_swap_in(page, top_k, extra_buffer, lens, seed):
    """Greedy tokens with prefetch equal those without, every request; the selections are the
    same (hits + misses equal), the prefetch copied rows, and the layers' own swap-ins missed
    fewer rows than without it (the toy model's early query predicts most pages)."""
    config = ModelConfig.from_hf(TINY)
    model = random_model(config, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lens]
    buffer = top_k + 4 * page + extra_buffer  # the selection, its sink, recent and newest pages, spare room
    off, s_off = run(model, config, quest("off", page, top_k, buffer), prompts, 24)
    on, s_on = run(model, config, quest("early_query", page, top_k, buffer), prompts, 24)
    assert on == off
    assert s_on["hits"] + s_on["misses"] == s_off["hits"] + s_off["misses"]
    assert s_on["prefetch_rows"] > 0 and s_off["prefetch_rows"] == 0
    assert s_on["misses"] < s_off["misses"], (s_on, s_off)


def test_the_early_query_from_a_layers_own_input_is_its_query() -> None:
    """early_query(j, stream entering layer j) is exactly the query layer j attends with."""
    config = ModelConfig.from_hf(TINY)
    model = random_model(config, torch.float32, seed=3)
    tokens, positions = torch.tensor([5, 9, 11, 2]), torch.tensor([0, 1, 2, 3])
    seen: dict[int, torch.Tensor] = {}

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen[layer] = q.clone()
        return q  # any output: the next layer's input is whatever this gives
    model(tokens, positions, attend)
    h = model.model.embed_tokens(tokens)
    cos, sin = model.rotary.cos_sin(positions, h.dtype)
    for j, layer in enumerate(model.model.layers):
        assert torch.equal(model.early_query(j, h, cos, sin), seen[j])
        h = layer(h, cos, sin, attend, j)


def test_prefetch_is_refused_where_it_cannot_work() -> None:
    with pytest.raises(ConfigError, match="prefetch"):
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "store": "resident", "prefetch": "early_query"})
    with pytest.raises(ConfigError, match="prefetch"):
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "prefetch": "yes"})
    gemma = ModelConfig.from_hf({**TINY, "architectures": ["Gemma2ForCausalLM"], "head_dim": 8})
    with pytest.raises(ConfigError, match="prefetch 'early_query'.*early query"):
        Engine(random_model(gemma, torch.float32), gemma, quest("early_query", 4, 32, 64), EngineConfig(max_model_len=64))


def test_a_prefetch_after_its_layer_began_is_refused() -> None:
    layout = KVLayout(2, 2, 8)
    coord = SparseCoordinator(quest("early_query", 4, 16, 32), layout, max_requests=1, max_seq_len=128)
    r = Request("a", 100)
    coord.on_request_begin(r)
    g = torch.Generator().manual_seed(0)
    prefill = Batch([r], is_prefill=True)
    coord.forward_begin(prefill)
    for layer in range(2):
        kv = torch.randn(100, 2, 8, generator=g)
        meta = coord.attention_begin(layer, torch.randn(100, 4, 8, generator=g), kv, kv, prefill)
        coord.attend(layer, torch.randn(100, 4, 8, generator=g), meta)
        coord.attention_end(layer, None, prefill)
    coord.forward_end(prefill)
    step = Batch([r])
    coord.forward_begin(step)
    q, kv = torch.randn(1, 4, 8, generator=g), torch.randn(1, 2, 8, generator=g)
    coord.prefetch(1, q, step)  # before layer 1: accepted
    assert int(coord.store.prefetch_counts[1].sum()) > 0
    meta = coord.attention_begin(1, q, kv, kv, step)
    coord.attend(1, q, meta)
    coord.attention_end(1, None, step)
    with pytest.raises(HookOrderError, match="prefetch\\(layer 1\\) after"):
        coord.prefetch(1, q, step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_on_cuda_the_side_stream_prefetch_changes_no_token(graphs: bool) -> None:
    """bf16, the fused store kernels, the prefetch copies on a side stream (inside whole-step
    CUDA graphs too: recorded at capture, replayed): the same greedy tokens as without it, the
    same selections, rows copied ahead. (Whether the random model's early query predicts well
    enough to take misses off is the benchmark's question, not a contract.)"""
    config = ModelConfig.from_hf({**TINY, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "num_hidden_layers": 4, "intermediate_size": 512})
    model = random_model(config, torch.bfloat16, "cuda", seed=1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (700, 900, 1000)]

    def go(prefetch: str):  # type: ignore[no-untyped-def]
        sparse = {**quest(prefetch, 16, 128, 256), "backend": "triton"}
        engine = Engine(model, config, sparse, EngineConfig(max_num_seqs=3, max_num_batched_tokens=1024,
                                                            max_model_len=1100, cuda_graphs=graphs))
        outs = run_batch(engine, prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        stats = engine.runner.coord.store.stats()
        return outs, sum(s["hits"] + s["misses"] for s in stats), sum(s["prefetch_rows"] for s in stats)

    off, on = go("off"), go("early_query")
    assert on[0] == off[0]
    assert on[1] == off[1] and on[2] > 0 and off[2] == 0, (on[1:], off[1:])
