"""kernels/paged_scores.py: Quest's bounds scored through a block table (the vLLM plugin's
scoring pass). The torch twin against a float64 loop over the formula; the Triton kernel
against the twin, interpreted on the CPU (in a subprocess) and on CUDA (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch
from helpers import run_interpreted
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.kernels.reference.scores import quest_paged_scores_torch


def float64_scores(q, page_min, page_max, table, n_pages, how, w):  # type: ignore[no-untyped-def]
    """Σ_d max(q_d·m_d, q_d·M_d) − (1 − w)/2 · Σ_d |q_d|·(M_d − m_d) of block table[b, p],
    per query head, then reduced over each KV head's group: a loop, in float64."""
    b, hq, _ = q.shape
    hkv = page_min.shape[1]
    g = hq // hkv
    out = torch.zeros(b, hkv, n_pages, dtype=torch.float64)
    for i in range(b):
        for p in range(n_pages):
            block = min(max(int(table[i, p]), 0), page_min.shape[0] - 1)
            for j in range(hkv):
                lo, hi = page_min[block, j].double(), page_max[block, j].double()
                per_head = []
                for h in range(j * g, (j + 1) * g):
                    qq = q[i, h].double()
                    bound = torch.maximum(qq * lo, qq * hi).sum() - (1 - w) / 2 * (qq.abs() * (hi - lo)).sum()
                    per_head.append(bound)
                stack = torch.stack(per_head)
                out[i, j, p] = {"max": stack.max(), "sum": stack.sum(), "mean": stack.mean()}[how]
    return out


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3), hkv=st.integers(1, 3), g=st.integers(1, 3), d=st.sampled_from([4, 16, 24]),
    blocks=st.integers(1, 12), width=st.integers(1, 9), how=st.sampled_from(["max", "sum", "mean"]),
    w=st.sampled_from([1.0, 0.0, 0.4]), seed=st.integers(0, 100),
)
def test_torch_twin_equals_the_formula_through_the_table(b, hkv, g, d, blocks, width, how, w, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(blocks, hkv, d, generator=gen), torch.randn(blocks, hkv, d, generator=gen)
    lo, hi = torch.minimum(x, y), torch.maximum(x, y)
    q = torch.randn(b, hkv * g, d, generator=gen)
    table = torch.randint(-2, blocks + 3, (b, width), generator=gen, dtype=torch.int32)  # out of range: clamped
    n_pages = int(torch.randint(0, width + 1, (1,), generator=gen))
    got = quest_paged_scores_torch(q, lo, hi, table, n_pages, how, w)
    assert got.dtype == torch.float32 and got.shape == (b, hkv, n_pages)
    torch.testing.assert_close(got.double(), float64_scores(q, lo, hi, table, n_pages, how, w), atol=1e-4, rtol=1e-5)


def test_bad_shapes_are_refused_with_the_argument_named() -> None:
    q, bounds = torch.randn(2, 4, 8), torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="block_table must be"):
        quest_paged_scores_torch(q, bounds, bounds, torch.zeros(3, 4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="n_pages"):
        quest_paged_scores_torch(q, bounds, bounds, torch.zeros(2, 4, dtype=torch.int32), 5)
    with pytest.raises(ValueError, match=r"\[num_blocks, Hkv, D\]"):
        quest_paged_scores_torch(q, bounds.unsqueeze(0), bounds.unsqueeze(0), torch.zeros(2, 4, dtype=torch.int32), 2)


INTERPRETED = r"""
import torch
from sparse_framework.kernels.paged_scores import quest_paged_scores_triton
from sparse_framework.kernels.reference.scores import quest_paged_scores_torch

g = torch.Generator().manual_seed(0)
cases = [(2, 2, 2, 16, 40, 37, 30, "max", 1.0), (1, 1, 3, 24, 10, 10, 10, "mean", 0.5),
         (3, 2, 1, 64, 200, 140, 133, "sum", 1.0), (2, 3, 3, 64, 90, 80, 77, "sum", 0.0),
         (4, 8, 4, 128, 300, 70, 64, "max", 0.0), (2, 2, 2, 32, 30, 29, 0, "max", 0.3)]
for dt in (torch.float32, torch.bfloat16):
    for b, hkv, grp, d, blocks, width, n_pages, how, w in cases:
        x, y = torch.randn(blocks + 1, hkv, d, generator=g), torch.randn(blocks + 1, hkv, d, generator=g)
        lo, hi = torch.minimum(x, y).to(dt), torch.maximum(x, y).to(dt)
        q = torch.randn(b, hkv * grp, d, generator=g).to(dt)
        table = torch.randint(-1, blocks + 4, (b, width), generator=g, dtype=torch.int32)
        view = table[:, : max(width - 1, 1)] if width > 1 else table  # a strided table (a slice of a wider one)
        for t in (table, view):
            n = min(n_pages, t.shape[1])
            got = quest_paged_scores_triton(q, lo, hi, t, n, how, w)
            want = quest_paged_scores_torch(q, lo, hi, t, n, how, w)
            assert got.shape == want.shape and got.dtype == torch.float32, (got.shape, want.shape)
            if want.numel():
                err, scale = float((got - want).abs().max()), float(want.abs().max())
                assert err <= (1e-4 if dt == torch.float32 else 1e-3) * max(1.0, scale), (dt, b, hkv, d, err)
print("paged ok")
"""


@pytest.mark.slow
def test_triton_interpreted_matches_the_torch_twin() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, "paged ok", timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how, w", [("max", 1.0), ("sum", 0.0), ("mean", 0.5)])
def test_triton_matches_the_torch_twin_on_cuda(dtype: torch.dtype, how: str, w: float) -> None:
    from sparse_framework.kernels.paged_scores import quest_paged_scores_triton

    gen = torch.Generator().manual_seed(3)
    blocks, hkv, g, d, b, width = 2100, 8, 4, 128, 8, 2053
    x, y = torch.randn(blocks, hkv, d, generator=gen), torch.randn(blocks, hkv, d, generator=gen)
    lo, hi = torch.minimum(x, y).to(dtype).cuda(), torch.maximum(x, y).to(dtype).cuda()
    q = torch.randn(b, hkv * g, d, generator=gen).to(dtype).cuda()
    table = torch.randint(0, blocks, (b, width), generator=gen, dtype=torch.int32).cuda()
    got = quest_paged_scores_triton(q, lo, hi, table, 1025, how, w)
    want = quest_paged_scores_torch(q, lo, hi, table, 1025, how, w)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
