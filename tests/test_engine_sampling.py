"""engine/sampling.py against a plain float64 reference: greedy, top-k, top-p, temperature,
per-request seeds, validation and stop conditions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sparse_framework.common.errors import ConfigError
from sparse_framework.engine.sampling import SamplingParams, Sampler, finished

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def make_logits(seed: int, rows: int, vocab: int, scale: float, quantum: float) -> torch.Tensor:
    """Random float32 logits; quantum > 0 rounds them to its multiples, so ties are common."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    return torch.round(x / quantum) * quantum if quantum > 0 else x


def reference(row: torch.Tensor, p: SamplingParams) -> tuple[dict[int, float], float]:
    """The distribution a row is sampled from, plainly in float64: {token: probability} over
    the kept set, and the distance of top_p from the nearest cumulative sum (to skip cases
    where float32 rounding may legitimately decide the nucleus differently)."""
    x = row.double().tolist()
    vocab = len(x)
    if p.greedy:
        return {max(range(vocab), key=lambda i: (x[i], -i)): 1.0}, math.inf
    x = [v / p.temperature for v in x]
    order = sorted(range(vocab), key=lambda i: (-x[i], i))  # highest first, ties: lowest id
    k = p.top_k if 0 < p.top_k < vocab else vocab
    top = order[:k]
    m = x[top[0]]
    weights = [math.exp(x[i] - m) for i in top]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, before, margin = [], 0.0, math.inf
    for i, q in zip(top, probs):
        if p.top_p < 1.0:
            margin = min(margin, abs(before - p.top_p))
            if before >= p.top_p:
                break
        kept.append((i, q))
        before += q
    mass = sum(q for _, q in kept)
    return {i: q / mass for i, q in kept}, margin


def chi_square(counts: torch.Tensor, dist: dict[int, float], n: int) -> tuple[float, int]:
    """Pearson's statistic of the counts against `dist` (bins expecting < 5 pooled into one;
    a count outside the distribution's support makes it infinite) and its degrees of freedom."""
    outside = sum(int(c) for t, c in enumerate(counts.tolist()) if t not in dist)
    if outside:
        return math.inf, 0
    stat, bins, pooled_obs, pooled_exp = 0.0, 0, 0.0, 0.0
    for token, q in dist.items():
        obs, exp = float(counts[token]), n * q
        if exp < 5:
            pooled_obs += obs
            pooled_exp += exp
        else:
            stat += (obs - exp) ** 2 / exp
            bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1.0)
        bins += 1
    return stat, max(bins - 1, 1)


def bound(df: int) -> float:
    """Far in the chi-square tail (about 5 standard deviations): fixed seeds pass it, a wrong
    distribution at several thousand draws does not."""
    return df + 5 * math.sqrt(2 * df) + 10


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 2.5]),
    top_k=st.integers(-1, 12),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2, 0.01]),
)


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    params=st.lists(params_strategy, min_size=1, max_size=8),
    vocab=st.integers(1, 40),
    quantum=st.sampled_from([0.0, 0.5]),
)
def test_greedy_rows_equal_argmax(seed: int, params: list[SamplingParams], vocab: int, quantum: float) -> None:
    """Greedy rows (temperature 0) are torch.argmax (ties: lowest id) whatever the other rows are."""
    params = [SamplingParams(temperature=0.0, top_k=p.top_k, top_p=p.top_p) if i % 2 == 0 else p
              for i, p in enumerate(params)]
    logits = make_logits(seed, len(params), vocab, 3.0, quantum)
    out = Sampler(seed).sample(logits, params)
    expect = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            assert out[i] == expect[i]
        assert 0 <= out[i] < vocab


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.01, 100.0),
    top_p=st.sampled_from([1.0, 0.5, 0.01]),
    quantum=st.sampled_from([0.0, 0.5]),
)
def test_top_k_one_is_greedy_at_any_temperature(seed: int, temperature: float, top_p: float, quantum: float) -> None:
    logits = make_logits(seed, 16, 64, 2.0, quantum)
    params = [SamplingParams(temperature=temperature, top_k=1, top_p=top_p)] * 16
    assert torch.equal(Sampler(seed).sample(logits, params), logits.argmax(dim=-1))


