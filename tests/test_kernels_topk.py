"""Triton top-k selection (kernels/topk.py) against the torch `topk_selection`: interpreted
on the CPU (in a subprocess, TRITON_INTERPRET=1) over small random shapes, and on CUDA
(`-m gpu`) at DSA's and Quest's decode shapes.

When several eligible units tie at the threshold both keep the lowest ids, so the kernel and
the torch path are each compared exactly with `stable_reference` (the torch rules written
out plainly, ties broken by a stable sort)."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import run_interpreted

from sparse_framework.algorithms.base import topk_selection

BIG = torch.finfo(torch.float32).max


def width_units_for(unit: int, budget: int, sink: int, recent: int) -> int:
    """The framework's static width in units: sink units + budget + recent units + 1."""
    return -(-sink // unit) + budget + -(-recent // unit) + 1


def _masks(scores: torch.Tensor, seq_lens: torch.Tensor, unit: int, sink: int, recent: int,
           newest_forced: bool = True, tail_start: torch.Tensor | None = None):
    """forced, eligible [B, H, n] and the ranked scores (eligible only; else -inf). A tail
    start forces every unit from the one holding it; without newest_forced an eligible
    newest unit ranks above everything (+inf, above the clamped +inf scores)."""
    b, h, n = scores.shape
    lens = seq_lens.to(scores.device).long().view(b, 1, 1)
    ids = torch.arange(n, device=scores.device).view(1, 1, n)
    valid = ids * unit < lens
    tail = lens if tail_start is None else tail_start.long().view(b, 1, 1)
    newest = ids == (lens - 1) // unit
    in_recent = (recent > 0) & (ids >= (lens - recent).clamp(min=0) // unit)
    in_tail = (tail < lens) & (ids >= tail.clamp(min=0) // unit)
    forced = valid & ((ids * unit < sink) | in_recent | in_tail | (newest & newest_forced))
    eligible = (valid & ~forced).expand(b, h, n)
    ranked = scores.float().nan_to_num(nan=-BIG, posinf=BIG, neginf=-BIG).masked_fill(~eligible, float("-inf"))
    if not newest_forced:
        ranked = torch.where(eligible & newest, float("inf"), ranked)
    return forced.expand(b, h, n), eligible, ranked


def stable_reference(scores, seq_lens, *, unit, budget_units, sink_tokens, recent_tokens, width_units,
                     newest_forced=True, tail_start=None):
    """topk_selection's rules with ties at the threshold broken towards the lowest unit ids:
    the kept eligible units are the first `budget` of a stable descending sort; the kept
    units, ascending (a sort, not topk_selection's scatter), cut to the width and expanded."""
    b, h, n = scores.shape
    forced, eligible, ranked = _masks(scores, seq_lens, unit, sink_tokens, recent_tokens, newest_forced, tail_start)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    top = order[..., : max(0, min(budget_units, n))]
    keep = forced | torch.zeros_like(forced).scatter(-1, top, eligible.gather(-1, top))
    width = min(width_units, n)
    ids = torch.arange(n, device=scores.device).expand(b, h, n)
    units = torch.where(keep, ids, n).sort(-1).values[..., :width]
    tokens = (units.unsqueeze(-1) * unit + torch.arange(unit, device=scores.device)).flatten(-2)
    lens = seq_lens.to(scores.device).long().view(b, 1, 1)
    ok = (units < n).repeat_interleave(unit, -1) & (tokens < lens)
    return torch.where(ok, tokens, -1).to(torch.int32), ok.sum(-1, dtype=torch.int32)


def check(got, scores, seq_lens, **kw) -> None:
    """`got` (a Selection) equals the stable reference, which agrees with topk_selection."""
    want = topk_selection(scores, seq_lens, **kw)
    ref_idx, ref_len = stable_reference(scores, seq_lens, **kw)
    assert got.indices.dtype == torch.int32 and got.lengths.dtype == torch.int32
    assert got.indices.shape == want.indices.shape and got.lengths.shape == want.lengths.shape
    assert got.page_size == want.page_size == kw["unit"]
    bad = (got.indices != ref_idx).any(-1) | (got.lengths != ref_len)
    assert not bool(bad.any()), f"rows {bad.nonzero().tolist()} differ from the stable reference"
    # the torch path breaks ties the same way (a stable sort): exactly the reference
    assert torch.equal(ref_len, want.lengths) and torch.equal(ref_idx, want.indices)


def make_scores(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random unit scores: distinct-ish floats, heavy ties, or a mix with the special values
    (NaN, ±inf, ±0, ±max, subnormals) and values that differ only in their low bits."""
    if kind == "randn":
        return torch.randn(shape, generator=g)
    if kind == "ties":
        return torch.randint(-2, 3, shape, generator=g).float()
    if kind == "lowbits":  # one float plus a few ulps: only the last radix digit separates them
        base = torch.tensor(1.5).view(torch.int32)
        return (base + torch.randint(0, 1500, shape, generator=g, dtype=torch.int32)).view(torch.float32)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, BIG, -BIG, 1e-45, -1e-45, 1.0, -1.0])
    pick = torch.randint(0, len(special), shape, generator=g)
    mixed = torch.randn(shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < 0.5, special[pick], mixed)


def poison_invalid(scores: torch.Tensor, lens: list[int], unit: int, g: torch.Generator) -> torch.Tensor:
    """Units at or past a request's length may hold anything."""
    junk = torch.tensor([float("inf"), float("nan"), BIG, float("-inf")])
    for b, length in enumerate(lens):
        tail = scores[b, :, -(-length // unit):]
        tail.copy_(junk[torch.randint(0, 4, tail.shape, generator=g)])
    return scores


# -- interpreted on the CPU ----------------------------------------------------------------------
# Each kernel program costs ~20 ms in the interpreter (4 kernels per call), so the examples keep
# rows x chunks small; small BLOCKs still give several chunks per row.
INTERPRETED = r"""
import sys
sys.path.insert(0, TESTS_DIR)
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from sparse_framework.algorithms.base import topk_selection
from sparse_framework.kernels import topk as tk
from test_kernels_topk import BIG, check, make_scores, poison_invalid, width_units_for

def run(scores, lens, block, **kw):
    tk.BLOCK_OVERRIDE = block
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = topk_selection(scores, seq_lens, impl="triton", **kw)
    check(got, scores, seq_lens, **kw)
    return got

@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(unit=st.sampled_from([1, 4]), b=st.integers(1, 3), h=st.sampled_from([1, 2]),
       lens=st.lists(st.integers(0, 700), min_size=3, max_size=3), extra=st.integers(0, 3),
       budget=st.integers(0, 200), sink=st.integers(0, 12), recent=st.integers(0, 12),
       narrow=st.one_of(st.none(), st.integers(0, 40)), kind=st.sampled_from(["randn", "ties", "lowbits", "special"]),
       block=st.sampled_from([None, 32, 64, 128]), strided=st.booleans(), seed=st.integers(0, 2**16),
       newest_forced=st.booleans(), tails=st.one_of(st.none(), st.lists(st.integers(0, 400), min_size=3, max_size=3)))
def random_cases(unit, b, h, lens, extra, budget, sink, recent, narrow, kind, block, strided, seed, newest_forced, tails):
    g = torch.Generator().manual_seed(seed)
    lens = lens[:b]
    if unit == 1:
        lens = [x // 2 for x in lens]  # a few hundred units either way
    n = -(-max(lens) // unit) + extra
    if block is not None:
        block = max(block, 1 << max(0, (-(-n // 3) - 1).bit_length()))  # at most 3 chunks per row
    full = make_scores(kind, (b, h, n + (5 if strided else 0)), g)
    scores = full[..., 2 : n + 2] if strided else full
    scores = poison_invalid(scores, lens, unit, g)
    budget = min(budget, n + 2)
    if not newest_forced:
        budget = max(budget, 1)  # the newest unit takes a place
    width = width_units_for(unit, budget, sink, recent) if narrow is None else narrow  # narrow: may cut
    tail = None
    if tails is not None:  # a forced tail of each row (SnapKV's window and decoded tokens)
        tail = torch.tensor([min(t, x) for t, x in zip(tails, lens)])
        width += n if narrow is None else 0
    run(scores, lens, block, unit=unit, budget_units=budget, sink_tokens=sink, recent_tokens=recent, width_units=width,
        newest_forced=newest_forced, tail_start=tail)

random_cases()

g = torch.Generator().manual_seed(0)
kw = dict(unit=1, sink_tokens=2, recent_tokens=3, width_units=200)
# every score equal, over many chunks: the tie quota goes to the lowest ids, across chunks
got = run(torch.zeros(1, 1, 150), [150], 16, budget_units=40, **kw)
assert got.indices[0, 0, : got.lengths[0, 0]].tolist() == list(range(42)) + list(range(147, 150))
# the threshold's ties straddle chunks, above-threshold units sit in every chunk
x = torch.randint(0, 4, (1, 2, 160), generator=g).float()
for budget in (1, 37, 80):
    run(x, [160], 32, budget_units=budget, **kw)
# a chunk too big for the write kernel's packed scan (> 2^14 units): its two-scan path
run(torch.randint(0, 4, (1, 1, 20000), generator=g).float(), [20000], 32768, budget_units=3000, **kw)
# NaN / -inf / -max tie at the bottom; +inf / +max at the top
x = torch.tensor([[[1.0, float("nan"), -BIG, float("-inf"), 2.0, float("inf"), BIG, -0.0, 0.0, 0.0, -1.0, 5.0]]])
for budget in range(0, 13):
    run(x, [12], 4 if budget == 6 else None, budget_units=budget, unit=1, sink_tokens=0, recent_tokens=0, width_units=13)
# lengths: empty, shorter than the sinks, longer than the scores cover; every unit size
for unit in (1, 2, 4, 16):
    x = torch.randn(4, 1, 9, generator=g)
    run(x, [0, 1, 3 * unit - 1, 9 * unit + 5], None, unit=unit, budget_units=3, sink_tokens=5, recent_tokens=2,
        width_units=width_units_for(unit, 3, 5, 2))
# subnormals and values a few ulps apart: decided by the low digits
x = make_scores("lowbits", (2, 1, 300), g)
x[1, 0, ::3] = torch.tensor(1e-45) * torch.arange(100)
run(x, [300, 300], 64, budget_units=70, unit=1, sink_tokens=0, recent_tokens=0, width_units=80)
print("interpreted ok")
"""


@pytest.mark.slow
def test_triton_topk_interpreted_matches_torch() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED.replace("MAX_EXAMPLES", "40"), "interpreted ok")


# Scores whose order keys differ in one byte only (the kernel's radix digit 1, 2, 3 or 4, most
# significant first) and take few values, so each pass's pick decides. Chunks 0 and 1 hold
# every value, chunks 2 and 3 only the lowest: a large budget's ties straddle all four chunks;
# a small budget's bucket lies in the first two, and from the pass after the varying byte's
# the other two hold none of it (they skip the histogram).
INTERPRETED_DIGITS = r"""
import sys
sys.path.insert(0, TESTS_DIR)
import torch
from sparse_framework.algorithms.base import topk_selection
from sparse_framework.kernels import topk as tk
from test_kernels_topk import check

def from_order_bits(u):
    # unsigned order bits (int64 in [0, 2^32)) -> float32, inverting the kernel's key map
    key = u - 2**31
    return torch.where(key < 0, key ^ 0x7FFFFFFF, key).to(torch.int32).view(torch.float32)

g = torch.Generator().manual_seed(3)
base = 0xBFC00000  # 1.5
values = torch.tensor([0x3F, 0x40, 0x41, 0xBF, 0xC0])  # all finite, whichever byte they fill
kw = dict(unit=1, sink_tokens=0, recent_tokens=0, width_units=64)
seq_lens = torch.tensor([64], dtype=torch.int32)
tk.BLOCK_OVERRIDE = 16  # 4 chunks
for byte, budget in enumerate((45, 40, 5, 12)):
    r = values[torch.randint(0, 5, (64,), generator=g)]
    r[32:] = values[0]
    u = (base & ~(0xFF << (8 * byte))) | (r << (8 * byte))
    scores = from_order_bits(u).view(1, 1, 64)
    assert torch.isfinite(scores).all()
    got = topk_selection(scores, seq_lens, impl="triton", budget_units=budget, **kw)
    check(got, scores, seq_lens, budget_units=budget, **kw)
print("digits ok")
"""


@pytest.mark.slow
def test_triton_topk_interpreted_each_radix_digit() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED_DIGITS, "digits ok")


def test_stable_reference_is_topk_selection_without_ties() -> None:
    """The reference the kernel is held to: on tie-free scores it is topk_selection itself."""
    g = torch.Generator().manual_seed(5)
    for unit, budget, sink, recent in [(1, 17, 4, 9), (4, 5, 3, 0), (16, 2, 0, 20)]:
        lens = torch.tensor([1, 50, 333, 400])
        n = 400 // unit + 2
        scores = torch.randperm(4 * 2 * n, generator=g).float().view(4, 2, n)
        kw = dict(unit=unit, budget_units=budget, sink_tokens=sink, recent_tokens=recent,
                  width_units=width_units_for(unit, budget, sink, recent))
        want = topk_selection(scores, lens, **kw)
        idx, length = stable_reference(scores, lens, **kw)
        assert torch.equal(idx, want.indices) and torch.equal(length, want.lengths)


def test_triton_needs_cuda_or_the_interpreter() -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs on CPU tensors")
    with pytest.raises(RuntimeError, match="CUDA"):
        topk_selection(torch.zeros(1, 1, 4), torch.tensor([4]), unit=1, budget_units=1, sink_tokens=0,
                       recent_tokens=0, width_units=2, impl="triton")


@pytest.mark.parametrize("extra", [{}, {"impl": "torch"}, {"impl": "triton"}])
@pytest.mark.parametrize("name", ["quest", "pqcache", "snapkv", "dsa"])
def test_algorithms_select_with_their_resolved_impl(name, extra, monkeypatch) -> None:
    """Each scoring algorithm's `impl` option also picks its top-k ("auto": torch on the
    CPU), and ScoringAlgorithm.select hands it to topk_selection, which dispatches on it."""
    from sparse_framework import KVLayout, load_config
    from sparse_framework.algorithms import base

    if extra.get("impl") == "triton":
        pytest.importorskip("triton")
    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": name, "top_k": 64, "device_buffer_tokens": 256, "extra": extra})
    algo = cfg.algorithm_class(cfg, KVLayout(num_layers=1, num_kv_heads=2, head_dim=128), 2, 64)
    assert algo.topk_impl == ("triton" if extra.get("impl") == "triton" else "torch")
    seen = []
    monkeypatch.setattr(base, "topk_selection", lambda *a, **kw: seen.append(kw["impl"]))
    monkeypatch.setattr(algo, "score", lambda *a, **kw: torch.zeros(1, 1, 4))
    algo.select(0, torch.zeros(1, 2, 128), type("B", (), {"seq_lens": torch.tensor([4]), "slot_ids": torch.tensor([0])})())
    assert seen == [algo.topk_impl]


def test_topk_selection_dispatches_to_the_kernel(monkeypatch) -> None:
    pytest.importorskip("triton")
    from sparse_framework.kernels import topk as tk

    calls = []
    monkeypatch.setattr(tk, "topk_selection_triton", lambda *a, **kw: calls.append(kw) or "sel")
    kw = dict(unit=2, budget_units=3, sink_tokens=1, recent_tokens=4, width_units=9)
    assert topk_selection(torch.zeros(1, 1, 4), torch.tensor([8]), impl="triton", **kw) == "sel"
    assert calls == [{**kw, "first_pass": None, "newest_forced": True, "tail_start": None}]
    assert topk_selection(torch.zeros(1, 1, 4), torch.tensor([8]), impl="auto", **kw) != "sel"  # CPU: torch


# -- CUDA ------------------------------------------------------------------------------------------
# (batch, heads, units, unit, budget, sink, recent): DSA's indexer (one selection per request,
# tokens) and Quest (per KV head, pages of 16) at 128K tokens, as benchmarks/selection.py runs them
GPU_SHAPES = {"dsa": (8, 1, 131072, 1, 2048, 16, 64), "quest": (8, 8, 8192, 16, 128, 16, 64)}


def _gpu_case(name: str, kind: str, seed: int):
    b, h, n, unit, budget, sink, recent = GPU_SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    scores = make_scores(kind, (b, h, n), g)
    lens = torch.randint(n * unit // 2, n * unit + 1, (b,), generator=g)
    lens[0] = n * unit
    lens[-1] = 1 + int(torch.randint(0, 40 * unit, (1,), generator=g))  # a short request in a long batch
    scores = poison_invalid(scores, lens.tolist(), unit, g).cuda()
    kw = dict(unit=unit, budget_units=budget, sink_tokens=sink, recent_tokens=recent,
              width_units=width_units_for(unit, budget, sink, recent))
    return scores, lens.to(torch.int32).cuda(), kw


@pytest.mark.parametrize("kind", ["randn", "ties", "lowbits", "special"])
@pytest.mark.parametrize("name", ["dsa", "quest"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_full_shapes_match_torch(name, kind) -> None:
    scores, lens, kw = _gpu_case(name, kind, seed=len(kind))
    got = topk_selection(scores, lens, impl="triton", **kw)
    got.validate(lens)
    check(got, scores, lens, **kw)
    again = topk_selection(scores, lens, impl="auto", **kw)  # auto is Triton on CUDA; deterministic
    assert torch.equal(again.indices, got.indices) and torch.equal(again.lengths, got.lengths)
    from sparse_framework.kernels import topk as tk

    if name == "quest":  # 64 rows x 4 chunks: on an H100 all 256 programs fit at once (DSA's do not)
        assert any(tk._FUSED_SHAPES.values()), "the fused kernel never fit this GPU"
    tk.FUSED = "off"  # the five kernels give the same selection as the fused one
    try:
        five = topk_selection(scores, lens, impl="triton", **kw)
    finally:
        tk.FUSED = "auto"
    assert torch.equal(five.indices, got.indices) and torch.equal(five.lengths, got.lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_no_host_sync_and_cuda_graph_replay() -> None:
    """No synchronising call (sync debug mode errors on one), and a captured graph replays
    with new scores and lengths to the eager result."""
    scores, lens, kw = _gpu_case("dsa", "randn", seed=11)
    topk_selection(scores, lens, impl="triton", **kw)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        topk_selection(scores, lens, impl="triton", **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_scores, static_lens = scores.clone(), lens.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        topk_selection(static_scores, static_lens, impl="triton", **kw)
        with torch.cuda.graph(graph, stream=stream):
            sel = topk_selection(static_scores, static_lens, impl="triton", **kw)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (12, 13):
        new_scores, new_lens, _ = _gpu_case("dsa", "ties" if seed == 13 else "randn", seed=seed)
        static_scores.copy_(new_scores)
        static_lens.copy_(new_lens)
        graph.replay()
        torch.cuda.synchronize()
        eager = topk_selection(new_scores, new_lens, impl="triton", **kw)
        assert torch.equal(sel.indices, eager.indices) and torch.equal(sel.lengths, eager.lengths)
        check(eager, new_scores, new_lens, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_random_shapes(monkeypatch) -> None:
    """The compiled kernels over many shapes: 1 to thousands of units, one to hundreds of
    chunks per row (automatic blocks and forced small ones), every score kind and unit."""
    from sparse_framework.kernels import topk as tk

    g = torch.Generator().manual_seed(21)
    for case in range(60):
        r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
        unit = [1, 4, 16][case % 3]
        b, h = r(1, 8), r(1, 8)
        lens = [r(0, 30000) if case % 2 else r(0, 300) for _ in range(b)]
        n = max(1, -(-max(lens) // unit) + r(0, 5))
        budget = r(0, min(n + 2, 3000))
        sink, recent = r(0, 64), r(0, 128)
        kind = ["randn", "ties", "lowbits", "special"][case % 4]
        scores = poison_invalid(make_scores(kind, (b, h, n), g), lens, unit, g).cuda()
        width = width_units_for(unit, budget, sink, recent) if case % 5 else r(0, n)
        monkeypatch.setattr(tk, "BLOCK_OVERRIDE", 256 if case % 7 == 0 else None)
        kw = dict(unit=unit, budget_units=budget, sink_tokens=sink, recent_tokens=recent, width_units=width)
        seq_lens = torch.tensor(lens, dtype=torch.int64).cuda()
        got = topk_selection(scores, seq_lens, impl="triton", **kw)  # fused where it fits
        check(got, scores, seq_lens, **kw)
        monkeypatch.setattr(tk, "FUSED", "off")
        five = topk_selection(scores, seq_lens, impl="triton", **kw)
        monkeypatch.setattr(tk, "FUSED", "auto")
        assert torch.equal(five.indices, got.indices) and torch.equal(five.lengths, got.lengths), case


def test_fused_kernel_switch(monkeypatch) -> None:
    """FUSED picks the one cooperative kernel on CUDA only (never under the interpreter); a
    bad value names the allowed ones."""
    pytest.importorskip("triton")
    from sparse_framework.kernels import topk as tk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert tk._fused_wanted(torch.device("cuda", 0)) is True
    assert tk._fused_wanted(torch.device("cpu")) is False
    monkeypatch.setattr(tk, "FUSED", "off")
    assert tk._fused_wanted(torch.device("cuda", 0)) is False
    monkeypatch.setattr(tk, "FUSED", "auto")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tk._fused_wanted(torch.device("cuda", 0)) is False
    monkeypatch.setattr(tk, "FUSED", "on")
    with pytest.raises(ValueError, match=r"FUSED must be 'auto' or 'off', got 'on'"):
        tk._fused_wanted(torch.device("cuda", 0))


def test_fused_shape_follows_the_occupancy_of_the_compiled_kernel(monkeypatch) -> None:
    """_fused_shape's decision, with a stand-in compiled kernel and GPU: the default shape
    when every program of the grid is resident at once, else None (the five kernels); None
    too when the compiled kernel does not say its registers; remembered per shape."""
    pytest.importorskip("triton")
    import types

    from sparse_framework.kernels import topk as tk

    props = types.SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                                  shared_memory_per_multiprocessor=228 * 1024, multi_processor_count=132)
    monkeypatch.setattr(tk.torch.cuda, "get_device_properties", lambda device: props)
    compiled: dict = {}

    class Compiled:
        def _init_handles(self) -> None:
            if "regs" not in compiled:
                raise AttributeError("n_regs")
            self.n_regs = compiled["regs"]
            self.metadata = types.SimpleNamespace(shared=compiled["shared"])

    warmups = []
    monkeypatch.setattr(tk._topk_fused_kernel, "warmup", lambda *a, **kw: warmups.append(kw["grid"]) or Compiled())
    monkeypatch.setattr(tk, "_FUSED_SHAPES", {})
    cuda = torch.device("cuda", 0)
    call = lambda blk, warps: ((), {"num_warps": warps})  # noqa: E731

    def shape(rows: int, n_units: int, block: int):  # type: ignore[no-untyped-def]
        return tk._fused_shape(cuda, rows, n_units, 1, block, True, call)

    compiled.update(regs=128, shared=20 * 1024)  # 8 warps x 128 registers: 2 programs per SM, 264 in all
    assert shape(64, 8192, 2048) == (2048, 8)  # 64 x 4 = 256 programs fit
    compiled.update(regs=129)  # rounded up to 136: one program per SM
    assert shape(64, 8192, 2048) == (2048, 8)  # remembered: not compiled again
    assert len(warmups) == 1
    assert shape(8, 131072, 4096) is None  # 8 x 32 = 256 programs > 132
    compiled.update(regs=64, shared=100 * 1024)  # shared memory: 2 programs per SM (228 KiB)
    assert shape(8, 131072 - 1, 4096) == (4096, 8)
    compiled.update(shared=120 * 1024)  # 1 per SM
    assert shape(8, 131072 - 2, 4096) is None
    compiled.clear()  # another Triton's CompiledKernel: no register count, no guess
    assert shape(8, 4096, 512) is None
