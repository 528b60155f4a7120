"""FP8 host tier (kv_store/fp8_host.py, SparseConfig.host_kv_dtype): the quantiser against a
float64 reference and torch's own e4m3 cast, the Triton copies against the torch ones, every
way a host row goes back to the device (swap-in, resume, prefix-cache pages, `read`) giving
the same dequantised rows, attention with a budget covering the context, the bytes the plan
counts, and the refusals by name."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_framework import Batch, ConfigError, KVLayout, Request, Selection
from sparse_framework.config import load_config
from sparse_framework.coordinator.footprint import coordinator_parts
from sparse_framework.kv_store.fp8_host import (
    check_host_kv_dtype, copy_from_host, copy_to_host, dequantize_rows, host_bytes_per_token_per_layer, quantize_rows,
)
from sparse_framework.kv_store.hierarchical import HierarchicalKVStore
from sparse_framework.coordinator.core import SparseCoordinator

from helpers import SMALL_QUEST, run_interpreted

FP8 = "fp8_e4m3"


def outlier_rows(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [..., D] with magnitudes over many binades and a few outlier channels (real keys
    have channels 4.5-14x the median: docs/algorithms.md), zeros and exact e4m3 ties included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 3)
    x[..., 0] *= 50  # an outlier channel
    flat = x.view(-1, shape[-1])
    flat[0] = 0
    flat[1, : min(4, shape[-1])] = torch.tensor([448.0, 1.0625, 1.1875, -(2.0**-10) * 3])[: min(4, shape[-1])]
    return x.clamp(-3e4, 3e4).to(dtype)  # (finite in float16)


def reference_round_trip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 quantise / dequantise of rows [..., D], written from e4m3's definition: the
    scale is 2^ceil(log2(absmax / 448)) (at least 2^-126), a scaled value is rounded half to
    even on its binade's grid (3 mantissa bits; below 2^-6 the subnormal grid 2^-9). Returns
    (dequantised float64 rows, scales [..., 1])."""
    xd = x.double()
    amax = xd.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)).clamp(-126, 127))
    scale = torch.where(amax > 0, scale, torch.tensor(2.0**-126, dtype=torch.float64))
    y = xd / scale
    binade = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    step = torch.exp2(binade - 3)
    return torch.round(y / step) * step * scale, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_e4m3_of_the_absmax_scaled_row(dtype) -> None:
    x = outlier_rows(64, 3, 24, dtype=dtype)
    packed = quantize_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 3, 25)
    back = dequantize_rows(packed, torch.float32)
    want, scale = reference_round_trip(x)
    assert torch.equal(back.double(), want)  # exactly the float64 reference
    # the scale byte is the power of two's biased exponent; values are torch's own RNE cast
    assert torch.equal(packed[..., -1].double(), torch.log2(scale[..., 0]) + 127)
    cast = (x.double() / scale).float().to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(packed[..., :-1], cast)
    # e4m3's bound: relative error <= 2^-4 of a scale-normalised value in the normal range,
    # <= 2^-10 of the scale below it
    y, err = x.double() / scale, (back.double() - x.double()) / scale
    normal = y.abs() >= 2.0**-6
    assert bool((err.abs()[normal] <= 2.0**-4 * y.abs()[normal]).all())
    assert bool((err.abs()[~normal] <= 2.0**-10).all())
    assert float(y.abs().amax()) <= 448 and float(y.abs().amax(-1).min()) == 0  # the zero row: scale 2^-126
    # bfloat16 holds every dequantised value exactly (4 significant bits x a power of two)
    if dtype == torch.bfloat16:
        assert torch.equal(dequantize_rows(packed, torch.bfloat16).float(), back)


COPY_CHECK = r"""
import torch
from sparse_framework.kv_store.fp8_host import copy_from_host, copy_to_host
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    heads, d, n = 3, 6, 9
    src = (torch.randn(n + 2, heads * d, generator=g) * torch.exp(torch.randn(n + 2, heads * d, generator=g) * 3)).to(dtype)
    src_off = torch.randperm(n + 2, generator=g)[:n] * heads * d
    dst_off = torch.randperm(n + 4, generator=g)[:n] * heads * (d + 1)
    src_off[2], dst_off[5] = -1, -1  # skipped
    hosts = [torch.full(((n + 4) * heads * (d + 1),), 7, dtype=torch.uint8) for _ in range(2)]
    for host, impl in zip(hosts, ("torch", "triton")):
        copy_to_host(src, host, src_off, dst_off, heads, d, impl=impl)
    assert torch.equal(hosts[0], hosts[1]), dtype
    outs = [torch.full((n + 2, heads * d), -5.0, dtype=dtype) for _ in range(2)]
    for out, impl in zip(outs, ("torch", "triton")):
        copy_from_host(hosts[0], out, dst_off, src_off, heads, d, impl=impl)
    assert torch.equal(outs[0], outs[1]), dtype
print("fp8 copies ok")
"""


