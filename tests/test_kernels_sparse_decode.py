"""Sparse decode kernels (kernels/sparse_decode.py) and the `triton` backend: the Triton kernels
against torch_ref's `paged_attention` / `indexed_attention`, interpreted on the CPU (in a
subprocess, with hypothesis over small shapes, NaN in every row that must not be read) and on
CUDA at full shapes (`-m gpu`); the backend's metadata handling, launch heuristics and its
clear errors where it cannot run."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from sparse_framework import ConfigError, KVLayout
from sparse_framework.backends.torch_ref import TorchRefBackend, indexed_attention, paged_attention
from sparse_framework.backends.triton import TritonBackend
from sparse_framework.coordinator.core import SparseCoordinator

from helpers import SMALL_QUEST, run_interpreted

sd = pytest.importorskip("sparse_framework.kernels.sparse_decode")


def reference_paged(q4, k, v, table, lens, scale, causal=True, **options):
    """float32 [N, s_q, Hq, Dv]: torch_ref per query token, query i of s_q seeing
    lens - (s_q - 1 - i) tokens when causal (flash_attn_with_kvcache's convention);
    `options`: softcap / sinks, passed on."""
    s_q = q4.shape[1]
    outs = []
    for i in range(s_q):
        li = (lens.long() - (s_q - 1 - i)).clamp(min=0) if causal else lens.long()
        outs.append(paged_attention(q4[:, i], k, v, table, li.to(torch.int32), scale, **options))
    return torch.stack(outs, 1)


# -- on the CPU, without the interpreter -------------------------------------------------------
def test_launch_heuristics() -> None:
    # GQA decode, d = 128: 4 query heads padded to 16 rows, 64 tokens a step, no second chunk
    assert sd._tiles(4, 128, 128) == (16, 64, 128, 0, 128, 4)
    assert sd._tiles(4, 128, 128, 4, 4) == (16, 64, 128, 0, 128, 4)  # float32: 64 KB a step
    assert sd._tiles(4, 128, 128, 4, 4, tile_bytes=36 * 1024) == (16, 32, 128, 0, 128, 4)
    # MLA: 128 heads in blocks of 64, 576 = 512 + 64, V 512 from the K tile, 8 warps for the
    # 64 x 512 accumulator; in float32 half the heads and tokens (shared memory)
    assert sd._tiles(128, 576, 512, v_shares_k=True) == (64, 64, 512, 64, 512, 8)
    assert sd._tiles(128, 576, 512, 4, 4, v_shares_k=True) == (32, 32, 512, 64, 512, 8)
    assert sd._tiles(16, 576, 512, v_shares_k=True) == (16, 64, 512, 64, 512, 4)
    assert sd._token_bytes(576, 512, 2, True) == 1152 and sd._token_bytes(128, 128, 2, False) == 512
    assert sd._tiles(3, 40, 32)[2:4] == (32, 16) and sd._tiles(1, 8, 8)[2:5] == (16, 0, 16)
    cpu = torch.device("cpu")  # 132 SMs assumed (an H100)
    assert sd.choose_num_splits(8 * 8, 2048, 64, 4, cpu) == 5  # batch 8 x 8 KV heads: 320 programs
    assert sd.choose_num_splits(8 * 2, 2048, 32, 8, cpu) == 9  # MLA, batch 8, two head blocks
    assert sd.choose_num_splits(8 * 2, 2048, 64, 8, cpu) == 9  # the same with 64-token steps
    assert sd.choose_num_splits(64 * 8, 2048, 64, 4, cpu) == 1  # enough programs already
    assert sd.choose_num_splits(4, 100, 64, 4, cpu) == 2  # no more splits than token blocks
    assert sd.choose_num_splits(1, 100000, 64, 4, cpu) == sd.MAX_SPLITS
    assert sd.choose_num_splits(4, 0, 64, 4, cpu) == 1


def test_a_tile_too_big_for_the_gpu_is_halved_until_it_fits(monkeypatch) -> None:
    """A GPU with less shared memory than the default MLA tile needs (OutOfResources at launch)
    gets half the tokens a step, remembered for the next call; one that fits nothing raises."""
    shapes = []

    def launch(*args, **kwargs) -> None:
        tiles = args[8]
        shapes.append(tiles[1])
        if tiles[1] * 1152 > 36 * 1024:  # pretend the GPU has room for 32 tokens a step only
            raise sd.OutOfResources(2 * tiles[1] * 1152, 2 * 36 * 1024, "shared memory")

    monkeypatch.setattr(sd, "_launch_tiles", launch)
    monkeypatch.setattr(sd, "_FITTING_TILE", {})
    q, k = torch.randn(2, 1, 128, 576).bfloat16(), torch.randn(4, 64, 1, 576).bfloat16()
    table, lens = torch.zeros(2, 4, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32)
    sd._launch(q, k, k[..., :512], table, lens, 256, 0.1, indexed=False, causal=True, num_splits=None)
    assert shapes == [64, 32]  # the default, then half of it
    sd._launch(q, k, k[..., :512], table, lens, 256, 0.1, indexed=False, causal=True, num_splits=None)
    assert shapes == [64, 32, 32]  # remembered: no second failure

    def never(*args, **kwargs) -> None:
        raise sd.OutOfResources(1 << 20, 1 << 10, "shared memory")

    monkeypatch.setattr(sd, "_launch_tiles", never)
    with pytest.raises(sd.OutOfResources):
        sd._launch(q, k, k[..., :512], table, lens, 256, 0.1, indexed=False, causal=True, num_splits=None)


def test_bad_arguments_are_refused_with_clear_errors() -> None:
    q, k = torch.randn(2, 4, 16), torch.randn(3, 4, 2, 16)
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        sd.paged_decode(torch.randn(2, 3, 16), k, k, table, lens, 0.25)
    with pytest.raises(ValueError, match="head dim"):
        sd.paged_decode(q, k, torch.randn(3, 4, 2, 32), table, lens, 0.25)
    with pytest.raises(ValueError, match="page_table must be"):
        sd.paged_decode(q, k, k, table[:1], lens, 0.25)
    with pytest.raises(ValueError, match="fp8"):
        sd.paged_decode(q, k.to(torch.float8_e4m3fn), k, table, lens, 0.25)
    with pytest.raises(ValueError, match="indices"):
        sd.sparse_mla_decode(torch.randn(2, 1, 4, 64), torch.randn(9, 1, 64), table, 0.1, v_dim=32)
    with pytest.raises(ValueError, match="v_dim"):
        sd.sparse_mla_decode(torch.randn(2, 1, 4, 64), torch.randn(9, 1, 64), table.view(2, 1, 3), 0.1, v_dim=65)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="CUDA"):
            sd.paged_decode(q, k, k, table, lens, 0.25)


def _coordinator(layout: KVLayout) -> SparseCoordinator:
    return SparseCoordinator({**SMALL_QUEST, "backend": "triton"}, layout)


def test_backend_needs_cuda_or_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="needs CUDA.*TRITON_INTERPRET=1") as info:
        TritonBackend.check_layout(layout)
    with pytest.raises(ConfigError) as info:
        _coordinator(layout)
    assert str(info.value).startswith("backend 'triton' needs CUDA")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        TritonBackend().run(torch.randn(1, 4, 16), torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16), object())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    TritonBackend.check_layout(layout)  # accepted under the interpreter
    TritonBackend.check_layout(KVLayout.mla(1, dtype=torch.bfloat16))


def test_backend_rejects_what_it_cannot_serve(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(ConfigError, match="fp8"):
            _coordinator(KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float8_e4m3fn))
    with pytest.raises(ConfigError, match="head_dim up to 576"):
        TritonBackend.check_layout(KVLayout(num_layers=1, num_kv_heads=1, head_dim=1024))
    assert TritonBackend.metadata_formats == ("flash_attention", "flashmla")


def test_backend_without_triton_says_how_to_install_it() -> None:
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from sparse_framework import ConfigError, KVLayout\n"
        "from sparse_framework.backends.triton import TritonBackend\n"
        "assert 'pip install triton' in TritonBackend.unavailable_reason()\n"
        "try:\n"
        "    TritonBackend.check_layout(KVLayout(num_layers=1, num_kv_heads=1, head_dim=16))\n"
        "except ConfigError as exc:\n"
        "    assert str(exc).startswith('is unavailable') and 'pip install triton' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('accepted')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


# -- Triton vs torch_ref, interpreted on the CPU -----------------------------------------------
# imports and helpers of the interpreted scripts (each runs in its own interpreted Python)
INTERPRETED_SETUP = r"""
import dataclasses, math, sys, types
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

sys.path.insert(0, TESTS_DIR)
from sparse_framework.adaptors.flash_attention import FlashAttentionAdaptor
from sparse_framework.backends.torch_ref import TorchRefBackend, indexed_attention, paged_attention
from sparse_framework.backends.triton import TritonBackend
from sparse_framework.kernels import sparse_decode as sd
from test_kernels_sparse_decode import reference_paged, drive_triton_coordinator, _compare_with_torch_ref as compare_with_torch_ref

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
NAN = float("nan")
# no shrinking: interpreted examples are slow, and a shrink could take minutes (the unshrunk
# falsifying example is still printed)
SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.reuse, Phase.generate])
DEFAULTS = (sd.MAX_BLOCK_N, sd.MAX_BLOCK_M)

