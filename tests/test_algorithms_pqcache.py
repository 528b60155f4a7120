"""PQCache: k-means, codes, and PQ scores vs direct re-computations."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import SMALL_QUEST, batch_of
from sparse_framework import Batch, ConfigError, KVLayout, Request, load_config
from sparse_framework.algorithms.pqcache import PQCache, kmeans, mix_seed
from sparse_framework.coordinator.core import SparseCoordinator


def make(bits: int = 6, subvectors: int = 2, how: str = "sum", iterations: int = 10, hk: int = 2,
         candidates: str = "all", max_requests: int = 2, **kw) -> PQCache:
    """SMALL_QUEST's framework settings (sink 4, recent 8); `candidates` "all" unless asked."""
    cfg = load_config({**SMALL_QUEST, "algorithm": "pqcache", "top_k": 16, **kw,
                       "extra": {"bits": bits, "subvectors": subvectors, "gqa_reduce": how, "iterations": iterations,
                                 "candidates": candidates}})
    return PQCache(cfg, KVLayout(num_layers=2, num_kv_heads=hk, head_dim=8), max_requests=max_requests, max_seq_len=200)



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
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "pqcache", "extra": {"bits": 9}})
    with pytest.raises(ConfigError, match=r"`extra.subvectors` = 3 must divide head_dim \(8\)"):
        SparseCoordinator({"store": "hierarchical", "sparse_policy": "always", "algorithm": "pqcache", "extra": {"subvectors": 3}}, KVLayout(1, 1, 8))


# -- candidates "middle": the original's k-means input and softmax normalisation -------------


@pytest.mark.parametrize("group", [1, 2])
def test_middle_candidates_match_a_float64_reference(group) -> None:
    """candidates "middle" (the original): the k-means clusters only the keys after the sink,
    and each head's softmax is normalised over the tokens between the sink and the recent
    window. With exactly 2**bits keys after the sink each is its own centroid, so the PQ
    logits of those tokens are exact and the scores equal a float64 softmax over
    [sink, seq_len - recent), summed per group; every other position scores 0."""
    g = torch.Generator().manual_seed(11)
    sink, recent, n = 4, 3, 12
    algo = make(bits=3, subvectors=2, how="sum", candidates="middle", recent_tokens=recent)
    keys = torch.randn(n, 2, 8, generator=g)
    r = Request("a", n, seq_len=n, slot=1)
    algo.build(0, r, keys)
    # the codebooks are exactly the after-sink keys' sub-vectors: the sink keys were not clustered
    books = algo.codebooks[0, 1]  # [Hkv, M, K, d]
    for h in range(2):
        for m in range(2):
            want = keys[sink:, h, 4 * m : 4 * m + 4]
            got = books[h, m]
            assert torch.equal(got[torch.cdist(want, got).argmin(-1)], want)
            assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))
    r.seq_len += 1  # the token being decoded
    q = torch.randn(1, 2 * group, 8, generator=g)
    got = algo.score(0, q, batch_of([r]))[0, :, :n].double()
    lo, hi = sink, r.seq_len - recent
    want = torch.zeros(2, n, dtype=torch.float64)
    for j in range(2 * group):
        h = j // group
        logits = keys[lo:hi, h].double() @ q[0, j].double() / math.sqrt(8)
        want[h, lo:hi] += logits.softmax(0)
    assert torch.allclose(got, want, atol=1e-6)


def test_middle_and_all_differ_and_short_prompts_cluster_every_key() -> None:
    """The two rules give different scores on the same prompt (the option does something),
    and a prompt no longer than the sink clusters all its keys (nothing follows the sink)."""
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(40, 2, 8, generator=g)
    q = torch.randn(1, 4, 8, generator=g)
    scores = {}
    for how in ("middle", "all"):
        algo = make(bits=3, candidates=how)
        r = Request("a", 40, seq_len=40, slot=0)
        algo.build(0, r, keys)
        r.seq_len += 1
        scores[how] = algo.score(0, q, batch_of([r]))[0, :, :40]
    assert not torch.allclose(scores["middle"], scores["all"])
    assert float(scores["middle"][:, :4].abs().max()) == 0.0  # sink tokens are no candidates
    short = make(bits=3, candidates="middle")
    r = Request("s", 3, seq_len=3, slot=0)
    short.build(0, r, keys[:3])  # 3 <= sink 4: clustered whole, codes are the nearest centroids
    x = keys[:3, 0, :4]
    assert torch.equal(short.codes[0, 0, 0, :3, 0].long(), torch.cdist(x, short.codebooks[0, 0, 0, 0]).argmin(-1))


# -- reproducibility: the same prompt gets the same codebooks --------------------------------

PQ_CFG = {**SMALL_QUEST, "algorithm": "pqcache", "top_k": 16, "extra": {"bits": 3, "iterations": 4, "seed": 7}}
LAYOUT = dict(num_layers=2, num_kv_heads=2, head_dim=8)


