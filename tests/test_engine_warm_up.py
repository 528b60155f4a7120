"""The engine's warm start (engine/warm_up.py): forced on the CPU, the warm-up runs every batch
bucket's decode step over dummy requests and leaves nothing behind — no request, page, cache
entry, logged step or counted work — so that outputs are those of an engine never warmed up;
the progress callback sees every bucket; LLM, the CLI flag and the server's /health follow it."""

from __future__ import annotations

import argparse
import threading
import time

import pytest
import torch

from sparse_framework import ConfigError
from sparse_framework.engine import LLM
from sparse_framework.cli import engine as engine_command
from sparse_framework.engine.models.random_shapes import RANDOM_MODELS, random_model_config
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import ModelConfig, random_model
from sparse_framework.engine.sampling import SamplingParams
from sparse_framework.engine.warm_up import bar_text, buckets
from helpers import HIERARCHICAL_ALWAYS, run_batch

TINY = ModelConfig.from_hf(RANDOM_MODELS["tiny"])
QUEST = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 8, "page_size": 4, "sink_tokens": 4, "recent_tokens": 4,
         "device_buffer_tokens": 32, "min_sparse_prompt_len": 24}  # prompts under 24 tokens decode densely
CONFIGS = {
    "quest": (QUEST, {}),
    "resident": ({**QUEST, "store": "resident"}, {"host_capacity_tokens": 1024}),
    "prefix-cache": (QUEST, {"enable_prefix_caching": True}),
    "dsa-keys": ({**QUEST, "algorithm": "dsa", "top_k": 12, "min_sparse_prompt_len": 0, "extra": {"source": "keys"}},
                 {}),
    "pqcache": ({**QUEST, "algorithm": "pqcache", "top_k": 12, "extra": {}}, {}),
    "snapkv": ({**QUEST, "algorithm": "snapkv", "top_k": 12, "extra": {"window": 6}}, {}),
}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_model(TINY, "float32", "cpu")


@pytest.fixture(scope="module")
def deepseek():
    """DeepSeek-V3.2 at test scale (MLA, the lightning indexer, MoE) and its DSA config."""
    torch.manual_seed(0)
    config = ModelConfig.from_hf(RANDOM_MODELS["deepseek-v3.2-tiny"])
    return random_model(config, "float32", "cpu"), random_model_config("deepseek-v3.2-tiny", "cpu")


def engine_for(model, sparse: dict = QUEST, **config) -> Engine:  # type: ignore[no-untyped-def]
    return Engine(model, model.config, sparse, EngineConfig(**{"max_num_seqs": 4, "max_model_len": 96,
                                                      "max_num_batched_tokens": 40, "warm_up": True, **config}))


def prompts(lens: tuple[int, ...] = (10, 30, 45, 70, 18), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]  # within both vocabularies


def run(engine: Engine, batch: list[list[int]], prefix: str = "r") -> dict[str, list[int]]:
    return run_batch(engine, batch, GREEDY, prefix)


