"""kernels/triton/residency.py `copy_missing_kernel` against a plain torch gather, interpreted on the
CPU (a subprocess with TRITON_INTERPRET=1): hand-made to-do lists (several streams with uneven
counts, none at all, counts that are not multiples of the rows per iteration), copied by small
grids (1 and 3 programs) with BLOCK_R 1, 2, 4 and 8 rows per loop iteration and tiles narrower
than a row; host rows of the device's dtype or fp8 ones dequantised on the way, head-major and
token-major buffers, one tensor or two (hypothesis). The whole device buffer must equal the
gather's: the missed rows at their slots, nothing else touched. The fused swap-in through the
store is tested in tests/test_kv_store_hierarchical.py and tests/test_kv_store_residency.py."""

from __future__ import annotations

import pytest
import torch

from helpers import run_interpreted

from sparse_framework.kv_store.fp8_host import dequantize_rows, quantize_rows


def missed_rows(g: torch.Generator, counts: list[int], w: int, page: int, host_pages: int, requests: int,
                streams: int, dev_slots: int, head_major: bool) -> dict[str, torch.Tensor]:
    """The planning kernel's outputs for `counts[stream]` missed entries per stream (B x S
    streams, W entries each), and the store's tables they refer to: selections idx [B, S, W]
    of tokens whose pages are mapped in host_table [R, TP] (R = requests + 1 state rows,
    requests on rows a permutation picks), device slots [B, S, W] whose destination rows
    (a head's slot when head-major) are distinct among the missed entries, and todo / n_todo."""
    b, s = len(counts) // streams, streams
    tp = -(-w // page) + 2
    rows = torch.randperm(requests + 1, generator=g)[:b]
    host_table = torch.randperm(host_pages, generator=g)[: (requests + 1) * tp].view(requests + 1, tp).to(torch.int32)
    idx = torch.randint(0, tp * page, (b, s, w), generator=g, dtype=torch.int32)
    # distinct destinations: per head when head-major (heads share slot numbers), else overall
    per = s if head_major else 1
    slots = torch.stack([torch.randperm(dev_slots, generator=g)[: b * s * w // per] for _ in range(per)])
    slots = slots.view(per, b, s // per, w).permute(1, 0, 2, 3).reshape(b, s, w).to(torch.int32).contiguous()
    todo = torch.full((b * s * w,), -7, dtype=torch.int64)  # past each stream's count: never read
    for st, c in enumerate(counts):
        entries = torch.randperm(w, generator=g)[:c].sort().values + st * w
        todo[st * w : st * w + c] = entries
    return {"idx": idx, "slots": slots, "rows": rows, "host_table": host_table, "todo": todo,
            "n_todo": torch.tensor(counts, dtype=torch.int32)}


def gather(case: dict[str, torch.Tensor], host: torch.Tensor, dev: torch.Tensor, page: int, head_major: bool,
           fp8: bool) -> torch.Tensor:
    """What the copy must leave in `dev` (a copy of it): host [host_slots, HK, width] ->
    dev [HK, slots, D] (head-major) or [slots, HK, D], row by row, dequantised with `fp8`."""
    out = dev.clone()
    b, s, w = case["idx"].shape
    for st, c in enumerate(case["n_todo"].tolist()):
        for j in range(c):
            e = int(case["todo"][st * w + j])
            assert e // w == st
            t, slot = int(case["idx"].view(-1)[e]), int(case["slots"].view(-1)[e])
            r = int(case["rows"][st // s])
            hrow = int(case["host_table"][r, t // page]) * page + t % page
            row = host[hrow, st % s] if head_major else host[hrow]  # [width] or [HK, width]
            row = dequantize_rows(row, dev.dtype) if fp8 else row
            if head_major:
                out[st % s, slot] = row
            else:
                out[slot] = row
    return out


def test_the_gather_reads_the_rows_it_is_given() -> None:
    """The reference itself: one stream, two missed entries, by hand."""
    g = torch.Generator().manual_seed(0)
    case = missed_rows(g, [2, 0], w=3, page=2, host_pages=8, requests=1, streams=1, dev_slots=8, head_major=False)
    host = torch.arange(16 * 2 * 3, dtype=torch.float32).view(16, 2, 3)
    dev = torch.zeros(8, 2, 3)
    out = gather(case, host, dev, 2, head_major=False, fp8=False)
    for j in range(2):
        e = int(case["todo"][j])
        t, slot = int(case["idx"].view(-1)[e]), int(case["slots"].view(-1)[e])
        hrow = int(case["host_table"][int(case["rows"][0]), t // 2]) * 2 + t % 2
        assert torch.equal(out[slot], host[hrow])
    assert int((out != 0).any(-1).any(-1).sum()) == 2


INTERPRETED = r"""
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from sparse_framework.common.arith import pow2
from sparse_framework.kernels.triton.residency import copy_missing_kernel
from sparse_framework.kv_store.fp8_host import quantize_rows
from test_kernels_residency import gather, missed_rows

DEVICE = "DEVICE_NAME"
fast = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def run(case, hosts, devs, layer, page, head_major, fp8, programs, block_r, cols):
    # one launch as kv_store/residency.py `_copy_missing` makes it: host [layers, host_slots, HK,
    # width] -> dev [layers, HK, slots, D] (head-major) or [layers, slots, HK, D], flat, at `layer`
    b, s, w = case["idx"].shape
    _, host_slots, hk, width = hosts[0].shape
    d = devs[0].shape[-1]
    dev_slots = devs[0].shape[2] if head_major else devs[0].shape[1]
    heads = 1 if head_major else hk
    cpu_devs = devs
    if DEVICE == "cuda":  # compiled: tables and buffers on the GPU, host rows pinned and read zero-copy
        from sparse_framework.kv_store.copy import _as_kernel_arg
        case = {k: v.cuda() for k, v in case.items()}
        hosts = [h.pin_memory() for h in hosts]
        devs = [x.cuda() for x in devs]
    flat_h, flat_d = [h.flatten() for h in hosts], [x.view(-1) for x in devs]
    if DEVICE == "cuda":
        flat_h = [_as_kernel_arg(h) for h in flat_h]
    two = len(devs) == 2
    copy_missing_kernel[(programs,)](
        case["todo"], case["n_todo"], case["idx"], case["slots"], case["rows"], case["host_table"],
        flat_h[0], flat_d[0], flat_h[1] if two else flat_h[0], flat_d[1] if two else flat_d[0],
        s, w, page, case["host_table"].shape[-1], layer * host_slots * hk * width, layer * dev_slots * hk * d,
        dev_slots, hk, b * s,
        BLOCK_S=pow2(b * s), HEAD_MAJOR=head_major, TWO=two, ROW=d * heads, COLS=cols, PDL=False,
        HROW=width * heads, FP8_HOST=fp8, HEAD_DIM=d, BLOCK_R=block_r,
    )
    for mine, x in zip(cpu_devs, devs):
        mine.copy_(x.cpu())


@fast
@given(head_major=st.booleans(), hk=st.integers(1, 3), requests=st.integers(1, 3), d=st.sampled_from([1, 3, 8]),
       page=st.sampled_from([1, 2, 4]), w=st.integers(1, 9), two=st.booleans(),
       host=st.sampled_from(["float32", "bfloat16", "uint8", "fp8"]), block_r=st.sampled_from([1, 2, 4, 8]),
       programs=st.sampled_from([1, 3]), narrow=st.booleans(), data=st.data(), seed=st.integers(0, 2**16))
def copies_equal(head_major, hk, requests, d, page, w, two, host, block_r, programs, narrow, data, seed):
    g = torch.Generator().manual_seed(seed)
    b = data.draw(st.integers(1, requests))
    s = hk if head_major else 1
    counts = data.draw(st.lists(st.integers(0, w), min_size=b * s, max_size=b * s))
    dev_slots = 2 * b * w + 3
    case = missed_rows(g, counts, w, page, 64, requests, s, dev_slots, head_major)
    fp8 = host == "fp8"
    dtype = torch.bfloat16 if fp8 else getattr(torch, host)
    layers, layer = 2, 1  # the copy's layer is the second of each tensor: nonzero bases
    def values(*shape):
        if dtype == torch.uint8:  # byte rows (FlashMLA's fp8 ones): moved as they are
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        return (torch.randn(*shape, generator=g) * 4).to(dtype)
    host_rows = [values(layers, 64 * page, hk, d) for _ in range(1 + two)]
    hosts = [quantize_rows(x) for x in host_rows] if fp8 else host_rows  # fp8: [..., HK, d + 1] bytes
    devs = [values(*((layers, hk, dev_slots, d) if head_major else (layers, dev_slots, hk, d))) for _ in hosts]
    want = [gather(case, h[layer], x[layer], page, head_major, fp8) for h, x in zip(hosts, devs)]
    row = d * (1 if head_major else hk)
    cols = max(1, pow2(row) // 2) if narrow else pow2(row)  # narrow: two column tiles per row or more
    got = {}
    for shape in [(1, 1), (programs, block_r)]:  # the one-row loop of one program too
        mine = [x.clone() for x in devs]
        run(case, hosts, mine, layer, page, head_major, fp8, *shape, cols)
        got[shape] = mine
        for m, x, wnt in zip(mine, devs, want):
            assert torch.equal(m[0], x[0]), ("layer 0 touched", shape)
            assert torch.equal(m[layer], wnt), (shape, counts, (m[layer] != wnt).nonzero()[:5])
    assert all(torch.equal(x, y) for x, y in zip(got[(1, 1)], got[(programs, block_r)]))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(block_r=st.sampled_from([1, 2, 4, 8]), programs=st.sampled_from([1, 3]), head_major=st.booleans(),
       seed=st.integers(0, 2**16))
def nothing_missed_changes_nothing(block_r, programs, head_major, seed):
    g = torch.Generator().manual_seed(seed)
    s, b, w, d = (2 if head_major else 1), 2, 5, 4
    case = missed_rows(g, [0] * (b * s), w, 2, 32, 2, s, 64, head_major)
    host = torch.randn(1, 64, 2, d, generator=g)
    dev = torch.randn(*((1, 2, 64, d) if head_major else (1, 64, 2, d)), generator=g)
    mine = dev.clone()
    run(case, [host], [mine], 0, 2, head_major, False, programs, block_r, pow2(d * (1 if head_major else 2)))
    assert torch.equal(mine, dev)


copies_equal()
nothing_missed_changes_nothing()
print("copy missing ok")
"""


@pytest.mark.slow
def test_copy_missing_kernel_equals_a_torch_gather_interpreted() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED.replace("DEVICE_NAME", "cpu"), "copy missing ok")


@pytest.mark.gpu
def test_copy_missing_kernel_equals_a_torch_gather_cuda() -> None:
    """The same cases compiled on a GPU, the host rows pinned and read over PCIe."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    namespace: dict[str, object] = {"__name__": "copy_missing_cuda"}
    exec(compile(INTERPRETED.replace("DEVICE_NAME", "cuda"), "copy_missing_cuda", "exec"), namespace)
