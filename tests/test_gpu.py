"""CUDA checks of the store: pinned host memory, the Triton zero-copy kernel, the side
stream for host writes. Skipped (visibly) without a GPU; run them on the GPU machine:
`python -m pytest -m gpu -q`."""

from __future__ import annotations

import pytest
import torch

from sparse_framework import Batch, KVLayout, Request
from sparse_framework.kv_store.copy import copy_rows
from sparse_framework.kv_store.hierarchical import HierarchicalKVStore

from coordinator_driver import Driver, make

def capture(fn):  # type: ignore[no-untyped-def]
    """Warm `fn` up on a side stream, then capture it: (graph, the captured call's output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("row", [1, 64, 576, 1024, 2048])
def test_zero_copy_kernel_both_directions(dtype, row) -> None:
    n_host, n_dev, n = 4096, 1024, 700
    host = (torch.randn(n_host * row) * 40).to(dtype).pin_memory()
    dev = torch.zeros(n_dev * row, dtype=dtype, device="cuda")
    src = torch.randperm(n_host, device="cuda")[:n] * row  # distinct rows, so the copy back is well defined
    src[::7] = -1
    dst = torch.randperm(n_dev, device="cuda")[:n] * row
    copy_rows(host, dev, src, dst, row)
    want = torch.zeros(n_dev * row, dtype=dtype)
    copy_rows(host, want, src.cpu(), dst.cpu(), row, impl="torch")
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), want)
    back = torch.zeros_like(host).pin_memory()
    copy_rows(dev, back, torch.where(src >= 0, dst, -1), src, row)  # device -> pinned host
    torch.cuda.synchronize()
    keep = src.cpu() >= 0
    cols = torch.arange(row)
    idx = (src.cpu()[keep].unsqueeze(1) + cols).flatten()
    assert torch.equal(back[idx], host[idx])


def test_unpinned_host_memory_is_refused() -> None:
    with pytest.raises(ValueError, match="must be pinned"):
        copy_rows(torch.zeros(8), torch.zeros(8, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda"),
                  torch.zeros(1, dtype=torch.long, device="cuda"), 1)


@pytest.mark.parametrize("config", [{}, {"top_k": 8, "page_size": 2, "sink_tokens": 2, "recent_tokens": 2}, {"min_sparse_prompt_len": 100}])
def test_coordinator_on_cuda_reads_the_right_rows_and_matches_dense_at_full_budget(config) -> None:
    coord = make(config, device="cuda")
    assert coord.store.host[0].is_pinned()
    drv = Driver(coord, q_heads=4)
    reqs = [Request("a", 150), Request("b", 77), Request("c", 300)]
    drv.prefill(reqs)
    for _ in range(20):
        drv.decode(reqs)  # checks the rows at every returned slot
    full = make({"top_k": 512, "device_buffer_tokens": 1024}, device="cuda")
    drv = Driver(full, q_heads=4)
    drv.prefill([Request("a", 150), Request("b", 300)])
    for _ in range(5):
        for out, ref, _ in drv.decode(list(full.requests.values())):
            assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)
    stats = full.store.stats()
    assert sum(x["misses"] for x in stats) > 0 and sum(x["bytes_out"] for x in stats) > 0


def test_retract_resume_bit_identical_on_cuda() -> None:
    a, b = make({}, device="cuda"), make({}, device="cuda")
    da, db = Driver(a, q_heads=4, seed=3), Driver(b, q_heads=4, seed=3)
    ra, rb = [Request("x", 200), Request("y", 90)], [Request("x", 200), Request("y", 90)]
    da.prefill(ra)
    db.prefill(rb)
    for step in range(10):
        if step == 3:
            b.on_request_retract(rb[1])
            b.on_request_resume(rb[1])
        for (oa, _, _), (ob, _, _) in zip(da.decode(ra), db.decode(rb)):
            assert torch.equal(oa, ob)


def test_host_copies_of_decode_tokens_complete_before_they_are_read() -> None:
    """Decode tokens go to the host on a side stream; evicting them right away and reading
    them back must still give the written rows."""
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cuda")
    store = HierarchicalKVStore(layout, page_size=1, device_buffer_tokens=8, sink_tokens=1, recent_tokens=1,
                                max_requests=1, max_seq_len=600)
    r = Request("a", 4, seq_len=4, slot=0)
    store.admit(r)
    rows = [torch.randn(4, 2, 64, device="cuda").bfloat16()]
    store.write_prefill(0, r, rows[0], rows[0] + 1)
    for _ in range(500):
        r.seq_len += 1
        b = Batch([r])
        store.grow(b)
        b.prepare("cuda")
        store.begin_step(b)
        k = torch.randn(1, 2, 64, device="cuda").bfloat16()
        store.write_decode(0, b, k, k + 1)
        rows.append(k)
        store.end_step(b)
    k_host, v_host = store.read(0, r)
    want = torch.cat(rows).cpu()
    assert torch.equal(k_host, want) and torch.equal(v_host, want + 1)


def test_decode_path_of_the_store_captures_in_a_cuda_graph() -> None:
    """write_decode + ensure_resident contain no host synchronisation: they capture in a
    CUDA graph, and replays keep the rows right."""
    from sparse_framework import Selection

    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cuda")
    store = HierarchicalKVStore(layout, page_size=4, device_buffer_tokens=64, sink_tokens=4, recent_tokens=4,
                                max_requests=2, max_seq_len=4096)
    reqs = [Request("a", 1000, seq_len=1000, slot=0), Request("b", 700, seq_len=700, slot=1)]
    truth = []
    for r in reqs:
        store.admit(r)
        k = torch.randn(r.prompt_len, 2, 64, device="cuda").bfloat16()
        store.write_prefill(0, r, k, k)
        truth.append(k)
    # the graph writes one new token at the current lengths and selects a fixed-width set
    for r in reqs:
        r.seq_len += 1
    batch = Batch(reqs)
    store.grow(batch)
    batch.prepare("cuda")
    store.timing = False
    new_k = torch.randn(2, 2, 64, device="cuda").bfloat16()
    idx = torch.zeros(2, 1, 40, dtype=torch.int32, device="cuda")
    lens = torch.full((2, 1), 40, dtype=torch.int32, device="cuda")

    def step() -> torch.Tensor:
        store.write_decode(0, batch, new_k, new_k)
        return store.ensure_resident(0, batch, Selection(idx, lens))

    def pick(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for i, r in enumerate(reqs):
            pinned = list(range(4)) + list(range(r.seq_len - 4, r.seq_len))
            rest = torch.randperm(r.seq_len - 8, generator=g)[:32] + 4
            idx[i, 0] = torch.tensor(sorted(pinned + rest.tolist()), dtype=torch.int32)

    pick(0)
    graph, slots = capture(step)
    for seed in range(1, 6):
        pick(seed)
        graph.replay()
        torch.cuda.synchronize()
        kc, _ = store.paged_view(0, 1)
        rows = kc.reshape(-1, 2, 64)
        for i, r in enumerate(reqs):
            want = torch.cat([truth[i], new_k[i : i + 1]])
            assert torch.equal(rows[slots[i, 0].long()], want[idx[i, 0].long()])


@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
@pytest.mark.parametrize(
    "config",
    [
        {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "extra": {"dense_first_layers": 0}},
        {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "extra": {"key_dtype": "fp8_e4m3"}},
        {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "store": "resident", "extra": {"key_dtype": "fp8_e4m3"}},
    ],
)
def test_whole_decode_layer_captures_in_a_cuda_graph(config, backend) -> None:
    """attention_begin (store write, select, ensure_resident, adapt) + attend has no host
    synchronisation: captured once, replays with new queries and keys give the eager outputs.
    The graph's kernels launch with PDL where the GPU has it (kernels/pdl.py), the eager call
    they are compared with without: bit for bit the same; so are eager calls whose kernels
    are re-launched directly (kernels/launch.py) and through Triton."""
    from sparse_framework.coordinator.core import SparseCoordinator
    from sparse_framework.kernels import launch, pdl

    layout = KVLayout(num_layers=1, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, device="cuda")
    cfg = {"top_k": 256, "page_size": 16, "sink_tokens": 16, "recent_tokens": 32, "device_buffer_tokens": 512,
           "min_sparse_prompt_len": 0, "backend": backend, **config}
    coord = SparseCoordinator(cfg, layout, max_requests=3, max_seq_len=4096)
    coord.store.timing = False
    drv = Driver(coord, q_heads=16)
    reqs = [Request("a", 3000), Request("b", 1500), Request("c", 800)]
    drv.prefill(reqs)
    batch = Batch(reqs)
    coord.forward_begin(batch)
    q = torch.randn(3, 16, 128, device="cuda").bfloat16()
    k, v = torch.randn(2, 3, 4, 128, device="cuda").bfloat16()
    inputs = drv.model_inputs(3, prefill=False)

    def layer() -> torch.Tensor:
        coord.steps.rewind(0)  # the same layer call, again and again on one step
        meta = coord.attention_begin(0, q, k, v, batch, inputs)
        return coord.attend(0, q, meta)

    graph, out = capture(layer)
    for _ in range(3):
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        k.copy_(torch.randn_like(k, dtype=torch.float32))
        for t in inputs.values():
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        direct = layer()  # eager, kernels re-launched through kernels/launch.py's direct path
        pdl.PDL, launch.FAST = "off", "off"
        try:
            want = layer()  # eager, every kernel through Triton's own launch
        finally:
            pdl.PDL, launch.FAST = "auto", "auto"
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(direct, want, atol=0, rtol=0)


def test_direct_launch_respects_triton_specialisation() -> None:
    """kernels/launch.py on a real kernel: an int argument that Triton specialises (1, a
    multiple of 16, beyond int32) or a misaligned tensor gets its own compiled kernel, so
    every call computes what Triton's own launch computes; repeated signatures reuse it."""
    import triton
    import triton.language as tl

    from sparse_framework.kernels import launch

    @triton.jit
    def scale_kernel(x_ptr, out_ptr, n, m, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=live) * (m % 1000), mask=live)

    launch.clear()
    x = torch.arange(300, device="cuda", dtype=torch.int64)
    for m in (3, 1, 3, 16, 1, 7, 2**33 + 5, 3, 2**33 + 7):
        for src in (x, x[1:]):  # 16-byte aligned, then not
            out = torch.empty_like(src)
            launch.launch(scale_kernel, (triton.cdiv(src.numel(), 128),), src, out, src.numel(), m, BLOCK=128)
            torch.testing.assert_close(out, src * (m % 1000))
    assert launch.cache_size() == 8  # 4 int signatures (3/7, 1, 16, > int32) x 2 alignments


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["fp8-dot", "exact", "exact-arith"])
def test_dsa_fused_query_quantisation_matches_the_torch_twin(path, q_dtype, pow2, monkeypatch) -> None:
    """`dsa_index_scores_fp8q_triton` (queries quantised in the kernel) against its torch twin
    at DSA's decode shape (64 heads x 128) and at Di 256 with strided inputs. fp8-dot: the
    fp8 tensor-core dot (sm_89+), whose 128 products per block accumulate in the tensor core's
    reduced precision (Hopper keeps ~14 bits, as DeepSeek reports; their indexer does the
    same): within 5e-3 of Σ|terms|. exact: float16 dots of decoded values (native or integer
    key decoding): within 1e-5. The quantisation itself (rounding ties, scale carry) exactly,
    one product per dot."""
    from sparse_framework.kernels import dsa_index as dsa, scoring as sc
    from test_kernels_scoring import fp8q_case, fp8q_check, fp8q_rounding_case

    if path != "exact-arith" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8e4nv needs sm_89+")
    monkeypatch.setattr(dsa, "FP8_DOT", "auto" if path == "fp8-dot" else "off")
    monkeypatch.setattr(dsa, "FP8_DECODE", "arith" if path == "exact-arith" else "auto")
    g = torch.Generator().manual_seed(4)
    for b, h, di, n, strided in [(8, 64, 128, 8191, False), (3, 24, 256, 3000, True)]:
        args = fp8q_case(g, b, h, di, n, q_dtype, torch.bfloat16, pow2, device="cuda", strided=strided)
        fp8q_check(sc.dsa_index_scores_fp8q_triton(*args), args, 5e-3 if path == "fp8-dot" else 1e-5)
    args, want = fp8q_rounding_case(pow2, device="cuda")
    assert torch.equal(sc.dsa_index_scores_fp8q_triton(*args), want)


