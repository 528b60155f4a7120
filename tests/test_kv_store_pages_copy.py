"""The page allocator and the row copy (torch path and the Triton kernel, interpreted)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import CapacityError
from sparse_framework.kv_store.copy import copy_rows
from sparse_framework.kv_store.pages import PageAllocator, allocate_pool

from helpers import run_interpreted


def test_allocator_bulk_alloc_release_and_exhaustion() -> None:
    pool = PageAllocator(8, "test pool")
    a = pool.alloc(3, 16, "a")
    b = pool.alloc(5, 16, "b")
    assert sorted(torch.cat([a, b]).tolist()) == list(range(8)) and pool.free == 0
    with pytest.raises(CapacityError, match=r"test pool full: c needs 1 more pages of 16 tokens \(16 tokens\), 0 of 8"):
        pool.alloc(1, 16, "c")
    pool.release(a)
    assert pool.free == 3 and pool.used == 5
    assert sorted(pool.alloc(3, 16, "d").tolist()) == sorted(a.tolist())
    with pytest.raises(RuntimeError, match="exceed the pool"):
        pool.release(torch.arange(9))


@settings(max_examples=30, deadline=None)
@given(row=st.integers(1, 40), n=st.integers(0, 12), seed=st.integers(0, 999))
def test_copy_rows_torch_path_matches_a_loop(row: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(16 * row, generator=g)
    dst = torch.randn(16 * row, generator=g)
    src_rows = torch.randint(0, 16, (n,), generator=g)
    dst_rows = torch.randperm(16, generator=g)[:n]
    skip = torch.rand(n, generator=g) < 0.3
    src_off = torch.where(skip, -1, src_rows * row)
    dst_off = dst_rows * row
    want = dst.clone()
    for s, d in zip(src_off.tolist(), dst_off.tolist()):
        if s >= 0:
            want[d : d + row] = src[s : s + row]
    copy_rows(src, dst, src_off, dst_off, row, impl="torch")
    assert torch.equal(dst, want)


def test_copy_rows_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="src is torch.float32, dst is torch.float16"):
        copy_rows(torch.zeros(4), torch.zeros(4, dtype=torch.float16), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="offset shapes differ"):
        copy_rows(torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="impl must be"):
        copy_rows(torch.zeros(4), torch.zeros(4), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1, impl="cuda")


KERNEL_CHECK = r"""
import torch
from sparse_framework.kv_store.copy import copy_rows
g = torch.Generator().manual_seed(0)
for row, n in ((1, 5), (7, 9), (130, 6), (1500, 3)):
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        src = (torch.randn(20 * row, generator=g) * 50).to(dtype)
        dst = torch.zeros(20 * row, dtype=dtype)
        src_off = torch.randint(0, 20, (n,), generator=g) * row
        src_off[0] = -1
        dst_off = torch.randperm(20, generator=g)[:n] * row
        want = dst.clone()
        copy_rows(src, want, src_off, dst_off, row, impl="torch")
        copy_rows(src, dst, src_off, dst_off, row, impl="triton")
        assert torch.equal(dst, want), (row, n, dtype)
print("kernel ok")
"""


def test_triton_kernel_matches_the_torch_path_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted(KERNEL_CHECK, "kernel ok", timeout=600)


def test_triton_path_needs_cuda_or_the_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter active")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        copy_rows(torch.zeros(4), torch.zeros(4), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1, impl="triton")


def test_a_pool_too_large_to_allocate_is_a_capacity_error() -> None:
    with pytest.raises(CapacityError, match=r"cannot allocate the device KV pool .* set device_capacity_tokens"):
        allocate_pool((2**40, 2**20), torch.float32, torch.device("cpu"), "device KV pool", "device_capacity_tokens")
