"""The load of a `bench-serve` run: when each request is sent and what it asks.

Poisson send offsets of a rate, and the requests themselves: synthetic prompts of exact token
counts built with the served model's tokenizer (lengths drawn as `bench` draws them), or the
lines of a JSONL dataset. Everything here is decided before the first request is sent, seeded, so
that every point of a sweep sends the same prompts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.errors import ConfigError, SparseFrameworkError
from .offline import draw_lengths  # `bench`'s lengths, drawn alike
from .serve_spec import ServeBenchSpec


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt (text or token ids), prompt length when known before sending
    (synthetic prompts), and the tokens it asks for."""

    prompt: str | list[int]
    max_tokens: int
    prompt_len: int | None = None


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
