"""The server's edges (docs/serve.md, "Errors"): bodies of the wrong shape, huge or deeply
nested bodies, admission counts, the API key's scheme, a client that goes away, and SIGTERM
with requests still running.

One toy-model server runs in this process (uvicorn on a thread, `--max-num-seqs 8`,
`--max-waiting 4`), so that a test can hold the engine's steps (`gate`) and read the log;
the SIGTERM test starts its own server process.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serve_server import free_port  # noqa: E402
from sparse_framework.serve.app import ServerState, build_app  # noqa: E402
from sparse_framework.cli.serve import build_llm  # noqa: E402
from sparse_framework.serve.loop import EngineLoop  # noqa: E402
from sparse_framework.serve.metrics import ServerMetrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
MAX_WAITING = 4


class Local:
    """The toy model served on a thread of this process; `gate` (set by default) holds every
    engine step while it is clear."""

    def __init__(self, api_key: str | None = None) -> None:
        self.llm, name = build_llm("reference", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)
        self.gate = threading.Event()
        self.gate.set()
        step = self.llm.engine.step

        def gated_step():  # type: ignore[no-untyped-def]
            assert self.gate.wait(30), "the test never let the engine step"
            return step()

        self.llm.engine.step = gated_step  # type: ignore[method-assign]
        metrics = ServerMetrics(name)
        self.loop = EngineLoop(self.llm.engine, on_finished=metrics.observe)
        metrics.attach(self.loop)
        self.state = ServerState(self.llm, name, self.loop, metrics, MAX_WAITING, MAX_MODEL_LEN)
        self.app = build_app(self.state, api_key)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_config=None,
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and self.loop.ready.is_set()):
            assert time.monotonic() < deadline and self.thread.is_alive(), "the in-process server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.gate.set()
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    s = Local()
    yield s
    s.stop()


def error(r: httpx.Response) -> dict:
    return r.json()["error"]


# -- 1. fields of the wrong type: a 400 that names the field and what it takes ---------------------
@pytest.mark.parametrize("path, fields, param, allowed", [
    ("/v1/completions", {"stream": True, "stream_options": "x"}, "stream_options",
     "stream_options must be an object"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options",
     "stream_options.include_usage must be true or false"),
    ("/v1/completions", {"user": {"a": 1}}, "user", "user must be a string"),
    ("/v1/completions", {"model": ["reference"]}, "model", "model must be a string"),
    ("/v1/completions", {"temperature": [1]}, "temperature", "temperature must be a number"),
    ("/v1/completions", {"max_tokens": "4"}, "max_tokens", "max_tokens must be an integer"),
    ("/v1/completions", {"stop_token_ids": ["a"]}, "stop_token_ids", "stop_token_ids must be a list of token ids"),
    ("/v1/completions", {"stop": ["x"] * 1000}, "stop", "stop takes at most 32 strings of at most 256 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages", "messages[0].content[0].text must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages",
     "messages[0].content must be a string or a list of text parts"),
])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(local: Local, path: str, fields: dict, param: str,
                                                      allowed: str) -> None:
    body = {"prompt": "1 2 3", "max_tokens": 2, **fields} if path == "/v1/completions" else {"max_tokens": 2, **fields}
    r = httpx.post(local.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert error(r)["param"] == param and allowed in error(r)["message"], r.text
    assert "Traceback" not in r.text


def test_a_400_keeps_the_connection_alive(local: Local) -> None:
    """(Before, stream_options "x" was a 500 and uvicorn closed the keep-alive connection.)"""
    conn = http.client.HTTPConnection("127.0.0.1", local.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "1 2", "stream": True, "stream_options": "x"}),
                     {"Content-Type": "application/json"})
        first = conn.getresponse()
        first.read()
        conn.request("GET", "/health")  # the same socket
        second = conn.getresponse()
        assert (first.status, second.status, json.loads(second.read())) == (400, 200, {"status": "ok"})
    finally:
        conn.close()


# -- 2. a body nested 100,000 deep, and numbers Python will not parse ------------------------------
@pytest.mark.parametrize("raw", [
    "[" * 100_000 + "]" * 100_000,
    '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"prompt": "1 2", "max_tokens": 1' + "0" * 5000 + "}",
], ids=["a list", "a prompt", "a 5000-digit integer"])
def test_a_body_nested_too_deep_or_with_a_huge_number_is_a_400(local: Local, raw: str) -> None:
    r = httpx.post(local.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert "the body is not valid JSON" in error(r)["message"] and "Traceback" not in r.text


# -- 3. the event loop never waits on a huge prompt ----------------------------------------------
def worst_health_latency_while(local: Local, send) -> tuple[float, httpx.Response]:  # noqa: ANN001
    """`send()`'s response, and the slowest GET /health answered while it ran (asked every 10 ms
    from another connection)."""

    async def run() -> tuple[float, httpx.Response]:
        async with httpx.AsyncClient(base_url=local.url, timeout=60) as client:
            assert (await client.get("/health")).status_code == 200  # the connection is open
            task = asyncio.ensure_future(asyncio.to_thread(send))
            worst = 0.0
            while not task.done():
                t = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.01)
            return worst, task.result()

    return asyncio.run(run())


def test_health_answers_within_100ms_while_a_5mb_prompt_is_refused(local: Local) -> None:
    """(Before, the 5 MB prompt was tokenized on the event loop before its length was checked.)"""
    prompt = "1 " * 2_500_000  # 5 MB of token ids: far beyond max_model_len 512
    worst, r = worst_health_latency_while(
        local, lambda: httpx.post(local.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60))
    assert r.status_code == 400 and error(r)["param"] == "prompt", r.text[:300]
    assert "5,000,000 characters" in error(r)["message"] and f"max_model_len {MAX_MODEL_LEN}" in error(r)["message"]
    assert worst < 0.1, f"/health took {worst * 1000:.0f} ms"


def test_tokenizing_runs_off_the_event_loop(local: Local, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = local.llm.tokenizer
    encode = tokenizer.encode

    def slow(text: str) -> list[int]:  # a tokenizer busy for 0.5 s on a prompt within the bound
        time.sleep(0.5)
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", slow)
    worst, r = worst_health_latency_while(
        local, lambda: httpx.post(local.url + "/v1/completions", json={"prompt": "1 2 3", "max_tokens": 2,
                                                                       "temperature": 0}, timeout=60))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    assert worst < 0.1, f"/health took {worst * 1000:.0f} ms"


# -- 4 and 5. admission: what can never wait, and what does not wait at all ---------------------------
def test_more_prompts_than_can_ever_be_admitted_is_a_400_with_the_limit(local: Local) -> None:
    """(Before, a batch over --max-waiting was a 429 "retry later" that no retry could pass.)"""
    r = httpx.post(local.url + "/v1/completions", json={"prompt": ["1 2"] * 500, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text
    limit = MAX_WAITING + MAX_NUM_SEQS
    assert error(r)["param"] == "prompt"
    assert f"500 prompts" in error(r)["message"] and f"at most {limit}" in error(r)["message"]
    ok = httpx.post(local.url + "/v1/completions", json={"prompt": ["1 2"] * limit, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == limit


def test_a_burst_within_the_free_running_slots_is_not_429(local: Local) -> None:
    """--max-waiting 4 and 8 free rows: a burst of 6 all run, even while the engine has not
    stepped yet (before, the requests about to run counted as waiting: two 429s)."""
    local.gate.clear()  # the engine adds the first request, then holds its step

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=local.url, timeout=60) as client:
            posts = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": f"1 2 {i}", "max_tokens": 2}))
                     for i in range(6)]
            await asyncio.sleep(0.5)  # all six admitted (or refused) while the engine is held
            local.gate.set()
            return list(await asyncio.gather(*posts))

    try:
        responses = asyncio.run(burst())
    finally:
        local.gate.set()
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses if r.status_code != 200]


# -- 7. the API key's scheme, and the 499 of a client gone -----------------------------------------
def test_the_bearer_scheme_is_case_insensitive(local: Local) -> None:
    from starlette.testclient import TestClient

    app = build_app(local.state, api_key="sekret")  # the running loop's state: no lifespan needed
    client = TestClient(app)
    for header in ("Bearer sekret", "bearer sekret", "BEARER  sekret"):
        assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
    for header in ("Bearer wrong", "sekret", "Basic sekret", "bearer", ""):
        r = client.get("/v1/models", headers={"Authorization": header})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", header


def test_a_client_gone_is_logged_as_499(local: Local, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    local.gate.clear()  # the request waits in the engine until the client gives up
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(local.url + "/v1/completions", json={"prompt": "1 2 3", "max_tokens": 4},
                       timeout=httpx.Timeout(10, read=0.3))
        deadline = time.monotonic() + 10
        while not any(r.getMessage().endswith('"POST /v1/completions HTTP/1.1" 499') for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
    finally:
        local.gate.set()


# -- 6. SIGTERM with requests running past --drain-timeout -------------------------------------------
SLOW_SERVER = f"""
import sys, time
from sparse_framework.cli.serve import build_llm, serve
llm, name = build_llm("reference", max_model_len={MAX_MODEL_LEN})
execute = llm.engine.runner.execute
def slow(decode, prefill, feed=None):  # 20 ms a step: 400 tokens outlast the drain
    time.sleep(0.02)
    return execute(decode, prefill, feed)
llm.engine.runner.execute = slow
sys.exit(serve(llm=llm, port=int(sys.argv[1]), log_level="warning", drain_timeout=1))
"""


@pytest.mark.slow
def test_sigterm_past_the_drain_timeout_answers_503_and_ends_streams_with_an_error_event(tmp_path: Path) -> None:
    """(Before, the whole response was uvicorn's 500 text/plain and the stream was cut.)"""
    import signal

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVER, str(port)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {"prompt": "1 2 3", "max_tokens": 400, "temperature": 0}
        whole: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: whole.update(r=httpx.post(url + "/v1/completions", json=body, timeout=60)))
        t.start()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")  # the stream runs
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        t.join(30)
        r = whole["r"]
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert "aborted by shutdown" in error(r)["message"] and error(r)["code"] == 503
        assert rest[-1] == "data: [DONE]", rest[-3:]
        event = json.loads(rest[-2].removeprefix("data: "))
        assert event["error"]["code"] == 503 and "aborted by shutdown" in event["error"]["message"], rest[-2]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
