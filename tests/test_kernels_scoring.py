"""Scoring kernels (kernels/scoring.py, DSA's in kernels/dsa_index.py): the torch references
against direct float64 re-computations and against what the algorithms compute; the Triton
versions against the references, interpreted on the CPU (in a subprocess) and on CUDA
(`-m gpu`)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import batch_of, run_interpreted
from sparse_framework import KVLayout, Request, load_config
from sparse_framework.kernels.reference.scores import reduce_groups
from sparse_framework.algorithms.pqcache import PQCache
from sparse_framework.algorithms.quest import Quest
from sparse_framework.kernels.reference.scores import ceil_pow2
from sparse_framework.algorithms.snapkv import SnapKVOptions, snapkv_votes
from sparse_framework.kernels import dsa_index as dsa, scoring as sc

DTYPES = [torch.float32, torch.bfloat16]


def combine(per_head: list[torch.Tensor], how: str) -> torch.Tensor:
    """A group's per-query-head float64 rows -> one row, by `how`."""
    stack = torch.stack(per_head)
    return {"max": stack.amax(0), "sum": stack.sum(0), "mean": stack.sum(0) / len(per_head)}[how]


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    assert err <= tol * max(1.0, scale), (err, scale)


shapes = dict(b=st.integers(1, 3), hkv=st.integers(1, 4), group=st.integers(1, 4), d=st.sampled_from([16, 32, 64]),
              how=st.sampled_from(["max", "sum", "mean"]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))


# -- torch references vs direct float64 re-computations -----------------------------------------
@settings(deadline=None, max_examples=20)
@given(n_pages=st.integers(0, 45), w=st.sampled_from([1.0, 0.5, 0.0]) | st.floats(0.0, 1.0), **shapes)
def test_quest_reference(b, hkv, group, d, how, dtype, seed, n_pages, w) -> None:
    """The bound Σ_d max(q_d·min_d, q_d·max_d) less (1 − w)·Σ_d |q_d|·(max_d − min_d)/2
    (`range_weight` w; 1 = the bound), against a float64 re-computation."""
    g = torch.Generator().manual_seed(seed)
    r, maxp = b + 1, n_pages + 3
    x, y = torch.randn(2, r, hkv, maxp, d, generator=g)
    lo, hi = torch.minimum(x, y).to(dtype), torch.maximum(x, y).to(dtype)
    q = torch.randn(b, hkv * group, d, generator=g).to(dtype)
    slots = torch.randperm(r, generator=g)[:b]
    got = sc.quest_scores_torch(q, lo, hi, slots, n_pages, how, w)
    want = torch.zeros(b, hkv, n_pages, dtype=torch.float64)
    for i in range(b):
        for j in range(hkv):
            rows = []
            for h in range(j * group, (j + 1) * group):
                qd = q[i, h].double()
                m, big = lo[slots[i], j, :n_pages].double(), hi[slots[i], j, :n_pages].double()
                pick = torch.where(qd >= 0, big, m)
                # the larger of q·min and q·max per dim, less the weighted spread
                rows.append((pick * qd).sum(-1) - (1 - w) / 2 * (qd.abs() * (big - m)).sum(-1))
            want[i, j] = combine(rows, how)
    close(got, want, 1e-5)


@settings(deadline=None, max_examples=20)
@given(n=st.integers(0, 300), m=st.sampled_from([1, 2, 4]), bits=st.integers(1, 8), **shapes)
def test_pqcache_reference(b, hkv, group, d, how, dtype, seed, n, m, bits) -> None:
    g = torch.Generator().manual_seed(seed)
    r, k, sub = b + 1, 2**bits, d // m
    books = torch.randn(r, hkv, m, k, sub, generator=g)
    codes = torch.randint(0, k, (r, hkv, n + 5, m), generator=g).to(torch.uint8)
    q = torch.randn(b, hkv * group, d, generator=g).to(dtype)
    slots = torch.randperm(r, generator=g)[:b]
    got = sc.pqcache_scores_torch(q, books, codes, slots, n, how)
    per_head = sc.pqcache_scores_torch(q, books, codes, slots, n, "none")  # [B, Hkv, G, n]
    assert per_head.shape == (b, hkv, group, n)
    close(reduce_groups(per_head.flatten(1, 2), hkv, how), got.double(), 1e-5)
    want = torch.zeros(b, hkv, n, dtype=torch.float64)
    for i in range(b):
        s = int(slots[i])
        for j in range(hkv):
            rows = []
            for h in range(j * group, (j + 1) * group):
                total = torch.zeros(n, dtype=torch.float64)
                for mm in range(m):
                    centroids = books[s, j, mm][codes[s, j, :n, mm].long()].double()  # [n, sub]
                    total += centroids @ q[i, h, mm * sub : (mm + 1) * sub].double()
                rows.append(total)
            want[i, j] = combine(rows, how)
    close(got, want, 1e-5)


