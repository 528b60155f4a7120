"""decode_graphs.py: the coordinator's CUDA-graph replay of decode layers.

CPU: the width rounding, the config errors, and the contract a graph relies on — scoring a
wider context than the longest request changes no selection. GPU: a coordinator replaying
its layers from graphs against an eager twin fed the same inputs, step by step, bit for bit,
through page and bucket boundaries, a mixed dense / sparse batch, retract / resume and a
request leaving and another joining; afterwards both stores hold the same host KV and counters.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import Batch, ConfigError, Request
from sparse_framework.backends.flash_attn import FlashAttnBackend
from sparse_framework.coordinator.graphs import Staging, bucket_width
from coordinator_driver import Driver, make


@given(st.integers(1, 10_000), st.integers(1, 4096), st.integers(1, 20_000))
def test_bucket_width_rounds_up_within_the_cap(max_len: int, bucket: int, cap: int) -> None:
    w = bucket_width(max_len, bucket, cap)
    assert w >= max_len
    assert w <= max(cap, max_len)
    if max_len <= cap:
        assert w % bucket == 0 or w == cap
        assert w - max_len < bucket


@settings(max_examples=30, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=6),
       dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]), min_size=6, max_size=6),
       transpose=st.booleans())
def test_staging_holds_each_input_and_refills_from_any_layout(shapes, dtypes, transpose) -> None:
    """The graph's input buffers: one flat buffer per dtype, each input a contiguous view of
    it; `fill` copies new values in, whatever the sources' strides."""
    def draw(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for shape, dtype in zip(shapes, dtypes):
            t = (torch.randn(*shape, generator=g) * 50).to(dtype)
            out.append(t.t() if transpose and t.dim() == 2 else t)
        return out

    first = draw(0)
    staging = Staging(first)
    assert len(staging.groups) == len({t.dtype for t in first})
    for got, want in zip(staging.views, first):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous() and torch.equal(got, want)
    second = draw(1)
    staging.fill(second)
    for got, want in zip(staging.views, second):
        assert torch.equal(got, want)


def test_decode_graphs_need_cuda_and_sane_sizes() -> None:
    with pytest.raises(ConfigError, match="decode_graphs=True needs a CUDA layout device"):
        make(decode_graphs=True)
    with pytest.raises(ConfigError, match="graph_bucket_tokens and max_graphs must be >= 1"):
        make(graph_bucket_tokens=0)
    with pytest.raises(ConfigError, match="graph_bucket_tokens and max_graphs must be >= 1"):
        make(max_graphs=0)


ALGORITHMS = {
    "quest": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "extra": {"dense_first_layers": 0}},
    "dsa": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"index_heads": 4, "index_dim": 128}},
    "dsa-keys": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"source": "keys"}},
    "snapkv": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "extra": {"window": 8}},
    "pqcache": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "pqcache", "extra": {"iterations": 3, "bits": 3}},
}


def _valid(sel) -> list[list[list[int]]]:  # type: ignore[no-untyped-def]
    """The selected indices of every row, without padding."""
    idx, lens = sel.indices.tolist(), sel.lengths.tolist()
    return [[row[:n] for row, n in zip(rows, ns)] for rows, ns in zip(idx, lens)]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@settings(max_examples=6, deadline=None)
