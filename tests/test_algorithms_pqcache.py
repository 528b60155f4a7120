"""PQCache: k-means, codes, and PQ scores vs direct re-computations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import SMALL_QUEST, batch_of
from sparse_framework import ConfigError, KVLayout, Request, load_config
from sparse_framework.algorithms.pqcache import PQCache, kmeans
from sparse_framework.coordinator import SparseCoordinator


def make(bits: int = 6, subvectors: int = 2, how: str = "sum", iterations: int = 10, hk: int = 2) -> PQCache:
    cfg = load_config({**SMALL_QUEST, "algorithm": "pqcache", "top_k": 16,
                       "extra": {"bits": bits, "subvectors": subvectors, "gqa_reduce": how, "iterations": iterations}})
    return PQCache(cfg, KVLayout(num_layers=2, num_kv_heads=hk, head_dim=8), max_requests=2, max_seq_len=200)



def objective(x: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> float:
    return float((x - centroids.gather(1, codes.unsqueeze(-1).expand(-1, -1, x.shape[-1]))).square().sum())


def test_kmeans_codes_are_nearest_and_lloyd_never_gets_worse() -> None:
    x = torch.randn(3, 200, 4, generator=torch.Generator().manual_seed(0))
    results = [kmeans(x, 8, it, torch.Generator().manual_seed(1)) for it in (1, 3, 10, 30)]
    for centroids, codes in results:
        assert torch.equal(codes, torch.cdist(x, centroids).argmin(-1))
    values = [objective(x, c, k) for c, k in results]
    assert all(a >= b - 1e-4 for a, b in zip(values, values[1:]))
    assert values[-1] < values[0]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), how=st.sampled_from(["sum", "max", "mean"]), group=st.sampled_from([1, 2]), seed=st.integers(0, 999))
def test_with_a_centroid_per_key_the_scores_are_exact(n, how, group, seed) -> None:
    """n <= 2**bits distinct keys: each is its own centroid, so PQ logits equal q·k, and the
    scores are the group's reduced softmax(q·k / √d) over the n stored tokens (the token
    being decoded, n, is not stored yet)."""
    g = torch.Generator().manual_seed(seed)
    algo = make(bits=6, how=how)
    keys = torch.randn(n, 2, 8, generator=g)
    r = Request("a", n, seq_len=n, slot=1)
    algo.build(0, r, keys)
    r.seq_len += 1
    q = torch.randn(1, 2 * group, 8, generator=g)
    got = algo.score(0, q, batch_of([r]))[0, :, :n]
    exact = torch.stack([(keys[:, j // group] @ q[0, j] / 8**0.5).softmax(0) for j in range(2 * group)])
    exact = exact.view(2, group, n)
    want = {"sum": exact.sum(1), "max": exact.amax(1), "mean": exact.mean(1)}[how]
    assert torch.allclose(got, want, atol=1e-5)


def test_scores_and_appended_codes_match_a_direct_computation() -> None:
    g = torch.Generator().manual_seed(3)
    algo = make(bits=3, subvectors=4, iterations=5)
    reqs = [Request("a", 120, seq_len=120, slot=0), Request("b", 70, seq_len=70, slot=1)]
    keys = {r.rid: torch.randn(r.prompt_len, 2, 8, generator=g) for r in reqs}
    for r in reqs:
        algo.build(1, r, keys[r.rid])
    for _ in range(3):  # decode keys are encoded against the prefill codebooks
        for r in reqs:
            r.seq_len += 1
        new = torch.randn(2, 2, 8, generator=g)
        algo.append(1, batch_of(reqs), new)
        for i, r in enumerate(reqs):
            books = algo.codebooks[1, r.slot]  # [Hkv, M, K, d]
            for h in range(2):
                sub = new[i, h].view(4, 2)
                want = torch.stack([(books[h, m] - sub[m]).square().sum(-1).argmin() for m in range(4)])
                assert algo.codes[1, r.slot, h, r.seq_len - 1].long().tolist() == want.tolist()
    q = torch.randn(2, 4, 8, generator=g)
    for r in reqs:  # the next step: its token is not encoded yet
        r.seq_len += 1
    scores = algo.score(1, q, batch_of(reqs))
    for i, r in enumerate(reqs):
        books, codes = algo.codebooks[1, r.slot], algo.codes[1, r.slot].long()
        n = r.seq_len - 1
        for h in range(2):
            total = torch.zeros(n, dtype=torch.float64)
            for j in (2 * h, 2 * h + 1):  # the group's summed per-head softmax of the PQ logits
                logits = torch.tensor([
                    sum(float(q[i, j, 2 * m : 2 * m + 2] @ books[h, m, codes[h, t, m]]) for m in range(4)) for t in range(n)
                ], dtype=torch.float64)
                total += (logits / 8**0.5).softmax(0)
            assert torch.allclose(scores[i, h, :n].double(), total, atol=1e-5)


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="`extra.bits` = 9"):
        load_config({"algorithm": "pqcache", "extra": {"bits": 9}})
    with pytest.raises(ConfigError, match=r"`extra.subvectors` = 3 must divide head_dim \(8\)"):
        SparseCoordinator({"algorithm": "pqcache", "extra": {"subvectors": 3}}, KVLayout(1, 1, 8))
