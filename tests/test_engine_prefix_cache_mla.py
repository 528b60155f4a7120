"""The prefix cache on an MLA + lightning-indexer model (engine/prefix_cache.py, "MLA models"):
a tiny random DeepSeek-V3.2 (index_topk 16, below the prompts, so the indexer's choice matters
at prefill and decode), DSA fed the model's indexer. With the cache on, a later request's
prefix latent rows come from host pages and its indexer keys from the cache's copies; its
outputs equal the cache off token for token: hierarchical sparse, dense mode (pages exported
from the device), resident, and DSA keys stored in bfloat16 by a float32 model (the cache
must hand back the model's own keys, not DSA's rounded ones)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefix_cache_driver import (
    GREEDY,
    arrivals,
    assert_empty_after_clear,
    chat,
    chat_hit_tokens,
    chat_prompt_lens,
    draw_arrivals,
    one_after_another,
    one_after_another_one,
    shared_prefix_prompts,
    tokens,
)

from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import ModelConfig, random_model
from helpers import HIERARCHICAL_ALWAYS, run_batch

CONFIG = ModelConfig.from_hf({**RANDOM_MODELS["deepseek-v3.2-tiny"], "vocab_size": 96})
DSA = {**HIERARCHICAL_ALWAYS, "algorithm": "dsa", "top_k": 16, "page_size": 4, "sink_tokens": 0, "recent_tokens": 0,
       "min_sparse_prompt_len": 0, "device_buffer_tokens": 64,
       "extra": {"index_heads": 4, "index_dim": 32, "key_dtype": "float32", "score_newest": True}}
CONFIGS = {
    "hierarchical": (DSA, {}),
    "bf16-index-keys": ({**DSA, "extra": {**DSA["extra"], "key_dtype": "bfloat16"}}, {}),
    "dense-mode": ({**DSA, "min_sparse_prompt_len": 1000}, {}),
    "resident": ({**DSA, "store": "resident"}, {"host_capacity_tokens": 1024}),
}


def engine_for(sparse: dict, cache: bool, **config) -> Engine:
    model = random_model(CONFIG, torch.float32, seed=0)
    settings = {"max_num_seqs": 4, "max_model_len": 128, "max_num_batched_tokens": 16, **config}
    return Engine(model, CONFIG, sparse, EngineConfig(enable_prefix_caching=cache, **settings))


def assert_no_keys_left(engine: Engine) -> None:
    assert_empty_after_clear(engine)
    cache = engine.prefix_cache
    assert not cache._index_pages and not cache._prompt_index and not cache._hit_pages


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_on_equals_cache_off_one_after_another(name) -> None:
    sparse, extra = CONFIGS[name]
    batch = shared_prefix_prompts(prefix=45, tails=(3, 9, 14, 6))
    off = one_after_another(engine_for(sparse, False, **extra), batch)
    engine = engine_for(sparse, True, **extra)
    assert one_after_another(engine, batch) == off
    stats, cache = engine.prefix_cache.stats, engine.prefix_cache
    assert stats.hits == len(batch) - 1
    assert stats.hit_tokens >= sum(min(44, cache.usable_tokens(len(p))) for p in batch[1:])
    assert sum(step[1] for step in engine.step_log) == stats.prompt_tokens - stats.hit_tokens
    # every cached page has its indexer keys: [layers, page, index_dim]
    assert len(cache._index_pages) == cache.cached_pages() > 0
    assert all(k.shape == (CONFIG.num_layers, 4, 32) for k in cache._index_pages.values())
    assert_no_keys_left(engine)


def test_the_cached_keys_are_the_models_own_not_dsas_rounded_form() -> None:
    """With bfloat16 DSA keys in a float32 model, the cached indexer keys equal the keys the
    model computed for the prompt (float32), which DSA's stored form does not."""
    sparse, _ = CONFIGS["bf16-index-keys"]
    engine = engine_for(sparse, True)
    captured: dict[int, torch.Tensor] = {}

    def grab(layer: int):
        def hook(module, args, out) -> None:
            captured.setdefault(layer, out[2].detach().clone())  # (q, weights, k) of the first forward
        return hook

    for i, layer in enumerate(engine.runner.model.model.layers):
        layer.self_attn.indexer.register_forward_hook(grab(i))
    prompt = shared_prefix_prompts(prefix=45, tails=(3,))[0]
    one_after_another(engine, [prompt])  # first forward: the prompt's first chunk of 16 tokens
    cache = engine.prefix_cache
    pages = cache.tree.match_prefix(prompt[:44]).values
    cached = torch.cat([cache._index_pages[p] for p in pages], 1)[:, :16]  # [layers, 16, 32]
    fresh = torch.stack([captured[i] for i in range(CONFIG.num_layers)])
    assert fresh.shape == cached.shape and fresh.dtype == torch.float32
    assert torch.equal(cached, fresh)
    assert not torch.equal(fresh, fresh.to(torch.bfloat16).float())  # DSA's bf16 form would differ