@given(lens=st.lists(st.integers(40, 150), min_size=1, max_size=3), extra=st.integers(1, 300), seed=st.integers(0, 99))
def test_a_wider_scored_context_selects_the_same_tokens(name: str, lens: list[int], extra: int, seed: int) -> None:
    """What lets one graph serve `graph_bucket_tokens` steps: `batch.max_seq_len` rounded up
    (scores past each request's length exist but are ignored) selects exactly the same tokens."""
    coord = make({**ALGORITHMS[name], "top_k": 16}, max_seq_len=512)
    drv = Driver(coord, q_heads=4, seed=seed)
    reqs = [Request(f"r{i}", n) for i, n in enumerate(lens)]
    drv.prefill(reqs)
    batch = Batch(reqs)
    coord.forward_begin(batch)
    b = len(reqs)
    q = drv.randn(b, 4, coord.layout.head_dim)
    inputs = drv.model_inputs(b, prefill=False)
    exact = coord.algorithm.select(1, q, batch, inputs=inputs)
    batch.max_seq_len = min(batch.max_seq_len + extra, coord.max_seq_len)
    wider = coord.algorithm.select(1, q, batch, inputs=inputs)
    assert _valid(wider) == _valid(exact)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GRAPH_CONFIGS = {
    "quest-triton": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "backend": "triton", "extra": {"dense_first_layers": 0}},
    "quest-torch_ref": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "backend": "torch_ref", "extra": {"dense_first_layers": 0}},
    "dsa-triton": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "backend": "triton", "extra": {"index_heads": 8, "index_dim": 128}},
    "dsa-keys-triton": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "backend": "triton", "extra": {"source": "keys"}},
    "quest-resident": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "backend": "triton", "store": "resident", "extra": {"dense_first_layers": 0}},
    "dsa-flash_attn": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "backend": "flash_attn", "extra": {"index_heads": 8, "index_dim": 128}},
}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", sorted(GRAPH_CONFIGS))
def test_replayed_layers_equal_eager_ones_step_by_step(name: str) -> None:
    backend = GRAPH_CONFIGS[name]["backend"]
    if backend == "flash_attn" and FlashAttnBackend.unavailable_reason() is not None:
        pytest.skip("needs flash-attn")
    cfg = {**GRAPH_CONFIGS[name], "top_k": 64, "page_size": 16, "sink_tokens": 16, "recent_tokens": 32,
           "device_buffer_tokens": 256, "min_sparse_prompt_len": 200, "dense_layers": [1]}
    dtype = torch.bfloat16 if backend == "flash_attn" else torch.float32  # flash-attn takes 16-bit KV only
    kw = dict(layers=3, kv_heads=2, head_dim=128, device="cuda", dtype=dtype, max_requests=4, max_seq_len=1024)
    eager = make(cfg, **kw)
    graphed = make(cfg, decode_graphs=True, graph_bucket_tokens=48, **kw)
    assert graphed.graphs is not None and graphed.store.timing is False
    drivers = [Driver(eager, q_heads=8, seed=3), Driver(graphed, q_heads=8, seed=3)]
    twins = [{rid: Request(rid, n) for rid, n in (("a", 400), ("b", 150), ("c", 330), ("d", 260))} for _ in drivers]

    def both(action):  # type: ignore[no-untyped-def]
        return [action(drv, reqs) for drv, reqs in zip(drivers, twins)]

    def steps(names: str, n: int) -> None:
        for _ in range(n):
            out_e, out_g = both(lambda drv, reqs: drv.decode([reqs[x] for x in names]))
            for (e, _, _), (g, _, _) in zip(out_e, out_g):
                torch.testing.assert_close(g, e, atol=0, rtol=0)

    both(lambda drv, reqs: drv.prefill([reqs["a"], reqs["b"], reqs["c"]]))
    steps("abc", 40)  # b decodes densely (prompt < 200) beside a and c; pages and buckets crossed
    if cfg.get("store") != "resident":  # a resident store keeps no host copy to resume from
        both(lambda drv, reqs: drv.coord.on_request_retract(reqs["b"]))
        steps("ac", 6)  # another composition
        both(lambda drv, reqs: drv.coord.on_request_resume(reqs["b"]))
    both(lambda drv, reqs: drv.coord.on_request_end(reqs["c"]))
    both(lambda drv, reqs: drv.prefill([reqs["d"]]))  # d takes c's state row
    steps("abd", 30)
    torch.cuda.synchronize()
    g = graphed.graphs
    assert g.captures > 0 and g.replays > g.captures, (g.captures, g.replays, g.eager)
    assert torch.equal(graphed.store.counts, eager.store.counts)
    assert torch.equal(graphed.store.rows_out, eager.store.rows_out)
    for mine, theirs in zip(graphed.store.host, eager.store.host):
        assert torch.equal(mine, theirs)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
