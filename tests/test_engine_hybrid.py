"""Hybrid sliding-window models in the engine (issue 21): Mistral with a window, Qwen2 with
`use_sliding_window`, Gemma 2 and Gemma 3, at prompts 3-5x the window, against transformers'
own greedy `generate` — sparse at a full budget, resident and dense — with chunked prefill and
several requests at once; preempted-and-resumed against unpreempted; the ring's memory in the
plan; the sliding chunk attention against a plain reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from sparse_framework import ConfigError
from sparse_framework.config import load_config
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.memory import plan_for
from sparse_framework.engine.models import causal_attention, load_model
from sparse_framework.engine.sampling import SamplingParams
from sparse_framework.engine.staging import chunk_attention
from helpers import HIERARCHICAL_ALWAYS, TINY_HYBRID, run_batch, tiny_hf_model

VOCAB = TINY_HYBRID["vocab_size"]
TINY = TINY_HYBRID
WINDOW = 8
S, F = "sliding_attention", "full_attention"
# name -> (config class, model class, extra): every model slides with a window of 8
MODELS = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),  # every layer slides
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2)),  # full, full, S, S
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",  # S, F, S, F; logit softcaps (made to bind)
               dict(sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",  # q/k norms, two RoPE bases, linear scaling
               dict(sliding_window=WINDOW, query_pre_attn_scalar=16, layer_types=[S, S, F, S],
                    rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                                     F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}})),
}
FULL = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 256, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
        "device_buffer_tokens": 512, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
SPARSE = {"sparse-full-budget": FULL, "resident": {**FULL, "store": "resident"},
          "dense-mode": {**FULL, "min_sparse_prompt_len": 1000}}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
LENS = [37, 5, 30, 24]  # 3-5x the window (and a short one)


def hf_model(name: str, window: bool = True):
    config_cls, model_cls, extra = MODELS[name]
    if not window:  # the same model with a window longer than any sequence here: every key seen
        extra = {**extra, "sliding_window": TINY["max_position_embeddings"]}
    return tiny_hf_model(config_cls, model_cls, extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in MODELS:
        model = hf_model(name)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (model, path)
    return out


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_for(path, sparse: dict, **config) -> Engine:
    model = load_model(path, dtype=torch.float32)
    return Engine(model, model.config, sparse, EngineConfig(**{"max_num_seqs": 4, "max_model_len": 128, **config}))


def run(engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    return run_batch(engine, batch, params)


@pytest.mark.parametrize("sparse", [s if s == "sparse-full-budget" else pytest.param(s, marks=pytest.mark.slow)
                                    for s in SPARSE])  # resident, dense mode: -m slow
@pytest.mark.parametrize("name", list(MODELS))
def test_engine_equals_transformers_greedy_generate(checkpoints, name: str, sparse: str) -> None:
    """Four prompts at once, prefilled in chunks of at most 12 tokens beside decode rows."""
    model, path = checkpoints[name]
    batch = prompts(LENS)
    engine = engine_for(path, SPARSE[sparse], max_num_batched_tokens=12, max_prefill_chunk=12)
    layers = engine.runner.layers
    assert layers.sliding and engine.runner.ring is not None and layers.window == WINDOW
    assert engine.runner.coord.layout.num_layers == len(layers.full)  # the store holds full layers only
    got = run(engine, batch)
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in batch]
    for i in range(len(batch)):
        assert got[f"r{i}"] == want[i], f"r{i}"


@pytest.mark.parametrize("name", list(MODELS))
def test_the_window_binds(name: str) -> None:
    """The comparison above tells windows apart: without them the same weights generate other
    tokens for some prompt (else a runner ignoring the window would pass it)."""
    windowed, unwindowed = hf_model(name), hf_model(name, window=False)
    assert any(hf_greedy(windowed, p, GREEDY.max_tokens) != hf_greedy(unwindowed, p, GREEDY.max_tokens)
               for p in prompts(LENS))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "qwen2"])
def test_preempted_and_resumed_output_equals_the_unpreempted_one(checkpoints, name: str) -> None:
    """A device pool too small for every request to grow to its end: the scheduler retracts
    (full layers to the host; the ring row stays reserved with its window) and resumes, and
    every request's tokens are those of a run with room for all."""
    _, path = checkpoints[name]
    sparse = {**FULL, "top_k": 8, "device_buffer_tokens": 48, "min_sparse_prompt_len": 1000}  # dense: grows on device
    batch = prompts([40, 44, 36], seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    roomy = run(engine_for(path, sparse), batch, params)
    tight = engine_for(path, sparse, device_capacity_tokens=140, max_num_batched_tokens=16, max_prefill_chunk=16)
    got = run(tight, batch, params)
    assert tight.scheduler.num_preemptions > 0
    assert got == roomy
    assert tight.runner.coord.store.used_tokens() == 0 and not tight.runner.requests


def test_memory_plan_counts_the_ring(checkpoints) -> None:
    """A request row's device bytes include its ring row (window slots of every sliding
    layer); the engine's ring is that times its rows."""
    _, path = checkpoints["gemma3"]
    model = load_model(path, dtype=torch.float32)
    c = model.config
    ring_row = c.sliding_ring_bytes(torch.float32, 128)
    assert ring_row == 2 * 3 * WINDOW * c.num_kv_heads * c.head_dim * 4  # 3 sliding layers
    layout = c.kv_layout(torch.float32, "cpu", 128)
    settings = dict(device=torch.device("cpu"), device_memory_bytes=2**30, host_memory_bytes=2**30, max_model_len=128,
                    max_num_batched_tokens=64, max_num_seqs=2, gpu_memory_utilization=0.5)
    plan = plan_for(model.parameters(), c, layout, load_config(FULL), **settings)
    no_ring = plan_for(model.parameters(), replace(c, layer_types=(), sliding_window=None), layout,
                       load_config(FULL), **settings)
    assert plan.device_bytes_per_request == no_ring.device_bytes_per_request + ring_row
    engine = Engine(model, c, FULL, EngineConfig(max_num_seqs=2, max_model_len=128, gpu_memory_utilization=0.5,
                                                 device_memory_bytes=2**30, host_memory_bytes=2**30))
    assert engine.runner.ring is not None and engine.runner.ring.nbytes == engine.num_seqs * ring_row


def test_fused_ops_are_refused_for_gemma_by_name(checkpoints) -> None:
    _, path = checkpoints["gemma2"]
    model = load_model(path, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"fused_ops=True: the model \(GemmaDecoderModel\) has no fused path"):
        Engine(model, model.config, FULL, EngineConfig(max_num_seqs=1, max_model_len=64, fused_ops=True))
    assert not Engine(model, model.config, FULL, EngineConfig(max_num_seqs=1, max_model_len=64)).runner.model.fused_ops


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize(("n", "before"), [(5, 0), (5, 3), (12, 8), (1, 8)])
def test_sliding_chunk_attention_equals_the_plain_reference(n: int, before: int, softcap: float | None) -> None:
    """A chunk of n queries over the `before` keys the ring holds and its own: equal to exact
    attention over the whole sequence with the window, scale and cap (causal_attention)."""
    g = torch.Generator().manual_seed(n + before)
    start = 20  # the chunk's first position; the ring holds positions start-before..start-1
    q = torch.randn(start + n, 4, 8, generator=g)
    k, v = torch.randn(start + n, 2, 8, generator=g), torch.randn(start + n, 2, 8, generator=g)
    keys = slice(start - before, start + n)
    got = chunk_attention(q[start:], k[keys], v[keys], scale=0.3, softcap=softcap, window=WINDOW)
    want = causal_attention(q, k, v, scale=0.3, softcap=softcap, window=WINDOW)[start:]
    if before >= WINDOW - 1:  # every key the window lets the chunk see is there
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # fewer keys than the window: the chunk is the sequence's start (start = before)
        want = causal_attention(q[start - before:], k[keys], v[keys], scale=0.3, softcap=softcap,
                                window=WINDOW)[before:]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), before=st.integers(0, 12), window=st.integers(1, 16), block=st.integers(1, 20),
       softcap=st.sampled_from([None, 2.0]), seed=st.integers(0, 2**16))
