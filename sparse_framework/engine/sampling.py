"""Sampling: the per-request parameters (vLLM's names) and a batched sampler.

`SamplingParams` validates every field when it is made, so a bad request is refused with one
`ConfigError` before it reaches the engine. `Sampler.sample` turns a step's logits rows
[R, V] into one token per row, each row with its own parameters:

- greedy rows (temperature 0, or top_k 1) take the argmax (ties: the lowest token id);
- every other row is sampled from softmax(logits / temperature), restricted first to the
  top_k highest logits, then to the nucleus: the smallest set of highest-probability tokens
  whose probability (renormalised over the top-k set) reaches top_p, never empty. Ties in the
  order (equal logits) go to the lower token id, so the kept set is exactly defined.

Sampling uses the exponential race (the Gumbel-max trick): with E_i ~ Exp(1) independent,
argmax_i (x_i - log E_i) over the kept tokens is a draw from softmax(x) over them. Each
sampled row draws exactly one vector of V exponentials per step, from its own generator when
the request has a seed, otherwise (together with the other unseeded rows, in one op) from the
sampler's generator. A seeded request's tokens therefore depend only on its seed and its
logits, never on the batch it is in or its row. Everything after the draws is vectorised over
rows: one argmax for the plain rows, one top-k (or full sort) for the filtered rows.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..common.errors import ConfigError, closest
from ..common.transfer import to_device

# Below this temperature a row is greedy: dividing by it would only overflow (vLLM does the same).
GREEDY_TEMPERATURE = 1e-5
_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes 0 <= seed < 2**64


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops (vLLM's field names).

    max_tokens: tokens to generate at most (>= 1).
    temperature: >= 0; 0 (or below 1e-5) is greedy.
    top_k: keep the k highest logits; 0 or -1 = off (a k >= the vocabulary is off as well).
    top_p: nucleus mass in (0, 1]; 1 = off.
    seed: None (the engine's generator) or an int in [0, 2**64): the request's own generator,
        so its tokens do not depend on the batch it is in.
    stop_token_ids: tokens that end the request (the token is kept in the output).
    stop: strings that end the request (a string or a list of them, none empty): the output
        text ends before the first one to complete in it (engine/stop.py), finish_reason
        "stop"; the token that completed it is the last output token. Needs the engine's
        tokenizer (`LLM` passes its own): without one, a request with stop strings is refused.
    include_stop_str_in_output: keep the stop string at the end of the text.
    ignore_eos: keep generating past the model's end-of-sequence token.
    sparse: this request's decoding (not a vLLM field): None follows the sparse config's rule
        (prompts shorter than min_sparse_prompt_len decode densely), False decodes it densely,
        True sparsely even when its prompt is short (the coordinator's `decodes_densely`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sparse: bool | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ConfigError:
            return ConfigError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {allowed}.")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= 1, or 0 / -1 for off")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):  # NaN fails the comparison
            raise bad("top_p", "a number in (0, 1] (1 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _SEED_LIMIT):
            raise bad("seed", "None or an integer in [0, 2**64)")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes, Mapping)) or not isinstance(stops, Collection):
            raise bad("stop_token_ids", "a list of token ids (integers >= 0)")
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise bad("stop_token_ids", "a list of token ids (integers >= 0)")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "true or false")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if (isinstance(stop, (bytes, Mapping)) or not isinstance(stop, Collection)
                or not all(isinstance(s, str) and s for s in stop)):
            raise bad("stop", "a string or a list of strings, none of them empty (or None / [] for none)")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", "true or false")
        if self.sparse is not None and not isinstance(self.sparse, bool):
            raise bad("sparse", "None (the sparse config's rule), true (sparse) or false (dense)")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        object.__setattr__(self, "stop", tuple(stop))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping (JSON, CLI); an unknown key is a ConfigError naming it."""
        names = [f.name for f in fields(cls)]
        for key in values:
            if key not in names:
                raise ConfigError(
                    f"SamplingParams has no field '{key}'.{closest(str(key), names)} "
                    f"Fields: {', '.join(names)}."
                )
        return cls(**values)

    def check(self, vocab_size: int) -> None:
        """Check the fields that depend on the model: every stop token id < vocab_size."""
        for token in self.stop_token_ids:
            if token >= vocab_size:
                raise ConfigError(
                    f"SamplingParams.stop_token_ids contains {token}, outside the model's "
                    f"vocabulary: token ids must be in [0, {vocab_size})."
                )

    @property
    def greedy(self) -> bool:
        """True when the row takes the argmax and draws no random numbers."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def make_generator(self, device: torch.device | str) -> torch.Generator | None:
        """The request's own generator (seeded, on the device of the logits), or None when
        the request has no seed. The engine keeps it for the request's lifetime."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def finished(
    params: SamplingParams,
    token: int,
    num_generated: int,
    eos_token_id: int | Collection[int] | None,
) -> str | None:
    """Why the request stops after emitting `token` as its `num_generated`-th output token:
    "stop" (a stop token, or the model's end of sequence unless ignore_eos), "length"
    (max_tokens reached), or None to go on. A stop token wins over the length, as in vLLM.
    Stop strings need the text: the engine matches them (engine/stop.py), and they win over
    the length too."""
    if token in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and eos_token_id is not None:
        eos = (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
        if token in eos:
            return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys that sort like (x descending, token id ascending) when sorted descending:
    a strict total order, so top-k and the nucleus are defined exactly even for tied logits.

    x: [n, V] float32. The float's bits, mapped to an order-preserving int32 (negative floats
    have their magnitude bits flipped), go in the high 32 bits, (2**32 - 1 - id) in the low."""
    bits = (x + 0.0).contiguous().view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    low = 0xFFFFFFFF - torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return key.bitwise_left_shift_(32).bitwise_or_(low)  # in place: one int64 [n, V] at a time


class Sampler:
    """Samples one token per logits row, each row with its own `SamplingParams`.

    seed: the sampler-wide generator's seed, for rows whose request has no seed (None: a
    nondeterministic seed). One generator per device, made on first use.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed if seed is not None else int(torch.seed() % _SEED_LIMIT)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    def __call__(self, logits, params, generators=None) -> torch.Tensor:  # noqa: ANN001
        return self.sample(logits, params, generators)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """logits: [R, V] float32; params: R entries; generators: R entries or None — row i
        draws from generators[i] when given (required for a request with a seed: its
        `make_generator`), else from the sampler's generator. Returns token ids [R] int64 on
        the logits' device. Greedy rows draw nothing; every other row draws V exponentials."""
        rows, vocab = self._check(logits, params, generators)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == rows:  # the common case: one argmax, nothing copied to the device
            return logits.argmax(dim=-1)
        device = logits.device
        out = torch.empty(rows, dtype=torch.int64, device=device)
        if greedy:
            idx = to_device(greedy, torch.long, device)
            out[idx] = logits[idx].argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        gumbel = self._gumbel(sampled, vocab, logits.device, generators)
        plain = [j for j, i in enumerate(sampled) if params[i].top_k == 0 and params[i].top_p >= 1.0]
        filtered = sorted(set(range(len(sampled))) - set(plain))
        for group, fn in ((plain, self._sample_plain), (filtered, self._sample_filtered)):
            if group:
                at = to_device([sampled[j] for j in group], torch.long, device)
                group_params = [params[sampled[j]] for j in group]
                out[at] = fn(logits[at], group_params, gumbel[to_device(group, torch.long, device)])
        return out

    @staticmethod
    def _check(logits: torch.Tensor, params: Sequence[SamplingParams], generators) -> tuple[int, int]:  # noqa: ANN001
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor [rows, vocab], got {tuple(logits.shape)} {logits.dtype}")
        rows, vocab = logits.shape
        if len(params) != rows:
            raise ValueError(f"{rows} logits rows but {len(params)} SamplingParams")
        if generators is not None and len(generators) != rows:
            raise ValueError(f"{rows} logits rows but {len(generators)} generators")
        for i, p in enumerate(params):
            g = generators[i] if generators is not None else None
            if p.seed is not None and not p.greedy and g is None:
                raise ValueError(
                    f"row {i} has seed={p.seed} but no generator: pass params.make_generator(device) "
                    "and keep it for the request, so its tokens follow its seed"
                )
            if g is not None and not _same_device(torch.device(g.device), logits.device):
                raise ValueError(f"row {i}'s generator is on {g.device}, the logits on {logits.device}")
        return rows, vocab

    def _gumbel(self, sampled: list[int], vocab: int, device: torch.device, generators) -> torch.Tensor:  # noqa: ANN001
        """-log E, E ~ Exp(1): [len(sampled), V] float32. Rows with their own generator draw
        one vector each; the others draw together from the sampler's generator."""
        noise = torch.empty(len(sampled), vocab, dtype=torch.float32, device=device)
        own = [j for j, i in enumerate(sampled) if generators is not None and generators[i] is not None]
        shared = [j for j, i in enumerate(sampled) if generators is None or generators[i] is None]
        for j in own:
            noise[j].exponential_(generator=generators[sampled[j]])
        if len(shared) == len(sampled):  # the common case: one op, no copy
            noise.exponential_(generator=self._shared(torch.device(device)))
        elif shared:
            draw = torch.empty(len(shared), vocab, dtype=torch.float32, device=device)
            noise[to_device(shared, torch.long, device)] = draw.exponential_(generator=self._shared(torch.device(device)))
        # E == 0 would give +inf; clamping keeps every score finite (a kept token's x is finite).
        return noise.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()

    @staticmethod
    def _temperatures(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
        return to_device([p.temperature for p in params], torch.float32, device)[:, None]

    def _sample_plain(self, logits: torch.Tensor, params: list[SamplingParams], gumbel: torch.Tensor) -> torch.Tensor:
        """No top-k / top-p: argmax(x / T + Gumbel) over the whole vocabulary."""
        x = logits.float() / self._temperatures(params, logits.device)
        return (x + gumbel).argmax(dim=-1)

    def _sample_filtered(self, logits: torch.Tensor, params: list[SamplingParams], gumbel: torch.Tensor) -> torch.Tensor:
        """Top-k then top-p, then the race over the kept candidates.

        Candidates: the c highest keys, c = the largest top_k of the group (all V when a row
        has none): a top-k of c when c < V, else a full sort. Each row's own mask depends only
        on its first top_k candidates, so the other rows' c never changes its result."""
        device = logits.device
        vocab = logits.shape[-1]
        x = logits.float() / self._temperatures(params, device)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        c = max(ks)
        key = order_key(x)
        if c < vocab:
            cand = key.topk(c, dim=-1, sorted=True).indices
        else:
            cand = key.sort(dim=-1, descending=True).indices
        xs = x.gather(1, cand)  # [n, c], descending
        weights = torch.exp(xs - xs[:, :1])  # unnormalised probabilities, the first is 1
        cum = weights.cumsum(dim=-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # exclusive cumsum
        k = to_device(ks, torch.long, device)[:, None]
        keep = torch.arange(c, device=device)[None, :] < k
        total = cum.gather(1, k - 1)  # mass of the row's top-k set
        top_p = to_device([p.top_p for p in params], torch.float32, device)[:, None]
        keep &= (before < top_p * total) | (top_p >= 1.0)
        score = torch.where(keep, xs + gumbel.gather(1, cand), float("-inf"))
        return cand.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
