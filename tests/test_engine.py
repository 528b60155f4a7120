"""The decode loop and its metrics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import load_config
from sparse_framework.eval.loop import run_experiment
from sparse_framework.eval.metrics import (
    attention_recall,
    dense_attention,
    needle_hits,
    relative_error,
    selected_mask,
)
from sparse_framework.eval.workload import WorkloadConfig

SMALL = {"contexts": [40, 300], "decode_steps": 3, "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def quest(**kw) -> object:
    return load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 32, "page_size": 8, "sink_tokens": 8, "recent_tokens": 8,
                        "min_sparse_prompt_len": 100, "device_buffer_tokens": 256,
                        "extra": {"dense_first_layers": 0}, **kw})


def test_dense_requests_match_dense_and_sparse_ones_read_less() -> None:
    results = run_experiment(quest(), WorkloadConfig(**SMALL))
    short, long = results
    assert short.mode == "dense" and long.mode == "sparse"
    assert short.rel_error < 1e-5 and short.recall == pytest.approx(1.0)
    assert short.kv_read_fraction == pytest.approx(1.0) and short.needle_hit_rate == 1.0
    assert long.kv_read_fraction < 0.5
    assert 0 < long.recall <= 1.0 + 1e-9
    assert long.selected_tokens <= 8 + 32 + 16 + 8


def test_budget_covering_the_context_matches_dense() -> None:
    results = run_experiment(quest(top_k=512, min_sparse_prompt_len=0, device_buffer_tokens=1024), WorkloadConfig(**SMALL))
    for r in results:
        assert r.mode == "sparse"
        assert r.rel_error < 1e-5 and r.recall == pytest.approx(1.0) and r.needle_hit_rate == 1.0


def test_strong_needles_are_found_weak_ones_are_missed() -> None:
    wl = {**SMALL, "contexts": [2000], "decode_steps": 2, "head_dim": 64}
    strong = run_experiment(quest(), WorkloadConfig(**wl, needle_strength=4.0))[0]
    weak = run_experiment(quest(), WorkloadConfig(**wl, needle_strength=0.5))[0]
    assert strong.needle_hit_rate == 1.0 and strong.recall > 0.95
    assert weak.needle_hit_rate < 1.0 and weak.rel_error > strong.rel_error


def test_workload_validation() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        WorkloadConfig(num_q_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="dtype must be one of"):
        WorkloadConfig(dtype="int8")
    with pytest.raises(ValueError, match="context length must be >= 1"):
        WorkloadConfig(contexts=[0])


@settings(max_examples=25, deadline=None)
@given(seq=st.integers(1, 40), heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), seed=st.integers(0, 999))
def test_recall_is_one_for_the_oracle_and_at_most_one_otherwise(seq, heads, group, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    hq = heads * group
    q, k, v = torch.randn(hq, 8, generator=g), torch.randn(seq, heads, 8, generator=g), torch.randn(seq, heads, 8, generator=g)
    out, probs = dense_attention(q, k, v)
    assert torch.allclose(probs.sum(-1), torch.ones(hq, dtype=torch.float64))
    # direct per-head loop
    for h in range(hq):
        kh = k[:, h // group].double()
        p = (kh @ q[h].double() / math.sqrt(8)).softmax(0)
        assert torch.allclose(out[h], p @ v[:, h // group].double())
    n = max(1, seq // 2)
    random_rows = torch.stack([torch.randperm(seq, generator=g)[:n].sort().values for _ in range(heads)]).int()
    mask = selected_mask(random_rows, seq, hq)
    assert int(mask.sum()) == hq * n
    assert attention_recall(probs, mask) <= 1.0 + 1e-9
    # a per-query-head oracle selection has recall exactly 1
    oracle = torch.zeros(hq, seq, dtype=torch.bool)
    oracle.scatter_(1, probs.topk(n, dim=-1).indices, True)
    assert attention_recall(probs, oracle) == pytest.approx(1.0)


def test_needle_hits_and_relative_error() -> None:
    mask = torch.tensor([[True, False, True], [False, False, True]])
    assert needle_hits(torch.tensor([0, 2]), mask) == (3, 4)
    assert needle_hits(torch.tensor([], dtype=torch.long), mask) == (0, 0)
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert relative_error(torch.tensor([3.0, 4.0]), ref) == 0.0
    assert relative_error(torch.tensor([0.0, 0.0]), ref) == pytest.approx(1.0)
    padded = torch.tensor([[0, 2, -1]], dtype=torch.int32)
    assert selected_mask(padded, 3, 2).tolist() == [[True, False, True]] * 2
