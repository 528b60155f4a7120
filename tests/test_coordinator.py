"""SparseCoordinator: lifecycle, dense paths, dense equality, KV integrity and input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import Batch, CapacityError, ConfigError, KVLayout, Request, registry
from sparse_framework.coordinator.core import SparseCoordinator
from coordinator_driver import BASE, Driver, dense_reference, make


def test_lifecycle_leaves_nothing_allocated() -> None:
    coord = make({"min_sparse_prompt_len": 60})
    drv = Driver(coord, q_heads=4)
    reqs = [Request("a", 100), Request("b", 37), Request("c", 70)]
    drv.prefill(reqs)
    assert [r.dense for r in reqs] == [False, True, False]
    assert coord.store.used_tokens() > 0
    for _ in range(30):  # crosses several page boundaries
        drv.decode(reqs)
    assert [r.seq_len for r in reqs] == [130, 67, 100]
    for r in reqs:
        coord.on_request_end(r)
        assert r.slot == -1
    assert coord.store.used_tokens() == 0
    assert coord.requests == {}
    assert bool((coord.store.dev_table == -1).all()) and bool((coord.store.host_table == -1).all())
    assert coord.store.host_alloc.used == 0
    # the freed rows and pages serve new requests
    drv.prefill([Request("d", 200)])
    drv.decode([coord.requests["d"]])


def test_sparse_rows_are_sparse_and_dense_rows_are_complete() -> None:
    coord = make({"min_sparse_prompt_len": 60})
    drv = Driver(coord, q_heads=4)
    reqs = [Request("long", 300), Request("short", 20)]
    drv.prefill(reqs)
    (out, ref, meta), _ = drv.decode(reqs)
    sel = meta.selection
    assert sel.indices.shape[1] == 2  # Quest selects per KV head
    assert bool((sel.lengths[0] < 301).all())  # sparse: fewer than all tokens
    assert sel.lengths[1].tolist() == [21, 21]  # dense: every token
    assert sel.indices[1, 0, :21].tolist() == list(range(21))
    # the dense request's output equals dense attention
    assert torch.allclose(out[1].double(), ref[1], atol=1e-5)


def test_dense_layers_attend_to_everything() -> None:
    coord = make({"dense_layers": [1]})
    drv = Driver(coord, q_heads=4)
    reqs = [Request("a", 300)]
    drv.prefill(reqs)
    (out0, ref0, meta0), (out1, ref1, meta1) = drv.decode(reqs)
    assert bool((meta0.selection.lengths < 301).all())
    assert meta1.selection.lengths.tolist() == [[301, 301]]
    assert torch.allclose(out1.double(), ref1, atol=1e-5)


VARIANTS = [(name, {}) for name in registry.names("algorithm")] + [
    ("quest", {"dense_first_layers": 0}),  # its default keeps both layers here dense
    ("dsa", {"source": "keys"}),
    ("dsa", {"key_dtype": "bfloat16"}),
]
# the built-ins at their defaults run by default, the other variants with -m slow
COVERING_VARIANTS = VARIANTS[:-3] + [pytest.param(*v, marks=pytest.mark.slow) for v in VARIANTS[-3:]]


@pytest.mark.parametrize("algorithm, extra", COVERING_VARIANTS)
@settings(max_examples=15, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    page_size=st.sampled_from([1, 2, 4, 8]),
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_budget_covering_the_context_equals_dense(algorithm, extra, kv_heads, group, page_size, lens, steps, seed) -> None:
    """Every registered algorithm, with a budget covering the context, equals dense attention."""
    cfg = {"algorithm": algorithm, "top_k": 128, "page_size": page_size, "sink_tokens": 0, "recent_tokens": 0,
           "extra": extra}
    coord = make(cfg, kv_heads=kv_heads)
    drv = Driver(coord, q_heads=kv_heads * group, seed=seed)
    reqs = [Request(f"r{i}", n) for i, n in enumerate(lens)]
    drv.prefill(reqs)
    for _ in range(steps):
        for out, ref, meta in drv.decode(reqs):
            assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)
    for r in reqs:
        coord.on_request_end(r)
    assert coord.store.used_tokens() == 0


def test_stored_kv_is_exactly_what_was_written() -> None:
    coord = make()
    drv = Driver(coord, q_heads=4)
    reqs = [Request("a", 45), Request("b", 13)]
    drv.prefill(reqs)
    for _ in range(7):
        drv.decode(reqs)
    for r in reqs:
        for layer in range(2):
            k, v = coord.store.read(layer, r)
            ek, ev = drv.kv[r.rid][layer]
            assert torch.equal(k, ek) and torch.equal(v, ev)


def test_input_errors_are_clear() -> None:
    coord = make()
    r = Request("a", 50)
    coord.on_request_begin(r)
    with pytest.raises(ValueError, match="already active"):
        coord.on_request_begin(Request("a", 10))
    with pytest.raises(ValueError, match="must be prefilled"):
        coord.forward_begin(Batch([r]))
    with pytest.raises(ValueError, match="was not begun"):
        coord.forward_begin(Batch([Request("zz", 5)]))
    batch = Batch([r], is_prefill=True)
    coord.forward_begin(batch)
    with pytest.raises(ValueError, match=r"k and v must be \[50, 2, 8\]"):
        coord.attention_begin(0, torch.randn(50, 4, 8), torch.randn(50, 3, 8), torch.randn(50, 3, 8), batch)
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        coord.attention_begin(0, torch.randn(50, 3, 8), torch.randn(50, 2, 8), torch.randn(50, 2, 8), batch)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        coord.attention_begin(5, torch.randn(50, 4, 8), torch.randn(50, 2, 8), torch.randn(50, 2, 8), batch)
    with pytest.raises(ValueError, match="not active"):
        coord.on_request_end(Request("nope", 3))
    with pytest.raises(ValueError, match="no room to decode"):
        coord.on_request_begin(Request("huge", 512))


def test_config_errors_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"`dense_layers` = \[0, 7\].*layers 0..1"):
        make({"dense_layers": [0, 7]})
    with pytest.raises(ConfigError, match="supports dtypes"):
        SparseCoordinator(BASE, KVLayout(1, 1, 8, dtype=torch.float64))


def test_capacity_error_names_sizes_and_keeps_existing_kv() -> None:
    # dense-mode requests (below min_sparse_prompt_len) hold every token on the device
    coord = make({"min_sparse_prompt_len": 1000}, device_capacity_tokens=64)
    drv = Driver(coord, q_heads=4)
    drv.prefill([Request("a", 40)])
    before = coord.store.read(0, coord.requests["a"])
    with pytest.raises(CapacityError, match=r"needs 10 more pages of 4 tokens \(40 tokens\), 6 of 16 pages are free"):
        coord.on_request_begin(Request("b", 40))
    assert "b" not in coord.requests
    after = coord.store.read(0, coord.requests["a"])
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    # sparse requests hold a fixed device buffer (device_buffer_tokens) and all tokens on the host
    coord = make({"device_buffer_tokens": 64}, device_capacity_tokens=128, host_capacity_tokens=100)
    drv = Driver(coord, q_heads=4)
    drv.prefill([Request("a", 90)])
    assert coord.store.device_tokens(coord.requests["a"]) == 64
    with pytest.raises(CapacityError, match=r"host KV pool full: request 'b' needs 3 more pages.*2 of 25 pages are free"):
        coord.on_request_begin(Request("b", 12))
    assert coord.store.host_alloc.used == 23
    with pytest.raises(ValueError, match="request rows are in use"):
        full = make(max_requests=1)
        full.on_request_begin(Request("x", 5))
        full.on_request_begin(Request("y", 5))


@pytest.mark.parametrize("config", [{}, {"min_sparse_prompt_len": 1000}, {"store": "resident"}])
def test_retract_and_resume_give_bit_identical_attention(config) -> None:
    """Two identical coordinators decode the same inputs; one retracts and resumes a request
    midway. Every later output is bit-identical."""
    host = {} if config.get("store") != "resident" else {"host_capacity_tokens": 1024}
    a, b = make(config, **host), make(config, **host)
    da, db = Driver(a, q_heads=4, seed=7), Driver(b, q_heads=4, seed=7)
    ra, rb = [Request("x", 120), Request("y", 64)], [Request("x", 120), Request("y", 64)]
    da.prefill(ra)
    db.prefill(rb)
    for step in range(12):
        if step == 4:
            used = b.store.device_bytes()
            b.on_request_retract(rb[0])
            assert b.store.device_bytes() < used and b.store.device_tokens(rb[0]) == 0
            with pytest.raises(ValueError, match="is retracted"):
                b.forward_begin(Batch(rb))
            b.on_request_resume(rb[0])
        for (oa, _, _), (ob, _, _) in zip(da.decode(ra), db.decode(rb)):
            assert torch.equal(oa, ob)
    with pytest.raises(ValueError, match="is not retracted"):
        b.on_request_resume(rb[0])


def test_mla_layout_latent_rows_and_dense_equality() -> None:
    """MLA: one latent row per token (K = all 24 dims, V = the first 16), 8 query heads."""
    layout = KVLayout.mla(2, latent_dim=24, v_head_dim=16)
    coord = SparseCoordinator({**BASE, "top_k": 256, "device_buffer_tokens": 512}, layout, max_requests=2, max_seq_len=256)
    g = torch.Generator().manual_seed(0)
    reqs = [Request("a", 90), Request("b", 40)]
    latents: dict[str, list[torch.Tensor]] = {}
    for r in reqs:
        coord.on_request_begin(r)
    batch = Batch(reqs, is_prefill=True)
    coord.forward_begin(batch)
    for layer in range(2):
        k = torch.randn(130, 1, 24, generator=g)
        q = torch.randn(130, 8, 24, generator=g)
        with pytest.raises(ValueError, match="MLA layout takes the latent as k"):
            coord.attention_begin(layer, q, k, k, batch)
        meta = coord.attention_begin(layer, q, k, None, batch)
        assert coord.attend(layer, q, meta).shape == (130, 8, 16)
        coord.attention_end(layer, None, batch)
        latents.setdefault("a", []).append(k[:90])
        latents.setdefault("b", []).append(k[90:])
    coord.forward_end(batch)
    for _ in range(4):
        batch = Batch(reqs)
        coord.forward_begin(batch)
        for layer in range(2):
            q = torch.randn(2, 8, 24, generator=g)
            k = torch.randn(2, 1, 24, generator=g)
            meta = coord.attention_begin(layer, q, k, None, batch)
            out = coord.attend(layer, q, meta)
            coord.attention_end(layer, out, batch)
            for i, r in enumerate(reqs):
                latents[r.rid][layer] = torch.cat([latents[r.rid][layer], k[i : i + 1]])
                lat = latents[r.rid][layer]
                ref = dense_reference(q[i], lat, lat[..., :16])
                assert torch.allclose(out[i].double(), ref, atol=1e-5)
        coord.forward_end(batch)


def test_model_input_errors_name_the_input_and_the_shape() -> None:
    coord = make({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"index_heads": 4, "index_dim": 16, "key_dtype": "bfloat16"}})
    r = Request("a", 20)
    coord.on_request_begin(r)
    batch = Batch([r], is_prefill=True)
    coord.forward_begin(batch)
    q, k, v = torch.randn(20, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    with pytest.raises(ValueError, match=r"needs the model input\(s\) index_k \[tokens, 16\]"):
        coord.attention_begin(0, q, k, v, batch)
    with pytest.raises(ValueError, match=r"takes no input\(s\) \['index_x'\]; it takes: index_k, index_q, index_weights"):
        coord.attention_begin(0, q, k, v, batch, {"index_k": torch.randn(20, 16), "index_x": torch.randn(20, 16)})
    with pytest.raises(ValueError, match=r"input 'index_k' of algorithm 'dsa' must be \[20, 16\], got \[20, 8\]"):
        coord.attention_begin(0, q, k, v, batch, {"index_k": torch.randn(20, 8)})
    quest = make()  # takes no model inputs
    rq = Request("b", 20)
    quest.on_request_begin(rq)
    qb = Batch([rq], is_prefill=True)
    quest.forward_begin(qb)
    with pytest.raises(ValueError, match="it takes: none"):
        quest.attention_begin(0, q, k, v, qb, {"index_k": torch.randn(20, 16)})


@pytest.mark.parametrize("layout_dtype, given", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_q_k_v_in_a_narrower_dtype_than_the_layout_are_refused_by_name(layout_dtype, given, phase) -> None:
    """bfloat16 q/k/v into a float32 layout (KVLayout's default dtype, not the model's) were
    cast silently into a pool twice the size; refused at attention_begin with both dtypes
    named, nothing changed (the same call in the layout's dtype then runs)."""
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype=layout_dtype)
    coord = SparseCoordinator(BASE, layout, max_requests=2, max_seq_len=64)
    r = Request("a", 20)
    if phase == "decode":
        Driver(coord, q_heads=4).prefill([r])  # float32 rows: cast down as stored
    else:
        coord.on_request_begin(r)
    batch = Batch([r], is_prefill=phase == "prefill")
    coord.forward_begin(batch)
    n = 20 if phase == "prefill" else 1
    q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    with pytest.raises(ValueError, match=rf"KV layout's dtype is {layout_dtype} but got q {given}, k {given}, v {given}"):
        coord.attention_begin(0, q.to(given), k.to(given), v.to(given), batch)
    with pytest.raises(ValueError, match=rf"got q torch.float32, k torch.float32, v {given}"):
        coord.attention_begin(0, q, k, v.to(given), batch)
    meta = coord.attention_begin(0, q.to(layout_dtype), k.to(layout_dtype), v.to(layout_dtype), batch)
    coord.attention_end(0, coord.attend(0, q.to(layout_dtype), meta), batch)
    coord.forward_end(batch)


