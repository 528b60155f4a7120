"""The prefix cache with hybrid sliding-window models (engine/prefix_cache.py, issue 21): a
Mistral with a window (every layer slides), Gemma 2 (sliding and full layers, soft-caps), Qwen2
with `use_sliding_window`, Gemma 3 and a Mistral whose window is not a whole number of pages. Outputs with the cache on equal those with
it off, token for token (greedy), for prompts sharing a prefix several windows long (a shared
system prompt with distinct questions, prompts extending each other) arriving one after
another, a multi-turn chat and requests arriving together; with the windows' SWA pages freed
(`evict_swa`) the match falls back to a shorter prefix or none and outputs still equal; every
pool (host pages, SWA pages, ring rows' requests) is empty once the cache is cleared. Plus the
ring with slots beyond its window against the plain ring."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_model
from prefix_cache_driver import (
    chat,
    chat_hit_tokens,
    chat_prompt_lens,
    engine_for,
    one_after_another_one,
    poison_staging,
)

from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import load_model
from sparse_framework.engine.sampling import SamplingParams
from sparse_framework.kv_store.sliding_window import SlidingWindowKV
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

VOCAB = 96
MODELS = {  # name -> (config class, model class, extra); page size 4 below
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=8, query_pre_attn_scalar=16,
                                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "mistral-w6": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),  # 1.5 pages
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",  # full, full, S, S
              dict(sliding_window=8, use_sliding_window=True, max_window_layers=2)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",  # S, S, F, S; two RoPE bases
               dict(sliding_window=8, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])),
}
FULL = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 256, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
        "device_buffer_tokens": 512, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
CONFIGS = {
    "sparse-full-budget": (FULL, {}),
    "dense-mode": ({**FULL, "min_sparse_prompt_len": 1000}, {}),
    "resident": ({**FULL, "store": "resident"}, {"host_capacity_tokens": 1024}),
}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, spec in MODELS.items():
        model = tiny_hf_model(*spec)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = path
    return out


def tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def poison(engine: Engine) -> None:
    """NaN over the idle staging and the whole ring: what earlier requests left in the ring
    row must not stand in for the window a hit restores (every slot a chunk reads is written)."""
    poison_staging(engine)
    ring = engine.runner.ring
    assert ring is not None
    for t in (ring.k, ring.v):
        if t is not None:
            t.fill_(float("nan"))


def run_one(engine: Engine, rid: str, prompt: list[int]) -> list[int]:
    return one_after_another_one(engine, rid, prompt, poison)


def one_after_another(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    return [run_one(engine, f"r{i}", p) for i, p in enumerate(batch)]


def assert_empty_after_clear(engine: Engine) -> None:
    """No request, no lock; once the cache is cleared no host page, no SWA page, no node."""
    cache = engine.prefix_cache
    assert cache is not None and not cache.locked() and not engine.runner.requests
    assert cache.tree.protected_size() == 0 and cache.tree.protected_swa_size() == 0
    store = engine.runner.coord.store
    cached = cache.cached_pages()
    assert store.host_alloc.used == cached
    assert len(cache.swa) == cache.tree.evictable_swa_size()  # every SWA page held is the tree's
    assert engine.clear_prefix_cache() == cached
    assert store.host_alloc.used == 0 and store.used_tokens() == 0
    assert len(cache.swa) == 0 and cache.tree.num_nodes() == 0
    assert not engine.runner.staging.spans and not cache._chunk_windows and not cache._windows


def shared_system_prompt(seed: int) -> list[list[int]]:
    """A 45-token system prompt (5.6 windows of 8) + distinct questions, and prompts that
    extend earlier ones (few-shot growth)."""
    g = torch.Generator().manual_seed(seed)
    system = tokens(45, g)
    a = system + tokens(9, g)
    return [a, system + tokens(3, g), a + tokens(14, g), system + tokens(6, g), a + tokens(5, g)]


@pytest.mark.parametrize("config", [c if c == "sparse-full-budget" else pytest.param(c, marks=pytest.mark.slow)
                                    for c in CONFIGS])  # dense mode, resident: -m slow
@pytest.mark.parametrize("name", list(MODELS))
def test_cache_on_equals_cache_off_one_after_another(checkpoints, name: str, config: str) -> None:
    sparse, extra = CONFIGS[config]
    batch = shared_system_prompt(seed=0)
    off = one_after_another(engine_for(checkpoints[name], sparse, False, **extra), batch)
    engine = engine_for(checkpoints[name], sparse, True, **extra)
    assert one_after_another(engine, batch) == off
    stats = engine.prefix_cache.stats
    assert stats.lookups == len(batch) and stats.hits == len(batch) - 1
    # a question after the system prompt finds at least the window snapshot at the last
    # chunk end inside it (chunks of 16: 32 tokens); an extension finds its predecessor's prompt
    assert stats.hit_tokens >= 3 * 32 + 52
    assert sum(step[1] for step in engine.step_log) == stats.prompt_tokens - stats.hit_tokens
    assert_empty_after_clear(engine)


@pytest.mark.parametrize("name", list(MODELS))
def test_multi_turn_chat(checkpoints, name: str) -> None:
    """Turn n+1's prompt is turn n's prompt + output + a new message: every whole page of the
    previous turn's K/V (but its last token's) comes from the cache, window included."""
    g = torch.Generator().manual_seed(2)
    messages = [tokens(n, g) for n in (21, 7, 10, 5)]
    off = chat(engine_for(checkpoints[name], FULL, False), messages, run_one)
    engine = engine_for(checkpoints[name], FULL, True)
    assert chat(engine, messages, run_one) == off
    assert engine.prefix_cache.stats.hit_tokens == chat_hit_tokens(chat_prompt_lens(messages)) > 0
    assert_empty_after_clear(engine)


def all_at_once(engine: Engine, batch: list[list[int]]) -> dict[str, list[int]]:
    """Every prompt queued at once, run to completion: tokens by request id."""
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, GREEDY)
    outs = engine.run_to_completion()
    assert all(o.finish_reason == "length" for o in outs)
    return {o.request_id: o.token_ids for o in outs}


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_arriving_together(checkpoints, name: str) -> None:
    """Two running at a time: later requests hit windows inserted while others still decode."""
    batch = shared_system_prompt(seed=1)
    off = all_at_once(engine_for(checkpoints[name], FULL, False, max_num_seqs=2), batch)
    engine = engine_for(checkpoints[name], FULL, True, max_num_seqs=2)
    assert all_at_once(engine, batch) == off
    assert engine.prefix_cache.stats.hits >= 2
    assert_empty_after_clear(engine)


@pytest.mark.parametrize("config", ["sparse-full-budget", "dense-mode"])
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_freed_windows_fall_back_to_a_shorter_prefix_or_none(checkpoints, name: str, config: str) -> None:
    """`evict_swa` frees the least recently used windows: after one 57-token request (windows
    at its chunk ends 16, 32, 48, its prompt's end 56 and its K/V's end 64, touched root
    first) freeing 4 pages turns the windows at 16 and 32 into tombstones. A prompt sharing
    40 tokens then matches nothing (its last window is freed), the same prompt again still
    matches 56 through the tombstones, and with every window freed nothing matches. Outputs
    equal the cache off throughout."""
    sparse, extra = CONFIGS[config]
    g = torch.Generator().manual_seed(5)
    b = tokens(57, g)
    c = b[:40] + tokens(9, g)
    off = one_after_another(engine_for(checkpoints[name], sparse, False, **extra), [b, c])
    engine = engine_for(checkpoints[name], sparse, True, **extra)
    cache, tree = engine.prefix_cache, engine.prefix_cache.tree
    assert run_one(engine, "b", b) == off[0]
    assert cache.evict_swa(4) == 4
    assert sum(n.tombstone for n in tree.iter_nodes()) >= 2 and tree.match_prefix(c).raw_pages == 10
    assert run_one(engine, "c", c) == off[1]
    assert cache.stats.hits == 0 and cache.stats.swa_lost_pages >= 10
    assert run_one(engine, "b2", b) == off[0]
    assert cache.stats.hit_tokens == 56  # through the tombstones to the window at 56
    assert cache.evict_swa(len(cache.swa)) > 0 and len(cache.swa) == 0
    assert run_one(engine, "b3", b) == off[0]
    assert cache.stats.hits == 1  # no window left: b3 computed everything
    assert_empty_after_clear(engine)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_async_scheduling_and_preemption(checkpoints, name: str) -> None:
    """Async scheduling (a finishing request's last outputs may be unknown: only its known
    tokens are cached), and a device pool too small for every dense-mode request to grow
    (requests preempted while prefilling drop their chunk windows and match again on
    resumption; a model with full-attention layers): outputs of a roomy synchronous run
    without the cache."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    batch = shared_system_prompt(seed=4)
    dense = CONFIGS["dense-mode"][0]

    def together(engine: Engine, first: int = 0) -> dict[str, list[int]]:
        outs = []
        for i, p in enumerate(batch):
            engine.add_request(f"r{i}", p, params)
            if i < first:
                outs += engine.run_to_completion()
        outs += engine.run_to_completion()
        assert all(o.finish_reason == "length" for o in outs)
        return {o.request_id: o.token_ids for o in outs}

    roomy = together(engine_for(checkpoints[name], dense, False, async_scheduling=False))
    engine = engine_for(checkpoints[name], dense, True, async_scheduling=True, max_num_seqs=2)
    assert together(engine, first=1) == roomy
    assert engine.prefix_cache.stats.hits > 0
    assert_empty_after_clear(engine)
    if not engine.runner.layers.full:
        return  # every layer slides (Mistral): no device pool to run short of
    tight = engine_for(checkpoints[name], dense, True, device_capacity_tokens=160, max_prefill_chunk=8)
    assert together(tight, first=1) == roomy
    assert tight.scheduler.num_preemptions > 0 and tight.prefix_cache.stats.hits > 0
    assert_empty_after_clear(tight)


