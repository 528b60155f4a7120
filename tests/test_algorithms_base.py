"""topk_selection and reduce_groups: the scoring base's selection rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.algorithms.base import reduce_groups, topk_selection


def expected_units(scores: torch.Tensor, length: int, unit: int, budget: int, sink: int, recent: int) -> set[int]:
    """Direct per-row computation: forced units ∪ best `budget` of the remaining valid units."""
    n_valid = -(-length // unit)
    forced = {u for u in range(n_valid) if u * unit < sink}
    forced |= {u for u in range(n_valid) if u >= max(0, length - recent) // unit}
    forced.add((length - 1) // unit)
    rest = sorted((u for u in range(n_valid) if u not in forced), key=lambda u: -float(scores[u]))
    return forced | set(rest[:budget])


@settings(max_examples=60, deadline=None)
@given(
    unit=st.sampled_from([1, 2, 4]),
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=3),
    heads=st.sampled_from([1, 2]),
    budget=st.integers(0, 10),
    sink=st.integers(0, 6),
    recent=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_selection_rules(unit, lens, heads, budget, sink, recent, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    n_units = -(-max(lens) // unit)
    scores = torch.randperm(len(lens) * heads * n_units, generator=g).float().view(len(lens), heads, n_units)
    width_units = -(-sink // unit) + budget + -(-recent // unit) + 1
    sel = topk_selection(
        scores, torch.tensor(lens, dtype=torch.int32), unit=unit, budget_units=budget,
        sink_tokens=sink, recent_tokens=recent, width_units=width_units,
    )
    assert sel.indices.dtype == torch.int32 and sel.lengths.dtype == torch.int32
    assert sel.indices.shape == (len(lens), heads, min(width_units, n_units) * unit)
    assert sel.page_size == unit
    sel.validate(torch.tensor(lens))  # ascending, -1 padded, inside [0, len)
    for b, length in enumerate(lens):
        for h in range(heads):
            toks = sel.indices[b, h, : sel.lengths[b, h]].tolist()
            units = {t // unit for t in toks}
            assert units == expected_units(scores[b, h], length, unit, budget, sink, recent)
            # whole units: every token of a kept unit below the length is there
            assert toks == [t for u in sorted(units) for t in range(u * unit, min((u + 1) * unit, length))]


def test_budget_covering_everything_selects_every_token() -> None:
    scores = torch.randn(2, 1, 10)
    sel = topk_selection(scores, torch.tensor([37, 9]), unit=4, budget_units=10, sink_tokens=0,
                         recent_tokens=0, width_units=11)
    assert sel.lengths.tolist() == [[37], [9]]
    assert sel.indices[0, 0, :37].tolist() == list(range(37))
    assert sel.indices[1, 0, :9].tolist() == list(range(9)) and bool((sel.indices[1, 0, 9:] == -1).all())


@pytest.mark.parametrize("how", ["max", "sum", "mean"])
def test_reduce_groups_matches_a_loop(how) -> None:
    x = torch.randn(3, 8, 5)
    got = reduce_groups(x, 2, how)
    for b in range(3):
        for h in range(2):
            group = x[b, h * 4 : (h + 1) * 4]
            want = {"max": group.amax(0), "sum": group.sum(0), "mean": group.mean(0)}[how]
            assert torch.allclose(got[b, h], want)


def test_reduce_groups_rejects_unknown_reduction() -> None:
    with pytest.raises(ValueError, match="gqa_reduce must be one of max, sum, mean; got 'min'"):
        reduce_groups(torch.zeros(1, 2, 3), 1, "min")
