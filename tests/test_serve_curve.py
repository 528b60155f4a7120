"""The serving curve (issue 46): `bench-serve`'s concurrency sweep against a fake server that
counts the streams it holds open (so "at most N in flight" is checked from the server's side,
not by the client's own counter), against the reference-model server through the command (its
JSON and table), and benchmarks/plot_serving_curve.py on synthetic reports."""

from __future__ import annotations

import asyncio
import io
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from helpers import load_benchmark  # noqa: E402
from serve_server import Server, free_port, reference_server  # noqa: E402

from sparse_framework.bench.online import benchmark  # noqa: E402
from sparse_framework.bench.serve_report import curve_tables, error_lines  # noqa: E402
from sparse_framework.bench.serve_spec import Point, ServeBenchSpec  # noqa: E402
from sparse_framework.cli.main import main  # noqa: E402
from sparse_framework.common.errors import ConfigError  # noqa: E402


# -- a fake server that counts open streams --------------------------------------------------------
class FakeServer:
    """/v1/models and streamed /v1/completions: `tokens` chunks `gap` seconds apart per request,
    with usage; it records the most streams open at once since `reset()` and every prompt."""

    def __init__(self, gap: float = 0.02) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.gap, self.open, self.most, self.prompts = gap, 0, 0, []
        self.lock = threading.Lock()

        async def models(request: Any) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "reference", "object": "model"}]})

        async def completions(request: Any) -> StreamingResponse:
            body = await request.json()
            self.prompts.append(body["prompt"])
            n = body["max_tokens"]

            async def stream() -> AsyncIterator[str]:
                with self.lock:
                    self.open += 1
                    self.most = max(self.most, self.open)
                try:
                    for i in range(n):
                        await asyncio.sleep(self.gap)
                        yield "data: " + json.dumps({"choices": [{"index": 0, "text": f" {i}", "finish_reason":
                                                                  None if i < n - 1 else "length"}]}) + "\n\n"
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                    yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    with self.lock:
                        self.open -= 1

            return StreamingResponse(stream(), media_type="text/event-stream")

        import uvicorn

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.02)

    def reset(self) -> None:
        with self.lock:
            self.most, self.prompts = 0, []

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.stop()


def test_each_point_holds_at_most_n_streams_open_and_reaches_n(fake: FakeServer) -> None:
    """Seen by the server: at concurrency N never more than N streams open at once, and N
    reached (K x N requests of 6 tokens, 20 ms apart, all offered at once); the same prompts at
    every point (each point's are the first of the largest's); a partial report after each."""
    caps = (1, 3, 5)
    spec = ServeBenchSpec(fake.url, concurrencies=caps, prompts_per_concurrency=2, min_prompts=3, input_len=8,
                          output_len=6, prompt_format="ids", tokenizer="reference", label="fake")
    seen: list[tuple[int, list[Any]]] = []
    partial: list[int] = []

    def before(point: Point) -> None:
        assert math.isinf(point.rate)
        fake.reset()

    def after(report: dict[str, Any]) -> None:
        seen.append((fake.most, list(fake.prompts)))
        partial.append(len(report["runs"]))

    report = benchmark(spec, on_start=before, on_point=after)
    assert partial == [1, 2, 3]
    assert [most for most, _ in seen] == list(caps)  # the server saw exactly N open at the peak
    counts = [max(2 * c, 3) for c in caps]
    assert [len(prompts) for _, prompts in seen] == counts
    largest = sorted(map(tuple, seen[-1][1]))
    for (_, prompts), n in zip(seen, counts):
        assert len({tuple(p) for p in prompts}) == n  # distinct prompts within a point
        assert set(map(tuple, prompts)) <= set(largest)
    assert report["mode"] == "concurrency" and report["concurrencies"] == list(caps)
    for run, c, n in zip(report["runs"], caps, counts):
        assert run["max_concurrency"] == c and run["request_rate"] == "inf" and run["max_in_flight"] == c
        assert (run["sent"], run["completed"], run["failed"], run["output_tokens"]) == (n, n, 0, 6 * n)
        assert run["tpot_ms"]["p50"] >= 15  # 20 ms between chunks, seen through HTTP


