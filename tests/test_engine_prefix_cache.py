"""The engine's prefix cache (engine/prefix_cache.py, issue 21 items 2 and 3): outputs with the
cache on equal those with it off, token for token (greedy), for requests sharing a long prefix
arriving one after another and together, a multi-turn chat, preemption, eviction under a small
host pool, async scheduling, sparse / dense-mode / resident configurations and SnapKV; the
prefill tokens saved are counted; every pool is empty once the requests are done and the cache
cleared; unsupported settings are refused by name. Plus the store's borrowed host pages."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_framework import ConfigError
from sparse_framework.common.batch import Request
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import load_model
from sparse_framework.engine.sampling import SamplingParams
from helpers import HIERARCHICAL_ALWAYS
from prefix_cache_driver import (
    GREEDY, VOCAB, arrivals, assert_empty_after_clear, chat, chat_hit_tokens, chat_prompt_lens, draw_arrivals, engine_for,
    one_after_another, one_after_another_one, shared_prefix_prompts, together, tokens,
)

TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10_000.0, eos_token_id=None,
            bos_token_id=None, pad_token_id=None)
FULL = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 256, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
        "device_buffer_tokens": 512, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
SMALL = {**FULL, "top_k": 8, "device_buffer_tokens": 48}  # a budget that binds: real selections
CONFIGS = {
    "sparse-full-budget": (FULL, {}),
    "sparse-small-budget": (SMALL, {}),
    "dense-mode": ({**FULL, "min_sparse_prompt_len": 1000}, {}),
    "resident": ({**FULL, "store": "resident"}, {"host_capacity_tokens": 1024}),
    # the hybrid store: whole requests export their pages to the cache; in a pool of about two
    # whole requests, admissions spill and spilled requests lend their host pages
    "hybrid": ({**SMALL, "store": "hybrid"}, {}),
    "hybrid-tight": ({**SMALL, "store": "hybrid", "device_buffer_tokens": 28}, {"device_capacity_tokens": 96}),
    "pqcache": ({**SMALL, "algorithm": "pqcache", "top_k": 12, "extra": {}}, {}),
    "dsa-keys": ({**SMALL, "algorithm": "dsa", "top_k": 12, "extra": {"source": "keys"}}, {}),
    "snapkv": ({**FULL, "algorithm": "snapkv", "top_k": 12, "device_buffer_tokens": 48, "extra": {"window": 6}}, {}),
}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    out = tmp_path_factory.mktemp("llama")
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_on_equals_cache_off_one_after_another(path, name) -> None:
    """Requests sharing a 45-token prefix, each arriving after the one before finished: every
    one after the first takes the prefix (and its predecessors' shared whole pages) from the
    cache, and generates exactly what it does without the cache."""
    sparse, extra = CONFIGS[name]
    batch = shared_prefix_prompts()
    off = one_after_another(engine_for(path, sparse, False, **extra), batch)
    engine = engine_for(path, sparse, True, **extra)
    on = one_after_another(engine, batch)
    assert on == off
    stats = engine.prefix_cache.stats
    usable = engine.prefix_cache.usable_tokens
    assert stats.lookups == len(batch) and stats.prompt_tokens == sum(map(len, batch))
    # each later prompt finds at least the prefix's whole pages (44 tokens), within its usable part
    assert stats.hits == len(batch) - 1
    assert stats.hit_tokens >= sum(min(44, usable(len(p))) for p in batch[1:])
    # the saved tokens were not prefilled: the steps ran exactly the rest of the prompts
    assert sum(step[1] for step in engine.step_log) == stats.prompt_tokens - stats.hit_tokens
    assert_empty_after_clear(engine)


@pytest.mark.parametrize("name", ["sparse-small-budget", "dense-mode", "hybrid-tight"])
def test_cache_on_equals_cache_off_arriving_together(path, name) -> None:
    """All requests queued at once, two running at a time: the later ones are admitted after
    the first prompts were handed over, so they hit pages inserted while those still decode."""
    sparse, extra = CONFIGS[name]
    batch = shared_prefix_prompts(seed=1)
    off = together(engine_for(path, sparse, False, max_num_seqs=2, **extra), batch)
    engine = engine_for(path, sparse, True, max_num_seqs=2, **extra)
    assert together(engine, batch) == off
    assert engine.prefix_cache.stats.hits >= 2
    if name == "hybrid-tight":
        assert engine.runner.coord.store.spill_count > 0
    assert_empty_after_clear(engine)


@pytest.mark.parametrize("name", ["sparse-full-budget", "dense-mode"])
def test_multi_turn_chat_reuses_prompt_and_generated_tokens(path, name) -> None:
    """Turn n+1's prompt is turn n's prompt + its output + a new user message: the cache
    holds the generated tokens too, so each turn recomputes only the last partial page of the
    previous turn and the new message."""
    sparse, extra = CONFIGS[name]
    g = torch.Generator().manual_seed(2)
    messages = [tokens(n, g) for n in (21, 7, 10, 5)]
    off = chat(engine_for(path, sparse, False, **extra), messages, one_after_another_one)
    engine = engine_for(path, sparse, True, **extra)
    assert chat(engine, messages, one_after_another_one) == off
    stats = engine.prefix_cache.stats
    lens = chat_prompt_lens(messages)
    assert stats.hit_tokens == chat_hit_tokens(lens) > 0
    assert stats.prompt_tokens == sum(lens)
    assert_empty_after_clear(engine)


@pytest.mark.parametrize("chunk", [8, 64])
def test_preemption_with_the_cache_on(path, chunk) -> None:
    """A device pool too small for every request to grow (dense-mode requests grow on the
    device): preempted-and-resumed requests with cached prefixes give the outputs of a roomy
    run without the cache."""
    sparse = {**SMALL, "min_sparse_prompt_len": 1000}
    batch = shared_prefix_prompts(seed=3, prefix=32, tails=(8, 12, 16, 10))
    params = SamplingParams(max_tokens=30, temperature=0.0)
    roomy = together(engine_for(path, sparse, False, max_num_batched_tokens=32), batch, params)
    tight = engine_for(path, sparse, True, device_capacity_tokens=160, max_num_batched_tokens=32,
                       max_prefill_chunk=chunk)
    # the first request alone fills the cache, the others then arrive together
    outs = together_all(tight, batch[:1], params)
    for i, p in enumerate(batch[1:], start=1):
        tight.add_request(f"r{i}", p, params)
    outs += tight.run_to_completion()
    assert all(o.finish_reason == "length" for o in outs)
    got = {o.request_id: o.token_ids for o in outs}
    assert tight.scheduler.num_preemptions > 0
    assert tight.prefix_cache.stats.hits >= 1
    assert got == roomy
    assert_empty_after_clear(tight)


@pytest.mark.parametrize("host_tokens", [80, 160, 240])
def test_dense_requests_hits_keep_every_host_promise(path, host_tokens) -> None:
    """A dense-mode request that hits copies its prefix into its staging but holds no host
    page: preempted, it copies its whole context to new host pages, so its promise covers its
    whole life, cached prefix included. After every scheduling step the free host pages cover
    every promise (the budget's headroom is never negative) — before the fix a hit shrank a
    dense request's promise by its cached pages — and where its own prefix lock kept the room
    it needs, it is admitted without the cache instead of failing; outputs equal the cache off."""
    sparse = {**SMALL, "min_sparse_prompt_len": 1000}
    batch = shared_prefix_prompts(seed=3, prefix=32, tails=(8, 12, 16, 10))
    params = SamplingParams(max_tokens=30, temperature=0.0)
    roomy = together(engine_for(path, sparse, False, max_num_batched_tokens=32), batch, params)
    tight = engine_for(path, sparse, True, device_capacity_tokens=160, max_num_batched_tokens=32,
                       max_prefill_chunk=8, host_capacity_tokens=host_tokens)
    schedule, headrooms = tight.scheduler.schedule, []

    def checked(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        headrooms.append(tight.budget.headroom())
        return plan

    tight.scheduler.schedule = checked
    outs = together_all(tight, batch[:1], params)
    for i, p in enumerate(batch[1:], start=1):
        tight.add_request(f"r{i}", p, params)
    outs += tight.run_to_completion()
    assert all(o.finish_reason == "length" for o in outs), [(o.request_id, o.error) for o in outs]
    assert {o.request_id: o.token_ids for o in outs} == roomy
    assert headrooms and min(headrooms) >= 0
    assert_empty_after_clear(tight)


def test_eviction_under_a_small_host_pool(path) -> None:
    """A host pool of 96 tokens (24 pages) for sparse requests of up to 69 tokens: the cache
    must give pages back (least recently used first) to admit the next request, and outputs
    stay those of the cache off."""
    g = torch.Generator().manual_seed(4)
    groups = [tokens(36, g) for _ in range(3)]
    batch = [groups[i % 3] + tokens(5 + i, g) for i in range(6)]
    extra = {"host_capacity_tokens": 96, "max_num_seqs": 1}
    off = one_after_another(engine_for(path, SMALL, False, **extra), batch)
    engine = engine_for(path, SMALL, True, **extra)
    assert one_after_another(engine, batch) == off
    stats = engine.prefix_cache.stats
    assert stats.evicted_pages > 0
    assert engine.runner.coord.store.host_alloc.used <= engine.runner.coord.store.host_alloc.num_pages
    assert_empty_after_clear(engine)


def test_async_scheduling_with_the_cache(path) -> None:
    """Async scheduling (outputs still on the device when a request ends: only the tokens
    read are cached) gives the outputs of the synchronous loop without the cache."""
    batch = shared_prefix_prompts(seed=5)
    params = SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[7])
    off = {o.request_id: o.token_ids for o in together_all(engine_for(path, FULL, False, async_scheduling=False), batch, params)}
    engine = engine_for(path, FULL, True, async_scheduling=True, max_num_seqs=2)
    on = {o.request_id: o.token_ids for o in together_all(engine, batch, params)}
    assert on == off
    assert engine.prefix_cache.stats.hits > 0
    assert_empty_after_clear(engine)


def together_all(engine: Engine, batch, params):
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    return engine.run_to_completion()


def test_abort_releases_the_lock_and_the_pages(path) -> None:
    batch = shared_prefix_prompts(seed=6)
    engine = engine_for(path, FULL, True)
    one_after_another(engine, batch[:1])
    engine.add_request("a", batch[1], GREEDY)
    engine.add_request("b", batch[2], GREEDY)
    engine.step()
    engine.step()
    assert engine.prefix_cache.locked()
    engine.abort("a")
    engine.run_to_completion()
    assert_empty_after_clear(engine)


def test_refused_settings_are_named(path) -> None:
    with pytest.raises(ConfigError, match="resident.*host_capacity_tokens"):
        engine_for(path, {**FULL, "store": "resident"}, True)


def test_prefix_longer_than_the_prompt_is_never_used(path) -> None:
    """A prompt that is all cached still computes its last token (the first output's
    logits): the hit stops a page short of it."""
    g = torch.Generator().manual_seed(7)
    prompt = tokens(40, g)
    engine = engine_for(path, FULL, True)
    first = one_after_another_one(engine, "a", prompt)
    again = one_after_another_one(engine, "b", prompt)
    assert again == first
    assert engine.prefix_cache.stats.hit_tokens == 36  # 39 usable tokens -> 9 whole pages
    assert_empty_after_clear(engine)


# -- the store's borrowed host pages --------------------------------------------------------

def _store():
    from sparse_framework.common.layout import KVLayout
    from sparse_framework.kv_store.hierarchical import HierarchicalKVStore
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    return HierarchicalKVStore(layout, page_size=4, device_buffer_tokens=16, sink_tokens=4, recent_tokens=4,
                               max_requests=2, max_seq_len=32, host_capacity_tokens=64, min_sparse_prompt_len=0)


def test_borrowed_pages_are_read_not_written_nor_freed() -> None:
    store = _store()
    a = Request("a", 10, slot=0)
    store.admit(a)
    a.seq_len = 10
    k = torch.randn(10, 2, 4)
    v = torch.randn(10, 2, 4)
    for layer in range(2):
        store.write_prefill(layer, a, k * (layer + 1), v * (layer + 1))
    shared = store.host_page_ids(a)[:2]
    store.lend_host_pages(a, shared)
    store.release(a)
    assert store.host_alloc.used == 2  # the two lent pages stay
    b = Request("b", 12, slot=1, cached_len=8)
    store.admit(b, shared)
    assert torch.equal(store.host_page_ids(b)[:2], shared) and store.host_alloc.used == 3
    b.seq_len = 12
    for layer in range(2):  # different values for the cached part: must not land on the shared pages
        store.write_prefill(layer, b, torch.zeros(12, 2, 4), torch.zeros(12, 2, 4))
    staged = [torch.zeros(2, 10, 2, 4), torch.zeros(2, 10, 2, 4)]
    store.load_pages(shared, staged, start=1)
    for layer in range(2):
        assert torch.equal(staged[0][layer, 1:9], k[:8] * (layer + 1))
        assert torch.equal(staged[1][layer, 1:9], v[:8] * (layer + 1))
        assert torch.equal(store.read(layer, b)[0][:8], k[:8] * (layer + 1))
        assert torch.equal(store.read(layer, b)[0][8:], torch.zeros(4, 2, 4))
    store.release(b)
    assert store.host_alloc.used == 2
    store.release_host_pages(shared)
    assert store.host_alloc.used == 0


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow], database=None)
@given(data=st.data())
def test_random_arrivals_with_shared_prefixes_equal_the_cache_off(path, data) -> None:
    """Random prompts drawn as a shared prefix (of 3) plus a tail, arriving at random steps,
    with random output lengths and a host pool from tight to roomy: cache on == cache off, and
    nothing is held once the cache is cleared."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    reqs = draw_arrivals(data, [tokens(n, g) for n in (24, 33, 41)], g)
    n = len(reqs)
    host = data.draw(st.sampled_from([None, 128, 256]), label="host_capacity_tokens")
    sparse = data.draw(st.sampled_from(["sparse-small-budget", "dense-mode"]), label="config")

    def make(cache: bool) -> Engine:
        return engine_for(path, CONFIGS[sparse][0], cache, max_num_seqs=2, host_capacity_tokens=host)

    off, _ = arrivals(make(False), reqs)
    on, engine = arrivals(make(True), reqs)
    assert on == off and len(on) == n
    assert_empty_after_clear(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["sparse-small-budget", "dense-mode", "resident"])
def test_cache_on_equals_cache_off_on_cuda(path, name) -> None:
    """The CUDA path with the cache: Triton kernels, pinned host pool (hits copied from it into
    the staging), whole-step CUDA graphs and async scheduling, float32 (TF32 off): requests
    sharing a prefix, arriving together and one after another, equal the cache off."""
    sparse, extra = CONFIGS[name]
    sparse = {**sparse, "backend": "triton"}
    settings = {"cuda_graphs": True, "async_scheduling": True, **extra}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        def make(cache: bool) -> Engine:
            model = load_model(path, dtype=torch.float32, device="cuda")
            config = {"max_num_seqs": 4, "max_model_len": 128, "max_num_batched_tokens": 16, **settings}
            return Engine(model, model.config, sparse, EngineConfig(enable_prefix_caching=cache, **config))

        batch = shared_prefix_prompts(seed=4)
        off = one_after_another(make(False), batch)
        engine = make(True)
        assert one_after_another(engine, batch) == off
        assert engine.prefix_cache.stats.hits == len(batch) - 1
        assert together(make(True), shared_prefix_prompts(seed=5)) == together(make(False), shared_prefix_prompts(seed=5))
        assert_empty_after_clear(engine)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