@pytest.mark.slow
def test_triton_copies_equal_the_torch_copies_bit_for_bit() -> None:
    """The quantising and dequantising Triton kernels (interpreted) write the same bytes and
    values as the torch path, skipping -1 offsets; the fused swap-in kernel's fp8 path is
    checked against the torch store in tests/test_kv_store_hierarchical.py (PARITY_CHECK)."""
    pytest.importorskip("triton")
    run_interpreted(COPY_CHECK, "fp8 copies ok")


def test_copies_place_rows_by_offset_and_skip_negative_ones() -> None:
    x = outlier_rows(5, 2 * 4, seed=3)
    host = torch.zeros(6 * 2 * 5, dtype=torch.uint8)
    src_off, dst_off = torch.tensor([0, 8, 16, -1]), torch.tensor([50, 0, -1, 10])
    copy_to_host(x, host, src_off, dst_off, 2, 4)
    want = quantize_rows(x.view(5, 2, 4))
    assert torch.equal(host[50:60].view(2, 5), want[0]) and torch.equal(host[0:10].view(2, 5), want[1])
    assert int(host[10:50].sum()) == 0  # the skipped pairs wrote nothing
    out = torch.zeros(5, 8)
    copy_from_host(host, out, torch.tensor([0, -1, 50]), torch.tensor([8, 0, 32]), 2, 4)
    back = dequantize_rows(want, torch.float32).view(5, 8)
    assert torch.equal(out[1], back[1]) and torch.equal(out[4], back[0]) and int(out[0].abs().sum()) == 0


# -- the store: every host read dequantises ------------------------------------------------------
def fp8_store(layout: KVLayout, **kw) -> HierarchicalKVStore:
    args = dict(page_size=4, device_buffer_tokens=16, sink_tokens=4, recent_tokens=4, unit=4, max_requests=2,
                max_seq_len=64, host_kv_dtype=FP8)
    return HierarchicalKVStore(layout, **{**args, **kw})


def decode_token(store: HierarchicalKVStore, r: Request, k: torch.Tensor, v: torch.Tensor) -> None:
    r.seq_len += 1
    store.grow(Batch([r]))
    batch = Batch([r])
    batch.prepare("cpu")
    store.begin_step(batch)
    store.write_decode(0, batch, k, v)
    store.end_step(batch)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(quantize_rows(x), x.dtype)


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_every_host_read_gives_the_same_dequantised_rows(per_kv_head) -> None:
    """Prefill and decode host writes hold fp8 rows; `read`, swap-ins, resume after retract
    and a prefix cache's export/load all bring back the same dequantised rows, while the rows
    written straight into the device buffer (sink, recent window, decode tokens) stay exact."""
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=6, dtype=torch.bfloat16)
    store = fp8_store(layout, per_kv_head=per_kv_head)
    host = store.host[0]
    assert host.dtype == torch.uint8 and host.shape[-2:] == (2, 7)  # 6 e4m3 bytes + the scale byte per head
    k, v = outlier_rows(40, 2, 6, seed=1, dtype=torch.bfloat16), outlier_rows(40, 2, 6, seed=2, dtype=torch.bfloat16)
    rk, rv = round_trip(k), round_trip(v)
    assert not torch.equal(rk, k)  # (the check below would pass for a lossless host)
    r = Request("a", 30, seq_len=30, slot=0)
    store.admit(r)
    store.write_prefill(0, r, k[:30], v[:30])
    for t in range(30, 40):
        decode_token(store, r, k[t : t + 1], v[t : t + 1])
    got_k, got_v = store.read(0, r)  # buffered: the host copy, dequantised
    assert torch.equal(got_k, rk) and torch.equal(got_v, rv)

    def rows_at(slots: torch.Tensor) -> list[torch.Tensor]:  # slots [S, n] -> [n, S, D] (S streams)
        bufs = store.layer_buffers(0)
        if per_kv_head:
            return [torch.stack([b[h, slots[h].long()] for h in range(slots.shape[0])], 1) for b in bufs]
        return [b[slots[0].long()] for b in bufs]

    toks = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 36, 37, 38, 39])
    streams = store.streams
    sel = Selection(toks.to(torch.int32).expand(1, streams, -1).contiguous(),
                    torch.full((1, streams), toks.numel(), dtype=torch.int32), 4)
    batch = Batch([r])
    batch.prepare("cpu")
    store.begin_step(batch)
    sk, sv = rows_at(store.ensure_resident(0, batch, sel)[0])
    # sink 0-3 and the decode tokens 36-39 were written to the buffer: exact; 8-11 came from the host
    exact, swapped = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11]), torch.tensor([4, 5, 6, 7])
    assert torch.equal(sk[exact], k[toks[exact]]) and torch.equal(sv[exact], v[toks[exact]])
    assert torch.equal(sk[swapped], rk[toks[swapped]]) and torch.equal(sv[swapped], rv[toks[swapped]])
    stats = store.stats()[0]  # bytes cross as the host stores them: 7 per head row, K and V
    assert stats["bytes_in"] == int(store.rows_in[0]) * store.row_heads * 7 * 2 > 0
    assert stats["bytes_out"] == 10 * 2 * 7 * 2
    assert store.pool_stats()[-1]["bytes"] == store.host_slots * 2 * 2 * 7

    store.retract(r)  # resume refills the buffer (sink, recent window, newest) from the host
    store.resume(r)
    store.begin_step(batch)
    sk, sv = rows_at(store.ensure_resident(0, batch, sel)[0])
    assert torch.equal(sk, rk[toks]) and torch.equal(sv, rv[toks])

    # a prefix cache's pages: a dense request's device rows exported, then loaded into staging
    d = Request("d", 12, seq_len=12, slot=1, dense=True)
    store.admit(d)
    store.write_prefill(0, d, k[:12], v[:12])
    ids = store.export_pages(d, 0, 3)
    staged = [torch.zeros(1, 20, 2, 6, dtype=torch.bfloat16) for _ in range(2)]
    store.load_pages(ids, staged, 5)
    assert torch.equal(staged[0][0, 5:17], rk[:12]) and torch.equal(staged[1][0, 5:17], rv[:12])
    assert int(staged[0][0, :5].abs().sum()) == 0

    # a dense request retracted and resumed: its whole context went through the host
    store.retract(d)
    store.resume(d)
    got_k, got_v = store.read(0, d)  # resident again: the device rows
    assert torch.equal(got_k, rk[:12]) and torch.equal(got_v, rv[:12])