def test_transformers_generate_with_decode_graphs_equals_without(backend: str) -> None:
    """The shipped reference model through the transformers integration, eager layers and the
    coordinator's decode graphs: the same tokens and the same selections, step for step."""
    pytest.importorskip("transformers")
    from sparse_framework.integrations.transformers import sparse
    from sparse_framework.toy_model.model import load_reference_model
    from sparse_framework.toy_model.tasks import TASKS, TaskConfig, draw

    model = load_reference_model(torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(0)
    seqs = [draw(TaskConfig(context=1500, **TASKS["passkey"]), gen) for _ in range(2)]
    prompt = torch.stack([s.tokens[: s.prompt_len + 1] for s in seqs]).cuda()
    config = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "backend": backend, "top_k": 256, "min_sparse_prompt_len": 0,
              "extra": {"dense_first_layers": 0}}
    runs = []
    for graphs in (False, True):
        seen: list[tuple[int, torch.Tensor]] = []
        with sparse(model, config, max_requests=2, max_seq_len=2048, decode_graphs=graphs) as handle:
            handle.observer = lambda ev: ev.selection is None or seen.append((ev.layer, ev.selection.indices.clone()))
            out = model.generate(prompt, max_new_tokens=40, do_sample=False)
            coord = handle.coordinator
            assert (coord.graphs is not None) == graphs
            if graphs:
                assert coord.graphs.replays > 0
        runs.append((out, seen))
    (out_e, sel_e), (out_g, sel_g) = runs
    assert torch.equal(out_g, out_e)
    assert len(sel_g) == len(sel_e) > 0
    for (la, a), (lb, b) in zip(sel_e, sel_g):
        assert la == lb and torch.equal(a, b)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("adaptor", [None, "flashmla"])
def test_mla_replayed_layers_equal_eager_ones(adaptor: str | None) -> None:
    """DeepSeek-like MLA (one 576-dim latent per token, V its first 512, 16 query heads), DSA's
    indexer, hierarchical store, the Triton kernel over a page table or FlashMLA's indices:
    replayed layers equal an eager twin's bit for bit, step after step."""
    from sparse_framework import KVLayout
    from sparse_framework.coordinator.core import SparseCoordinator

    layout = KVLayout.mla(2, dtype=torch.bfloat16, device="cuda")
    cfg = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "backend": "triton", "top_k": 128, "page_size": 16, "sink_tokens": 16,
           "recent_tokens": 32, "device_buffer_tokens": 256, "min_sparse_prompt_len": 0,
           "extra": {"index_heads": 8, "index_dim": 128}, **({"adaptor": adaptor} if adaptor else {})}
    coords = [SparseCoordinator(cfg, layout, max_requests=3, max_seq_len=1024, **kw)
              for kw in ({}, {"decode_graphs": True, "graph_bucket_tokens": 48})]
    gen = torch.Generator().manual_seed(5)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)

    def inputs(tokens: int, prefill: bool) -> dict[str, torch.Tensor]:
        algo = coords[0].algorithm
        return {n: randn(tokens, *s) for n, s in (algo.prefill_inputs if prefill else algo.decode_inputs).items()}

    twins = [[Request("a", 500), Request("b", 300)] for _ in coords]
    for coord, reqs in zip(coords, twins):
        for r in reqs:
            coord.on_request_begin(r)
    n = 800
    pre = [(randn(n, 16, 576), randn(n, 1, 576), inputs(n, True)) for _ in range(2)]
    for coord, reqs in zip(coords, twins):
        batch = Batch(reqs, is_prefill=True)
        coord.forward_begin(batch)
        for layer, (q, k, extra) in enumerate(pre):
            coord.attention_begin(layer, q, k, None, batch, extra)
            coord.attention_end(layer, None, batch)
        coord.forward_end(batch)
    for _ in range(60):
        step = [(randn(2, 16, 576), randn(2, 1, 576), inputs(2, False)) for _ in range(2)]
        outs = []
        for coord, reqs in zip(coords, twins):
            batch = Batch(reqs)
            coord.forward_begin(batch)
            for layer, (q, k, extra) in enumerate(step):
                meta = coord.attention_begin(layer, q, k, None, batch, extra)
                outs.append(coord.attend(layer, q, meta))
                coord.attention_end(layer, outs[-1], batch)
            coord.forward_end(batch)
        for eager, graphed in zip(outs[:2], outs[2:]):
            torch.testing.assert_close(graphed, eager, atol=0, rtol=0)
    torch.cuda.synchronize()
    g = coords[1].graphs
    assert g is not None and g.captures > 0 and g.replays > g.captures
    assert torch.equal(coords[1].store.counts, coords[0].store.counts)
    for mine, theirs in zip(coords[1].store.host, coords[0].store.host):
        assert torch.equal(mine, theirs)
