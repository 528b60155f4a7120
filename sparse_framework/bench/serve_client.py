"""The HTTP side of `bench-serve`: streamed completions sent and timed, one point's requests in flight.

`send` times one streamed /v1/completions request (TTFT, ITL, latency, the server's usage) into a
`RequestResult`, a failure counted as its kind and reason rather than raised; `run_point` sends a
point's requests at their arrivals under its concurrency cap over one connection pool and counts
the most in flight; `served_model` asks the server its model (GET /v1/models). httpx is imported
only here, inside the functions, so the rest of the benchmark loads without it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..common.errors import ConfigError
from .serve_load import BenchRequest, poisson_arrivals
from .serve_spec import Point, ServeBenchSpec

if TYPE_CHECKING:
    import httpx


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