# -- through the coordinator ----------------------------------------------------------------------
def fp8_coordinator(config: dict, layout: KVLayout, **kw) -> SparseCoordinator:
    """A SparseCoordinator built from a config with host_kv_dtype: its store gets the field."""
    return SparseCoordinator(config, layout, **kw)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 decode attention of one request: q [Hq, D], k/v [L, Hk, D] -> [Hq, D]."""
    group = q.shape[0] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    probs = (torch.einsum("hd,lhd->hl", q.double(), kk) / math.sqrt(q.shape[-1])).softmax(-1)
    return torch.einsum("hl,lhd->hd", probs, vv)


@pytest.mark.parametrize("page_size, lens", [(4, [45, 13]), (8, [90])])
def test_a_budget_covering_the_context_is_dense_attention_over_the_dequantised_kv(page_size, lens) -> None:
    """Quest with top_k >= the context and fp8 host rows: every output equals float64 dense
    attention over the KV as the buffer holds it — the fp8 round trip of every prompt token
    that came back from the host, the originals of the prompt's newest unit (written to the
    buffer at prefill; sink and recent window are 0 here) and of every decode token — and
    not dense attention over the original KV."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8)
    cfg = {**SMALL_QUEST, "top_k": 128, "page_size": page_size, "sink_tokens": 0, "recent_tokens": 0,
           "host_kv_dtype": FP8}
    coord = fp8_coordinator(cfg, layout, max_requests=2, max_seq_len=256)
    assert coord.store.host_kv_dtype == FP8
    g = torch.Generator().manual_seed(page_size)
    reqs = [Request(f"r{i}", n) for i, n in enumerate(lens)]
    for r in reqs:
        coord.on_request_begin(r)
    batch = Batch(reqs, is_prefill=True)
    coord.forward_begin(batch)
    kv: dict[str, list[list[torch.Tensor]]] = {r.rid: [] for r in reqs}
    n = sum(lens)
    for layer in range(2):
        q, k, v = (torch.randn(n, h, 8, generator=g) for h in (4, 2, 2))
        meta = coord.attention_begin(layer, q, k, v, batch)
        coord.attention_end(layer, coord.attend(layer, q, meta), batch)
        start = 0
        for r in reqs:
            pk, pv = k[start : start + r.prompt_len], v[start : start + r.prompt_len]
            newest = (r.prompt_len - 1) // page_size * page_size  # the prompt's last unit: exact
            held = [torch.cat([round_trip(x[:newest]), x[newest:]]) for x in (pk, pv)]
            kv[r.rid].append([held, [pk, pv]])
            start += r.prompt_len
    coord.forward_end(batch)
    far_from_original = 0.0
    for _ in range(3):
        batch = Batch(reqs)
        coord.forward_begin(batch)
        for layer in range(2):
            q, k, v = (torch.randn(len(reqs), h, 8, generator=g) for h in (4, 2, 2))
            meta = coord.attention_begin(layer, q, k, v, batch)
            out = coord.attend(layer, q, meta)
            coord.attention_end(layer, out, batch)
            for i, r in enumerate(reqs):
                held, orig = kv[r.rid][layer]
                for rows in (held, orig):  # decode tokens go to the buffer as they are
                    rows[0], rows[1] = torch.cat([rows[0], k[i : i + 1]]), torch.cat([rows[1], v[i : i + 1]])
                assert torch.allclose(out[i].double(), dense_attention(q[i], *held), atol=1e-5, rtol=0)
                diff = (out[i].double() - dense_attention(q[i], *orig)).abs().max()
                far_from_original = max(far_from_original, float(diff))
        coord.forward_end(batch)
    assert far_from_original > 1e-3  # the host rows really are fp8
    for r in reqs:
        coord.on_request_end(r)


