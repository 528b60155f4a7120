"""Driving the engine with its prefix cache on and off (one request after another, together,
a multi-turn chat, random arrivals) and checking that nothing is left once the cache is cleared:
shared by the prefix cache's tests (test_engine_prefix_cache*.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import load_model
from sparse_framework.engine.sampling import SamplingParams
from helpers import run_batch

VOCAB = 96  # the tiny Llama's (test_engine_prefix_cache.TINY)


GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def shared_prefix_prompts(seed: int = 0, prefix: int = 45, tails=(3, 9, 14, 6)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = tokens(prefix, g)
    return [system + tokens(n, g) for n in tails]


def engine_for(path, sparse: dict, cache: bool, **config) -> Engine:
    model = load_model(path, dtype=torch.float32)
    settings = {"max_num_seqs": 4, "max_model_len": 128, "max_num_batched_tokens": 16, **config}
    return Engine(model, model.config, sparse, EngineConfig(enable_prefix_caching=cache, **settings))


def one_after_another(engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    out = {}
    for i, p in enumerate(batch):
        poison_staging(engine)
        engine.add_request(f"r{i}", p, params)
        for o in engine.run_to_completion():
            assert o.finish_reason == "length", (o.request_id, o.error)
            out[o.request_id] = o.token_ids
    return out


def poison_staging(engine: Engine) -> None:
    """NaN over the idle prefill staging: what an earlier prompt left there (the same prefix
    at the same rows, here) must not stand in for the cached prefix's copy (or its indexer keys)."""
    staging = engine.runner.staging
    assert not staging.spans
    staging.k.fill_(float("nan"))
    for other in (staging.v, staging.index_k):  # V, or an MLA model's indexer keys
        if other is not None:
            other.fill_(float("nan"))


def together(engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    return run_batch(engine, batch, params)


def assert_empty_after_clear(engine: Engine) -> None:
    """No request left, no lock, and once the cache is cleared not a page held anywhere."""
    cache = engine.prefix_cache
    assert cache is not None and not cache.locked() and not engine.runner.requests
    assert cache.tree.protected_size() == 0
    cached = cache.cached_pages()
    store = engine.runner.coord.store
    assert store.host_alloc.used == cached  # every host page still taken is the cache's
    assert engine.clear_prefix_cache() == cached
    assert store.host_alloc.used == 0 and store.used_tokens() == 0
    assert cache.tree.num_nodes() == 0 and not engine.runner.staging.spans


def chat(engine: Engine, messages: list[list[int]], run) -> list[list[int]]:
    """A multi-turn chat: turn n's prompt is turn n-1's prompt + its output + messages[n], each
    turn run alone (`run(engine, rid, prompt)` -> its tokens); every turn's output."""
    history, outputs = [], []
    for turn, message in enumerate(messages):
        history = history + message
        out = run(engine, f"t{turn}", history)
        outputs.append(out)
        history = history + out
    return outputs


def chat_prompt_lens(messages: list[list[int]]) -> list[int]:
    """Each turn's prompt length in `chat` (GREEDY's max_tokens per answer)."""
    lens, history = [], 0
    for message in messages:
        lens.append(history + len(message))
        history = lens[-1] + GREEDY.max_tokens
    return lens


def chat_hit_tokens(lens: list[int], page: int = 4) -> int:
    """Prompt tokens a chat's turns find in a cache holding every whole page of the previous
    turn's K/V: its prompt and all its outputs but the last (whose K/V is never written)."""
    return sum(min(prev + GREEDY.max_tokens - 1, cur - 1) // page * page for prev, cur in zip(lens, lens[1:]))


def one_after_another_one(engine: Engine, rid: str, prompt: list[int],
                          poison: Callable[[Engine], None] | None = None) -> list[int]:
    """One request run alone (greedy, to its length) on `engine`, the idle staging poisoned
    first (`poison_staging`, or `poison`: a hybrid's ring too); its output tokens."""
    (poison or poison_staging)(engine)
    engine.add_request(rid, prompt, GREEDY)
    (out,) = engine.run_to_completion()
    assert out.finish_reason == "length", out.error
    return out.token_ids


def draw_arrivals(data, heads: list[list[int]], g: torch.Generator) -> list[tuple[list[int], int, int]]:
    """2-6 requests: (one of the shared prefixes + a tail of 1-12 tokens, max_tokens 1-8, the
    step it arrives at 0-4)."""
    n = data.draw(st.integers(2, 6), label="requests")
    return [(heads[data.draw(st.integers(0, len(heads) - 1))] + tokens(data.draw(st.integers(1, 12)), g),
             data.draw(st.integers(1, 8)), data.draw(st.integers(0, 4))) for _ in range(n)]


def arrivals(engine: Engine, reqs: list[tuple[list[int], int, int]]) -> tuple[dict[str, list[int]], Engine]:
    """Add each request at its step, greedy, and run until all are done: tokens by request."""
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    out, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        for o in engine.step():
            assert o.finish_reason == "length", o.error
            out[o.request_id] = o.token_ids
        step += 1
    return out, engine