def prompt_keys(seed: int, n: int) -> list[torch.Tensor]:
    """Per layer, the K rows of a prompt: [n, Hkv, D], fixed by `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 2, 8, generator=g) for _ in range(LAYOUT["num_layers"])]


def prefill(coord: SparseCoordinator, reqs: list[Request], keys: dict[str, list[torch.Tensor]]) -> None:
    """One prefill batch of `reqs` with the given keys (values: the keys, queries: zeros)."""
    for r in reqs:
        coord.on_request_begin(r)
    batch = Batch(reqs, is_prefill=True)
    coord.forward_begin(batch)
    for layer in range(LAYOUT["num_layers"]):
        k = torch.cat([keys[r.rid][layer] for r in reqs])
        q = torch.zeros(k.shape[0], 4, 8)
        meta = coord.attention_begin(layer, q, k, k.clone(), batch)
        coord.attention_end(layer, coord.attend(layer, q, meta), batch)
    coord.forward_end(batch)


def codebook_state(coord: SparseCoordinator, r: Request) -> tuple[torch.Tensor, torch.Tensor]:
    algo = coord.algorithm
    return algo.codebooks[:, r.slot].clone(), algo.codes[:, r.slot, :, : r.prompt_len].clone()


def digest(books: torch.Tensor) -> str:
    return hashlib.sha256(books.contiguous().numpy().tobytes()).hexdigest()


def test_a_prompt_gets_the_same_codebooks_alone_in_a_batch_and_again() -> None:
    keys = {"a": prompt_keys(1, 50), "b": prompt_keys(2, 70), "c": prompt_keys(3, 50)}
    alone = SparseCoordinator(PQ_CFG, KVLayout(**LAYOUT), max_requests=3, max_seq_len=128)
    a = Request("a", 50)
    prefill(alone, [a], keys)
    want = codebook_state(alone, a)
    # in a batch, after another prompt (and in another pool slot)
    batched = SparseCoordinator(PQ_CFG, KVLayout(**LAYOUT), max_requests=3, max_seq_len=128)
    b, c, a2 = Request("b", 70), Request("c", 50), Request("a", 50)
    prefill(batched, [b, c, a2], keys)
    assert a2.slot != a.slot
    for x, y in zip(codebook_state(batched, a2), want):
        assert torch.equal(x, y)
    # a prompt of the same length but other keys gets other codebooks from the same starts
    assert not torch.equal(codebook_state(batched, c)[0], want[0])
    # a second call in the same instance, after everything above: the same again
    for r in (a,):
        alone.on_request_end(r)
    prefill(alone, [Request("b", 70)], keys)
    again = Request("a", 50)
    prefill(alone, [again], keys)
    for x, y in zip(codebook_state(alone, again), want):
        assert torch.equal(x, y)
    # and the same selection at the next decode step, alone and in the batch
    q, k = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(9)), torch.randn(1, 2, 8)
    sels = []
    for coord, reqs in ((alone, [again]), (batched, [b, a2])):
        batch = Batch(reqs)
        coord.forward_begin(batch)
        i = [r.rid for r in reqs].index("a")
        qq = torch.zeros(len(reqs), 4, 8)
        kk = torch.zeros(len(reqs), 2, 8)
        qq[i], kk[i] = q[0], k[0]
        sel = coord.attention_begin(0, qq, kk, kk.clone(), batch).selection
        sels.append((sel.indices[i, :, : int(sel.lengths[i].max())], sel.lengths[i]))
        coord.attention_end(0, None, batch)
        for layer in range(1, LAYOUT["num_layers"]):
            coord.attention_begin(layer, qq, kk, kk.clone(), batch)
            coord.attention_end(layer, None, batch)
        coord.forward_end(batch)
    assert torch.equal(sels[0][0], sels[1][0]) and torch.equal(sels[0][1], sels[1][1])


ANOTHER_PROCESS = r"""
import sys
sys.path.insert(0, TESTS_DIR)
from sparse_framework import KVLayout, Request
from sparse_framework.coordinator.core import SparseCoordinator
from test_algorithms_pqcache import LAYOUT, PQ_CFG, codebook_state, digest, prefill, prompt_keys
coord = SparseCoordinator(PQ_CFG, KVLayout(**LAYOUT), max_requests=2, max_seq_len=128)
a = Request("a", 50)
prefill(coord, [a], {"a": prompt_keys(1, 50)})
print("digest", digest(codebook_state(coord, a)[0]))
"""


@pytest.mark.slow
def test_another_process_builds_the_same_codebooks() -> None:
    """A fresh process (another hash salt, a fresh instance) builds the prompt's codebooks
    bit for bit as this one does after building another prompt first."""
    coord = SparseCoordinator(PQ_CFG, KVLayout(**LAYOUT), max_requests=2, max_seq_len=128)
    keys = {"z": prompt_keys(4, 90), "a": prompt_keys(1, 50)}
    prefill(coord, [Request("z", 90)], keys)
    a = Request("a", 50)
    prefill(coord, [a], keys)
    tests_dir = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
           "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", ANOTHER_PROCESS.replace("TESTS_DIR", repr(tests_dir))],
                          capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"digest {digest(codebook_state(coord, a)[0])}" in done.stdout


def test_seeds_are_stable_numbers_and_the_seed_option_changes_them() -> None:
    """mix_seed depends on every part and stays in a generator's seed range; another `seed`
    option gives other starts (the other-process test checks it is the same everywhere)."""
    assert mix_seed(0, 0, 0, 0) == mix_seed(0, 0, 0, 0) != mix_seed(0, 0, 0, 1)
    assert all(0 <= mix_seed(s, 3, 1, 50) < 2**63 for s in (0, 1, -1, 2**70))
    one = make(bits=3)
    other = PQCache(load_config({**SMALL_QUEST, "algorithm": "pqcache", "top_k": 16, "extra": {"bits": 3, "seed": 1}}),
                    KVLayout(num_layers=2, num_kv_heads=2, head_dim=8), max_requests=2, max_seq_len=200)
    picks = [[int(torch.randperm(50, generator=g)[0]) for g in algo.generators(0, 50)] for algo in (one, other)]
    assert picks[0] != picks[1]