def test_host_bytes_counted_are_the_bytes_allocated() -> None:
    """coordinator_parts (check_footprint, the engine's plan) counts the fp8 host pool the
    store allocates: (head_dim + 1) bytes per head row, against 2 x head_dim in bf16."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    cfg = {**SMALL_QUEST, "host_kv_dtype": FP8}
    coord = fp8_coordinator(cfg, layout, max_requests=3, max_seq_len=100)
    parts = {p.what: p for p in coordinator_parts(load_config(cfg), layout, max_requests=3, max_seq_len=100)}
    allocated = sum(t.numel() * t.element_size() for t in coord.store.host)
    assert parts["host KV pool"].bytes == allocated == 2 * coord.store.host_slots * 2 * 2 * 9
    bf16 = {p.what: p for p in coordinator_parts(load_config(SMALL_QUEST), layout, max_requests=3, max_seq_len=100)}
    assert parts["host KV pool"].bytes * 16 == bf16["host KV pool"].bytes * 9
    assert host_bytes_per_token_per_layer(layout, FP8) == 2 * 2 * 9
    assert host_bytes_per_token_per_layer(layout) == layout.bytes_per_token_per_layer == 2 * 2 * 16


# -- refusals, by name ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout, message", [
    (KVLayout.mla(1, dtype=torch.bfloat16), "FlashMLA's 656-byte row"),
    (KVLayout.mla(1, dtype=torch.float8_e4m3fn), "already are fp8 \\(FlashMLA's 656-byte FP8 rows"),
    (KVLayout(1, 2, 8, dtype=torch.float8_e4m3fn), "already are fp8 \\(torch.float8_e4m3fn rows"),
], ids=["mla-bf16", "mla-fp8", "mha-fp8"])
def test_fp8_host_is_refused_where_it_cannot_apply(layout, message) -> None:
    """Refused, not a no-op: an fp8 layout is already stored as fp8 (host and device alike)
    and an MLA latent's fp8 form is FlashMLA's row; the refusal comes from the store, from
    the footprint check the coordinator runs before allocating, and from the plan."""
    with pytest.raises(ConfigError, match=f"`host_kv_dtype` = 'fp8_e4m3'.*{message}"):
        check_host_kv_dtype(FP8, layout)
    with pytest.raises(ConfigError, match="host_kv_dtype"):
        HierarchicalKVStore(layout, page_size=4, device_buffer_tokens=16, sink_tokens=0, recent_tokens=0,
                            host_kv_dtype=FP8)
    cfg = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": 16, "page_size": 4, "host_kv_dtype": FP8} if layout.is_mla else \
        {**SMALL_QUEST, "host_kv_dtype": FP8}
    with pytest.raises(ConfigError, match="host_kv_dtype"):
        coordinator_parts(load_config(cfg), layout, max_requests=1, max_seq_len=64)
    with pytest.raises(ConfigError, match="host_kv_dtype"):
        SparseCoordinator(cfg, layout, max_requests=1, max_seq_len=64)


def test_resident_store_and_unknown_values_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="`host_kv_dtype` = 'fp8_e4m3': the resident store keeps no host tier"):
        load_config({"store": "resident", "host_kv_dtype": FP8})
    with pytest.raises(ConfigError, match="`host_kv_dtype` = 'fp8'"):
        load_config({"host_kv_dtype": "fp8"})
    layout = KVLayout(1, 2, 8)
    with pytest.raises(ConfigError, match="resident store keeps no host tier"):
        HierarchicalKVStore(layout, page_size=4, device_buffer_tokens=16, sink_tokens=0, recent_tokens=0,
                            resident_only=True, host_kv_dtype=FP8)
    # stored eval results are keyed by every option spelt out (config.key()), the host dtype too
    assert load_config({}).key()["host_kv_dtype"] == "auto"
    assert load_config({"store": "hierarchical", "host_kv_dtype": FP8}).key()["host_kv_dtype"] == FP8