@settings(deadline=None, max_examples=20)
@given(n=st.integers(1, 90), w=st.integers(1, 40), hkv=shapes["hkv"], group=shapes["group"], d=shapes["d"],
       dtype=shapes["dtype"], seed=shapes["seed"])
def test_snapkv_reference(n, w, hkv, group, d, dtype, seed) -> None:
    w = min(w, n)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, hkv, d, generator=g).to(dtype)
    qw = torch.randn(w, hkv * group, d, generator=g).to(dtype)
    got = sc.snapkv_window_mass_torch(qw, keys)
    want = torch.zeros(hkv * group, n - w, dtype=torch.float64)
    for h in range(hkv * group):
        k = keys[:, h // group].double()
        for i in range(w):
            seen = n - w + i + 1
            p = torch.exp(k[:seen] @ qw[i, h].double() / math.sqrt(d))
            want[h] += (p / p.sum())[: n - w]
    close(got, want, 1e-5)


@settings(deadline=None, max_examples=20)
@given(b=shapes["b"], h=st.integers(1, 8), blocks=st.integers(1, 2), n=st.integers(0, 100),
       kind=st.sampled_from(["float32", "bfloat16", "fp8"]), seed=shapes["seed"])
def test_dsa_reference(b, h, blocks, n, kind, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    r, di = b + 1, 128 * blocks
    iq = torch.randn(b, h, di, generator=g).to(torch.float32 if kind == "float32" else torch.bfloat16)
    wts = torch.randn(b, h, generator=g)
    raw = torch.randn(r, n + 3, di, generator=g) * 2
    if kind == "fp8":
        keys, scale = sc.quantize_fp8_blocks(raw)
        plain = keys.view(torch.float8_e4m3fn).double() * scale.double().repeat_interleave(128, -1)
    else:
        keys, scale = raw.to(getattr(torch, kind)), None
        plain = keys.double()
    slots = torch.randperm(r, generator=g)[:b]
    got = sc.dsa_index_scores_torch(iq, wts, keys, scale, slots, n)
    want = torch.zeros(b, n, dtype=torch.float64)
    for i in range(b):
        for hh in range(h):
            want[i] += wts[i, hh].double() * (plain[slots[i], :n] @ iq[i, hh].double()).clamp(min=0)
    close(got, want, 1e-5)


@settings(deadline=None, max_examples=20)
@given(shape=st.sampled_from([(3, 128), (2, 5, 256), (1, 384)]), spread=st.floats(-20, 20), seed=shapes["seed"])
def test_fp8_round_trip(shape, spread, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2) * 2**spread
    bits, scales = sc.quantize_fp8_blocks(x)
    assert bits.dtype == torch.uint8 and bits.shape == x.shape and scales.shape == (*shape[:-1], shape[-1] // 128)
    back = sc.dequantize_fp8_blocks(bits, scales)
    step = scales.repeat_interleave(128, -1)
    err = (back - x).abs()
    normal = x.abs() >= step * 2**-6  # e4m3's normal range after scaling
    assert bool((err[normal] < x.abs()[normal] / 16).all())
    assert bool((err <= step * 2**-10 + x.abs() / 16).all())  # subnormals: half a step of 2^-9
    zeros = torch.zeros(2, 128)
    zb, zs = sc.quantize_fp8_blocks(zeros)
    assert bool((zs > 0).all()) and torch.equal(sc.dequantize_fp8_blocks(zb, zs), zeros)


# -- DSA with the queries quantised in the kernel (fp8q): cases shared with the interpreted and GPU runs
E4M3 = torch.arange(128, dtype=torch.uint8)[:127].view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending


def fp8q_queries(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Raw indexer queries [..., Di]; each 128-value block one of: gaussian of a random
    magnitude (1e-6 .. 1e6, fp16 .. 1e3: under the 1e-4 amax clamp, and large scales), zero,
    one outlier with the rest 1e4 times smaller (e4m3 subnormals and zeros), or (float32) amax
    one ulp above 448·2^k, so that amax / 448 = 2^k·(1 + 2^-23): the power-of-two scale's carry."""
    *lead, di = shape
    x = torch.randn(*lead, di // 128, 128, generator=g)
    kind = torch.randint(0, 4, (*lead, di // 128, 1), generator=g)
    top = 3.0 if dtype == torch.float16 else 6.0
    x = x * 10.0 ** (torch.rand(kind.shape, generator=g) * (top + 6) - 6)
    x = torch.where(kind == 1, 0.0, x)
    x[..., 1:] = torch.where(kind == 2, x[..., 1:] * 1e-4, x[..., 1:])
    pow2 = torch.tensor([448 * 2.0**k for k in range(-12, 4)])[torch.randint(0, 16, kind.shape, generator=g)]
    edge = x / x.abs().amax(-1, keepdim=True).clamp(min=1e-30) * pow2 * 0.9
    edge[..., :1] = torch.nextafter(pow2, torch.tensor(math.inf)) * torch.where(x[..., :1] < 0, -1.0, 1.0)
    x = torch.where(kind == 3, edge, x)
    return x.flatten(-2).to(dtype)


def fp8q_case(
    g: torch.Generator, b: int, h: int, di: int, n: int, q_dtype: torch.dtype, w_dtype: torch.dtype, pow2: bool,
    device: str = "cpu", strided: bool = False,
) -> tuple:
    """Arguments of `dsa_index_scores_fp8q_*`: raw queries (strided: a view into a wider
    tensor, the weights every other column), positive weights, fp8 keys of random magnitudes
    quantised in the same scale format, a random slot per row."""
    r = b + 2
    q = fp8q_queries(g, (b, h, di), q_dtype)
    w = torch.rand(b, h, generator=g).to(w_dtype)
    if strided:
        q = torch.cat([torch.zeros(b, h, 32, dtype=q_dtype), q, torch.zeros(b, h, 32, dtype=q_dtype)], -1)[..., 32:-32]
        w = torch.stack([w, torch.zeros_like(w)], -1).flatten(1)[:, ::2]
    raw = torch.randn(r, n + 5, di, generator=g) * 10.0 ** (torch.rand(r, n + 5, 1, generator=g) * 6 - 3)
    keys, scale = sc.quantize_fp8_blocks(raw, pow2)
    slots = torch.randperm(r, generator=g)[:b]
    return tuple(x.to(device) for x in (q, w, keys, scale, slots)) + (n, pow2)


def fp8q_check(got: torch.Tensor, args: tuple, tol: float) -> None:
    """got against the torch twin, per element within tol x Σ_h |w_h| Σ_d |q̂_hd·k̂_td| (the
    twin over |q|, |w|, |k|: quantisation commutes with |.|), so exactly where that is 0."""
    q, w, keys, scale, slots, n, pow2 = args
    want = sc.dsa_index_scores_fp8q_torch(*args)
    bound = sc.dsa_index_scores_fp8q_torch(q.abs(), w.abs(), keys & 0x7F, scale, slots, n, pow2)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got - want).abs()
    assert bool((err <= tol * bound).all()), float((err / bound).nan_to_num(posinf=1.0).max())


def fp8q_rounding_case(pow2: bool, device: str = "cpu") -> tuple[tuple, torch.Tensor]:
    """(arguments, exact scores) whose queries read back one by one: row i's head 0 is the
    block [448, c_1 .. c_127] (scale 1 in both formats), head 1 its negation, weights (1, -1),
    token t's key the unit vector e_t, so score[i, t] = ReLU(q̂_t) - ReLU(-q̂_t) = q̂_t, one
    product per dot (exact on any tensor core). The c are e4m3's ties (midpoints), the float32
    values beside them and e4m3 values, both signs: q̂ = c rounded to e4m3, ties to even. With
    pow2, more rows test the scale's carry: amax = 448·2^k one ulp up takes the scale 2^(k+1),
    under which 1.5·2^(k-8) is a tie, to 2^(k-7) (2^k would keep it: 3·2^(k-9) is an e4m3 value)."""
    mids = (E4M3[1:] + E4M3[:-1]) / 2
    cands = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(448.0)), E4M3])
    cands = cands * (1 - 2 * (torch.arange(cands.numel()) % 3 == 0))
    rows = -(-cands.numel() // 127)
    head = torch.cat([torch.full((rows, 1), 448.0), torch.nn.functional.pad(cands, (0, rows * 127 - cands.numel())).view(rows, 127)], 1)
    want = head.to(torch.float8_e4m3fn).float()
    if pow2:
        ks = torch.tensor([-10, -3, 2])
        edge = torch.zeros(len(ks), 128)
        edge[:, 0] = torch.nextafter(448 * torch.tensor([2.0**k for k in ks.tolist()]), torch.tensor(math.inf))
        edge[:, 1] = torch.tensor([1.5 * 2.0 ** (k - 8) for k in ks.tolist()])
        exact = torch.zeros(len(ks), 128)
        exact[:, 0] = torch.tensor([448 * 2.0**k for k in ks.tolist()])
        exact[:, 1] = torch.tensor([2.0 ** (k - 7) for k in ks.tolist()])
        head, want = torch.cat([head, edge]), torch.cat([want, exact])
    q = torch.stack([head, -head], 1)
    w = torch.tensor([1.0, -1.0]).expand(len(q), 2)
    keys = torch.eye(128).to(torch.float8_e4m3fn).view(torch.uint8).unsqueeze(0)
    args = (q, w, keys, torch.ones(1, 128, 1), torch.zeros(len(q), dtype=torch.long))
    return tuple(x.to(device) for x in args) + (128, pow2), want.to(device)


@settings(deadline=None, max_examples=30)
@given(k=st.integers(-20, 30), seed=shapes["seed"])
def test_pow2_scales_are_the_least_power_of_two_above(k, seed) -> None:
    """ue8m0 scales are the least power of two >= amax / 448 (the float32 scale), exactly:
    also for amax / 448 = 2^k·(1 + 2^-23), which exp2(ceil(log2(.))) rounds down for most k."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 256, generator=g) * 10.0 ** (torch.rand(3, 2, generator=g) * 12 - 6).repeat_interleave(128, -1)
    x[0, :128] = torch.randn(128, generator=g) * 2.0**k
    x[0, 0] = torch.nextafter(torch.tensor(448 * 2.0**k), torch.tensor(math.inf))
    x[1, 128:] = 0.0
    _, s = sc.quantize_fp8_blocks(x)
    _, s32 = sc.quantize_fp8_blocks(x, pow2_scales=False)
    assert torch.equal(s32, x.view(3, 2, 128).abs().amax(-1).clamp(min=1e-4) / 448)
    assert float(s32[0, 0]) == 2.0**k * (1 + 2**-23) and float(s[0, 0]) == 2.0 ** (k + 1)
    mant, exp = torch.frexp(s32)  # s32 = mant·2^exp, mant in [0.5, 1): a power of two when mant = 0.5
    want = torch.pow(2.0, (exp - (mant == 0.5).int()).double()).float()
    assert torch.equal(s, want) and bool((s >= s32).all() and (s < 2 * s32).all())
    assert torch.equal(ceil_pow2(torch.tensor([1.0, 1.5, 0.75, 2.0**-20 * (1 + 2**-23), 2.0**100])),
                       torch.tensor([1.0, 2.0, 1.0, 2.0**-19, 2.0**100]))


@pytest.mark.parametrize("pow2", [True, False])
def test_dsa_fp8q_reference(pow2) -> None:
    """The torch twin: quantised queries read back exactly (ties to even, the scale's carry);
    on random cases, `dsa_index_scores_torch` over the quantised and dequantised queries."""
    args, want = fp8q_rounding_case(pow2)
    assert torch.equal(sc.dsa_index_scores_fp8q_torch(*args), want)
    g = torch.Generator().manual_seed(7)
    for q_dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, w, keys, scale, slots, n, _ = args = fp8q_case(g, 2, 5, 256, 40, q_dtype, torch.bfloat16, pow2)
        plain_q = sc.dequantize_fp8_blocks(*sc.quantize_fp8_blocks(q, pow2))
        assert torch.equal(sc.dsa_index_scores_fp8q_torch(*args), sc.dsa_index_scores_torch(plain_q, w, keys, scale, slots, n))


# -- the references are what the algorithms compute ----------------------------------------------
@pytest.mark.parametrize("how", ["max", "sum", "mean"])
def test_references_equal_the_algorithms(how) -> None:
    g = torch.Generator().manual_seed(5)
    reqs = [Request("a", 70, seq_len=70, slot=2), Request("b", 33, seq_len=33, slot=0)]
    batch = batch_of(reqs)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    common = {"top_k": 32, "page_size": 4, "min_sparse_prompt_len": 0, "device_buffer_tokens": 512}
    quest = Quest(load_config({**common, "algorithm": "quest", "extra": {"gqa_reduce": how}}), layout, 3, 128)
    pq = PQCache(load_config({**common, "algorithm": "pqcache", "extra": {"gqa_reduce": how, "iterations": 3,
                                                                               "candidates": "all"}}),
                 layout, 3, 128)
    for r in reqs:
        keys = torch.randn(r.seq_len, 2, 16, generator=g).to(torch.bfloat16)
        quest.build(1, r, keys)
        pq.build(1, r, keys)
    q = torch.randn(2, 6, 16, generator=g).to(torch.bfloat16)
    for r in reqs:  # the step being decoded (its token is not in the representations yet)
        r.seq_len += 1
    batch = batch_of(reqs)
    # PQCache.score (candidates "all"): each query head's softmax of the kernel's logits / √d over
    # every stored token, then the group's reduce (the "middle" rule: test_algorithms_pqcache.py)
    logits = sc.pqcache_scores_torch(q, pq.codebooks[1], pq.codes[1], batch.slot_ids, 71, "none")
    want = pq.score(1, q, batch)
    for i, r in enumerate(reqs):
        n = r.seq_len - 1
        probs = (logits[i, :, :, :n].double() / 4).softmax(-1).flatten(0, 1).unsqueeze(0)
        close(want[i, :, :n], reduce_groups(probs, 2, how)[0], 1e-5)
    keys, queries = torch.randn(50, 2, 16, generator=g), torch.randn(50, 6, 16, generator=g)
    votes = snapkv_votes(keys, queries, SnapKVOptions(window=12, kernel_size=1, gqa_reduce=how))
    mass = sc.snapkv_window_mass_torch(queries[-12:], keys)
    assert torch.equal(reduce_groups(mass.unsqueeze(0), 2, how)[0], votes)


def test_bad_arguments_are_refused_with_clear_errors() -> None:
    q, pages, slots = torch.randn(1, 4, 16), torch.randn(2, 2, 8, 16), torch.tensor([1])
    with pytest.raises(ValueError, match="reduce must be one of"):
        sc.quest_scores_torch(q, pages, pages, slots, 4, "median")
    with pytest.raises(ValueError, match="n_pages"):
        sc.quest_scores_torch(q, pages, pages, slots, 9)
    with pytest.raises(ValueError, match="range_weight must be in"):
        sc.quest_scores_torch(q, pages, pages, slots, 4, "sum", -0.5)
    with pytest.raises(ValueError, match="not a multiple"):
        sc.quest_scores_torch(torch.randn(1, 3, 16), pages, pages, slots, 4)
    with pytest.raises(ValueError, match="w <= n"):
        sc.snapkv_window_mass_torch(torch.randn(5, 2, 16), torch.randn(4, 1, 16))
    with pytest.raises(ValueError, match="multiple of 128"):
        sc.quantize_fp8_blocks(torch.randn(2, 100))
    with pytest.raises(ValueError, match="needs k_scale"):
        sc.dsa_index_scores_torch(torch.randn(1, 2, 128), torch.randn(1, 2), torch.zeros(1, 4, 128, dtype=torch.uint8),
                                  None, slots.clamp(max=0), 4)
    with pytest.raises(ValueError, match="needs fp8 keys"):
        sc.dsa_index_scores_fp8q_torch(torch.randn(1, 2, 128), torch.randn(1, 2), torch.zeros(1, 4, 128), None,
                                       slots.clamp(max=0), 4)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="CUDA"):
            sc.quest_scores_triton(q, pages, pages, slots, 4)


# -- Triton vs torch, interpreted on the CPU -----------------------------------------------------
INTERPRETED = r"""
import torch
from sparse_framework.kernels import dsa_index as dsa, scoring as sc

g = torch.Generator().manual_seed(0)
def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)
def check(got, want, tol, what):
    assert got.dtype == torch.float32 and got.shape == want.shape, (what, got.shape, want.shape)
    if want.numel():
        err, scale = float((got - want).abs().max()), float(want.abs().max())
        assert err <= tol * max(1.0, scale), (what, err, scale)
def tol(dt):
    return 1e-4 if dt == torch.float32 else 1e-3

for dt in (torch.float32, torch.bfloat16):
    for b, r, hkv, grp, d, maxp, n_pages, how, w in [(2, 3, 2, 2, 16, 40, 37, "max", 1.0), (1, 2, 1, 3, 24, 10, 10, "mean", 0.5),
                                                      (3, 3, 2, 1, 64, 200, 133, "sum", 1.0), (2, 3, 3, 3, 64, 90, 77, "sum", 0.0),
                                                      (2, 2, 2, 2, 32, 30, 29, "max", 0.3)]:
        x, y = rnd(r, hkv, maxp, d), rnd(r, hkv, maxp, d)
        lo, hi, q = torch.minimum(x, y).to(dt), torch.maximum(x, y).to(dt), rnd(b, hkv * grp, d, dtype=dt)
        slots = torch.randperm(r, generator=g)[:b]
        args = (q, lo, hi, slots, n_pages, how, w)  # w: range_weight (1 = the paper's bound)
        check(sc.quest_scores_triton(*args), sc.quest_scores_torch(*args), tol(dt), ("quest", dt, d, w))
    for b, r, hkv, grp, m, k, sub, maxn, n, how in [(2, 3, 2, 2, 2, 64, 8, 700, 613, "sum"), (1, 2, 3, 1, 4, 16, 4, 50, 50, "max"),
                                                     (2, 2, 1, 3, 3, 256, 5, 40, 33, "mean"),
                                                     (2, 3, 2, 3, 2, 64, 8, 300, 257, "none")]:
        books = rnd(r, hkv, m, k, sub)
        codes = torch.randint(0, k, (r, hkv, maxn, m), generator=g).to(torch.uint8)
        args = (rnd(b, hkv * grp, m * sub, dtype=dt), books, codes, torch.randperm(r, generator=g)[:b], n, how)
        check(sc.pqcache_scores_triton(*args), sc.pqcache_scores_torch(*args), tol(dt), ("pqcache", dt, m))

sc.SNAPKV_SPLIT = 64  # several key splits per row even at these lengths
for qdt, kdt in [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16,) * 2, (torch.float32, torch.bfloat16)]:
    for w, hkv, grp, d, n in [(8, 2, 2, 16, 150), (20, 1, 3, 32, 20), (32, 2, 4, 64, 97), (5, 1, 1, 8, 6), (40, 1, 2, 16, 60)]:
        args = (rnd(w, hkv * grp, d, dtype=qdt), rnd(n, hkv, d, dtype=kdt))
        check(sc.snapkv_window_mass_triton(*args), sc.snapkv_window_mass_torch(*args), tol(kdt), ("snapkv", qdt, kdt, w, n))

for kind in ("float32", "bfloat16", "float16", "fp8-native", "fp8-arith", "fp8-half", "fp8-q32"):
    qdt = {"float32": torch.float32, "float16": torch.float16, "fp8-half": torch.float16,
           "fp8-q32": torch.float32}.get(kind, torch.bfloat16)
    dsa.FP8_DECODE = "arith" if kind == "fp8-arith" else "native"
    for b, r, h, di, maxn, n in [(2, 3, 8, 128, 150, 130), (1, 1, 64, 256, 70, 70), (2, 2, 5, 24, 40, 17)]:
        raw = rnd(r, maxn, di) * 3
        if kind.startswith("fp8"):
            if di % 128:
                continue
            keys, scale = sc.quantize_fp8_blocks(raw)
        else:
            keys, scale = raw.to(getattr(torch, kind)), None
        args = (rnd(b, h, di, dtype=qdt), torch.rand(b, h, generator=g), keys, scale, torch.randperm(r, generator=g)[:b], n)
        check(sc.dsa_index_scores_triton(*args), sc.dsa_index_scores_torch(*args), tol(qdt), ("dsa", kind, di))

# every finite e4m3 pattern, through both decoders: row i (weights one-hot on head i, q_i = e_i)
# scores relu(k_t[i]); token 0 holds the patterns 0..127, token 1 the negative ones 128..255
bits = torch.arange(256, dtype=torch.uint8).view(2, 128)
bits[0, 127] = bits[1, 127] = 0  # the two NaN patterns
scale = torch.ones(1, 2, 1)
eye = torch.eye(128)
want = sc.dsa_index_scores_torch(eye.unsqueeze(0).expand(128, -1, -1).contiguous(), eye, bits.unsqueeze(0), scale,
                                 torch.zeros(128, dtype=torch.long), 2)
assert torch.equal(want[:, 0], bits[0].view(torch.float8_e4m3fn).float()) and not want[:, 1].any()
for mode in ("native", "arith"):
    dsa.FP8_DECODE = mode
    got = sc.dsa_index_scores_triton(eye.unsqueeze(0).expand(128, -1, -1).contiguous(), eye, bits.unsqueeze(0), scale,
                                     torch.zeros(128, dtype=torch.long), 2)
    assert torch.equal(got, want), mode

x = rnd(3, 256) * 10
back = sc.dequantize_fp8_blocks(*sc.quantize_fp8_blocks(x))
big = x.abs() > x.abs().amax(-1, keepdim=True) / 448 * 2**-6
assert bool(((back - x).abs()[big] < x.abs()[big] / 16).all())
print("interpreted ok")
"""


@pytest.mark.slow
def test_triton_kernels_interpreted_match_the_references() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, "interpreted ok", timeout=600)


# The fused fp8q kernel over random cases (hypothesis, in the subprocess): every path the
# interpreter can take (float16 dot of decoded operands with native or integer key decoding,
# the fp8 dot forced on), small token blocks so that rows span several programs and steps.
INTERPRETED_FP8Q = r"""
import sys
sys.path.insert(0, TESTS_DIR)
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from sparse_framework.kernels import dsa_index as dsa, scoring as sc
from test_kernels_scoring import fp8q_case, fp8q_check, fp8q_rounding_case

PATHS = {"exact": ("auto", "native"), "exact-arith": ("auto", "arith"), "fp8-dot": ("on", "native")}

@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 3), h=st.integers(1, 9), di=st.sampled_from([128, 256]), n=st.integers(0, 150),
       q_dtype=st.sampled_from(["float32", "bfloat16", "float16"]), w_dtype=st.sampled_from(["float32", "bfloat16"]),
       pow2=st.booleans(), path=st.sampled_from(sorted(PATHS)), block_n=st.sampled_from([16, 32, 64]),
       steps=st.integers(1, 3), strided=st.booleans(), seed=st.integers(0, 2**16))
def random_cases(b, h, di, n, q_dtype, w_dtype, pow2, path, block_n, steps, strided, seed):
    dsa.FP8_DOT, dsa.FP8_DECODE = PATHS[path]
    dsa.DSA_TUNING["fp8q"] = {"block_n": block_n, "steps": steps, "stages": 1, "warps": 4}
    dsa.DSA_MIN_PROGRAMS = 1  # keep the drawn steps per program, however small the grid gets
    g = torch.Generator().manual_seed(seed)
    args = fp8q_case(g, b, h, di, n, getattr(torch, q_dtype), getattr(torch, w_dtype), pow2, strided=strided)
    fp8q_check(sc.dsa_index_scores_fp8q_triton(*args), args, 1e-5)

random_cases()
for path in sorted(PATHS):
    dsa.FP8_DOT, dsa.FP8_DECODE = PATHS[path]
    for pow2 in (True, False):
        args, want = fp8q_rounding_case(pow2)
        assert torch.equal(sc.dsa_index_scores_fp8q_triton(*args), want), (path, pow2)
print("fp8q ok")
"""


@pytest.mark.slow
def test_triton_fp8q_interpreted_matches_the_torch_twin() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED_FP8Q.replace("MAX_EXAMPLES", "40"), "fp8q ok")


# The prefill indexer kernel over random shapes (hypothesis, in the subprocess): query and key
# counts off the blocks, head dims not powers of two, strided inputs, every 16-bit dtype and
# float32; small blocks so that both grid axes have several programs.
INTERPRETED_PREFILL = r"""
import torch
from hypothesis import given, settings, strategies as st, HealthCheck
from sparse_framework.kernels import dsa_index as dsa, scoring as sc

dsa.DSA_PREFILL_TUNING = {"block_q": 16, "block_n": 32, "warps": 4}

@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 70), m=st.integers(0, 100), h=st.integers(1, 6), di=st.sampled_from([16, 24, 64, 128]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), strided=st.booleans(), seed=st.integers(0, 2**16))
def random_cases(n, m, h, di, dtype, strided, seed):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    q = torch.randn(n, h, di * (2 if strided else 1), generator=g).to(dt)[..., :di]
    k = torch.randn(m, di + (8 if strided else 0), generator=g).to(dt)[:, :di]
    w = torch.randn(h, n, generator=g).t() if strided else torch.randn(n, h, generator=g)
    got, want = sc.dsa_prefill_index_scores_triton(q, w, k), sc.dsa_prefill_index_scores_torch(q, w, k)
    assert got.dtype == torch.float32 and got.shape == want.shape == (n, m)
    if want.numel():
        # exact products, float32 sums in another order: float32 rounding of the magnitudes summed
        bound = torch.einsum("njd,md->njm", q.float().abs(), k.float().abs())
        bound = torch.einsum("nj,njm->nm", w.abs(), bound)
        assert bool(((got - want).abs() <= 1e-5 * bound + 1e-6).all()), float((got - want).abs().max())

