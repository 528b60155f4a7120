"""`sparse-framework bench-serve`: an online benchmark of a running OpenAI-compatible server.

`bench` measures the engine alone; this measures what a client sees through HTTP (queueing,
tokenization, streaming, the event loop) under a controlled load, in the shape of vLLM's
`bench serve`, against this server or any other that speaks /v1/completions:

- load: requests arrive as a Poisson process at each `--request-rate` (`inf`: all at once),
  optionally at most `--max-concurrency` in flight; every rate of a sweep sends the same
  prompts, so rates compare. Or a concurrency sweep (the serving curve, issue 46): several
  `--max-concurrency` values, each a run of every request offered at once with at most N in
  flight and K x N of the same prompts (`--prompts-per-concurrency` K, at least
  `--min-prompts`), so that a point stays near N in flight for several requests' lifetimes;
- prompts: synthetic, of exact token counts drawn from a length distribution and built with the
  served model's own tokenizer (text that re-tokenizes to exactly that count, else the token
  ids themselves, which /v1/completions takes), or a JSONL file of {"prompt", "max_tokens"};
  `ignore_eos` (vLLM's field, this server's too) pins each output to its max_tokens;
- per request, over a streamed completion (this server sends one chunk per token): TTFT from
  the send to the first token chunk, ITL between token chunks, latency to the end of the
  stream, TPOT = (latency - TTFT) / (output tokens - 1), output tokens from the server's usage;
- per rate: mean, p50 and p99 of each, request and token throughput over the rate's duration
  (first send to last answer), and goodput (vLLM's): requests meeting every SLO given
  (--slo-ttft-ms, --slo-tpot-ms) per second;
- failures (connection refused, timeouts, HTTP 4xx/5xx, an error event inside a stream) are
  counted per rate and kind with the first message, never raised: a benchmark that overloads
  a server should say how, not stop;
- the JSON report carries the command, the commit of the code that ran (`$SF_COMMIT` where the
  tree travelled without .git, else `git rev-parse`), a `--label` and `--meta KEY=VALUE` facts,
  so that curves of several servers can be joined later (benchmarks/plot_serving_curve.py); with
  `--out` it is rewritten after every point, so a run cut short keeps the points it finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.errors import ConfigError, SparseFrameworkError
from .stats import percentile
from .offline import LENGTH_DISTRIBUTIONS, draw_lengths  # `bench`'s lengths, drawn alike

if TYPE_CHECKING:
    import httpx
    from rich.console import Console
    from rich.table import Table

PROMPT_FORMATS = ("text", "ids")
PERCENTILES = (50, 99)

BENCH_SERVE_HELP = """\
Drive a running OpenAI-compatible server (sparse-framework serve, or any other) with streamed
completions arriving as a Poisson process, and report TTFT, ITL, TPOT and latency (mean, p50,
p99), request and output-token throughput, and goodput under SLOs, per request rate
(docs/serve.md, "Online benchmark").

  sparse-framework serve --model reference --port 8000 &
  sparse-framework bench-serve --base-url http://127.0.0.1:8000 --request-rate 2 8 inf \\
      --num-prompts 50 --input-len 256 --output-len 32 --slo-ttft-ms 500 --slo-tpot-ms 50 --out bench.json

A concurrency sweep (the serving curve: output tok/s against requests in flight): several
--max-concurrency values; each is a run at --request-rate inf with at most N in flight and
K x N prompts (--prompts-per-concurrency K, at least --min-prompts), the same prompts at every N:

  sparse-framework bench-serve --max-concurrency 1 2 4 8 16 --prompts-per-concurrency 4 \\
      --input-len 256 --output-len 64 --label mine --out curve.json
  python benchmarks/plot_serving_curve.py curve.json other.json --png docs/serving_curve/curve.png

Prompts are built with the served model's tokenizer (--tokenizer, default the served model's
name: a catalog model, a checkpoint directory or `reference`) to exact token counts; or read
from --dataset, a JSONL file of {"prompt": "..." or [ids], "max_tokens": N}.
"""


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt (text or token ids), prompt length when known before sending
    (synthetic prompts), and the tokens it asks for."""

    prompt: str | list[int]
    max_tokens: int
    prompt_len: int | None = None