def test_all_greedy_draws_no_random_numbers() -> None:
    sampler = Sampler(0)
    sampler.sample(torch.randn(3, 10), [SamplingParams(temperature=0.0)] * 3)
    state = sampler._shared(torch.device("cpu")).get_state()
    sampler.sample(torch.randn(5, 10), [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 2 + [
        SamplingParams(temperature=0.0, seed=4)])
    assert torch.equal(state, sampler._shared(torch.device("cpu")).get_state())


DRAWS = 4000


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.3, 0.6, 1.0, 2.0]),
    top_k=st.integers(-1, 45),
    top_p=st.sampled_from([1.0, 0.97, 0.9, 0.7, 0.5, 0.3, 0.05]),
    scale=st.sampled_from([0.5, 1.5, 3.0]),
    quantum=st.sampled_from([0.0, 0.25]),
)
def test_samples_follow_the_reference_nucleus(
    seed: int, vocab: int, temperature: float, top_k: int, top_p: float, scale: float, quantum: float
) -> None:
    """Many draws of one row: no token outside the reference top-k/nucleus set ever appears, and
    the frequencies match the renormalised reference distribution; the same check against the
    distribution with the temperature ignored fails wherever that one is clearly different."""
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    row = make_logits(seed, 1, vocab, scale, quantum)[0]
    dist, margin = reference(row, p)
    assume(margin > 1e-4)
    tokens = Sampler(seed).sample(row.expand(DRAWS, vocab).contiguous(), [p] * DRAWS)
    counts = torch.bincount(tokens, minlength=vocab)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(dist)
    stat, df = chi_square(counts, dist, DRAWS)
    assert stat < bound(df), (stat, df, dist)

    wrong, wrong_margin = reference(row, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p))
    distance = sum(abs(dist.get(t, 0.0) - wrong.get(t, 0.0)) for t in set(dist) | set(wrong)) / 2
    if distance > 0.15 and wrong_margin > 1e-4:
        wrong_stat, wrong_df = chi_square(counts, wrong, DRAWS)
        assert wrong_stat > bound(wrong_df), (wrong_stat, distance)


def test_frequency_check_rejects_an_ignored_temperature() -> None:
    """The check above has power: at temperature 0.5 on these logits, draws at temperature 1
    (what a sampler ignoring the temperature would give) fail it; the right ones pass."""
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    cold = SamplingParams(temperature=0.5, top_p=0.95)
    dist, _ = reference(row, cold)
    good = torch.bincount(Sampler(1).sample(row.expand(DRAWS, 8), [cold] * DRAWS), minlength=8)
    bad = torch.bincount(
        Sampler(1).sample(row.expand(DRAWS, 8), [SamplingParams(top_p=0.95)] * DRAWS), minlength=8
    )
    assert chi_square(good, dist, DRAWS)[0] < bound(chi_square(good, dist, DRAWS)[1])
    stat, df = chi_square(bad, dist, DRAWS)
    assert stat > bound(df)


def test_top_k_ties_keep_the_lowest_ids() -> None:
    row = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0, 3.0])
    p = SamplingParams(top_k=2)
    tokens = Sampler(0).sample(row.expand(500, 6), [p] * 500)
    assert set(tokens.tolist()) == {1, 3}


SEEDED = [
    SamplingParams(seed=7),
    SamplingParams(seed=7, temperature=0.8, top_k=5),
    SamplingParams(seed=123, top_p=0.9),
    SamplingParams(seed=2**64 - 1, temperature=1.3, top_k=20, top_p=0.8),
]


