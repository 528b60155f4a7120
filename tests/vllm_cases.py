"""Shared cases of the vLLM plugin's tests: random paged K/V in shuffled blocks, the writes
vLLM makes, and float64 references (torch only)."""

from __future__ import annotations

import math

import torch

from sparse_framework.algorithms.base import _max_units, topk_selection
from sparse_framework.algorithms.quest import Quest
from sparse_framework.common.batch import Batch, Request, Selection
from sparse_framework.common.layout import KVLayout
from sparse_framework.integrations.vllm.paged import PagedAlgorithm, attend_reference, folded_page_table

BASE = {"algorithm": "quest", "min_sparse_prompt_len": 0}

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


def fill(algo: PagedAlgorithm, lens, keys, values, table, k_cache, v_cache, bs: int, chunk: int):
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


def rebuilt_selection(config, lens, keys, q) -> Selection:  # type: ignore[no-untyped-def]
    """The selection the rebuild bridge (`paged_bridge.PagedBridge`) must make, written apart
    from it, with no paging: the config's algorithm built on each request's contiguous keys
    before the newest (as the engine's prefill), scored for one decode step, its units pooled
    to blocks one by one (a token-granular algorithm: the max over the tokens it saw; a
    page-granular one: its page), then the framework's top-k over blocks."""
    bs = config.page_size
    hkv, dim = keys[0].shape[1:]
    cls = config.algorithm_class
    algo = cls(config, KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=dim), max_requests=len(lens),
               max_seq_len=max(lens))
    requests = [Request(f"r{i}", prompt_len=max(n - 1, 1), seq_len=n, slot=i) for i, n in enumerate(lens)]
    for r, k, n in zip(requests, keys, lens):
        if n > 1:
            algo.build(0, r, k[: n - 1])
    batch = Batch(requests)
    batch.prepare("cpu")
    scores = algo.score(0, q, batch).float()
    n_blocks = -(-max(lens) // bs)
    blocks = torch.full((len(lens), scores.shape[1], n_blocks), float("-inf"))
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            if algo.unit > 1:
                blocks[i, :, j] = scores[i, :, j]
            elif j * bs < n - 1:
                blocks[i, :, j] = scores[i, :, j * bs : min((j + 1) * bs, n - 1)].max(-1).values
    budget = cls.budget_units(config) if cls.granularity == "page" else config.top_k // bs
    return topk_selection(blocks, torch.tensor(lens), unit=bs, budget_units=budget, sink_tokens=config.sink_tokens,
                          recent_tokens=config.recent_tokens, width_units=_max_units(config, bs, budget),
                          newest_forced=algo.newest_forced or config.recent_tokens >= 1)


def assert_selects_everything_and_attends_densely(  # type: ignore[no-untyped-def]
    selection, seq_lens, q, keys, values, table, k_cache, v_cache, bs: int
) -> None:
    """A covering budget's selection: every token of every row and KV head, and attention over
    it through the folded page table equal to float64 dense attention."""
    assert torch.equal(selection.lengths, seq_lens.view(-1, 1).expand_as(selection.lengths))
    metadata = folded_page_table(selection, table, k_cache.shape[1], bs)
    scale = 1 / math.sqrt(q.shape[-1])
    got = attend_reference(q, k_cache, v_cache, metadata, scale=scale)
    torch.testing.assert_close(got.double(), dense_attention(q, keys, values, scale), atol=2e-6, rtol=1e-5)


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