def test_dsa_select_with_the_top_k_first_pass_in_the_indexer_matches_the_separate_pass(monkeypatch) -> None:
    """DSA's fused path (the indexer kernel also histograms the top-k's first radix digit) at
    V3.2's indexer shape (64 heads x 128, FP8 keys) over ~40K tokens: the same selection as
    the separate first pass, and as torch's top-k wherever the scores do not tie."""
    import sparse_framework.algorithms.dsa as dsa_mod
    from sparse_framework.algorithms.dsa import DSA
    from sparse_framework.config import load_config
    from helpers import batch_of

    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": 2048, "sink_tokens": 16, "recent_tokens": 64, "min_sparse_prompt_len": 0,
                       "device_buffer_tokens": 4096, "extra": {"key_dtype": "fp8_e4m3"}})
    algo = DSA(cfg, KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, device=torch.device("cuda")), 4, 40000)
    assert algo.topk_impl == "triton"
    g = torch.Generator(device="cuda").manual_seed(7)
    reqs = [Request(f"r{i}", n, seq_len=n, slot=i) for i, n in enumerate([39999, 12345, 2500, 30000])]
    for r in reqs:
        algo.build(0, r, torch.zeros(r.seq_len, 1, device="cuda"), inputs={"index_k": torch.randn(r.seq_len, 128, device="cuda", generator=g)})
    batch = batch_of(reqs)
    batch.seq_lens, batch.slot_ids = batch.seq_lens.cuda(), batch.slot_ids.cuda()
    inputs = {"index_q": torch.randn(4, 64, 128, device="cuda", generator=g).bfloat16(),
              "index_weights": torch.rand(4, 64, device="cuda", generator=g).bfloat16()}
    monkeypatch.setattr(dsa_mod, "FUSE_TOPK_FIRST_PASS", True)
    fused = algo.select(0, None, batch, inputs=inputs)
    monkeypatch.setattr(dsa_mod, "FUSE_TOPK_FIRST_PASS", False)
    plain = algo.select(0, None, batch, inputs=inputs)
    assert torch.equal(fused.indices, plain.indices) and torch.equal(fused.lengths, plain.lengths)
    monkeypatch.setattr(algo, "topk_impl", "torch")
    ref = algo.select(0, None, batch, inputs=inputs)
    assert torch.equal(fused.lengths, ref.lengths)
    for b in range(4):  # same kept set unless the threshold score ties
        n = int(ref.lengths[b, 0])
        assert set(fused.indices[b, 0, :n].tolist()) == set(ref.indices[b, 0, :n].tolist())
