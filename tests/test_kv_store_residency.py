"""kv_store/residency.py's launch shapes of the fused copy, interpreted on the CPU (a subprocess
with TRITON_INTERPRET=1; hypothesis over layouts, units and selections): `_copy_missing` fills
the buffer the same with the decode path's shapes (`CopyShapes`: copy_programs x copy_rows, and
narrow_programs x narrow_rows for one head's rows) and the prefetch's (prefetch_programs x prefetch_rows), as the torch
path does; and `prefetch` through its
side-stream branch — the one that takes the prefetch's shape, reached on the CPU with the CUDA
stream and event calls stood in for by synchronous no-ops — leaves the same buffer, maps and
counters as the inline prefetch and the torch path. The kernel itself over many shapes:
tests/test_kernels_residency.py; the whole fused swap-in against the torch path:
tests/test_kv_store_hierarchical.py."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import run_interpreted

from sparse_framework.kv_store import residency
from sparse_framework.kv_store.residency import CopyShapes

SHAPES = CopyShapes()  # the defaults


def test_the_prefetch_copies_with_few_programs_of_many_rows() -> None:
    """The prefetch's copy must leave most SMs to the compute it overlaps (the module's comment),
    and BLOCK_R is a power of two (a tl.arange length)."""
    assert SHAPES.prefetch_programs < SHAPES.copy_programs
    assert SHAPES.prefetch_rows > SHAPES.copy_rows
    for rows in (SHAPES.copy_rows, SHAPES.prefetch_rows, SHAPES.narrow_rows):
        assert rows >= 1 and rows & (rows - 1) == 0


def test_one_heads_rows_take_the_narrow_copy_shape() -> None:
    """Llama-3-8B's rows: one KV head (128 bf16, head-major) takes the narrow shape; a token's
    8 heads (1,024) and an MLA latent (576) the decode path's wide one."""
    narrow = (SHAPES.narrow_programs, SHAPES.narrow_rows, SHAPES.narrow_warps)
    wide = (SHAPES.copy_programs, SHAPES.copy_rows, SHAPES.copy_warps)
    assert narrow != wide
    assert SHAPES.decode(128) == SHAPES.decode(SHAPES.narrow_row) == narrow
    assert SHAPES.decode(1024) == SHAPES.decode(576) == wide
    assert SHAPES.decode(SHAPES.narrow_row + 1) == wide
    assert residency.decode_copy_shape(128) == narrow


def test_copy_shapes_are_the_stores_and_checked() -> None:
    """The launch shapes are an argument of the store (its swap-in's `copy_shapes`), defaults
    otherwise; BLOCK_R and the tile's columns must be powers of two (tl.arange lengths)."""
    from sparse_framework import KVLayout
    from sparse_framework.kv_store.hierarchical import HierarchicalKVStore

    kw = dict(page_size=4, device_buffer_tokens=24, sink_tokens=4, recent_tokens=6, max_requests=2, max_seq_len=64)
    assert HierarchicalKVStore(KVLayout(2, 2, 4), **kw).residency.copy_shapes == SHAPES
    mine = dataclasses.replace(SHAPES, copy_programs=5, prefetch_rows=4)
    assert HierarchicalKVStore(KVLayout(2, 2, 4), copy_shapes=mine, **kw).residency.copy_shapes is mine
    for bad in ({"copy_rows": 3}, {"copy_cols": 100}, {"narrow_programs": 0}):
        with pytest.raises(ValueError, match="CopyShapes"):
            dataclasses.replace(SHAPES, **bad)