def tunables(block_n, block_m):
    sd.MAX_BLOCK_N, sd.MAX_BLOCK_M = block_n, block_m

def restore():
    sd.MAX_BLOCK_N, sd.MAX_BLOCK_M = DEFAULTS

def check(got, want, dtype, what):
    assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    assert not got.isnan().any(), ("NaN leaked", what)
    err = float((got.float() - want).abs().max()) if want.numel() else 0.0
    assert err <= TOL[dtype] * max(1.0, float(want.abs().max()) if want.numel() else 0.0), (what, err)

def paged_case(g, n, hk, group, s_q, d, dv_kind, page, max_pages, lengths, dtype):
    # caches full of NaN except the rows each sequence uses; unused page-table entries point at
    # a page of NaN (or hold garbage numbers: they must never be read either)
    num_pages = n * max_pages + 1
    poison = num_pages - 1
    k = torch.full((num_pages, page, hk, d), NAN)
    dv = {"same": d, "half": d // 2, "prefix": d // 2}[dv_kind]
    v = torch.full((num_pages, page, hk, dv), NAN)
    perm = torch.randperm(num_pages - 1, generator=g)
    table = torch.full((n, max_pages), poison, dtype=torch.int32)
    for i, length in enumerate(lengths):
        used = -(-length // page)
        table[i, :used] = perm[i * max_pages : i * max_pages + used].int()
        if used < max_pages and i % 2:
            table[i, used:] = torch.randint(-(2**30), 2**30, (max_pages - used,), generator=g).int()
        for t in range(length):
            k[table[i, t // page], t % page] = torch.randn(hk, d, generator=g)
            v[table[i, t // page], t % page] = torch.randn(hk, dv, generator=g)
    k = k.to(dtype)
    v = k[..., :dv] if dv_kind == "prefix" else v.to(dtype)  # prefix: MLA's strided V view
    q = torch.randn(n, s_q, hk * group, d, generator=g).to(dtype)
    return q, k, v, table, torch.tensor(lengths, dtype=torch.int32)
"""

INTERPRETED = INTERPRETED_SETUP + r"""
@settings(max_examples=25, **SETTINGS)
@given(n=st.integers(1, 3), hk=st.integers(1, 2), group=st.integers(1, 4), s_q=st.integers(1, 3),
       causal=st.booleans(), d=st.sampled_from([16, 40, 64]), dv_kind=st.sampled_from(["same", "half", "prefix"]),
       page=st.sampled_from([1, 4, 16]), max_pages=st.integers(1, 5),
       fill=st.lists(st.floats(0, 1), min_size=3, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), splits=st.sampled_from([None, 1, 2, 5]),
       block_n=st.sampled_from([16, 64]), block_m=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_paged(n, hk, group, s_q, causal, d, dv_kind, page, max_pages, fill, dtype, splits, block_n, block_m, seed):
    g = torch.Generator().manual_seed(seed)
    cap = max_pages * page
    lengths = [0 if f < 0.1 else cap if f > 0.9 else int(f * cap) for f in fill[:n]]  # empty, full, partial
    q, k, v, table, lens = paged_case(g, n, hk, group, s_q, d, dv_kind, page, max_pages, lengths, dtype)
    tunables(block_n, block_m)
    scale = d**-0.5
    got = sd.paged_decode(q, k, v, table, lens, scale, causal=causal, num_splits=splits)
    check(got, reference_paged(q, k, v, table, lens, scale, causal), dtype, ("paged", lengths))
    if s_q == 1:  # q [N, Hq, D] -> [N, Hq, Dv]
        check(sd.paged_decode(q[:, 0], k, v, table, lens, scale, num_splits=splits),
              paged_attention(q[:, 0], k, v, table, lens, scale), dtype, "paged 3d")

@settings(max_examples=15, **SETTINGS)
@given(n=st.integers(1, 2), s_q=st.integers(1, 2), hq=st.integers(1, 4), mla=st.booleans(),
       topk=st.integers(1, 70), unused=st.floats(0, 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       splits=st.sampled_from([None, 1, 3]), block_n=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_mla(n, s_q, hq, mla, topk, unused, dtype, splits, block_n, seed):
    g = torch.Generator().manual_seed(seed)
    d, v_dim = (576, 512) if mla else (48, 32)
    rows = 90
    kv = torch.randn(rows, 1, d, generator=g)
    idx = torch.stack([torch.randperm(rows, generator=g)[:topk] for _ in range(n * s_q)]).view(n, s_q, topk)
    idx = torch.where(torch.rand(idx.shape, generator=g) < unused, -1, idx).int()  # -1 anywhere
    idx[0, 0, : topk // 2] = -1
    if n * s_q > 1:
        idx[-1, -1] = -1  # a query token with nothing to attend to: zeros
    read = torch.zeros(rows, dtype=torch.bool)
    read[idx[idx >= 0].long()] = True
    kv[~read] = NAN  # rows no index names
    kv = kv.to(dtype)
    q = torch.randn(n, s_q, hq, d, generator=g).to(dtype)
    tunables(block_n, 64)
    got = sd.sparse_mla_decode(q, kv, idx, d**-0.5, v_dim=v_dim, num_splits=splits)
    check(got, indexed_attention(q, kv, idx, d**-0.5, v_dim), dtype, ("mla", topk))

test_paged()
test_mla()
restore()

# fixed cases: several row blocks (G * s_q > BLOCK_M), MLA head dims through the page table,
# more MLA heads than one block, a long sequence with many splits
g = torch.Generator().manual_seed(1)
tunables(16, 16)
for n, hk, group, s_q, d, dv_kind, page, max_pages, lengths, causal in [
    (2, 2, 8, 3, 16, "same", 4, 3, [12, 7], True),
    (1, 1, 24, 1, 576, "prefix", 16, 2, [29], True),
    (2, 1, 5, 2, 24, "half", 1, 40, [40, 33], False),
]:
    dv = {"same": d, "half": d // 2, "prefix": 512}[dv_kind]
    q, k, v, table, lens = paged_case(g, n, hk, group, s_q, d, "same", page, max_pages, lengths, torch.float32)
    v = k[..., :dv] if dv_kind == "prefix" else v[..., :dv]
    for splits in (None, 1, 3):
        got = sd.paged_decode(q, k, v, table, lens, 0.3, causal=causal, num_splits=splits)
        check(got, reference_paged(q, k, v, table, lens, 0.3, causal), torch.float32, ("fixed", d, splits))
restore()  # 80 MLA heads in float32: row blocks of 32, 32 and 16
kv = torch.randn(300, 1, 576, generator=g)
q = torch.randn(1, 1, 80, 576, generator=g)
idx = torch.randperm(300, generator=g)[:260].view(1, 1, -1).int()
check(sd.sparse_mla_decode(q, kv, idx, 0.05), indexed_attention(q, kv, idx, 0.05, 512), torch.float32, "mla 80 heads")
restore()
q, k, v, table, lens = paged_case(g, 1, 1, 2, 1, 16, "same", 16, 64, [1000], torch.float32)
check(sd.paged_decode(q, k, v, table, lens, 0.25), reference_paged(q, k, v, table, lens, 0.25, True),
      torch.float32, "many splits")

# the backend: FlashAttention metadata, plain and with the KV heads folded into the batch;
# q [B, Hq, D], and q [B, 2, Hq, D] (two query tokens: causal over the newest rows)
adaptor = FlashAttentionAdaptor()
for heads, page in [(1, 4), (2, 1), (2, 4)]:
    b, hk, group, d, n_slots = 3, 2, 3, 16, 64
    perm = torch.stack([torch.randperm(n_slots // page, generator=g) for _ in range(b * heads)]).view(b, heads, -1)
    slots = (perm[..., :5, None] * page + torch.arange(page)).flatten(-2).int()
    lengths = torch.randint(0, 5 * page + 1, (b, heads), generator=g).int()
    slots = torch.where(torch.arange(5 * page) < lengths.unsqueeze(-1), slots, -1)
    plan = adaptor.plan(slots, lengths, page_size=page, num_slots=n_slots)
    pages = hk * n_slots // page if heads > 1 else n_slots // page
    k_cache = torch.randn(pages, page, 1 if heads > 1 else hk, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(k_cache.shape, generator=g).to(torch.bfloat16)
    q = torch.randn(b, 2, hk * group, d, generator=g).to(torch.bfloat16)
    got = TritonBackend().run(q[:, 1], k_cache, v_cache, plan)
    want = TorchRefBackend().run(q[:, 1].float(), k_cache, v_cache, plan)
    check(got, want, torch.bfloat16, ("backend fa", heads, page))
    got = TritonBackend().run(q, k_cache, v_cache, plan)
    older = dataclasses.replace(plan, cache_seqlens=(plan.cache_seqlens - 1).clamp(min=0))
    want = torch.stack([TorchRefBackend().run(q[:, 0].float(), k_cache, v_cache, older),
                        TorchRefBackend().run(q[:, 1].float(), k_cache, v_cache, plan)], 1)
    check(got, want, torch.bfloat16, ("backend fa, 2 query tokens", heads, page))

# FlashMLA metadata (duck-typed: `indices`), over a paged latent cache with V its strided prefix
for s_q in (1, 2):
    b, hq, page = 2, 3, 4
    k_cache = torch.randn(10, page, 1, 576, generator=g)
    idx = torch.randint(-1, 40, (b, s_q, 25), generator=g).int()
    q = torch.randn(b, s_q, hq, 576, generator=g)
    meta = types.SimpleNamespace(indices=idx)
    got = TritonBackend().run(q[:, 0] if s_q == 1 else q, k_cache, k_cache[..., :512], meta, scale=0.07)
    want = indexed_attention(q, k_cache.view(-1, 1, 576), idx, 0.07, 512)
    check(got, want[:, 0] if s_q == 1 else want, torch.float32, ("backend flashmla", s_q))
try:
    TritonBackend().run(q, k_cache, k_cache, object())
except TypeError as exc:
    assert "FlashAttention metadata" in str(exc)
else:
    raise AssertionError("unknown metadata accepted")

# through the coordinator: every call against torch_ref on the same inputs (sparse), and at a
# budget that holds every token against dense attention
from sparse_framework import Batch, KVLayout, Request
from sparse_framework.coordinator.core import SparseCoordinator
from helpers import SMALL_QUEST

for config in ({}, {"top_k": 256, "device_buffer_tokens": 512}):
    errors = drive_triton_coordinator(config, "cpu", (70, 33), steps=3, atol=1e-5)
    assert errors and max(errors) < 1e-5, errors

# an MLA latent (576, V its first 512) through both adaptors
for adaptor_name in ("flash_attention", "flashmla"):
    coord = SparseCoordinator({**SMALL_QUEST, "backend": "triton", "adaptor": adaptor_name}, KVLayout.mla(1),
                              max_requests=2, max_seq_len=256)
    errors = compare_with_torch_ref(coord)
    reqs = [Request("a", 70), Request("b", 33)]
    for r in reqs:
        coord.on_request_begin(r)
    batch = Batch(reqs, is_prefill=True)
    coord.forward_begin(batch)
    q = torch.randn(103, 4, 576, generator=g)
    meta = coord.attention_begin(0, q, torch.randn(103, 1, 576, generator=g), None, batch)
    coord.attention_end(0, coord.attend(0, q, meta), batch)
    coord.forward_end(batch)
    for _ in range(2):
        batch = Batch(reqs)
        coord.forward_begin(batch)
        q = torch.randn(2, 4, 576, generator=g)
        meta = coord.attention_begin(0, q, torch.randn(2, 1, 576, generator=g), None, batch)
        out = coord.attend(0, q, meta)
        assert out.shape == (2, 4, 512)
        coord.attention_end(0, out, batch)
        coord.forward_end(batch)
    assert len(errors) == 2 and max(errors) < 1e-5, (adaptor_name, errors)
print("interpreted ok")
"""


@pytest.mark.slow
def test_triton_kernels_interpreted_match_torch_ref() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, "interpreted ok", timeout=600)


INTERPRETED_OPTIONS = INTERPRETED_SETUP + r"""
from test_attention_options import check_against_formula, coordinator

def options_of(kind, hq, n, g):
    # (softcap, sinks): sinks per head [Hq] or per sequence [N, Hq], some large enough to dominate
    softcap = 1.5 if kind in ("softcap", "both") else None
    sinks = None
    if kind in ("sinks", "both", "sinks per sequence"):
        shape = (n, hq) if kind == "sinks per sequence" else (hq,)
        sinks = torch.randn(shape, generator=g) * 3
    return softcap, sinks

KINDS = st.sampled_from(["softcap", "sinks", "both", "sinks per sequence"])

@settings(max_examples=14, **SETTINGS)
@given(n=st.integers(1, 3), hk=st.integers(1, 2), group=st.integers(1, 3), s_q=st.integers(1, 2),
       causal=st.booleans(), d=st.sampled_from([16, 40]), page=st.sampled_from([1, 4]), max_pages=st.integers(1, 6),
       fill=st.lists(st.floats(0, 1), min_size=3, max_size=3), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       splits=st.sampled_from([None, 1, 3]), kind=KINDS, seed=st.integers(0, 2**16))
def test_paged_options(n, hk, group, s_q, causal, d, page, max_pages, fill, dtype, splits, kind, seed):
    g = torch.Generator().manual_seed(seed)
    cap = max_pages * page
    lengths = [0 if f < 0.1 else cap if f > 0.9 else int(f * cap) for f in fill[:n]]
    q, k, v, table, lens = paged_case(g, n, hk, group, s_q, d, "same", page, max_pages, lengths, dtype)
    q = q * 3  # logits large enough for the cap to bend them
    softcap, sinks = options_of(kind, hk * group, n, g)
    tunables(16, 16)  # 16-token steps: splits of the longer sequences
    got = sd.paged_decode(q, k, v, table, lens, d**-0.5, causal=causal, num_splits=splits, softcap=softcap, sinks=sinks)
    want = reference_paged(q, k, v, table, lens, d**-0.5, causal, softcap=softcap, sinks=sinks)
    check(got, want, dtype, ("paged", kind, lengths, splits))

@settings(max_examples=8, **SETTINGS)
@given(s_q=st.integers(1, 2), hq=st.integers(1, 4), mla=st.booleans(), topk=st.integers(1, 50),
       splits=st.sampled_from([None, 1, 3]), kind=KINDS, seed=st.integers(0, 2**16))
def test_indexed_options(s_q, hq, mla, topk, splits, kind, seed):
    g = torch.Generator().manual_seed(seed)
    n, rows = 2, 60
    d, v_dim = (576, 512) if mla else (48, 32)
    kv = torch.randn(rows, 1, d, generator=g)
    idx = torch.stack([torch.randperm(rows, generator=g)[:topk] for _ in range(n * s_q)]).view(n, s_q, topk)
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, -1, idx).int()
    idx[-1, -1] = -1  # nothing to attend to: zeros, sinks or not
    q = torch.randn(n, s_q, hq, d, generator=g) * (0.2 if mla else 1.0)
    softcap, sinks = options_of(kind, hq, n, g)
    tunables(16, 64)
    got = sd.sparse_mla_decode(q, kv, idx, d**-0.5, v_dim=v_dim, num_splits=splits, softcap=softcap, sinks=sinks)
    want = indexed_attention(q, kv, idx, d**-0.5, v_dim, softcap=softcap, sinks=sinks)
    check(got, want, torch.float32, ("indexed", kind, topk, splits))
    assert bool((got[-1, -1] == 0).all())

test_paged_options()
test_indexed_options()
restore()

# the default path: the options off give the very same bits as a call without them, and a
# sink of -inf (weight 0) the same attention
g = torch.Generator().manual_seed(5)
tunables(16, 16)
q, k, v, table, lens = paged_case(g, 2, 2, 2, 1, 16, "same", 4, 8, [30, 17], torch.float32)
for splits in (1, 3):
    plain = sd.paged_decode(q, k, v, table, lens, 0.25, num_splits=splits)
    assert torch.equal(sd.paged_decode(q, k, v, table, lens, 0.25, num_splits=splits, softcap=None, sinks=None), plain)
    never = sd.paged_decode(q, k, v, table, lens, 0.25, num_splits=splits, sinks=torch.full((4,), -math.inf))
    check(never, plain.float(), torch.float32, ("sink of -inf", splits))
restore()

# the backend: FlashAttention metadata, plain and with the KV heads folded (per-KV-head sinks
# folded with them), and FlashMLA metadata, against torch_ref's backend with the same options
adaptor = FlashAttentionAdaptor()
for heads, page in [(1, 4), (2, 1), (2, 4)]:
    b, hk, group, d, n_slots = 3, 2, 3, 16, 64
    perm = torch.stack([torch.randperm(n_slots // page, generator=g) for _ in range(b * heads)]).view(b, heads, -1)
    slots = (perm[..., :5, None] * page + torch.arange(page)).flatten(-2).int()
    lengths = torch.randint(0, 5 * page + 1, (b, heads), generator=g).int()
    slots = torch.where(torch.arange(5 * page) < lengths.unsqueeze(-1), slots, -1)
    plan = adaptor.plan(slots, lengths, page_size=page, num_slots=n_slots)
    pages = hk * n_slots // page if heads > 1 else n_slots // page
    k_cache = torch.randn(pages, page, 1 if heads > 1 else hk, d, generator=g)
    v_cache = torch.randn(k_cache.shape, generator=g)
    q = torch.randn(b, hk * group, d, generator=g) * 3
    for softcap, sinks in [(2.0, None), (None, torch.randn(hk * group, generator=g) * 2), (0.5, torch.randn(hk * group, generator=g))]:
        got = TritonBackend().run(q, k_cache, v_cache, plan, softcap=softcap, sinks=sinks)
        want = TorchRefBackend().run(q, k_cache, v_cache, plan, softcap=softcap, sinks=sinks)
        check(got, want, torch.float32, ("backend fa", heads, page, softcap))
k_cache = torch.randn(10, 4, 1, 576, generator=g)
idx = torch.randint(-1, 40, (2, 1, 25), generator=g).int()
q = torch.randn(2, 3, 576, generator=g) * 0.2
sinks = torch.randn(3, generator=g)
got = TritonBackend().run(q, k_cache, k_cache[..., :512], types.SimpleNamespace(indices=idx), scale=0.07, softcap=1.0, sinks=sinks)
want = indexed_attention(q.unsqueeze(1), k_cache.view(-1, 1, 576), idx, 0.07, 512, softcap=1.0, sinks=sinks)[:, 0]
check(got, want, torch.float32, "backend flashmla")

# through the coordinator with the triton backend: a budget holding every token equals the
# float64 formula with each layer's options, at prefill and decode
coord = coordinator({"backend": "triton", "top_k": 256, "device_buffer_tokens": 512}, layers=3)
sinks = torch.tensor([0.5, -1.0, 2.0, 6.0])
options = {0: {"softcap": 1.5, "sinks": sinks}, 1: {"sinks": sinks}, 2: {"softcap": 2.0}}
for layer, opts in options.items():
    coord.set_attention_options(layer, **opts)
assert check_against_formula(coord, options, [37, 20], steps=2) > 0
print("options ok")
"""


@pytest.mark.slow
def test_triton_softcap_and_sinks_interpreted_match_torch_ref() -> None:
    """Soft-capping and sinks in the Triton kernels (paged, indexed / MLA, split or not, per
    head or per sequence sinks) and the backend against torch_ref, under the interpreter;
    the default path bit-identical with the options off; the coordinator at a full budget
    equal to the float64 formula."""
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED_OPTIONS, "options ok", timeout=600)


# -- Triton vs torch_ref on CUDA, full shapes --------------------------------------------------
def GPU(test):
    """`-m gpu`, skipped visibly without a GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def _compare_with_torch_ref(coord: SparseCoordinator) -> list[float]:
    """Make the coordinator's backend also run torch_ref on every call; returns the list the
    max abs differences are appended to."""
    triton_run, errors = coord.backend.run, []

    def run(q, k_cache, v_cache, metadata, **kw):
        out = triton_run(q, k_cache, v_cache, metadata, **kw)
        want = TorchRefBackend().run(q, k_cache, v_cache, metadata, **kw)
        errors.append(float((out.float() - want.float()).abs().max()))
        return out

    coord.backend.run = run
    return errors


def drive_triton_coordinator(config: dict, device: str, lengths: tuple[int, int], steps: int, atol: float) -> list[float]:
    """Prefill two requests of `lengths` through a coordinator with the triton backend and
    decode `steps` steps. Every backend call is also run by torch_ref (the max abs
    differences are returned); when `config` sets a budget that holds every token, each
    layer's output must equal dense attention to `atol`."""
    from coordinator_driver import Driver, make

    from sparse_framework import Request

    coord = make({"backend": "triton", **config}, device=device)
    errors = _compare_with_torch_ref(coord)
    drv = Driver(coord, q_heads=4)
    reqs = [Request("a", lengths[0]), Request("b", lengths[1])]
    drv.prefill(reqs)
    for _ in range(steps):
        for out, ref, _ in drv.decode(reqs):
            if config:
                assert torch.allclose(out.double(), ref, atol=atol, rtol=0), float((out.double() - ref).abs().max())
    return errors


GPU_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-3}  # max abs error vs the float32 reference


def _paged_inputs(b, hq, hk, d, page, tokens, s_q, dtype, seed):
    """A decode batch over a shuffled pool of pages: `tokens` selected tokens a sequence (some
    a partial last page), the rest of the pool (and of the page table) garbage."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_pages = tokens // page + 1
    num_pages = b * max_pages + 7
    k = torch.randn(num_pages, page, hk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(num_pages, page, hk, d, device="cuda", generator=g).to(dtype)
    table = torch.randperm(num_pages, device="cuda", generator=g)[: b * max_pages].view(b, max_pages).int()
    lens = tokens - torch.randint(0, page, (b,), device="cuda", generator=g).int()
    lens[0] = tokens
    q = (torch.randn(b, s_q, hq, d, device="cuda", generator=g) * 2).to(dtype)  # peaked enough to catch wrong rows
    return q, k, v, table, lens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("splits", [None, 1])
@GPU
def test_gpu_paged_decode_full_shapes(dtype, page, folded, s_q, splits) -> None:
    """B=8, Hq=32, Hk=8, D=128, 2048 selected tokens; folded: each (request, KV head) its own
    sequence of one KV head and 4 query heads, as the per-head selections arrive."""
    b, hq, hk, d = 8, 32, 8, 128
    if folded:
        b, hq, hk = b * hk, hq // hk, 1
    q, k, v, table, lens = _paged_inputs(b, hq, hk, d, page, 2048, s_q, dtype, seed=page + 100 * s_q)
    scale = d**-0.5
    got = sd.paged_decode(q, k, v, table, lens, scale, num_splits=splits)
    want = reference_paged(q, k, v, table, lens, scale)
    assert got.dtype == dtype and got.shape == want.shape
    err = float((got.float() - want).abs().max())
    assert err <= GPU_TOL[dtype], err


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@GPU
def test_gpu_sparse_mla_decode_full_shapes(s_q, dtype) -> None:
    """DeepSeek sparse MLA decode: Hq=128, latent 576 (V 512), topk 2048 with -1 padding."""
    n, hq, d, topk, rows = 8, 128, 576, 2048, 16384
    g = torch.Generator(device="cuda").manual_seed(7 + s_q)
    kv = torch.randn(rows, 1, d, device="cuda", generator=g).to(dtype)
    q = (torch.randn(n, s_q, hq, d, device="cuda", generator=g) * 2).to(dtype)
    idx = torch.stack([torch.randperm(rows, device="cuda", generator=g)[:topk] for _ in range(n * s_q)])
    idx = idx.view(n, s_q, topk).int()
    idx[:, :, -100:] = -1
    idx[1, 0, ::3] = -1
    scale = 1.0 / math.sqrt(192)  # DeepSeek-V3's softmax scale (qk_nope 128 + rope 64)
    got = sd.sparse_mla_decode(q, kv, idx, scale)
    want = indexed_attention(q, kv, idx, scale, 512)
    assert got.dtype == dtype and got.shape == (n, s_q, hq, 512)
    err = float((got.float() - want).abs().max())
    assert err <= GPU_TOL[dtype], err


@pytest.mark.parametrize("config", [{}, {"top_k": 512, "device_buffer_tokens": 1024}])
@GPU
def test_gpu_backend_through_the_coordinator(config) -> None:
    """Every decode call of the coordinator against torch_ref on the same inputs, and at a
    budget that holds every token against dense attention."""
    errors = drive_triton_coordinator(config, "cuda", (150, 300), steps=5, atol=1e-4)
    assert errors and max(errors) <= 1e-4, max(errors)