random_cases()
print("prefill ok")
"""


@pytest.mark.slow
def test_triton_prefill_index_interpreted_matches_the_torch_twin() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED_PREFILL.replace("MAX_EXAMPLES", "25"), "prefill ok")


def test_prefill_index_refuses_bad_shapes_by_name() -> None:
    q, w, k = torch.randn(3, 2, 16), torch.randn(3, 2), torch.randn(5, 16)
    with pytest.raises(ValueError, match=r"index_k \[m, Di\]"):
        sc.dsa_prefill_index_scores_torch(q, w, torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"weights must be \[3, 2\]"):
        sc.dsa_prefill_index_scores_torch(q, torch.randn(2, 3), k)
    with pytest.raises(ValueError, match="not fp8 bits"):
        sc.dsa_prefill_index_scores_torch(q, w, k.to(torch.uint8))
    # the reference is what the MLA model's `index_scores` computes off CUDA
    from sparse_framework.engine.models import index_scores
    assert torch.equal(index_scores(q, w, k), sc.dsa_prefill_index_scores_torch(q, w, k))


# -- Triton vs torch on CUDA ---------------------------------------------------------------------
def _gpu_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    close(got.cpu(), want.cpu(), tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["max", "sum", "mean"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_quest_and_pqcache(dtype, how) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    b, r, hkv, grp, d, maxp = 4, 6, 8, 4, 128, 1100
    x, y = torch.randn(2, r, hkv, maxp, d, device="cuda", generator=g)
    lo, hi = torch.minimum(x, y).to(dtype), torch.maximum(x, y).to(dtype)
    q = torch.randn(b, hkv * grp, d, device="cuda", generator=g).to(dtype)
    slots = torch.randperm(r, device="cuda", generator=g)[:b]
    args = (q, lo, hi, slots, 1031, how)
    _gpu_close(sc.quest_scores_triton(*args), sc.quest_scores_torch(*args), 1e-4)
    books = torch.randn(r, hkv, 2, 64, 64, device="cuda", generator=g)
    codes = torch.randint(0, 64, (r, hkv, 20000, 2), device="cuda", generator=g).to(torch.uint8)
    args = (q, books, codes, slots, 17001, how)
    _gpu_close(sc.pqcache_scores_triton(*args), sc.pqcache_scores_torch(*args), 1e-4)
    args = (q, books, codes, slots, 17001, "none")  # every query head, as PQCache.score asks
    _gpu_close(sc.pqcache_scores_triton(*args), sc.pqcache_scores_torch(*args), 1e-4)


@pytest.mark.parametrize("q_dtype,k_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_snapkv(q_dtype, k_dtype) -> None:
    """Every dot mode: 16-bit, float32 queries split over bf16 keys, tf32x3."""
    g = torch.Generator(device="cuda").manual_seed(2)
    for w, n in [(32, 5000), (7, 3001)]:
        qw = torch.randn(w, 32, 128, device="cuda", generator=g).to(q_dtype)
        keys = torch.randn(n, 8, 128, device="cuda", generator=g).to(k_dtype)
        _gpu_close(sc.snapkv_window_mass_triton(qw, keys), sc.snapkv_window_mass_torch(qw, keys), 1e-4)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8-native", "fp8-arith"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dsa(kind, q_dtype, monkeypatch) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    b, r, h, di, maxn, n = 4, 6, 64, 256, 9000, 8191
    iq = torch.randn(b, h, di, device="cuda", generator=g).to(q_dtype)
    raw = torch.randn(r, maxn, di, device="cuda", generator=g)
    if kind.startswith("fp8"):
        if kind == "fp8-native" and torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("fp8e4nv needs sm_89+")
        monkeypatch.setattr(dsa, "FP8_DECODE", kind[4:])
        keys, scale = sc.quantize_fp8_blocks(raw)
    else:
        keys, scale = raw.to(getattr(torch, kind)), None
    args = (iq, torch.rand(b, h, device="cuda", generator=g), keys, scale,
            torch.randperm(r, device="cuda", generator=g)[:b], n)
    _gpu_close(sc.dsa_index_scores_triton(*args), sc.dsa_index_scores_torch(*args), 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prefill_index(dtype) -> None:
    """DeepSeek-V3.2's indexer shape (64 heads x 128), a chunk of queries over a longer prefix."""
    g = torch.Generator(device="cuda").manual_seed(4)
    n, m, h, di = 777, 3001, 64, 128
    q = torch.randn(n, h, di, device="cuda", generator=g).to(dtype)
    k = torch.randn(m, di, device="cuda", generator=g).to(dtype)
    w = torch.rand(n, h, device="cuda", generator=g) / 64
    _gpu_close(sc.dsa_prefill_index_scores_triton(q, w, k), sc.dsa_prefill_index_scores_torch(q, w, k), 1e-4)
