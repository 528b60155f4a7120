"""Quest's one-launch append of page bounds (kernels/page_bounds.py) against its torch twin
(algorithms/quest.py `append_page_bounds`), interpreted on the CPU over random shapes, page
sizes, positions and dtypes (hypothesis); the twin against a per-element loop."""

from __future__ import annotations

import pytest
import torch

from helpers import run_interpreted

from sparse_framework.algorithms.quest import append_page_bounds


def test_the_torch_twin_sets_a_fresh_page_and_widens_an_open_one() -> None:
    g = torch.Generator().manual_seed(0)
    lo, hi = torch.randn(3, 2, 4, 5, generator=g), torch.randn(3, 2, 4, 5, generator=g)
    hi = torch.maximum(lo, hi)
    keys = torch.randn(2, 2, 5, generator=g)
    rows, lens = torch.tensor([2, 0]), torch.tensor([9, 7])  # page size 4: position 8 opens page 2, 6 is in page 1
    want_lo, want_hi = lo.clone(), hi.clone()
    want_lo[2, :, 2], want_hi[2, :, 2] = keys[0], keys[0]
    for h in range(2):
        for d in range(5):
            want_lo[0, h, 1, d] = min(float(lo[0, h, 1, d]), float(keys[1, h, d]))
            want_hi[0, h, 1, d] = max(float(hi[0, h, 1, d]), float(keys[1, h, d]))
    append_page_bounds(lo, hi, rows, lens, keys, 4)
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)


INTERPRETED = r"""
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from sparse_framework.algorithms.quest import append_page_bounds
from sparse_framework.kernels.page_bounds import append_page_bounds_triton

@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 5), h=st.integers(1, 3), d=st.sampled_from([1, 5, 16, 33]), p=st.sampled_from([1, 4, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), key_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def bounds_equal(b, h, d, p, dtype, key_dtype, strided, seed):
    g = torch.Generator().manual_seed(seed)
    requests, pages = b + 2, 4
    lo = torch.randn(requests, h, pages, d, generator=g).to(dtype)
    hi = torch.maximum(lo, torch.randn(requests, h, pages, d, generator=g).to(dtype))
    rows = torch.randperm(requests, generator=g)[:b]
    lens = torch.randint(1, pages * p + 1, (b,), generator=g, dtype=torch.int32)
    keys = torch.randn(b, h, 2 * d if strided else d, generator=g).to(key_dtype)
    keys = keys[..., ::2] if strided else keys
    mine_lo, mine_hi = lo.clone(), hi.clone()
    append_page_bounds(lo, hi, rows, lens, keys, p)
    append_page_bounds_triton(mine_lo, mine_hi, rows, lens, keys, p)
    assert torch.equal(mine_lo, lo) and torch.equal(mine_hi, hi), (mine_lo - lo, mine_hi - hi)

bounds_equal()
print("page bounds ok")
"""


def test_the_kernel_equals_its_twin_interpreted() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, "page bounds ok")


def test_the_kernel_refuses_bounds_of_different_strides() -> None:
    pytest.importorskip("triton")
    from sparse_framework.kernels.page_bounds import append_page_bounds_triton

    lo, hi = torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 4, 3).transpose(2, 3)
    with pytest.raises((ValueError, RuntimeError)):
        append_page_bounds_triton(lo, hi, torch.tensor([0]), torch.tensor([1]), torch.zeros(1, 1, 4), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_kernel_equals_its_twin_at_decode_shapes(dtype: torch.dtype) -> None:
    """Compiled (not interpreted): a Llama-3-8B layer's bounds, 32 requests, every page size
    phase (fresh and open pages), keys in float32 and in the bounds' dtype."""
    from sparse_framework.kernels.page_bounds import append_page_bounds_triton

    g = torch.Generator().manual_seed(1)
    requests, heads, pages, dim, p = 40, 8, 256, 128, 16
    lo = torch.randn(requests, heads, pages, dim, generator=g).to(dtype).cuda()
    hi = torch.maximum(lo, torch.randn(requests, heads, pages, dim, generator=g).to(dtype).cuda())
    for key_dtype in (torch.float32, dtype):
        rows = torch.randperm(requests, generator=g)[:32].cuda()
        lens = torch.randint(1, pages * p + 1, (32,), generator=g, dtype=torch.int32).cuda()
        keys = torch.randn(32, heads, dim, generator=g).to(key_dtype).cuda()
        mine_lo, mine_hi = lo.clone(), hi.clone()
        append_page_bounds(lo, hi, rows, lens, keys, p)
        append_page_bounds_triton(mine_lo, mine_hi, rows, lens, keys, p)
        assert torch.equal(mine_lo, lo) and torch.equal(mine_hi, hi)
