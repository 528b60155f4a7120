"""DSA: indexer keys stored as given (bf16) or block-quantised (FP8), index scores and the
exact-keys oracle against direct re-computations, selections within the budget."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import ConfigError, KVLayout, Request
from sparse_framework.algorithms.dsa import DSA
from sparse_framework.config import load_config
from sparse_framework.kernels.reference.scores import dequantize_fp8_blocks, quantize_fp8_blocks
from helpers import batch_of, run_interpreted

MAX_REQUESTS, MAX_SEQ_LEN = 4, 96


def make(extra: dict, hk: int = 1, d: int = 8, top_k: int = 16, sink: int = 0, recent: int = 0) -> DSA:
    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": top_k, "sink_tokens": sink, "recent_tokens": recent,
                       "min_sparse_prompt_len": 0, "device_buffer_tokens": 4096, "extra": extra})
    return DSA(cfg, KVLayout(num_layers=2, num_kv_heads=hk, head_dim=d), MAX_REQUESTS, MAX_SEQ_LEN)


def requests(lens: list[int], gen: torch.Generator) -> list[Request]:
    slots = torch.randperm(MAX_REQUESTS, generator=gen)[: len(lens)].tolist()
    return [Request(f"r{i}", n, seq_len=n, slot=s) for i, (n, s) in enumerate(zip(lens, slots))]


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Σ_h w_h ReLU(q_h · k_s) by loops in float64: q [H, Di], w [H], k [n, Di] -> [n]."""
    out = torch.zeros(k.shape[0], dtype=torch.float64)
    for h in range(q.shape[0]):
        out += w[h].double() * (k.double() @ q[h].double()).clamp(min=0)
    return out