@pytest.mark.parametrize("name", ["hierarchical", "bf16-index-keys", "dense-mode", "dense-layer"])
def test_multi_turn_chat(name) -> None:
    """Turn n+1 = turn n's prompt + its answer + a message; outputs equal the cache off. With
    DSA's keys in the model's dtype (float32 here) the answer's indexer keys are read from
    DSA's representation, so the cache serves every whole page of turn n's K/V (all but its
    last token, as for other models). Only turn n's prompt pages are served where those keys
    would be wrong: bf16 keys in the float32 model (rounded), a dense-mode request and a
    dense layer (no representation built)."""
    sparse, _ = CONFIGS["hierarchical"] if name == "dense-layer" else CONFIGS[name]
    if name == "dense-layer":
        sparse = {**sparse, "dense_layers": [0]}
    lossless = name == "hierarchical"
    g = torch.Generator().manual_seed(2)
    messages = [tokens(n, g) for n in (21, 7, 10)]
    off = chat(engine_for(sparse, False), messages, one_after_another_one)
    engine = engine_for(sparse, True)
    assert (engine.prefix_cache.index_reader is not None) == (name in ("hierarchical", "dense-mode"))
    assert chat(engine, messages, one_after_another_one) == off
    lens = chat_prompt_lens(messages)
    hits = chat_hit_tokens(lens) if lossless else sum(prev // 4 * 4 for prev in lens[:-1])  # prompts only
    assert engine.prefix_cache.stats.hit_tokens == hits > 0
    assert_no_keys_left(engine)


def test_arriving_together_with_eviction_under_a_small_host_pool() -> None:
    """Two at a time over a host pool that cannot keep every prefix: pages (and their keys)
    are evicted, outputs still equal the cache off."""
    sparse, _ = CONFIGS["hierarchical"]
    batch = [*shared_prefix_prompts(seed=1), *shared_prefix_prompts(seed=2, prefix=30, tails=(5, 11))]
    settings = {"max_num_seqs": 2, "host_capacity_tokens": 160}

    def together(engine: Engine) -> dict[str, list[int]]:
        return run_batch(engine, batch, GREEDY)

    off = together(engine_for(sparse, False, **settings))
    engine = engine_for(sparse, True, **settings)
    assert together(engine) == off
    stats = engine.prefix_cache.stats
    assert stats.hits >= 2 and stats.evicted_pages > 0
    assert len(engine.prefix_cache._index_pages) == engine.prefix_cache.cached_pages()
    assert_no_keys_left(engine)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(data=st.data())
def test_random_arrivals_equal_the_cache_off(data) -> None:
    """Random prompts over three shared prefixes arriving at random steps, random output
    lengths, a host pool from tight to roomy, every configuration: cache on == cache off."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    reqs = draw_arrivals(data, [tokens(n, g) for n in (24, 33, 41)], g)
    host = data.draw(st.sampled_from([None, 128, 256]), label="host_capacity_tokens")
    sparse, extra = CONFIGS[data.draw(st.sampled_from(sorted(CONFIGS)), label="config")]
    settings_ = {**extra, "max_num_seqs": 2}
    if host is not None:
        settings_["host_capacity_tokens"] = host
    off, _ = arrivals(engine_for(sparse, False, **settings_), reqs)
    on, engine = arrivals(engine_for(sparse, True, **settings_), reqs)
    assert on == off and len(on) == len(reqs)
    assert_no_keys_left(engine)