@dataclass
class RequestResult:
    """What one request measured (seconds), or why it failed: `error` is its kind ("HTTP 503",
    "connect", "timeout", "stream error" ...), `message` the first words of the reason."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a failure or a single token."""
        if not self.ok or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def fail(self, kind: str, message: str) -> RequestResult:
        self.error, self.message = kind, " ".join(message.split())[:200]
        return self


@dataclass(frozen=True)
class Point:
    """One run of a sweep: requests arrive at `rate` per second (inf: all at once), at most
    `max_concurrency` in flight (None: no limit), the first `num_prompts` of the prompts."""

    rate: float
    max_concurrency: int | None
    num_prompts: int


@dataclass(frozen=True)
class ServeBenchSpec:
    """The benchmark's options; `__post_init__` refuses a bad value with the flag's name.

    rates: requests per second (math.inf: all at once); input/output lengths as `bench`'s
    (a mean, a distribution, range_ratio R: [L(1-R), L(1+R)]); dataset: a JSONL file instead
    of synthetic prompts (num_prompts None: all its lines); model/tokenizer: None asks the
    server (GET /v1/models) and uses the served name. concurrencies: a concurrency sweep (each
    at rate inf, max(prompts_per_concurrency x N, min_prompts) prompts); max_concurrency: the
    cap of every rate of a rate sweep. label and meta: what the report says it measured."""

    base_url: str
    rates: tuple[float, ...] = (math.inf,)
    num_prompts: int | None = None
    input_len: int = 256
    output_len: int = 32
    input_len_dist: str = "fixed"
    output_len_dist: str | None = None
    range_ratio: float = 0.0
    dataset: str | None = None
    model: str | None = None
    tokenizer: str | None = None
    api_key: str | None = None
    prompt_format: str = "text"
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout: float = 600.0
    concurrencies: tuple[int, ...] = ()
    prompts_per_concurrency: int = 4
    min_prompts: int = 8
    label: str | None = None
    meta: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"--base-url must be an http:// or https:// URL of the server, got {self.base_url!r}")
        if not self.rates:
            raise ConfigError("--request-rate needs at least one rate")
        for rate in self.rates:
            if not (isinstance(rate, (int, float)) and rate > 0) or math.isnan(rate):
                raise ConfigError(f"--request-rate must be positive numbers of requests per second or inf, got {rate!r}")
        for name in ("num_prompts", "input_len", "output_len", "max_concurrency", "prompts_per_concurrency",
                     "min_prompts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.concurrencies:
            bad = [c for c in self.concurrencies if not isinstance(c, int) or isinstance(c, bool) or c < 1]
            if bad:
                raise ConfigError(f"--max-concurrency takes whole numbers >= 1 of requests in flight, got {bad[0]!r}")
            if len(set(self.concurrencies)) != len(self.concurrencies):
                raise ConfigError(f"--max-concurrency: a value given twice in {list(self.concurrencies)}")
            if self.max_concurrency is not None:
                raise ConfigError("--max-concurrency: give one value (a cap on every rate of a rate sweep) or a "
                                  "concurrency sweep, not both")
            if self.rates != (math.inf,):
                raise ConfigError("--request-rate: a concurrency sweep (several --max-concurrency values, or "
                                  "--prompts-per-concurrency) offers every request at once (rate inf); give either "
                                  "a --request-rate sweep with one --max-concurrency cap, or a --max-concurrency sweep")
            if self.num_prompts is not None:
                raise ConfigError("--num-prompts: a concurrency sweep sends --prompts-per-concurrency x N prompts at "
                                  "concurrency N (at least --min-prompts); set those instead")
        for name in ("input_len_dist", "output_len_dist"):
            value = getattr(self, name)
            if value is not None and value not in LENGTH_DISTRIBUTIONS:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, "
                                  f"got {value!r}")
        if not 0 <= self.range_ratio < 1:
            raise ConfigError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ConfigError(f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}, got {self.prompt_format!r}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.dataset is not None and not Path(self.dataset).is_file():
            raise ConfigError(f"--dataset {self.dataset!r}: no such file")

    @property
    def mode(self) -> str:
        """The report's "mode": "concurrency" for a --max-concurrency sweep, else "rate"."""
        return "concurrency" if self.concurrencies else "rate"

    def points(self, available: int | None = None) -> list[Point]:
        """The runs in order: one per rate, or one per concurrency with its prompt count
        (`available`: the prompts of a rate sweep, its every run sends them all)."""
        if self.concurrencies:
            return [Point(math.inf, c, max(self.prompts_per_concurrency * c, self.min_prompts))
                    for c in self.concurrencies]
        n = available if available is not None else (self.num_prompts or 100)
        return [Point(rate, self.max_concurrency, n) for rate in self.rates]

    @property
    def root(self) -> str:
        """The server's root URL (a trailing "/v1" given by habit is dropped)."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# -- the load: arrivals, lengths, prompts ---------------------------------------------------------
def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets (s) of `n` requests arriving as a Poisson process of `rate` per second:
    exponential gaps of mean 1/rate, the first request at 0; all 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def load_tokenizer_for(name: str) -> Any:
    """The tokenizer the server uses for model `name`: `reference` or a `--random` shape (an id
    tokenizer: text of space-separated ids), a catalog name (converted on first use) or a
    checkpoint directory (its tokenizer files)."""
    from ..engine.models.catalog import REFERENCE
    from ..engine.models.random_shapes import RANDOM_MODELS
    from ..engine.llm import IdTokenizer, load_tokenizer
    from ..engine.models.catalog import resolve_model

    if name == REFERENCE:
        from ..engine.models.loader import reference_config

        return IdTokenizer(reference_config().vocab_size)
    if name in RANDOM_MODELS:  # `serve --random SHAPE`: token ids over the shape's vocabulary
        return IdTokenizer(RANDOM_MODELS[name]["vocab_size"])
    try:
        tokenizer = load_tokenizer(resolve_model(name))
    except SparseFrameworkError as exc:
        raise ConfigError(f"--tokenizer: cannot find the tokenizer of {name!r} ({exc}); pass --tokenizer with a "
                          "model name or checkpoint directory, or use --dataset") from None
    if tokenizer is None:
        raise ConfigError(f"--tokenizer {name!r}: the checkpoint has no tokenizer files; pass another --tokenizer")
    return tokenizer


def synthetic_requests(spec: ServeBenchSpec, tokenizer: Any, n: int | None = None) -> list[BenchRequest]:
    """`n` (default `spec.num_prompts`, else 100) prompts of drawn lengths (seeded) of random
    ordinary tokens (no special ones), as text that the tokenizer turns back into exactly that
    many tokens, or as the ids when no such text is found in a few rounds (or with
    --prompt-format ids). Seeded draws in order: the first k of n are those of any n >= k."""
    import torch

    n = n or spec.num_prompts or 100
    gens = [torch.Generator().manual_seed(spec.seed * 4 + i) for i in range(2)]
    inputs = draw_lengths(spec.input_len_dist, spec.input_len, spec.range_ratio, n, gens[0])
    outputs = draw_lengths(spec.output_len_dist or spec.input_len_dist, spec.output_len, spec.range_ratio, n, gens[1])
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
    pool = [i for i in range(size) if i not in special]
    rng = random.Random(spec.seed)
    out = []
    for length, max_tokens in zip(inputs, outputs):
        ids = [rng.choice(pool) for _ in range(length)]
        prompt = ids if spec.prompt_format == "ids" else exact_text(tokenizer, ids)
        out.append(BenchRequest(prompt, max_tokens, length))
    return out


def exact_text(tokenizer: Any, ids: list[int], rounds: int = 10) -> str | list[int]:
    """Text whose encoding (the server's: `tokenizer.encode(text)`) has len(ids) tokens: decode,
    re-encode, cut or refill to the length, repeat; the ids themselves if it does not settle."""
    n = len(ids)
    for _ in range(rounds):
        text = tokenizer.decode(ids)
        got = list(tokenizer.encode(text))
        if len(got) == n:
            return text
        ids = got[:n] if len(got) > n else got + ids[len(got):]
    return ids


def dataset_requests(path: str, num_prompts: int | None, default_max_tokens: int) -> list[BenchRequest]:
    """The requests of a JSONL file, one {"prompt": text or token ids, "max_tokens": N} a line
    (max_tokens defaults to --output-len); the first `num_prompts`, cycling when it has fewer."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"--dataset {path} line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise ConfigError(f"{where}: needs a 'prompt', a non-empty string or list of token ids")
        max_tokens = row.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
        rows.append(BenchRequest(prompt, max_tokens, len(prompt) if ids else None))
    if not rows:
        raise ConfigError(f"--dataset {path}: no requests in the file")
    n = num_prompts or len(rows)
    return [rows[i % len(rows)] for i in range(n)]


# -- statistics ---------------------------------------------------------------------------------
def distribution_ms(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 of seconds, in milliseconds (None when there are none)."""
    out: dict[str, float | None] = {"mean": 1000 * sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        p = percentile(values, q)
        out[f"p{q}"] = None if p is None else 1000 * p
    return out


def summarize(results: Sequence[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """One rate's figures from its requests and its duration (s); goodput is None without SLOs."""
    done = [r for r in results if r.ok]
    errors: dict[str, dict[str, Any]] = {}
    for r in results:
        if not r.ok:
            e = errors.setdefault(str(r.error), {"count": 0, "message": r.message})
            e["count"] += 1
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)  # noqa: E731
    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(1 for r in done if meets_slo(r, slo_ttft_ms, slo_tpot_ms))
    inputs, outputs = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    return {
        "sent": len(results), "completed": len(done), "failed": len(results) - len(done), "errors": errors,
        "duration_s": duration, "input_tokens": inputs, "output_tokens": outputs,
        "request_throughput": per_s(len(done)), "output_throughput": per_s(outputs),
        "total_token_throughput": per_s(inputs + outputs),
        "good_requests": good, "goodput": None if good is None else per_s(good),
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms([g for r in done for g in r.itl]),
        "latency_ms": distribution_ms([r.latency for r in done if r.latency is not None]),
    }


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A completed request within both SLOs (one not given holds; a single-token answer has no TPOT)."""
    if not r.ok or r.ttft is None:
        return False
    if slo_ttft_ms is not None and 1000 * r.ttft > slo_ttft_ms:
        return False
    tpot = r.tpot
    return slo_tpot_ms is None or tpot is None or 1000 * tpot <= slo_tpot_ms


# -- the client -----------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    """One streamed completion, timed; a failure comes back as its kind and reason."""
    import httpx

    res, start, last, chunks = RequestResult(), time.perf_counter(), 0.0, 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return res.fail(f"HTTP {r.status_code}", _reason((await r.aread()).decode(errors="replace")))
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data, now = line[5:].strip(), time.perf_counter()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    return res.fail("bad stream", f"an event is not JSON: {data[:80]}")
                if "error" in event:
                    return res.fail("stream error", _reason(event))
                if event.get("usage"):
                    res.prompt_tokens = int(event["usage"].get("prompt_tokens") or 0)
                    res.output_tokens = int(event["usage"].get("completion_tokens") or 0)
                choices = event.get("choices") or []
                # a token chunk; the last one (finish_reason set) only when no token came before it
                if choices and (choices[0].get("finish_reason") is None or res.ttft is None):
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.latency = time.perf_counter() - start
    except httpx.ConnectError as exc:
        return res.fail("connect", f"cannot connect to {url}: {exc}")
    except httpx.TimeoutException as exc:
        return res.fail("timeout", f"{type(exc).__name__} after {time.perf_counter() - start:.1f} s")
    except httpx.HTTPError as exc:
        return res.fail(type(exc).__name__, str(exc) or type(exc).__name__)
    if res.ttft is None:
        return res.fail("empty stream", "the stream ended without a token")
    res.output_tokens = res.output_tokens or chunks  # a server that does not send usage
    return res


def _reason(body: str | dict[str, Any]) -> str:
    """The error message of an OpenAI error body (or the text as it is)."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            return body
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err if err is not None else body)