def feed(algo: DSA, reqs: list[Request], heads: int, dim: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Build every request's layer 1 from prompt indexer keys; returns them (float32)."""
    keys = []
    for r in reqs:
        k = torch.randn(r.seq_len, dim, generator=gen)
        algo.build(1, r, torch.randn(r.seq_len, algo.layout.num_kv_heads, algo.layout.head_dim), inputs={"index_k": k})
        keys.append(k)
    return keys


@settings(max_examples=25, deadline=None)
@given(
    heads=st.integers(1, 5),
    dim=st.sampled_from([16, 32]),
    lens=st.lists(st.integers(2, 60), min_size=1, max_size=MAX_REQUESTS),
    seed=st.integers(0, 2**16),
)
def test_bf16_index_scores_match_the_formula(heads, dim, lens, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    algo = make({"index_heads": heads, "index_dim": dim, "key_dtype": "bfloat16"})
    assert algo.decode_inputs == {"index_q": (heads, dim), "index_weights": (heads,), "index_k": (dim,)}
    reqs = requests(lens, g)
    keys = feed(algo, reqs, heads, dim, g)
    q, w = torch.randn(len(reqs), heads, dim, generator=g), torch.rand(len(reqs), heads, generator=g)
    batch = batch_of(reqs)
    scores = algo.score(1, torch.randn(len(reqs), 2, 8), batch, inputs={"index_q": q, "index_weights": w})
    assert scores.shape == (len(reqs), 1, max(lens))
    for i, (r, k) in enumerate(zip(reqs, keys)):
        assert torch.equal(algo.index_k[1, r.slot, : r.seq_len], k.bfloat16())  # the representation
        want = index_scores(q[i], w[i], k.bfloat16().float())
        torch.testing.assert_close(scores[i, 0, : r.seq_len].double(), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(heads=st.integers(1, 4), lens=st.lists(st.integers(2, 40), min_size=1, max_size=3),
       scale_format=st.sampled_from(["ue8m0", "float32"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_fp8_scores_use_quantised_queries_and_keys(heads, lens, scale_format, dtype, seed) -> None:
    """FP8: keys are stored as e4m3 bits plus a scale per 128 values (ue8m0: a power of two),
    and the score is the formula over the dequantised query and key (the original quantises
    both); queries and weights are taken in the model's dtype."""
    g = torch.Generator().manual_seed(seed)
    algo = make({"index_heads": heads, "index_dim": 128, "scale_format": scale_format})
    pow2 = scale_format == "ue8m0"
    reqs = requests(lens, g)
    keys = feed(algo, reqs, heads, 128, g)
    q, w = torch.randn(len(reqs), heads, 128, generator=g).to(dtype), torch.rand(len(reqs), heads, generator=g).to(dtype)
    scores = algo.score(1, torch.randn(len(reqs), 1, 8), batch_of(reqs), inputs={"index_q": q, "index_weights": w})
    deq_q = dequantize_fp8_blocks(*quantize_fp8_blocks(q, pow2))
    for i, (r, k) in enumerate(zip(reqs, keys)):
        stored = dequantize_fp8_blocks(algo.index_k[1, r.slot, : r.seq_len], algo.k_scale[1, r.slot, : r.seq_len])
        scale = algo.k_scale[1, r.slot, : r.seq_len]
        assert not pow2 or torch.equal(scale, 2.0 ** scale.log2().round())  # ue8m0: powers of two
        assert float(((stored - k).abs() / k.abs().amax(-1, keepdim=True)).max()) < 1 / 8  # e4m3: 3 mantissa bits
        want = index_scores(deq_q[i], w[i], stored)
        torch.testing.assert_close(scores[i, 0, : r.seq_len].double(), want, rtol=1e-5, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    lens=st.lists(st.integers(2, 60), min_size=1, max_size=MAX_REQUESTS),
    steps=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_exact_mode_scores_each_groups_attention_mass(hk, group, lens, steps, seed) -> None:
    """source=keys: per KV head, Σ over its query heads of softmax(q·k/√d) over the stored
    tokens (every token but the newest, which `append` adds after `select`)."""
    g = torch.Generator().manual_seed(seed)
    d = 8
    algo = make({"source": "keys"}, hk=hk, d=d)
    assert algo.per_kv_head == (hk > 1) and algo.decode_inputs == {}
    reqs = requests(lens, g)
    history = []
    for r in reqs:
        k = torch.randn(r.seq_len, hk, d, generator=g)
        algo.build(0, r, k)
        history.append(k)
    for _ in range(steps):  # decode steps append one key per request
        for r in reqs:
            r.seq_len += 1
        new = torch.randn(len(reqs), hk, d, generator=g)
        algo.append(0, batch_of(reqs), new)
        history = [torch.cat([h, new[i : i + 1]]) for i, h in enumerate(history)]
    for r in reqs:  # the step being decoded: its token is not stored yet
        r.seq_len += 1
    q = torch.randn(len(reqs), hk * group, d, generator=g)
    scores = algo.score(0, q, batch_of(reqs))
    for i, (r, k) in enumerate(zip(reqs, history)):
        for j in range(hk):
            mass = torch.zeros(k.shape[0], dtype=torch.float64)
            for h in range(j * group, (j + 1) * group):
                mass += (k[:, j].double() @ q[i, h].double() / math.sqrt(d)).softmax(0)
            torch.testing.assert_close(scores[i, j, : k.shape[0]].double(), mass, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    top_k=st.integers(1, 40),
    sink=st.integers(0, 6),
    recent=st.integers(0, 10),
    lens=st.lists(st.integers(2, 80), min_size=1, max_size=MAX_REQUESTS),
    seed=st.integers(0, 2**16),
    newest_in_top_k=st.booleans(),
)
def test_selection_is_the_index_top_k_plus_sink_recent_and_newest(top_k, sink, recent, lens, seed, newest_in_top_k) -> None:
    """The sink, the recent window and the newest token, plus the top_k best-scoring others;
    newest_in_top_k: the newest token, unless sink or recent holds it, is one of the top_k."""
    g = torch.Generator().manual_seed(seed)
    heads, dim = 3, 16
    extra = {"index_heads": heads, "index_dim": dim, "key_dtype": "bfloat16", "newest_in_top_k": newest_in_top_k}
    algo = make(extra, top_k=top_k, sink=sink, recent=recent)
    reqs = requests(lens, g)
    keys = feed(algo, reqs, heads, dim, g)
    q, w = torch.randn(len(reqs), heads, dim, generator=g), torch.rand(len(reqs), heads, generator=g)
    batch = batch_of(reqs)
    sel = algo.select(1, torch.randn(len(reqs), 1, 8), batch, inputs={"index_q": q, "index_weights": w})
    sel.validate(batch.seq_lens)
    assert sel.indices.shape[-1] <= DSA.max_selected_tokens(algo.config)
    for i, (r, k) in enumerate(zip(reqs, keys)):
        n = r.seq_len
        chosen = set(sel.indices[i, 0, : sel.lengths[i, 0]].tolist())
        forced = set(range(min(sink, n))) | set(range(max(0, n - recent), n)) | ({n - 1} if not newest_in_top_k else set())
        assert forced | {n - 1} <= chosen
        rest = set(range(n)) - forced
        picked = chosen - forced
        assert len(picked) == min(top_k, len(rest))
        if n - 1 in picked:  # counted inside top_k, whatever its score
            picked, rest = picked - {n - 1}, rest - {n - 1}
        score = index_scores(q[i], w[i], k.bfloat16().float())
        if picked and rest - picked:
            assert min(score[list(picked)]) >= max(score[list(rest - picked)]) - 1e-5


# impl torch and impl triton (interpreted, in a subprocess): the same scores up to float32
# summation order, and the same selections (continuous random scores: no ties at the threshold)
INTERPRETED = r"""
import sys
sys.path.insert(0, TESTS_DIR)
import torch
from helpers import batch_of
from test_algorithms_dsa import make, requests

g = torch.Generator().manual_seed(0)
for extra, dtype in [({"index_heads": 5, "index_dim": 128}, torch.bfloat16),
                     ({"index_heads": 3, "index_dim": 256, "scale_format": "float32"}, torch.float32),
                     ({"index_heads": 9, "index_dim": 128}, torch.float16),
                     ({"index_heads": 4, "index_dim": 48, "key_dtype": "bfloat16"}, torch.bfloat16)]:
    algos = [make({**extra, "impl": impl}, top_k=12, sink=2, recent=3) for impl in ("torch", "triton")]
    for algo, impl in zip(algos, ("torch", "triton")):  # fp8 keys: the fused function, pow2_scales bound
        fn = getattr(algo.index_scores, "func", algo.index_scores)
        fp8q = extra.get("key_dtype", "fp8_e4m3") == "fp8_e4m3"
        assert fn.__name__ == ("dsa_index_scores_fp8q_" if fp8q else "dsa_index_scores_") + impl, fn
    heads, dim = extra["index_heads"], extra["index_dim"]
    reqs = requests([70, 33, 90], g)
    for r in reqs:  # prompts, then one decode step appended
        k = torch.randn(r.seq_len, dim, generator=g) * 10.0 ** float(torch.rand(1, generator=g) * 4 - 2)
        for algo in algos:
            algo.build(1, r, torch.zeros(r.seq_len, 1, 8), inputs={"index_k": k})
        r.seq_len += 1
    new = torch.randn(len(reqs), dim, generator=g)
    for algo in algos:
        algo.append(1, batch_of(reqs), torch.zeros(len(reqs), 1, 8), inputs={"index_k": new})
    for r in reqs:
        r.seq_len += 1
    batch = batch_of(reqs)
    inputs = {"index_q": (torch.randn(len(reqs), heads, dim, generator=g) * 3).to(dtype),
              "index_weights": torch.rand(len(reqs), heads, generator=g).to(dtype)}
    queries = torch.randn(len(reqs), 2, 8)
    want, got = (algo.score(1, queries, batch, inputs=inputs) for algo in algos)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), extra
    import sparse_framework.algorithms.dsa as dsa_mod
    import sparse_framework.kernels.topk as tk
    dsa_mod.FUSE_TOPK_FIRST_PASS = True
    passes = []
    real_topk = tk.topk_selection_triton
    tk.topk_selection_triton = lambda *a, **kw: passes.append(kw["first_pass"] is not None) or real_topk(*a, **kw)
    want, got = (algo.select(1, queries, batch, inputs=inputs) for algo in algos)
    tk.topk_selection_triton = real_topk
    assert passes == [fp8q], (passes, extra)  # fp8 keys: the indexer did the first pass
    assert torch.equal(got.indices, want.indices) and torch.equal(got.lengths, want.lengths), extra
    if fp8q:  # select fused the top-k's first pass into the indexer: the same as without it
        from sparse_framework.kernels.topk import first_pass_buffer
        dsa_mod.FUSE_TOPK_FIRST_PASS = False
        plain = algos[1].select(1, queries, batch, inputs=inputs)
        assert torch.equal(plain.indices, got.indices) and torch.equal(plain.lengths, got.lengths), extra
        # and its histogram is that of the eligible scores' top radix digits, nothing else
        tri, b_n = algos[1], len(reqs)
        hist = first_pass_buffer(b_n, "cpu")
        s = tri.index_scores(inputs["index_q"], inputs["index_weights"], tri.index_k[1], tri.k_scale[1],
                             batch.slot_ids, batch.max_seq_len, first_pass=(hist, batch.seq_lens, 2, 3))
        bits = s.view(torch.int32)
        bits = torch.where(bits & 0x7FFFFFFF == 0, 0, bits)
        digit = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) ^ -2**31) >> 24 & 0xFF
        ids = torch.arange(s.shape[1])
        for b, n in enumerate(batch.seq_lens.tolist()):
            eligible = (ids < n) & (ids >= 2) & (ids < max(n - 3, 0)) & (ids != n - 1)
            want_hist = torch.bincount(digit[b][eligible], minlength=256).to(torch.int32)
            assert torch.equal(hist.view(b_n, 1024)[b, :256], want_hist), (extra, b)
        assert not hist.view(b_n, 1024)[:, 256:].any()
print("dsa ok")
"""


@pytest.mark.slow
def test_select_with_triton_interpreted_matches_torch() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, "dsa ok", timeout=600)


def test_clear_errors() -> None:
    with pytest.raises(ConfigError, match="multiple of 128"):
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"index_dim": 64}})
    with pytest.raises(ConfigError, match="source"):
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"source": "oracle"}})
    assert load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"index_dim": 64, "key_dtype": "bfloat16"}}).top_k == 2048


def test_representation_bytes() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128)
    fp8 = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa"})
    bf16 = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"key_dtype": "bfloat16"}})
    exact = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"source": "keys"}})
    assert DSA.representation_bytes_per_token(layout, fp8) == 128 + 4
    assert DSA.representation_bytes_per_token(layout, bf16) == 256
    assert DSA.representation_bytes_per_token(layout, exact) == layout.row_bytes