def test_a_point_whose_server_is_gone_counts_failures_per_concurrency() -> None:
    spec = ServeBenchSpec(f"http://127.0.0.1:{free_port()}", concurrencies=(1, 2), prompts_per_concurrency=1,
                          min_prompts=1, input_len=4, output_len=2, model="reference", prompt_format="ids",
                          tokenizer="reference")
    report = benchmark(spec)
    assert [(r["sent"], r["failed"], r["output_throughput"]) for r in report["runs"]] == [(1, 1, 0.0), (2, 2, 0.0)]
    assert error_lines(report)[1].startswith("concurrency 2: 2 x connect: cannot connect")


def test_sweep_options_are_checked_with_their_flag() -> None:
    for kwargs, match in [
        (dict(concurrencies=(2, 4), rates=(8.0,)), "--request-rate: a concurrency sweep"),
        (dict(concurrencies=(2, 4), num_prompts=10), "--num-prompts: a concurrency sweep sends"),
        (dict(concurrencies=(2, 4), max_concurrency=4), "give one value .* or a concurrency sweep, not both"),
        (dict(concurrencies=(0, 4)), "--max-concurrency takes whole numbers >= 1"),
        (dict(concurrencies=(4, 4)), "--max-concurrency: a value given twice"),
        (dict(concurrencies=(4,), prompts_per_concurrency=0), "--prompts-per-concurrency must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ServeBenchSpec("http://x", **kwargs)  # type: ignore[arg-type]
    points = ServeBenchSpec("http://x", concurrencies=(1, 4, 16), prompts_per_concurrency=3, min_prompts=5).points()
    assert [(p.max_concurrency, p.num_prompts) for p in points] == [(1, 5), (4, 12), (16, 48)]
    assert all(math.isinf(p.rate) for p in points)
    rates = ServeBenchSpec("http://x", rates=(2.0, math.inf), max_concurrency=3, num_prompts=7).points()
    assert [(p.rate, p.max_concurrency, p.num_prompts) for p in rates] == [(2.0, 3, 7), (math.inf, 3, 7)]


# -- the command against the reference server ------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = reference_server("--max-num-seqs", "4", "--max-waiting", "64")
    yield s
    assert s.stop() == 0


def test_the_command_sweeps_concurrency_and_writes_the_curve(server: Server, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "curve.json"
    argv = ["bench-serve", "--base-url", server.url, "--max-concurrency", "1,2", "6", "--prompts-per-concurrency", "2",
            "--min-prompts", "3", "--input-len", "12", "--output-len", "4", "--label", "reference toy",
            "--meta", "memory_max=4", "--meta", "config={\"algorithm\": \"quest\"}", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "concurrency sweep" in text and "TTFT p50" in text and "TPOT p50" in text and "Traceback" not in text
    report = json.loads(out.read_text())
    assert report["label"] == "reference toy" and report["mode"] == "concurrency" and report["model"] == "reference"
    assert report["meta"] == {"memory_max": "4", "config": '{"algorithm": "quest"}'}
    assert report["command"].startswith("sparse-framework bench-serve --base-url") and "--max-concurrency" in report["command"]
    assert isinstance(report["commit"], str) and len(report["commit"]) >= 7  # this checkout's HEAD
    assert (report["concurrencies"], report["prompts_per_concurrency"], report["min_prompts"]) == ([1, 2, 6], 2, 3)
    for run, c in zip(report["runs"], (1, 2, 6)):
        n = max(2 * c, 3)
        assert (run["max_concurrency"], run["sent"], run["completed"], run["failed"]) == (c, n, n, 0)
        assert run["output_tokens"] == 4 * n and run["input_tokens"] == 12 * n
        assert 1 <= run["max_in_flight"] <= c
        assert run["output_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms"):
            assert 0 < run[key]["p50"] <= run[key]["p99"]
    # the server runs 4 rows: at 6 the other two wait in its queue, so the client holds 6 open
    assert report["runs"][2]["max_in_flight"] == 6
    from rich.console import Console

    console = Console(width=80, record=True, file=io.StringIO())
    for table in curve_tables(report):
        console.print(table)
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"], ["6"])]
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "3/3", "0"), ("2", "4/4", "0"), ("6", "12/12", "0")]


# -- the plot --------------------------------------------------------------------------------------
def synthetic_report(label: str, tok_s: list[float], failed_at: int | None = None, max_running: int | None = None,
                     caps: tuple[int, ...] = (1, 4, 16, 32)) -> dict[str, Any]:
    runs = []
    for c, t in zip(caps, tok_s):
        failed = 3 if c == failed_at else 0
        runs.append({"request_rate": "inf", "max_concurrency": c, "max_in_flight": c, "sent": c, "completed": c - failed,
                     "failed": failed, "duration_s": 10.0, "output_throughput": t, "request_throughput": c / 10,
                     "ttft_ms": {"mean": 1.0, "p50": 100.0 * c, "p99": 150.0 * c},
                     "tpot_ms": {"mean": 1.0, "p50": 5.0 + c, "p99": 6.0 + c},
                     "errors": {"HTTP 429": {"count": failed, "message": "full"}} if failed else {}})
    return {"label": label, "mode": "concurrency", "commit": "abc1234", "command": f"sparse-framework bench-serve --label {label}",
            "meta": {"memory_max": str(max_running + 5), "max_running": str(max_running)} if max_running else {},
            "model": "llama-3-8b",
            "input_len": 32768, "output_len": 1024, "prompts_per_concurrency": 1, "min_prompts": 1, "runs": runs}


def test_the_plot_script_draws_one_line_per_label_and_tables_them(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    plot = load_benchmark("plot_serving_curve")
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(synthetic_report("vllm-dense", [70.0, 260.0, 700.0, 810.0], max_running=24)))
    b.write_text(json.dumps(synthetic_report("engine-resident", [60.0, 250.0, 900.0, 1234.5], failed_at=32,
                                             max_running=21)))
    c.write_text(json.dumps(synthetic_report("engine-dense", [55.0, 200.0], caps=(1, 4))))
    png, md, curve = tmp_path / "docs" / "curve.png", tmp_path / "curve.md", tmp_path / "curve.json"
    png.parent.mkdir()
    assert plot.main([str(a), str(b), "--png", str(png), "--md", str(md), "--json", str(curve)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    page = md.read_text()
    assert "![serving curve](docs/curve.png)" in page
    assert "| N | vllm-dense | engine-resident |" in page
    assert "| 32 | 810.0 | 1,234.5* |" in page and "| 1 | 70.0 | 60.0 |" in page
    assert "| engine-resident | 32 | 29/32 | 32 | 1,234.5 | 3,200.0 | 4,800.0 | 37.0 | 38.0 |" in page
    assert "runs at most 21 requests at once" in page and "32768-token prompts, 1024 output tokens" in page
    joined = json.loads(curve.read_text())
    assert [s["label"] for s in joined["series"]] == ["vllm-dense", "engine-resident"]
    assert [p["concurrency"] for p in joined["series"][0]["points"]] == [1, 4, 16, 32]
    # the curve file joins with a later run's report; missing points are dashes
    assert plot.main([str(curve), str(c), "--md", str(md)]) == 0
    assert "| 16 | 700.0 | 900.0 | - |" in md.read_text()
    capsys.readouterr()
    # refused, with the reason and no traceback
    rate = synthetic_report("rates", [1.0])
    rate["mode"] = "rate"
    (tmp_path / "rate.json").write_text(json.dumps(rate))
    for argv, match in [([str(curve), str(a), "--md", str(md)], "label 'vllm-dense' is in both"),
                        ([str(tmp_path / "rate.json"), "--md", str(md)], "a rate sweep .* --max-concurrency 1 2 4"),
                        ([str(a)], "nothing to write"),
                        ([str(a), "--png", str(tmp_path / "x.svg")], "must end in .png"),
                        ([str(a), "--png", str(tmp_path / "no" / "x.png")], "--png .*: the directory .* does not exist"),
                        ([str(tmp_path / "none.json"), "--md", str(md)], "no such file")]:
        assert plot.main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        import re

        assert re.search(match, err), (argv, err)