async def run_point(spec: ServeBenchSpec, requests: Sequence[BenchRequest], point: Point, model: str | None,
                    on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float, int]:
    """Send `requests` at Poisson arrivals of the point's rate (seeded), at most its
    max_concurrency in flight, and wait for all; the results in request order, the duration from
    the first send to the last answer (s) and the most requests that were in flight at once (a
    request is in flight from its send to the end of its answer)."""
    import httpx

    offsets = poisson_arrivals(len(requests), point.rate, spec.seed)
    url = spec.root + "/v1/completions"
    common: dict[str, Any] = {"temperature": spec.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        common["model"] = model
    if spec.ignore_eos:
        common["ignore_eos"] = True
    gate = asyncio.Semaphore(point.max_concurrency or len(requests) or 1)
    flight = {"now": 0, "max": 0}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(spec.timeout, connect=10.0)) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                body = {**common, "prompt": requests[i].prompt, "max_tokens": requests[i].max_tokens}
                flight["now"] += 1
                flight["max"] = max(flight["max"], flight["now"])
                try:
                    result = await send(client, url, body, spec.headers)
                finally:
                    flight["now"] -= 1
            if result.ok and not result.prompt_tokens and requests[i].prompt_len:
                result.prompt_tokens = requests[i].prompt_len
            if on_done is not None:
                on_done(result)
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - t0
    return list(results), duration, flight["max"]