def test_a_sliding_chunk_in_blocks_equals_one_call(n: int, before: int, window: int, block: int,
                                                   softcap: float | None, seed: int) -> None:
    """Queries `block` at a time over their band of keys = the whole [n, m] mask in one call
    (and so = exact attention, test above), for blocks shorter and longer than the window."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 4, 8, generator=g)
    k, v = torch.randn(before + n, 2, 8, generator=g), torch.randn(before + n, 2, 8, generator=g)
    got = chunk_attention(q, k, v, scale=0.3, softcap=softcap, window=window, block=block)
    want = chunk_attention(q, k, v, scale=0.3, softcap=softcap, window=window, block=None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "dense"), [("gemma3", set()), ("gemma2", {0}), ("qwen2", {0, 1})])
def test_quests_default_first_layers_are_the_models_on_a_hybrid(checkpoints, name: str, dense: set[int]) -> None:
    """The engine and the transformers integration both give the coordinator the model layers
    of its store layers: Quest's default first two layers are the model's, so Gemma 3 here
    (S, S, F, S) decodes its one full layer sparsely, Gemma 2 (S, F, S, F) keeps model layer 1
    (store layer 0) dense, and Qwen2 (F, F, S, S) both."""
    from sparse_framework.integrations.transformers import sparse

    model, path = checkpoints[name]
    engine_model = load_model(path, dtype=torch.float32)
    quest = {"algorithm": "quest", "store": "resident"}
    engine = Engine(engine_model, engine_model.config, quest, EngineConfig(max_num_seqs=1, max_model_len=64))
    assert engine.runner.coord.dense_layers == dense
    with sparse(model, quest, max_requests=1, max_seq_len=64) as handle:
        assert handle.coordinator.dense_layers == dense
