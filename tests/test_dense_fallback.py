"""Dense fallbacks are counted: requests below min_sparse_prompt_len, dense layers (the config's
and the algorithm's own), and the decode layer-steps each makes dense, against a plain count
over (request, layer, step); the eval marks a cell that never attended sparsely."""

from __future__ import annotations

from collections import Counter

import torch

from sparse_framework import Batch, KVLayout, Request
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.coordinator.dense_tally import COST_POLICY, DENSE_LAYER, DENSE_REQUEST, SHORT_PROMPT, DenseTally
from sparse_framework.eval.experiment import load_experiment
from sparse_framework.eval.sweep import run_sweep

LAYERS, KV_HEADS, Q_HEADS, DIM = 4, 2, 4, 16


def _drive(coord: SparseCoordinator, prompts: list[int], steps: int) -> list[Request]:
    """Prefill each prompt alone, then decode them together for `steps` steps (random tensors)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    requests = [Request(f"r{i}", n) for i, n in enumerate(prompts)]
    for r in requests:
        coord.on_request_begin(r)
        batch = Batch([r], is_prefill=True)
        coord.forward_begin(batch)
        for layer in range(LAYERS):
            q = rand(r.prompt_len, Q_HEADS, DIM)
            coord.attention_begin(layer, q, rand(r.prompt_len, KV_HEADS, DIM), rand(r.prompt_len, KV_HEADS, DIM), batch)
            coord.attention_end(layer, None, batch)
        coord.forward_end(batch)
    for _ in range(steps):
        batch = Batch(requests)
        coord.forward_begin(batch)
        for layer in range(LAYERS):
            q = rand(len(requests), Q_HEADS, DIM)
            meta = coord.attention_begin(layer, q, rand(len(requests), KV_HEADS, DIM), rand(len(requests), KV_HEADS, DIM), batch)
            coord.attention_end(layer, coord.attend(layer, q, meta), batch)
        coord.forward_end(batch)
    return requests


def test_coordinator_counts_dense_requests_and_layer_steps_with_their_reason() -> None:
    config = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 16, "page_size": 4, "sink_tokens": 4, "recent_tokens": 4,
              "device_buffer_tokens": 64, "min_sparse_prompt_len": 50, "dense_layers": [3],
              "extra": {"dense_first_layers": 1}}
    coord = SparseCoordinator(config, KVLayout(LAYERS, KV_HEADS, DIM, torch.float32), max_requests=3, max_seq_len=256)
    prompts, steps = [20, 100, 120], 3  # the first is below min_sparse_prompt_len
    _drive(coord, prompts, steps)
    # the plain count: every (request, layer, step), dense for the first reason that applies
    dense_layers = {0, 3}
    expected: Counter[str] = Counter()
    for n in prompts:
        for layer in range(LAYERS):
            for _ in range(steps):
                if layer in dense_layers:
                    expected[DENSE_LAYER] += 1
                elif n < 50:
                    expected[DENSE_REQUEST] += 1
    report = coord.dense_report()
    assert report["requests"] == 3 and report["dense_requests"] == {SHORT_PROMPT: 1}
    assert report["layer_steps"] == len(prompts) * LAYERS * steps
    assert report["dense_layer_steps"] == dict(expected)
    assert report["sparse_layer_steps"] == report["layer_steps"] - sum(expected.values())
    assert report["dense_layers"] == [0, 3] and report["min_sparse_prompt_len"] == 50
    assert coord.dense_tally.sparse_fraction == (2 * 2 * steps) / (3 * LAYERS * steps)


def test_tally_adds_and_summarises() -> None:
    a, b = DenseTally(), DenseTally()
    a.admit(True)
    a.decode_step(2, 1, 4, 1)  # 8 layer-steps: 2 in the dense layer, 3 of the dense request elsewhere
    b.dense_steps("no cache (use_cache=False)", 5)
    total = a + b
    assert total.layer_steps == 13 and total.sparse_layer_steps == 3
    assert total.summary() == ("1 of 1 requests dense (short prompt: 1); 10 of 13 decode layer-steps dense "
                               "(dense layer: 2, dense request: 3, no cache (use_cache=False): 5)")
    assert DenseTally().sparse_fraction is None


def test_tally_counts_the_cost_policy_apart() -> None:
    tally = DenseTally()
    tally.admit(True, COST_POLICY)
    # 3 requests x 4 layers, one dense layer: 1 dense for another reason, 2 by the cost policy
    tally.decode_step(3, 1, 4, 1, cost_policy=2)
    assert tally.as_dict()["dense_requests"] == {COST_POLICY: 1}
    assert tally.as_dict()["dense_layer_steps"] == {DENSE_LAYER: 3, DENSE_REQUEST: 3, COST_POLICY: 6}
    assert tally.sparse_layer_steps == 0 and "cost policy: 6" in tally.summary()


def test_eval_marks_a_cell_that_never_went_sparse(tmp_path) -> None:
    exp = load_experiment({
        "name": "short", "algorithms": [{"algorithm": "quest", "extra": {"dense_first_layers": 0}}],
        "budgets": [32], "contexts": [256, 512],
        "base": {"min_sparse_prompt_len": 300},  # 256 decodes densely, 512 sparsely
        "workloads": [{"kind": "synthetic", "options": {"decode_steps": 2}}],
    })
    records = {(r.context, r.top_k): r for r in run_sweep(exp, None, progress=False)}
    assert records[(256, 32)].metrics["sparse_fraction"] == 0.0
    assert records[(512, 32)].metrics["sparse_fraction"] == 1.0
    assert records[(256, None)].metrics["sparse_fraction"] is None  # the dense baseline is not a fallback
