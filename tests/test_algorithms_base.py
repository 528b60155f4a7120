"""topk_selection and reduce_groups: the scoring base's selection rules, against direct
per-row Python computations."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.algorithms.base import topk_selection
from sparse_framework.kernels.reference.scores import reduce_groups
from sparse_framework.config import load_config


def forced_tokens(length: int, sink: int, recent: int, newest: bool = True, tail: int | None = None) -> set[int]:
    """Tokens kept outside the budget: the sinks, the recent window, a forced tail from
    `tail` on, and (newest) the newest token."""
    tail_tokens = set(range(min(tail, length), length)) if tail is not None else set()
    return (set(range(min(sink, length))) | set(range(max(0, length - recent), length)) | tail_tokens
            | ({length - 1} if newest else set()))


def expected_units(scores: list[float], length: int, unit: int, budget: int, sink: int, recent: int,
                   newest: bool = True, tail: int | None = None) -> set[int]:
    """Direct per-row computation: units holding a forced token, plus the `budget` best-scoring
    of the remaining valid units (scores are distinct, so the set is unique); without
    `newest`, the newest token's unit, if not forced, is the first of those `budget`."""
    n_valid = -(-length // unit)
    forced = {t // unit for t in forced_tokens(length, sink, recent, newest, tail)}
    rest = sorted((u for u in range(n_valid) if u not in forced), key=lambda u: -scores[u])
    last = (length - 1) // unit
    if last in rest:
        rest = [last] + [u for u in rest if u != last] if not newest else rest
    return forced | set(rest[:budget])


def width_units_for(unit: int, budget: int, sink: int, recent: int) -> int:
    """The framework's static width in units: sink units + budget + recent units + 1."""
    return -(-sink // unit) + budget + -(-recent // unit) + 1


def poison_invalid(scores: torch.Tensor, lens: list[int], unit: int, gen: torch.Generator) -> torch.Tensor:
    """Units at or past a request's length may hold anything: make them +inf, NaN or huge."""
    out = scores.clone()
    junk = torch.tensor([float("inf"), float("nan"), 1e30, float("-inf")])
    for b, length in enumerate(lens):
        n_valid = -(-length // unit)
        tail = out[b, :, n_valid:]
        tail.copy_(junk[torch.randint(0, 4, tail.shape, generator=gen)])
    return out


@settings(max_examples=80, deadline=None)
@given(
    unit=st.sampled_from([1, 2, 4]),
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=3),
    heads=st.sampled_from([1, 2]),
    budget=st.integers(0, 10),
    sink=st.integers(0, 6),
    recent=st.integers(0, 9),
    seed=st.integers(0, 2**16),
    newest=st.booleans(),
    tails=st.one_of(st.none(), st.lists(st.integers(0, 60), min_size=3, max_size=3)),
)
def test_selection_rules(unit, lens, heads, budget, sink, recent, seed, newest, tails) -> None:
    """newest False: the newest unit counts in the budget (DSA's / Quest's exact count);
    tails: a per-row forced tail (SnapKV's window and decoded tokens)."""
    g = torch.Generator().manual_seed(seed)
    n_units = -(-max(lens) // unit)
    budget = budget if newest else max(budget, 1)
    scores = torch.randperm(len(lens) * heads * n_units, generator=g).float().view(len(lens), heads, n_units)
    scores = poison_invalid(scores, lens, unit, g)
    width_units = width_units_for(unit, budget, sink, recent) + (n_units if tails is not None else 0)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tail_list = None if tails is None else tails[: len(lens)]
    sel = topk_selection(
        scores, seq_lens, unit=unit, budget_units=budget,
        sink_tokens=sink, recent_tokens=recent, width_units=width_units, newest_forced=newest,
        tail_start=None if tail_list is None else torch.tensor(tail_list),
    )
    assert sel.indices.dtype == torch.int32 and sel.lengths.dtype == torch.int32
    assert sel.indices.shape == (len(lens), heads, min(width_units, n_units) * unit)
    assert sel.lengths.shape == (len(lens), heads)
    assert sel.page_size == unit
    sel.validate(seq_lens)  # the contract's own check
    for b, length in enumerate(lens):
        for h in range(heads):
            n = int(sel.lengths[b, h])
            row = sel.indices[b, h].tolist()
            toks = row[:n]
            # int32, ascending, inside [0, len), -1 after lengths: checked directly too
            assert toks == sorted(set(toks)) and all(0 <= t < length for t in toks)
            assert row[n:] == [-1] * (len(row) - n)
            # forced tokens, token by token (the newest is always kept: forced or first in the budget)
            tail = None if tail_list is None else tail_list[b]
            assert forced_tokens(length, sink, recent, True, tail) <= set(toks)
            # the selected units are exactly forced ∪ best `budget` of the rest
            units = {t // unit for t in toks}
            assert units == expected_units(scores[b, h].tolist(), length, unit, budget, sink, recent, newest, tail)
            # whole units: every token of a kept unit below the length is there
            assert toks == [t for u in sorted(units) for t in range(u * unit, min((u + 1) * unit, length))]


@settings(max_examples=40, deadline=None)
@given(
    unit=st.sampled_from([1, 2, 4, 8]),
    lens=st.lists(st.integers(1, 50), min_size=1, max_size=3),
    heads=st.sampled_from([1, 2, 4]),
    extra=st.integers(0, 3),
    sink=st.integers(0, 6),
    recent=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_budget_covering_every_unit_selects_every_token(unit, lens, heads, extra, sink, recent, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    n_units = -(-max(lens) // unit)
    scores = torch.randn(len(lens), heads, n_units, generator=g)
    odd = torch.rand(scores.shape, generator=g) < 0.3  # valid units may score ±inf or NaN too
    scores[odd] = torch.tensor([float("inf"), float("-inf"), float("nan")])[torch.randint(0, 3, (int(odd.sum()),), generator=g)]
    scores = poison_invalid(scores, lens, unit, g)
    budget = n_units + extra
    sel = topk_selection(scores, torch.tensor(lens, dtype=torch.int32), unit=unit, budget_units=budget,
                         sink_tokens=sink, recent_tokens=recent,
                         width_units=width_units_for(unit, budget, sink, recent))
    assert sel.indices.shape[-1] == n_units * unit
    for b, length in enumerate(lens):
        assert sel.lengths[b].tolist() == [length] * heads
        for h in range(heads):
            assert sel.indices[b, h].tolist() == list(range(length)) + [-1] * (n_units * unit - length)


def test_budget_covering_everything_example() -> None:
    scores = torch.randn(2, 1, 10)
    sel = topk_selection(scores, torch.tensor([37, 9]), unit=4, budget_units=10, sink_tokens=0,
                         recent_tokens=0, width_units=11)
    assert sel.lengths.tolist() == [[37], [9]]
    assert sel.indices[0, 0, :37].tolist() == list(range(37))
    assert sel.indices[1, 0, :9].tolist() == list(range(9)) and bool((sel.indices[1, 0, 9:] == -1).all())


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 3, 4]),
    n=st.integers(1, 9),
    how=st.sampled_from(["max", "sum", "mean"]),
    seed=st.integers(0, 2**16),
)
def test_reduce_groups_matches_a_loop(b, hkv, group, n, how, seed) -> None:
    x = torch.randn(b, hkv * group, n, generator=torch.Generator().manual_seed(seed))
    got = reduce_groups(x, hkv, how)
    assert got.shape == (b, hkv, n)
    for i in range(b):
        for h in range(hkv):
            for u in range(n):
                vals = [float(x[i, h * group + j, u]) for j in range(group)]
                want = {"max": max(vals), "sum": sum(vals), "mean": sum(vals) / group}[how]
                assert abs(float(got[i, h, u]) - want) <= 1e-5 * (1 + abs(want))


@pytest.mark.parametrize("how", ["min", "MAX", "", "median"])
def test_reduce_groups_rejects_unknown_reduction(how) -> None:
    with pytest.raises(ValueError, match=f"gqa_reduce must be one of max, sum, mean; got {how!r}"):
        reduce_groups(torch.zeros(1, 2, 3), 1, how)


@settings(max_examples=30, deadline=None)
@given(
    unit=st.sampled_from([1, 2, 4]),
    lens=st.lists(st.integers(2, 40), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_non_finite_scores_of_valid_units_still_compete(unit, lens, seed) -> None:
    """Scores of valid units are whatever an algorithm computed, -inf and NaN included: with a
    budget covering every unit all tokens are selected, and a budget of one unit keeps the
    best finite-scored unit, never wasting the slot on a NaN."""
    g = torch.Generator().manual_seed(seed)
    n_units = -(-max(lens) // unit)
    scores = torch.randn(len(lens), 1, n_units, generator=g)
    scores[..., 0] = float("-inf")
    scores[..., 1 % n_units] = float("nan")
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    full = topk_selection(scores, seq_lens, unit=unit, budget_units=n_units, sink_tokens=0,
                          recent_tokens=0, width_units=n_units + 1)
    assert full.lengths[:, 0].tolist() == lens
    one = topk_selection(scores, seq_lens, unit=unit, budget_units=1, sink_tokens=0,
                         recent_tokens=0, width_units=2)
    for b, length in enumerate(lens):
        last = (length - 1) // unit
        candidates = [u for u in range(2, last) if u < n_units]
        units = {t // unit for t in one.indices[b, 0, : one.lengths[b, 0]].tolist()}
        if candidates:  # a finite-scored eligible unit exists: it must win the one slot
            best = max(candidates, key=lambda u: float(scores[b, 0, u]))
            assert units == {best, last}
        else:
            assert len(units) == 2 or last < 2


NO_TRITON = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed (blocked by the test)")
sys.meta_path.insert(0, Block())
from sparse_framework import load_config, registry
from sparse_framework.eval.loop import run_experiment
from sparse_framework.eval.workload import WorkloadConfig
for name in registry.names("algorithm"):
    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": name, "top_k": 64, "device_buffer_tokens": 256, "min_sparse_prompt_len": 0})
    (result,) = run_experiment(cfg, WorkloadConfig(contexts=[300], decode_steps=2))
    assert result.mode == "sparse", name
assert "triton" not in sys.modules
print("ok", registry.names("algorithm"))
"""


@pytest.mark.slow
def test_algorithms_run_without_triton_installed() -> None:
    """Triton is a GPU extra: on the CPU every algorithm runs on its torch reference, and only
    choosing impl "triton" (or CUDA) imports it."""
    done = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dsa" in done.stdout and "quest" in done.stdout


# -- every paper-semantics option keeps "a budget covering the context equals dense" -------------

OPTION_VARIANTS = [
    ("quest", {"dense_first_layers": 0, "newest_in_top_k": True}),
    ("quest", {"dense_first_layers": 0, "newest_in_top_k": False}),
    ("dsa", {"newest_in_top_k": True}),
    ("dsa", {"newest_in_top_k": False}),
    ("dsa", {"source": "keys", "newest_in_top_k": True}),
    ("snapkv", {"decoded_tokens": "on_top"}),
    ("snapkv", {"decoded_tokens": "on_top", "max_tail_tokens": 2}),
    ("snapkv", {"decoded_tokens": "in_budget"}),
    ("pqcache", {"candidates": "middle"}),
    ("pqcache", {"candidates": "all"}),
]


@pytest.mark.parametrize("algorithm, extra", OPTION_VARIANTS)
@pytest.mark.parametrize("sink, recent", [(0, 0), (3, 5)])
def test_each_option_with_a_budget_covering_the_context_equals_dense(algorithm, extra, sink, recent) -> None:
    """Through the coordinator, against float64 dense attention, over a few decode steps."""
    from coordinator_driver import Driver, make

    from sparse_framework import Request

    cfg = {"algorithm": algorithm, "top_k": 128, "page_size": 4, "sink_tokens": sink, "recent_tokens": recent,
           "extra": extra}
    coord = make(cfg, kv_heads=2)
    drv = Driver(coord, q_heads=4, seed=len(str(extra)) + sink)
    reqs = [Request("a", 40), Request("b", 77)]
    drv.prefill(reqs)
    for _ in range(4):
        for out, ref, _meta in drv.decode(reqs):
            assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)


# the options' selections, torch and Triton (interpreted) paths: identical
INTERPRETED_OPTIONS = r"""
import sys
sys.path.insert(0, TESTS_DIR)
import torch
from helpers import batch_of
from sparse_framework import KVLayout, Request, load_config
from sparse_framework.algorithms.dsa import DSA
from sparse_framework.algorithms.quest import Quest
from sparse_framework.algorithms.snapkv import SnapKV

g = torch.Generator().manual_seed(0)
base = {"min_sparse_prompt_len": 0, "device_buffer_tokens": 1024, "sink_tokens": 0, "recent_tokens": 0}
cases = [
    (SnapKV, {"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "top_k": 12, "extra": {"window": 4, "decoded_tokens": "on_top", "max_tail_tokens": 8}}),
    (DSA, {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": 9, "extra": {"source": "keys", "newest_in_top_k": True}}),
    (Quest, {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 8, "page_size": 4, "extra": {"newest_in_top_k": True, "dense_first_layers": 0, "min_pages": 0}}),
]
for cls, cfg in cases:
    algos = []
    for impl in ("torch", "triton"):
        c = load_config({**base, **cfg, "extra": {**cfg["extra"], "impl": impl}})
        algos.append(cls(c, KVLayout(num_layers=1, num_kv_heads=2, head_dim=8), 3, 200))
    reqs = [Request("a", 50, seq_len=50, slot=0), Request("b", 23, seq_len=23, slot=2)]
    for r in reqs:
        k, q = torch.randn(r.prompt_len, 2, 8, generator=g), torch.randn(r.prompt_len, 4, 8, generator=g)
        for algo in algos:
            algo.build(0, r, k, q)
    for step in range(8):  # past SnapKV's tail cap (window 4 + 8 decoded > 8)
        for r in reqs:
            r.seq_len += 1
        q = torch.randn(2, 4, 8, generator=g)
        want, got = (algo.select(0, q, batch_of(reqs)) for algo in algos)
        assert torch.equal(want.indices, got.indices) and torch.equal(want.lengths, got.lengths), (cls, step)
        k = torch.randn(2, 2, 8, generator=g)
        for algo in algos:
            algo.append(0, batch_of(reqs), k)
    if cls is not SnapKV:  # exactly top_k tokens (Quest: top_k // page_size pages, the last one partial)
        unit = cfg.get("page_size", 1) if cls is Quest else 1
        for i in range(2):
            for h in range(2):
                toks = got.indices[i, h, : got.lengths[i, h]]
                assert len(set((toks // unit).tolist())) == cfg["top_k"] // unit, (cls, i, h, toks)
print("options ok")
"""


@pytest.mark.slow
def test_options_triton_interpreted_matches_torch() -> None:
    pytest.importorskip("triton")
    from helpers import run_interpreted

    run_interpreted(INTERPRETED_OPTIONS, "options ok")


@pytest.mark.parametrize(("model_layers", "want"), [
    (None, {0, 1}),                 # every layer full: the first two store layers
    ((5, 11, 17), set()),           # Gemma 3: layers 0 and 1 slide, every full layer is sparse
    ((0, 1, 5, 11), {0, 1}),        # a hybrid whose first layers are full
    ((1, 6, 11), {0}),              # only model layer 1 of the first two is full
])
def test_quests_first_layers_count_in_the_models_layers(model_layers, want) -> None:  # noqa: ANN001
    """`dense_first_layers` names the network's first layers; on a sliding-window hybrid the
    store holds only its full layers (KVLayout.model_layers), and `dense_layers` stays in store
    layers."""
    from sparse_framework.common.layout import KVLayout
    from sparse_framework.config import dense_layer_set

    n = 4 if model_layers is None else len(model_layers)
    layout = KVLayout(n, 1, 8, model_layers=model_layers)
    config = load_config({"algorithm": "quest"})
    assert dense_layer_set(config, layout) == want
    explicit = load_config({"algorithm": "quest", "dense_layers": [n - 1], "extra": {"dense_first_layers": 0}})
    assert dense_layer_set(explicit, layout) == {n - 1}


@pytest.mark.parametrize("bad", [(3, 2, 5), (0, 0, 1), (0, 1), (-1, 2, 3)])
def test_a_layout_refuses_model_layers_that_do_not_map_its_store_layers(bad) -> None:  # noqa: ANN001
    from sparse_framework.common.layout import KVLayout

    with pytest.raises(ValueError, match="model_layers"):
        KVLayout(3, 1, 8, model_layers=bad)
