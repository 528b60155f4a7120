"""The options of a `bench-serve` run and the points of its sweep.

`ServeBenchSpec` owns every option and refuses a bad one by its flag's name when built, so that
the load (serve_load.py), the client (serve_client.py) and the sweep (online.py) read values
already checked; `spec.points()` turns a rate sweep or a concurrency sweep into the runs in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import ConfigError
from .offline import LENGTH_DISTRIBUTIONS  # `bench`'s lengths, drawn alike

PROMPT_FORMATS = ("text", "ids")


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