@pytest.mark.parametrize("algorithm, extra", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_keys_in_another_dtype_than_the_layout_are_accepted(algorithm, extra, dtype) -> None:
    """A model computes K in float32 (or bf16) while the cache is bf16 or fp8: every algorithm
    builds and extends its representations from such keys, and decode runs."""
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=dtype)
    cfg = {**BASE, "algorithm": algorithm, "extra": extra, "top_k": 8}
    coord = SparseCoordinator(cfg, layout, max_requests=2, max_seq_len=128)
    drv = Driver(coord, q_heads=4)  # float32 q, k, v
    reqs = [Request("a", 60), Request("b", 33)]
    drv.prefill(reqs)
    for _ in range(3):
        for out, ref, _ in drv.decode(reqs):
            assert out.shape == ref.shape and torch.isfinite(out).all()


def _grow_until_full(lens: list[int], short: int, host_pages: int, dense_pages: int) -> bool:
    """Decode until a step finds no room (True) or max_seq_len (False), checking before each
    step that can_grow predicts it and changes nothing."""
    coord = make({"min_sparse_prompt_len": short}, max_seq_len=200,
                 host_capacity_tokens=host_pages * 4, device_capacity_tokens=dense_pages * 4)
    drv = Driver(coord, q_heads=4)
    reqs = [r for r in (Request(f"r{i}", n) for i, n in enumerate(lens)) if _prefilled(drv, r)]
    while reqs and max(r.seq_len for r in reqs) < 199:
        before = [r.seq_len for r in reqs]
        used = coord.store.used_tokens()
        predicted = coord.can_grow(reqs)
        assert [r.seq_len for r in reqs] == before and coord.store.used_tokens() == used
        try:
            drv.decode(reqs)
        except CapacityError:
            assert not predicted and [r.seq_len for r in reqs] == before
            return True
        assert predicted
    return False


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(lens=st.lists(st.integers(1, 60), min_size=1, max_size=3), short=st.integers(0, 40),
       host_pages=st.integers(5, 60), dense_pages=st.integers(8, 120))
def test_can_grow_predicts_whether_forward_begin_finds_room(lens, short, host_pages, dense_pages) -> None:
    """can_grow says, without changing anything, whether the next decode step's forward_begin
    finds room (host pages of sparse requests, device pages of dense-mode ones)."""
    _grow_until_full(lens, short, host_pages, dense_pages)


# sparse requests (buffers of 200 tokens) run out of host pages, dense-mode ones of device pages
@pytest.mark.parametrize("short, host_pages, dense_pages", [(0, 24, 100), (100, 200, 24)])
def test_can_grow_says_no_before_the_pools_run_out(short, host_pages, dense_pages) -> None:
    assert _grow_until_full([30, 40], short, host_pages, dense_pages)


def _prefilled(drv: Driver, r: Request) -> bool:
    """Begin and prefill `r`, False where there is no room for it (nothing changed then)."""
    try:
        drv.prefill([r])
    except CapacityError:
        return False
    return True