INTERPRETED = r"""
import contextlib
import dataclasses
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from sparse_framework import Batch, KVLayout, Request, Selection
from sparse_framework.kv_store.residency import CopyShapes
from sparse_framework.kv_store.hierarchical import HierarchicalKVStore

SHAPES = CopyShapes()
few = settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
KINDS = ["mha-token", "mha-head", "mla", "fp8host-token", "fp8host-head"]
LENS = [45, 30]


def stores(kind, unit, impls):
    # stores holding the same two prefilled requests (layer 1), one per impl
    if kind == "mla":
        layout = KVLayout.mla(2, latent_dim=6, v_head_dim=4)
    elif kind.startswith("fp8host"):  # fp8 host rows, dequantised by the copy
        layout = KVLayout(2, 2, 6, dtype=torch.bfloat16)
    else:
        layout = KVLayout(2, 2, 4)
    g = torch.Generator().manual_seed(0)
    rows = [[torch.randn(n, layout.num_kv_heads, layout.head_dim, generator=g) for _ in range(layout.tensors_per_token)]
            for n in LENS]
    out = []
    for impl in impls:
        s = HierarchicalKVStore(layout, page_size=4, device_buffer_tokens=24, sink_tokens=4, recent_tokens=6, unit=unit,
                                per_kv_head=kind.endswith("head"), max_requests=2, max_seq_len=64, impl=impl,
                                host_kv_dtype="fp8_e4m3" if kind.startswith("fp8host") else "auto")
        reqs = [Request(f"r{i}", n, seq_len=n, slot=i) for i, n in enumerate(LENS)]
        for r, kv in zip(reqs, rows):
            s.admit(r)
            s.write_prefill(1, r, kv[0], kv[1] if len(kv) > 1 else None)
        b = Batch(reqs)
        b.prepare("cpu")
        s.begin_step(b)
        out.append((s, b))
    return out


def selection(store, unit, seed):
    # whole units of each stream: its pinned ones (sink, recent, newest) and random others
    g = torch.Generator().manual_seed(seed)
    s, ub = store.streams, store.buffer_units
    idx = torch.full((2, s, ub * unit), -1, dtype=torch.int32)
    for i, n in enumerate(LENS):
        nu = -(-n // unit)
        for h in range(s):
            pinned = {x for x in range(nu) if x * unit < 4} | set(range(max(0, n - 6) // unit, nu))
            others = [x for x in range(nu) if x not in pinned]
            pick = torch.randperm(len(others), generator=g)[: ub - len(pinned)]
            toks = [t for x in sorted(pinned | {others[p] for p in pick.tolist()})
                    for t in range(x * unit, min((x + 1) * unit, n))]
            idx[i, h, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
    return Selection(idx, (idx >= 0).sum(-1, dtype=torch.int32), unit)


def tensors(store):
    return [t.clone() for p in store.pools for t in p.tensors]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@few
@given(kind=st.sampled_from(KINDS), unit=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))
def both_shapes_copy_the_same(kind, unit, seed):
    (ref, rb), (st_, b) = stores(kind, unit, ["torch", "triton"])
    sel = selection(st_, unit, seed)
    want = ref.ensure_resident(1, rb, sel)
    idx = sel.indices.contiguous()
    slots, todo, n_todo = st_.residency._plan_selection(1, b, idx, st_.counts[1])
    assert torch.equal(slots, want) and int(n_todo.sum()) > 0
    before = tensors(st_)
    got = []
    for programs, rows, warps in [(SHAPES.copy_programs, SHAPES.copy_rows, SHAPES.copy_warps),
                                  (SHAPES.prefetch_programs, SHAPES.prefetch_rows, SHAPES.copy_warps),
                                  (SHAPES.narrow_programs, SHAPES.narrow_rows, SHAPES.narrow_warps)]:
        for p, x in zip([t for p in st_.pools for t in p.tensors], before):
            p.copy_(x)
        st_.residency._copy_missing(1, idx, slots, todo, n_todo, b.slot_ids, programs=programs, block_r=rows, warps=warps)
        got.append(tensors(st_))
    assert same(got[0], tensors(ref)), kind
    assert same(got[1], got[0]) and same(got[2], got[0]), kind


class Side:  # a CUDA stream or event stood in for: everything runs at once on the CPU
    def wait_stream(self, other): pass
    def wait_event(self, event): pass
    def record(self, stream=None): pass


@few
@given(kind=st.sampled_from(KINDS), unit=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))
def side_stream_prefetch_equals_the_inline_one(kind, unit, seed):
    ref, inline, side = stores(kind, unit, ["torch", "triton", "triton"])
    shapes = []
    copy = side[0].residency._copy_missing
    side[0].residency._copy_missing = lambda *a, **kw: shapes.append((kw["programs"], kw["block_r"])) or copy(*a, **kw)
    side[0].residency._prefetch_side = Side()
    cuda = torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event
    torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event = (
        lambda device=None: Side(), lambda s: contextlib.nullcontext(), Side)
    # narrowed for the interpreter (both_shapes_copy_the_same runs the real ones), on the stores' swap-ins
    for s, _ in (inline, side):
        s.residency.copy_shapes = dataclasses.replace(SHAPES, copy_programs=5, narrow_programs=5)
    try:
        predicted, own = selection(ref[0], unit, seed), selection(ref[0], unit, seed + 1)
        for s, b in (ref, inline, side):
            s.prefetch(1, b, predicted)
        assert shapes == [(SHAPES.prefetch_programs, SHAPES.prefetch_rows)], shapes
        assert 1 in side[0].residency._prefetches and not inline[0].residency._prefetches
        for s, b in (inline, side):
            assert same(tensors(s), tensors(ref[0])), kind
            assert torch.equal(s.l2s[..., :-1], ref[0].l2s[..., :-1])  # the last column: a trash column
            assert torch.equal(s.s2l[..., :-1], ref[0].s2l[..., :-1])
            assert torch.equal(s.prefetch_counts, ref[0].prefetch_counts) and torch.equal(s.counts, ref[0].counts)
        assert int(ref[0].prefetch_counts[1, 1]) > 0  # the prediction missed rows, and they were copied
        # the layer's own selection then: joins the prefetch, copies what it missed (the decode path's shape)
        slots = [s.ensure_resident(1, b, own) for s, b in (ref, inline, side)]
        assert shapes[1:] == [side[0].residency.copy_shapes.decode(side[0].row_elems)[:2]], shapes
        assert not side[0].residency._prefetches
        for s, sl in zip((inline[0], side[0]), slots[1:]):
            assert torch.equal(sl, slots[0]) and same(tensors(s), tensors(ref[0])), kind
            assert torch.equal(s.counts, ref[0].counts)
    finally:
        torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Event = cuda


both_shapes_copy_the_same()
side_stream_prefetch_equals_the_inline_one()
print("launch shapes ok")
"""


@pytest.mark.slow
def test_both_launch_shapes_and_the_side_stream_prefetch_copy_the_same_interpreted() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, "launch shapes ok")