def test_swa_limit_evicts_least_recently_used_windows(checkpoints) -> None:
    """With room for 4 SWA pages the cache frees older windows as new ones come: outputs stay
    those of the cache off and the SWA pages held never exceed the limit after an insertion."""
    batch = shared_system_prompt(seed=3)
    off = one_after_another(engine_for(checkpoints["mistral"], FULL, False), batch)
    engine = engine_for(checkpoints["mistral"], FULL, True)
    cache = engine.prefix_cache
    cache.swa_limit_pages = 4
    got = []
    for i, p in enumerate(batch):
        got.append(run_one(engine, f"r{i}", p))
        assert len(cache.swa) <= 4
    assert got == off
    assert cache.stats.swa_evicted_pages > 0
    assert_empty_after_clear(engine)


# -- the ring with slots beyond its window ----------------------------------------------------

@pytest.mark.parametrize("slots", [8, 12, 13])
def test_ring_with_extra_slots_attends_like_the_plain_ring(slots: int) -> None:
    """Decode attention, the window read back and positions still held equal a plain ring's
    (window slots) at every length: the extra slots are masked out."""
    g = torch.Generator().manual_seed(slots)
    window, n = 8, 30
    plain = SlidingWindowKV(1, window, 2, 2, 4)
    wide = SlidingWindowKV(1, window, 2, 2, 4, slots=slots)
    k, v = torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g)
    for ring in (plain, wide):
        ring.write_prefill(0, 1, k[:5], v[:5])
    for t in range(5, n):
        rows, pos = torch.tensor([1]), torch.tensor([t])
        q = torch.randn(1, 4, 4, generator=g)
        outs = []
        for ring in (plain, wide):
            ring.write_decode(0, rows, pos, k[t:t + 1], v[t:t + 1])
            outs.append(ring.attend(0, q, rows, pos + 1, 0.5, softcap=2.0))
        torch.testing.assert_close(outs[1], outs[0])
        lo = max(0, t + 1 - window)  # plain reference: each q head over its kv head's window
        keys, values = k[lo:t + 1].repeat_interleave(2, 1), v[lo:t + 1].repeat_interleave(2, 1)
        logits = 2.0 * torch.tanh(0.5 * torch.einsum("hd,jhd->hj", q[0], keys) / 2.0)
        ref = torch.einsum("hj,jhd->hd", torch.softmax(logits, -1), values)
        torch.testing.assert_close(outs[1][0], ref, atol=1e-5, rtol=1e-5)
        rk, _ = wide.window_kv(0, 1, t + 1)
        torch.testing.assert_close(rk, k[lo:t + 1])
        oldest = max(0, t + 1 - slots)
        torch.testing.assert_close(wide.read(0, 1, oldest, t + 1)[1], v[oldest:t + 1])


