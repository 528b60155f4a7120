"""`SparseCoordinator.store_prompt`: an engine that attended its prompt itself hands it over
without stand-in queries, and the coordinator ends in the state attention_begin + attention_end
would have left (the decode steps after it are equal, bit for bit)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import Batch, Request
from sparse_framework.coordinator.step_order import HookOrderError
from coordinator_driver import make

ALGORITHMS = {
    "quest": {"algorithm": "quest"},
    "snapkv": {"algorithm": "snapkv", "extra": {"window": 4, "kernel_size": 1}},
    "pqcache": {"algorithm": "pqcache"},
    "dsa-keys": {"algorithm": "dsa", "extra": {"source": "keys"}},
}
Q_HEADS = 4


def _prompts(lens: list[int]) -> list[Request]:
    return [Request(f"r{i}", n) for i, n in enumerate(lens)]


def _tail(coord, q: torch.Tensor, lens: list[int]) -> torch.Tensor | None:
    """The queries the algorithm's build reads, in q's tail form (None: it reads none)."""
    rows = coord.algorithm.prefill_query_rows
    if rows == 0:
        return None
    if rows is None:
        return q
    parts, start = [], 0
    for n in lens:
        parts.append(q[start + n - min(rows, n) : start + n])
        start += n
    return torch.cat(parts)


def _run(config: dict, lens: list[int], seed: int, handed_over: bool) -> list[torch.Tensor]:
    """Prefill `lens` (by store_prompt, or by attention_begin + attention_end), then two decode
    steps; the decode outputs of every layer."""
    coord = make({**config, "top_k": 16})
    lay = coord.layout
    g = torch.Generator().manual_seed(seed)
    requests = _prompts(lens)
    for r in requests:
        coord.on_request_begin(r)
    batch = Batch(requests, is_prefill=True)
    coord.forward_begin(batch)
    n = sum(lens)
    for layer in range(lay.num_layers):
        q = torch.randn(n, Q_HEADS, lay.head_dim, generator=g)
        k, v = (torch.randn(n, lay.num_kv_heads, lay.head_dim, generator=g) for _ in range(2))
        torch.manual_seed(seed)  # PQCache's k-means draws its start from the global generator
        if handed_over:
            coord.store_prompt(layer, k, v, batch, _tail(coord, q, lens))
        else:
            coord.attention_begin(layer, q, k, v, batch)
            coord.attention_end(layer, None, batch)
    coord.forward_end(batch)
    outs = []
    for _ in range(2):
        step = Batch(requests)
        coord.forward_begin(step)
        for layer in range(lay.num_layers):
            q = torch.randn(len(requests), Q_HEADS, lay.head_dim, generator=g)
            k, v = (torch.randn(len(requests), lay.num_kv_heads, lay.head_dim, generator=g) for _ in range(2))
            meta = coord.attention_begin(layer, q, k, v, step)
            out = coord.attend(layer, q, meta)
            coord.attention_end(layer, out, step)
            outs.append(out)
        coord.forward_end(step)
    return outs


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(ALGORITHMS)), lens=st.lists(st.integers(20, 90), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_store_prompt_leaves_the_state_attention_begin_and_end_leave(name: str, lens: list[int], seed: int) -> None:
    config = ALGORITHMS[name]
    want = _run(config, lens, seed, handed_over=False)
    got = _run(config, lens, seed, handed_over=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_store_prompt_refuses_a_decode_batch_and_missing_queries_by_name() -> None:
    coord = make({"algorithm": "snapkv", "extra": {"window": 4, "kernel_size": 1}, "top_k": 16})
    lay = coord.layout
    r = Request("a", 32)
    coord.on_request_begin(r)
    batch = Batch([r], is_prefill=True)
    coord.forward_begin(batch)
    k = v = torch.zeros(32, lay.num_kv_heads, lay.head_dim)
    with pytest.raises(ValueError, match="builds from the prompt's queries: pass store_prompt"):
        coord.store_prompt(0, k, v, batch)
    coord.store_prompt(0, k, v, batch, torch.zeros(4, Q_HEADS, lay.head_dim))
    with pytest.raises(HookOrderError):  # the layer counts as begun and ended
        coord.store_prompt(0, k, v, batch, torch.zeros(4, Q_HEADS, lay.head_dim))
    coord.abort_step(batch)
    with pytest.raises(ValueError, match="takes a prefill batch"):  # checked before the step order
        coord.store_prompt(0, k[:1], v[:1], Batch([r]))