def state(engine: Engine) -> dict:
    """Everything of the engine a warm-up must leave as it was."""
    coord, store, sched = engine.runner.coord, engine.runner.coord.store, engine.scheduler
    tally = coord.dense_tally
    cache = engine.prefix_cache
    return {
        "used_tokens": store.used_tokens(), "host_pages_used": store.host_alloc.used,
        "runner_requests": dict(engine.runner.requests), "coord_requests": dict(coord.requests),
        "free_slots": list(coord.lifecycle.free_slots), "staging": dict(engine.runner.staging.spans),
        "tally": (tally.requests, dict(tally.dense_requests), tally.layer_steps, dict(tally.dense_layer_steps)),
        "counts": store.counts.tolist(), "rows_out": store.rows_out.tolist(), "clock": int(store.clock),
        "steps": engine.steps, "step_log": list(engine.step_log), "unfinished": engine.has_unfinished(),
        "scheduler": (len(sched.waiting), len(sched.running), len(sched.preempted), sched.num_preemptions),
        "cache": None if cache is None else (cache.cached_pages(), cache.stats.as_dict()),
        "hooks": (engine.runner.chunk_hook, engine.runner.commit_hook), "timing": store.timing,
        "cache_index_keys": None if cache is None else dict(cache._prompt_index),  # a commit hook's copies
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_outputs_after_the_warm_up_equal_those_of_an_engine_without_it(model, name) -> None:
    """Greedy outputs of a few requests (dense and sparse rows, chunked prefill, preemption-free)
    are those of a fresh engine never warmed up, for every algorithm and store."""
    sparse, config = CONFIGS[name]
    cold = run(engine_for(model, sparse, **config), prompts())
    warm = engine_for(model, sparse, **config)
    report = warm.warm_up()
    assert report.steps == len(report.buckets) > 0 and not report.skipped
    assert run(warm, prompts()) == cold


@pytest.mark.parametrize("case", ["sparse-and-dense-rows", "sparse-rows", "deepseek-v3.2"])
def test_the_warm_up_leaves_the_engine_as_it_was(model, deepseek, case) -> None:
    """After some user work (so that the counters are not all zero), a warm-up changes no
    request, page, slot order, staging span, prefix-cache entry or statistic, no scheduler
    queue, logged step or counter of user work, and the runner's hooks are back (DeepSeek's
    commit hook would copy the dummies' indexer keys into the prefix cache)."""
    if case == "deepseek-v3.2":
        model, sparse = deepseek
    else:
        sparse = QUEST if case == "sparse-and-dense-rows" else {**QUEST, "min_sparse_prompt_len": 0}
    engine = engine_for(model, sparse, enable_prefix_caching=True)
    first = run(engine, prompts(seed=1), prefix="u")
    before = state(engine)
    assert before["steps"] > 0 and before["tally"][0] > 0 and before["cache"][0] > 0  # something to keep
    report = engine.warm_up()
    assert state(engine) == before
    assert engine.warm_up_report is report and report.graph_bytes_measured is None  # no CUDA: nothing measured
    # and it serves on as before: the same prompts again (now partly from the prefix cache)
    assert run(engine, prompts(seed=1), prefix="u") == first


def test_progress_sees_every_bucket_in_order_with_a_total(model) -> None:
    """Largest batch first, all-sparse rows then all-dense rows (the config decodes short prompts
    densely), each announced before it runs, then "done"; the bar's text says which."""
    engine = engine_for(model)
    calls: list[tuple[int, int, str]] = []
    report = engine.warm_up(lambda done, total, label: calls.append((done, total, label)))
    want = [(4, False), (3, False), (2, False), (1, False), (4, True), (3, True), (2, True), (1, True)]
    assert list(report.buckets) == buckets(engine) == want
    assert [c[:2] for c in calls] == [(i, 8) for i in range(9)]
    assert [c[2] for c in calls] == [f"running batch {n}" for n in (4, 3, 2, 1)] + \
        [f"running batch {n}, dense rows" for n in (4, 3, 2, 1)] + ["done"]
    assert bar_text(2, 12, "capturing batch 8") == "warming up: capturing batch 8 (3/12)"
    # a config whose every prompt decodes sparsely has no dense buckets
    sparse_only = engine_for(model, {**QUEST, "min_sparse_prompt_len": 0})
    assert buckets(sparse_only) == want[:4]


def test_dummies_longer_than_the_context_are_replaced_and_rooms_missing_are_skipped(model, monkeypatch) -> None:
    """A short max_model_len: the dummies are replaced by fresh ones before they would pass it.
    No room for the largest batch (admission refused): that bucket is skipped, the rest run."""
    from sparse_framework.engine import warm_up as module

    monkeypatch.setattr(module, "PROMPT_TOKENS", 30)
    engine = engine_for(model, {**QUEST, "min_sparse_prompt_len": 0}, max_model_len=33)
    before = state(engine)
    assert engine.warm_up().steps == 4 and state(engine) == before
    engine = engine_for(model, {**QUEST, "min_sparse_prompt_len": 0})
    admit = engine.runner.admit
    room_for_three = lambda rid, n, **kw: len(engine.runner.requests) < 3 and admit(rid, n, **kw)  # noqa: E731
    monkeypatch.setattr(engine.runner, "admit", room_for_three)
    report = engine.warm_up()
    assert report.skipped == ((4, False),) and report.steps == 3 and state(engine)["used_tokens"] == 0


def test_a_failed_step_leaves_nothing_behind_and_raises(model, monkeypatch) -> None:
    engine = engine_for(model)
    before = state(engine)
    execute = engine.runner.execute

    def failing(decode, prefill, feed=None):  # type: ignore[no-untyped-def]
        if decode and len(decode) == 2:
            raise RuntimeError("injected")
        return execute(decode, prefill, feed)

    monkeypatch.setattr(engine.runner, "execute", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.warm_up()
    assert state(engine) == before and engine.warm_up_report is None


def test_the_warm_up_is_for_an_idle_engine_and_off_on_the_cpu_by_default(model) -> None:
    engine = engine_for(model)
    engine.add_request("r", prompts()[0], GREEDY)
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warm_up()
    assert not engine_for(model, warm_up=None).wants_warm_up  # CPU: no graphs to capture
    assert engine_for(model, warm_up=True).wants_warm_up
    with pytest.raises(ConfigError, match="warm_up"):
        EngineConfig(warm_up="yes")  # type: ignore[arg-type]


def test_llm_warms_its_engine_up_unless_deferred_or_off(model) -> None:
    calls: list[tuple[int, int, str]] = []
    llm = LLM.from_model(model, QUEST, max_num_seqs=2, max_model_len=96, warm_up=True,
                         warm_up_progress=lambda *c: calls.append(c))
    assert llm.engine.warm_up_report is not None and calls[-1] == (4, 4, "done")
    assert llm.engine.steps == 0
    assert LLM.from_model(model, QUEST, max_num_seqs=2, warm_up=True, defer_warm_up=True).engine.warm_up_report is None
    assert LLM.from_model(model, QUEST, max_num_seqs=2).engine.warm_up_report is None  # CPU default: off
    bar = LLM.from_model(model, QUEST, max_num_seqs=2, max_model_len=96, warm_up=True)  # the default: a rich bar
    assert bar.engine.warm_up_report is not None


def test_no_warm_up_flag_turns_it_off_for_every_engine_command() -> None:
    parser = argparse.ArgumentParser()
    engine_command.engine_arguments(parser, "")
    assert engine_command.engine_options(parser.parse_args([]), None)["warm_up"] is None
    assert engine_command.engine_options(parser.parse_args(["--no-warm-up"]), None)["warm_up"] is False


def test_health_is_not_ready_until_the_engine_warm_up_has_finished(model) -> None:
    """The server's loop warms the engine up on its own thread: /health answers 503 with the
    bucket being warmed up, and completions are refused, until it has finished."""
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from sparse_framework.serve.app import ServerState, build_app
    from sparse_framework.serve.loop import EngineLoop
    from sparse_framework.serve.metrics import ServerMetrics

    llm = LLM.from_model(model, QUEST, max_num_seqs=2, max_model_len=96, warm_up=True, defer_warm_up=True)
    engine = llm.engine
    gate, entered = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def held(decode, prefill, feed=None):  # type: ignore[no-untyped-def]
        if any(row.rid.startswith("warm-up/") for row in decode):  # the engine warm-up's decode steps
            entered.set()
            assert gate.wait(30), "the test never let the warm-up go on"
        return execute(decode, prefill, feed)

    engine.runner.execute = held  # type: ignore[method-assign]
    metrics = ServerMetrics("tiny")
    loop = EngineLoop(engine, on_finished=metrics.observe)
    metrics.attach(loop)
    app = build_app(ServerState(llm, "tiny", loop, metrics, 8, 96))
    with TestClient(app) as client:
        assert entered.wait(30)
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "starting", "warm_up": {"done": 0, "total": 4, "label": "running batch 2"}}
        refused = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert refused.status_code == 503 and "warming up" in refused.text
        gate.set()
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "not ready 30 s after the warm-up was let go"
            time.sleep(0.02)
        assert client.get("/health").json() == {"status": "ok"}
        assert engine.warm_up_report is not None and loop.warm_up_progress == (4, 4, "done")
        done = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert done.status_code == 200, done.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_every_bucket_is_captured_before_the_first_request() -> None:
    """cuda_graphs on CUDA (warm-up on by default through LLM): one step graph per bucket, the
    bytes it took recorded beside the plan's estimate; a batch of short requests afterwards
    captures nothing new and decodes the tokens of an engine without warm-up."""
    config = ModelConfig.from_hf(RANDOM_MODELS["tiny"])
    model = random_model(config, "float32", "cuda")
    sparse = {**QUEST, "backend": "triton", "min_sparse_prompt_len": 0}
    options = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=40, cuda_graphs=True,
                   gpu_memory_utilization=0.5, host_memory_bytes=2**30)
    warm = LLM.from_model(model, sparse, **options)
    report = warm.engine.warm_up_report
    assert report is not None and report.step_graphs_captured == len(report.buckets) == 4
    assert report.graph_bytes_measured is not None and report.graph_bytes_planned and report.graph_bytes_planned > 0
    print(report.describe())
    step_graphs = warm.engine.runner.step_graphs
    captures = step_graphs.captures
    batch = prompts((10, 30, 45, 70))
    got = warm.generate(batch, GREEDY)
    assert step_graphs.captures == captures  # every decode-only step of these found its graph
    cold = LLM.from_model(model, sparse, warm_up=False, **options)
    assert [o.token_ids for o in got] == [o.token_ids for o in cold.generate(batch, GREEDY)]