def test_memory_plan_counts_the_ring_page_of_slack(checkpoints) -> None:
    """With the cache on a ring row holds window + page_size slots of every sliding layer; the
    plan's device bytes per request count that page, and the engine's ring is that size."""
    model = load_model(checkpoints["gemma3"], dtype=torch.float32)
    c = model.config
    settings = dict(max_num_seqs=2, max_model_len=128, gpu_memory_utilization=0.5, device_memory_bytes=2**30,
                    host_memory_bytes=2**30)
    off = Engine(model, c, FULL, EngineConfig(**settings))
    on = Engine(model, c, FULL, EngineConfig(enable_prefix_caching=True, **settings))
    page_bytes = 2 * 3 * FULL["page_size"] * c.num_kv_heads * c.head_dim * 4  # 3 sliding layers, K and V
    assert on.memory_plan.device_bytes_per_request == off.memory_plan.device_bytes_per_request + page_bytes
    assert on.runner.ring.slots == 8 + FULL["page_size"]
    assert on.runner.ring.nbytes == on.num_seqs * c.sliding_ring_bytes(torch.float32, 128, FULL["page_size"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_cache_on_equals_cache_off_on_cuda(checkpoints, name) -> None:
    """On CUDA the window snapshots are copied to pinned host memory without waiting for the
    device (read after an event at the next hit): a shared system prompt, one request after
    another and then together, float32 (TF32 off), Triton, async scheduling: equal to the cache off."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        def make(cache: bool) -> Engine:
            model = load_model(checkpoints[name], dtype=torch.float32, device="cuda")
            settings = {"max_num_seqs": 4, "max_model_len": 128, "max_num_batched_tokens": 16,
                        "async_scheduling": True}
            return Engine(model, model.config, {**FULL, "backend": "triton"},
                          EngineConfig(enable_prefix_caching=cache, **settings))

        batch = shared_system_prompt(seed=5)
        engine = make(True)
        assert one_after_another(engine, batch) == one_after_another(make(False), batch)
        assert engine.prefix_cache.stats.hits > 0
        assert all_at_once(make(True), batch) == all_at_once(make(False), batch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