@pytest.mark.parametrize("params", SEEDED, ids=lambda p: f"k{p.top_k}-p{p.top_p}")
def test_seeded_row_ignores_its_batch(params: SamplingParams) -> None:
    """A seeded request's tokens are the same alone, at another row of a batch, with other rows
    (greedy, filtered, seeded or not, of other top_k) changing at every step."""
    steps, vocab = 12, 50
    own = [make_logits(100 + s, 1, vocab, 2.0, 0.0)[0] for s in range(steps)]
    others_pool = [
        SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=40),
        SamplingParams(top_k=3, top_p=0.5, seed=99), SamplingParams(top_p=0.3), SamplingParams(seed=5),
    ]

    def run(position: int | None, sampler_seed: int) -> list[int]:
        sampler = Sampler(sampler_seed)
        gen = params.make_generator("cpu")
        other_gens = {id(p): p.make_generator("cpu") for p in others_pool}
        out = []
        for s in range(steps):
            if position is None:
                rows, ps, gens, at = own[s][None], [params], [gen], 0
            else:
                n = 2 + (s * 3 + position) % 5
                at = min(position, n)
                others = [others_pool[(s + j + position) % len(others_pool)] for j in range(n)]
                rows = make_logits(1000 * position + s, n + 1, vocab, 3.0, 0.0)
                rows[at] = own[s]
                ps = others[:at] + [params] + others[at:]
                gens = [other_gens[id(p)] for p in others[:at]] + [gen] + [other_gens[id(p)] for p in others[at:]]
            out.append(int(sampler.sample(rows, ps, gens)[at]))
        return out

    alone = run(None, 0)
    assert run(3, 1) == alone
    assert run(0, 2) == alone
    assert run(5, 3) == alone
    other_seed = SamplingParams(seed=params.seed ^ 1, temperature=params.temperature,
                                top_k=params.top_k, top_p=params.top_p)
    gen = other_seed.make_generator("cpu")
    diverged = [int(Sampler(0).sample(own[s][None], [other_seed], [gen])[0]) for s in range(steps)]
    assert diverged != alone  # the seed matters (12 draws from >= 3 likely tokens)


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = make_logits(3, 6, 30, 1.0, 0.0)
    params = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(top_p=0.8)] * 2
    a = [Sampler(11).sample(logits, params) for _ in range(1)]
    first = Sampler(11)
    b = [first.sample(logits, params), first.sample(logits, params)]
    assert torch.equal(a[0], b[0])
    assert not all(torch.equal(Sampler(s).sample(logits, params), a[0]) for s in range(12, 16))


BAD = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")), ("top_p", "0.9"),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0), ("seed", True),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", "12"), ("stop_token_ids", 3),
    ("stop_token_ids", [1.0]),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
]


@pytest.mark.parametrize("field,value", BAD, ids=lambda v: repr(v))
def test_bad_value_is_one_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}={value!r}" in str(err.value)
    assert "invalid:" in str(err.value)


def test_accepted_values_and_normalisation() -> None:
    p = SamplingParams(max_tokens=1, temperature=0, top_k=-1, top_p=1, seed=0, stop_token_ids=[3, 4])
    assert (p.top_k, p.temperature, p.stop_token_ids, p.greedy) == (0, 0.0, (3, 4), True)
    assert SamplingParams(top_k=1).greedy and not SamplingParams().greedy
    assert SamplingParams.from_dict({"max_tokens": 4, "top_p": 0.5}) == SamplingParams(max_tokens=4, top_p=0.5)
    assert SamplingParams().make_generator("cpu") is None


def test_model_dependent_check_and_unknown_fields() -> None:
    SamplingParams(stop_token_ids=[9]).check(10)
    with pytest.raises(ConfigError, match=r"stop_token_ids contains 10.*\[0, 10\)"):
        SamplingParams(stop_token_ids=[9, 10]).check(10)
    with pytest.raises(ConfigError, match="no field 'topk'.*Did you mean 'top_k'"):
        SamplingParams.from_dict({"topk": 3})


def test_bad_calls_are_clear() -> None:
    sampler = Sampler(0)
    with pytest.raises(ValueError, match="rows, vocab"):
        sampler.sample(torch.randn(5), [SamplingParams()])
    with pytest.raises(ValueError, match="2 logits rows but 1 SamplingParams"):
        sampler.sample(torch.randn(2, 5), [SamplingParams()])
    with pytest.raises(ValueError, match="row 1 has seed=3 but no generator"):
        sampler.sample(torch.randn(2, 5), [SamplingParams(), SamplingParams(seed=3)], [None, None])


@pytest.mark.parametrize(
    "params,token,n,eos,expect",
    [
        (SamplingParams(max_tokens=3), 5, 1, 2, None),
        (SamplingParams(max_tokens=3), 5, 3, 2, "length"),
        (SamplingParams(max_tokens=3), 2, 1, 2, "stop"),
        (SamplingParams(max_tokens=3), 2, 3, 2, "stop"),  # a stop beats the length
        (SamplingParams(max_tokens=3, ignore_eos=True), 2, 1, 2, None),
        (SamplingParams(max_tokens=3, ignore_eos=True), 2, 3, 2, "length"),
        (SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[2]), 2, 1, 2, "stop"),
        (SamplingParams(stop_token_ids=[7, 8]), 8, 1, None, "stop"),
        (SamplingParams(), 9, 1, [8, 9], "stop"),  # Llama 3: several end-of-sequence ids
        (SamplingParams(), 9, 1, None, None),
    ],
)
def test_finished(params: SamplingParams, token: int, n: int, eos, expect) -> None:  # noqa: ANN001
    assert finished(params, token, n, eos) == expect