def served_model(spec: ServeBenchSpec) -> str:
    """The server's model name (GET /v1/models), for requests and the default tokenizer."""
    import httpx

    try:
        r = httpx.get(spec.root + "/v1/models", headers=spec.headers, timeout=10)
    except httpx.HTTPError as exc:
        raise ConfigError(f"--base-url {spec.base_url}: cannot ask the server its model (GET /v1/models): {exc}; "
                          "is it running? (or pass --model)") from None
    if r.status_code != 200:
        raise ConfigError(f"--base-url {spec.base_url}: GET /v1/models answered {r.status_code}: {_reason(r.text)}"
                          + (" (--api-key)" if r.status_code == 401 else ""))
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(f"--base-url {spec.base_url}: GET /v1/models did not list a model; pass --model") from None


def benchmark(spec: ServeBenchSpec, on_start: Callable[[Point], None] | None = None,
              on_done: Callable[[RequestResult], None] | None = None,
              on_point: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The whole sweep: the requests built once (as many as the largest point sends; each point
    sends the first of them), then each point in turn (`on_start(point)` before it, `on_done`
    after each request, `on_point(report so far)` after it); the JSON-ready report."""
    model = spec.model or served_model(spec)
    wanted = max(p.num_prompts for p in spec.points()) if spec.concurrencies else spec.num_prompts
    if spec.dataset is not None:
        requests, tokenizer_name = dataset_requests(spec.dataset, wanted, spec.output_len), None
    else:
        tokenizer_name = spec.tokenizer or model
        requests = synthetic_requests(spec, load_tokenizer_for(tokenizer_name), wanted)
    report: dict[str, Any] = {
        "label": spec.label or model, "mode": spec.mode, "commit": source_commit(), "command": None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "meta": dict(spec.meta),
        "base_url": spec.root, "model": model, "tokenizer": tokenizer_name, "dataset": spec.dataset,
        "num_prompts": len(requests), "input_len": spec.input_len, "output_len": spec.output_len,
        "input_len_dist": spec.input_len_dist, "output_len_dist": spec.output_len_dist or spec.input_len_dist,
        "range_ratio": spec.range_ratio, "prompt_format": spec.prompt_format, "ignore_eos": spec.ignore_eos,
        "temperature": spec.temperature, "max_concurrency": spec.max_concurrency,
        "concurrencies": list(spec.concurrencies) or None,
        "prompts_per_concurrency": spec.prompts_per_concurrency if spec.concurrencies else None,
        "min_prompts": spec.min_prompts if spec.concurrencies else None, "seed": spec.seed,
        "slo_ttft_ms": spec.slo_ttft_ms, "slo_tpot_ms": spec.slo_tpot_ms, "runs": [],
    }
    for point in spec.points(len(requests)):
        if on_start is not None:
            on_start(point)
        sent = requests[:point.num_prompts]
        results, duration, in_flight = asyncio.run(run_point(spec, sent, point, model, on_done))
        report["runs"].append({
            "request_rate": "inf" if math.isinf(point.rate) else point.rate, "max_concurrency": point.max_concurrency,
            "max_in_flight": in_flight, **summarize(results, duration, spec.slo_ttft_ms, spec.slo_tpot_ms),
            "requests": [request_row(r) for r in results]})
        if on_point is not None:
            on_point(report)
    return report


def source_commit() -> str | None:
    """The commit of the code that runs: $SF_COMMIT where the tree travelled without .git (the
    GPU machine's packed tree), else `git rev-parse HEAD` beside this file; None when neither
    says (an installed wheel)."""
    import subprocess

    if os.environ.get("SF_COMMIT"):
        return os.environ["SF_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def request_row(r: RequestResult) -> dict[str, Any]:
    ms = (lambda s: None if s is None else 1000 * s)  # noqa: E731
    return {"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft),
            "tpot_ms": ms(r.tpot), "latency_ms": ms(r.latency), "error": r.error, "message": r.message or None}


def rate_text(rate: float | str) -> str:
    """A rate for tables: "inf" or the number as short as it goes."""
    return str(rate) if isinstance(rate, str) else "inf" if math.isinf(rate) else f"{rate:g}"


# -- the command ------------------------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench-serve", help="online benchmark of a running server: Poisson load, TTFT/ITL/TPOT, "
                       "throughput, goodput", description=BENCH_SERVE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    b.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY' (also SPARSE_FRAMEWORK_API_KEY)")
    b.add_argument("--model", help="the model field of requests (default: the server's, GET /v1/models)")
    b.add_argument("--tokenizer", metavar="NAME|DIR", help="builds the prompts: a catalog model, a checkpoint directory "
                   "or 'reference' (default: the model's name)")
    b.add_argument("--request-rate", nargs="+", default=["inf"], metavar="RATE",
                   help="Poisson arrivals per second; several (or comma-separated) make a sweep; inf = all at once "
                   "(default inf)")
    b.add_argument("--max-concurrency", nargs="+", metavar="N",
                   help="requests in flight at most (default: no limit). One value caps every rate of the rate sweep; "
                   "several (or comma-separated, or one with --prompts-per-concurrency) make a concurrency sweep: "
                   "each N a run of every request offered at once, at most N in flight, the same prompts")
    b.add_argument("--prompts-per-concurrency", type=int, metavar="K",
                   help="a concurrency sweep sends K x N prompts at concurrency N (default 4), so that each point "
                   "stays near N in flight for K requests' lifetimes")
    b.add_argument("--min-prompts", type=int, metavar="M",
                   help="a concurrency sweep sends at least M prompts at any N (default 8)")
    b.add_argument("--num-prompts", type=int, help="requests per rate of a rate sweep (default 100; with --dataset: "
                   "its lines)")
    b.add_argument("--input-len", type=int, default=256, help="prompt tokens, the mean (default 256)")
    b.add_argument("--output-len", type=int, default=32, help="max_tokens, the mean (default 32)")
    b.add_argument("--input-len-dist", choices=LENGTH_DISTRIBUTIONS, default="fixed",
                   help="fixed (default), uniform in [L(1-R), L(1+R)], normal (sd L*R/2, clipped)")
    b.add_argument("--output-len-dist", choices=LENGTH_DISTRIBUTIONS, help="default: as --input-len-dist")
    b.add_argument("--range-ratio", type=float, default=0.0, help="R of the length distributions, in [0, 1) (default 0)")
    b.add_argument("--dataset", metavar="JSONL", help='requests from a file: {"prompt": text or [ids], "max_tokens": N} '
                   "a line")
    b.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text",
                   help="synthetic prompts as text of the exact token count (default) or as token ids")
    b.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at its end token (default: ignore_eos, outputs of exactly max_tokens)")
    b.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    b.add_argument("--seed", type=int, default=0, help="lengths, prompts and arrivals (default 0)")
    b.add_argument("--slo-ttft-ms", type=float, help="goodput's TTFT bound (ms)")
    b.add_argument("--slo-tpot-ms", type=float, help="goodput's TPOT bound (ms)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    b.add_argument("--label", help="the report's name for this server and config, the line's name in "
                   "benchmarks/plot_serving_curve.py (default: the served model's name)")
    b.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                   help="a fact to keep in the report's 'meta' (repeatable), e.g. memory_max=23 (the server's "
                   "memory-bound maximum of requests, which the plot marks) or config='{...}'")
    b.add_argument("--out", metavar="PATH", help="write the report as JSON (rewritten after every point)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_concurrencies(values: Sequence[str] | None) -> tuple[int, ...]:
    """--max-concurrency's values, space- or comma-separated, as whole numbers."""
    out = []
    for text in (v.strip() for value in values or () for v in value.split(",") if v.strip()):
        try:
            out.append(int(text))
        except ValueError:
            raise ConfigError(f"--max-concurrency takes whole numbers >= 1 of requests in flight, got {text!r}") from None
    return tuple(out)


def parse_meta(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """--meta KEY=VALUE pairs, in order (a key given again: the last value)."""
    pairs: dict[str, str] = {}
    for text in values:
        key, eq, value = text.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--meta takes KEY=VALUE, got {text!r}")
        pairs[key.strip()] = value
    return tuple(pairs.items())


def parse_rates(values: Sequence[str]) -> tuple[float, ...]:
    rates = []
    for text in (v for value in values for v in value.split(",") if v.strip()):
        try:
            rates.append(float(text))
        except ValueError:
            raise ConfigError(f"--request-rate takes numbers of requests per second or inf, got {text!r}") from None
    return tuple(rates)


def run(args: argparse.Namespace, console: Console) -> int:
    """The `bench-serve` subcommand."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ConfigError("bench-serve needs httpx: pip install httpx") from None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    caps = parse_concurrencies(args.max_concurrency)
    sweep = len(caps) > 1 or args.prompts_per_concurrency is not None or args.min_prompts is not None
    if sweep and not caps:
        raise ConfigError("--prompts-per-concurrency and --min-prompts belong to a concurrency sweep: give the "
                          "concurrencies with --max-concurrency N [N ...]")
    spec = ServeBenchSpec(
        base_url=args.base_url, rates=parse_rates(args.request_rate), num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, input_len_dist=args.input_len_dist,
        output_len_dist=args.output_len_dist, range_ratio=args.range_ratio, dataset=args.dataset, model=args.model,
        tokenizer=args.tokenizer, api_key=args.api_key or os.environ.get("SPARSE_FRAMEWORK_API_KEY"),
        prompt_format=args.prompt_format, max_concurrency=None if sweep or not caps else caps[0],
        ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, timeout=args.timeout, concurrencies=caps if sweep else (),
        prompts_per_concurrency=4 if args.prompts_per_concurrency is None else args.prompts_per_concurrency,
        min_prompts=8 if args.min_prompts is None else args.min_prompts, label=args.label,
        meta=parse_meta(args.meta))
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise ConfigError(f"--out {args.out!r}: the directory {str(Path(args.out).resolve().parent)!r} does not exist")
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[failed]} failed"), console=console, disable=args.no_progress,
                        transient=True)
    bar: dict[str, Any] = {"task": None, "failed": 0}

    def on_start(point: Point) -> None:  # one bar per point, moved by each answer
        if bar["task"] is not None:
            progress.remove_task(bar["task"])
        what = f"concurrency {point.max_concurrency}" if spec.concurrencies else f"rate {rate_text(point.rate)} req/s"
        bar.update(task=progress.add_task(what, total=point.num_prompts, failed=0), failed=0)

    def on_done(r: RequestResult) -> None:
        bar["failed"] += not r.ok
        progress.update(bar["task"], advance=1, failed=bar["failed"])

    command = command_line(args)

    def on_point(report: dict[str, Any]) -> None:  # a run cut short keeps the points it finished
        report["command"] = command
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

    with progress:
        report = benchmark(spec, on_start, on_done, on_point)
    report["command"] = command
    for table in (curve_tables if spec.concurrencies else report_tables)(report):
        console.print(table)
    for line in error_lines(report):
        console.print(line, highlight=False, markup=False)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        console.print(f"report written to {args.out}")
    return 0 if any(run["completed"] for run in report["runs"]) else 1  # 1: nothing was measured


def command_line(args: argparse.Namespace) -> str:
    """The command as typed (sys.argv) when run from the shell, else rebuilt from the parsed
    options that differ from their defaults (called from Python: `main([...])`)."""
    if sys.argv[1:2] == ["bench-serve"]:
        return " ".join(["sparse-framework", *map(shlex.quote, sys.argv[1:])])
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    defaults = vars(parser.parse_args(["bench-serve"]))
    words = ["sparse-framework", "bench-serve"]
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if key not in defaults or value == defaults[key] or key == "command":
            continue
        if isinstance(value, bool):  # store_true / store_false flags
            words.append({"ignore_eos": "--no-ignore-eos"}.get(key, flag))
        elif key == "meta":  # repeated: one flag per pair
            words += [w for pair in value for w in (flag, pair)]
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return " ".join(map(shlex.quote, words))


def report_tables(report: dict[str, Any]) -> list[Table]:
    """Two tables of one row per rate, each within 80 columns: throughput, then latency (ms)."""
    from ..common.tables import new_table

    slo = " and ".join(f"{what} <= {report[key]:g} ms" for what, key in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
                       if report[key] is not None)
    first = new_table(f"bench-serve: {report['model']}, {report['num_prompts']} requests per rate", (
        "ok: completed / sent; req/s and out tok/s over the rate's duration (first send to last answer); "
        + (f"goodput: requests with {slo} per second" if slo else "goodput: give --slo-ttft-ms / --slo-tpot-ms")),
        tight=True)
    for col in ("rate", "ok", "failed", "time s", "req/s", "out tok/s", "in tok", "out tok", "goodput"):
        first.add_column(col, justify="right", no_wrap=True)
    second = new_table("latency (ms)", "TTFT: to the first token; TPOT: per output token after it; ITL: between "
                       "tokens; E2E: the whole request", tight=True)
    for col in ("rate", "TTFT p50", "p99", "TPOT p50", "p99", "ITL p50", "p99", "E2E p50", "p99"):
        second.add_column(col, justify="right", no_wrap=True)
    for run in report["runs"]:
        rate = rate_text(run["request_rate"])
        first.add_row(rate, f"{run['completed']}/{run['sent']}", str(run["failed"]), f"{run['duration_s']:.1f}",
                      _num(run["request_throughput"], ".2f"), _num(run["output_throughput"], ",.1f"),
                      f"{run['input_tokens']:,}", f"{run['output_tokens']:,}", _num(run["goodput"], ".2f"))
        second.add_row(rate, *(_ms(run[k][f"p{q}"]) for k in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms")
                               for q in PERCENTILES))
    return [first, second]


def curve_tables(report: dict[str, Any]) -> list[Table]:
    """A concurrency sweep in one table of one row per N, within 80 columns: throughput, then
    TTFT and TPOT p50/p99 (ms)."""
    from ..common.tables import new_table

    k, floor = report.get("prompts_per_concurrency"), report.get("min_prompts")
    table = new_table(f"bench-serve: {report['label']}, concurrency sweep",
                      f"N: at most N in flight, {k} x N requests (at least {floor}) offered at once; out tok/s over "
                      "the point's duration (first send to last answer); TTFT to the first token, TPOT per output "
                      "token after it (ms)", tight=True, drop=("time s",))
    for col in ("N", "ok", "failed", "time s", "out tok/s", "TTFT p50", "p99", "TPOT p50", "p99"):
        table.add_column(col, justify="right", no_wrap=True)
    for run in report["runs"]:
        table.add_row(str(run["max_concurrency"]), f"{run['completed']}/{run['sent']}", str(run["failed"]),
                      f"{run['duration_s']:.1f}", _num(run["output_throughput"], ",.1f"),
                      *(_ms(run[key][f"p{q}"]) for key in ("ttft_ms", "tpot_ms") for q in PERCENTILES))
    return [table]


def run_name(report: dict[str, Any], run: dict[str, Any]) -> str:
    """A run as the error lines name it: "concurrency N" in a concurrency sweep, else "rate R"."""
    if report.get("mode") == "concurrency":
        return f"concurrency {run['max_concurrency']}"
    return f"rate {rate_text(run['request_rate'])}"


def error_lines(report: dict[str, Any]) -> list[str]:
    """One line per run and kind of failure: how many, and the first reason."""
    return [f"{run_name(report, run)}: {e['count']} x {kind}: {e['message']}"
            for run in report["runs"] for kind, e in run["errors"].items()]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ms(value: float | None) -> str:
    """Milliseconds in at most 7 characters (eight columns of them fit 80): 3 significant
    figures below 100 ms, whole milliseconds above."""
    if value is None:
        return "-"
    return format(value, ".2f" if value < 10 else ".1f" if value < 100 else ",.0f")
