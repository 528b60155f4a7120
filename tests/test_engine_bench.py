"""engine/bench.py on the CPU: drawn lengths and arrivals are seeded and are what the engine
ran, the figures are sane, prefill FLOPs and the decode floor equal hand computations."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from sparse_framework.cli import main as cli
from sparse_framework.common.errors import ConfigError
from sparse_framework.bench import floors
from sparse_framework.bench import offline as bench
from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
from sparse_framework.config import load_config
from sparse_framework.engine.llm import LLM
from sparse_framework.engine.memory import plan_for
from sparse_framework.engine.models import ModelConfig, random_model

TINY = ModelConfig.from_hf(RANDOM_MODELS["tiny"])  # 2 layers, 4/2 heads of 16, hidden 64, MLP 128, vocab 512


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return random_model(TINY, "float32", "cpu")


def quest(store: str, min_sparse: int = 64) -> dict:
    return {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "store": store, "top_k": 64, "page_size": 16, "sink_tokens": 16, "recent_tokens": 16,
            "device_buffer_tokens": 128, "min_sparse_prompt_len": min_sparse, "extra": {"dense_first_layers": 0}}


@pytest.mark.parametrize("dist", bench.LENGTH_DISTRIBUTIONS)
def test_lengths_are_seeded_and_within_their_range(dist) -> None:
    draw = lambda seed: bench.draw_lengths(dist, 100, 0.3, 200, torch.Generator().manual_seed(seed))  # noqa: E731
    a, b, c = draw(1), draw(1), draw(2)
    assert a == b and all(70 <= n <= 130 for n in a)
    if dist == "fixed":
        assert a == [100] * 200
    else:
        assert a != c and len(set(a)) > 10 and abs(sum(a) / len(a) - 100) < 5
    if dist == "uniform":  # both ends reachable
        assert min(a) <= 73 and max(a) >= 127


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    spec = bench.BenchSpec(num_prompts=400, input_len=8, request_rate=50.0, seed=3)
    a, b = bench.draw_workload(spec, 512), bench.draw_workload(spec, 512)
    assert a.arrivals == b.arrivals and a.prompts == b.prompts and a.arrivals[0] == 0
    gaps = [y - x for x, y in zip(a.arrivals, a.arrivals[1:])]
    assert all(g >= 0 for g in gaps) and 0.015 < sum(gaps) / len(gaps) < 0.025  # mean 1/50 s
    assert bench.draw_workload(bench.BenchSpec(num_prompts=4), 512).arrivals == [0.0] * 4


@pytest.mark.parametrize("bad, message", [
    ({"input_len_dist": "zipf"}, "--input-len-dist must be one of fixed, uniform, normal"),
    ({"range_ratio": 1.0}, "--range-ratio must be in [0, 1)"),
    ({"request_rate": 0.0}, "--request-rate must be > 0"),
    ({"num_prompts": 0}, "--num-prompts must be >= 1"),
])
def test_bad_specs_are_clear_errors(bad, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        bench.BenchSpec(**bad)


@pytest.mark.parametrize("dist, rate", [("fixed", None), ("uniform", None), ("normal", 200.0)])
def test_the_engine_runs_the_drawn_lengths(tiny, dist, rate) -> None:
    spec = bench.BenchSpec(num_prompts=5, input_len=40, output_len=6, input_len_dist=dist, output_len_dist=dist,
                           range_ratio=0.5, request_rate=rate, concurrency=3, seed=7)
    work = bench.draw_workload(spec, TINY.vocab_size)
    llm = LLM.from_model(tiny, quest("hierarchical"), max_num_seqs=3, max_model_len=work.max_model_len)
    r = bench.run_benchmark(llm, spec)  # no plan, CPU: no bound
    assert r["input_lens"] == work.input_lens and r["output_lens"] == work.output_lens
    assert r["prefill_tokens_computed"] == sum(work.input_lens)  # from the engine's step log
    assert r["output_tokens"] == sum(work.output_lens)
    assert r["admitted_concurrency"] == 3 and r["memory_bound_max"] is None and r["peak_gpu_bytes"] is None
    assert r["memory_plan"] is None
    if rate is not None:
        assert r["arrivals_s"] == work.arrivals and r["arrivals_s"][-1] > 0


def test_the_prefetch_rows_are_reported_and_counted_in_the_host_to_device_bytes(tiny) -> None:
    """With prefetch on, the rows it copied ahead show in the JSON, and h2d_bytes counts them
    beside the layers' own misses (the store's `bytes_in`)."""
    spec = bench.BenchSpec(num_prompts=2, input_len=200, output_len=6, concurrency=2)
    rows = {}
    for prefetch in ("off", "early_query"):
        llm = LLM.from_model(tiny, {**quest("hierarchical"), "prefetch": prefetch}, max_num_seqs=2, max_model_len=208)
        rows[prefetch] = bench.run_benchmark(llm, spec)
        stats = llm.engine.runner.coord.store.stats()
        assert rows[prefetch]["prefetch_rows"] == sum(s["prefetch_rows"] for s in stats)
        assert rows[prefetch]["h2d_bytes"] == sum(s["bytes_in"] for s in stats)
    assert rows["off"]["prefetch_rows"] == 0 and rows["early_query"]["prefetch_rows"] > 0


def test_hierarchical_figures_are_sane_and_resident_has_no_traffic(tiny) -> None:
    spec = bench.BenchSpec(num_prompts=3, input_len=200, output_len=8, concurrency=3)
    rows, plans = {}, {}
    for store in ("hierarchical", "resident"):
        plans[store] = bench.memory_plan(tiny, load_config(quest(store)), "cpu", max_model_len=208,
                                         max_num_batched_tokens=2048, max_num_seqs=3, device_memory_bytes=2**25,
                                         host_memory_bytes=2**30)
        llm = LLM.from_model(tiny, quest(store), max_num_seqs=3, max_model_len=208)
        rows[store] = bench.run_benchmark(llm, spec, plans[store])
    h, r = rows["hierarchical"], rows["resident"]
    assert h["buffer_hits"] + h["buffer_misses"] > 0 and 0 <= h["hit_rate"] <= 1
    assert h["h2d_bytes"] > 0 and h["h2d_gb_per_s"] > 0 and h["host_pool_bytes"] > 0
    assert r["hit_rate"] is None and r["h2d_bytes"] is None and r["h2d_gb_per_s"] is None
    assert h["prefetch_rows"] == 0 and r["prefetch_rows"] is None  # prefetch is off by default
    for x in (h, r):
        assert x["prefill_flops"] == floors.prefill_flops(TINY, [200] * 3) and x["prefill_tflops"] > 0
        assert x["decode_step_rows"] == 3 and 0 < x["decode_step_floor_ms"] < x["decode_step_ms"]
        assert x["memory_bound_max"] >= 1 and x["ttft_p50_ms"] <= x["ttft_p99_ms"]
    for store, x in rows.items():  # the bound is the plan's, recorded whole
        assert x["memory_bound_max"] == plans[store].max_requests and x["memory_bound"] == plans[store].limited_by
        assert x["memory_plan"] == plans[store].as_dict()
    assert r["memory_plan"]["host_bytes_per_request"] == 0 and h["memory_plan"]["host_bytes_per_request"] > 0


def test_prefill_flops_equal_a_hand_computation() -> None:
    d, q, kv, mlp, vocab, layers = 64, 4 * 16, 2 * 16, 128, 512, 2
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * mlp + 2 * d  # q, k, v, o; gate, up, down; two norms
    per_token = layers * per_layer + d  # and the final norm; not the embedding (a lookup) nor the head
    prompts = [10, 20]
    attention = sum(2 * 2 * layers * 4 * 16 * n * n / 2 for n in prompts)
    expected = 2 * per_token * sum(prompts) + 2 * vocab * d * len(prompts) + attention
    assert floors.prefill_flops(TINY, prompts) == expected == 4_701_952


@pytest.mark.parametrize("kind", ["dense resident", "sparse resident", "hierarchical"])
def test_decode_floor_of_each_kind_equals_a_hand_computation(tiny, kind) -> None:
    config = quest("resident", min_sparse=10**9) if kind == "dense resident" else quest(kind.split()[-1], 100)
    llm = LLM.from_model(tiny, config, max_num_seqs=2, max_model_len=256)
    # float32: per layer q, o (64 x 64), k, v (64 x 32), gate, up, down (64 x 128), two norms; final norm, embedding, head
    # the embedding: only the step's 2 rows are read (a lookup); the head is read whole
    weights = 4 * (TINY.num_layers * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64 + 512 * 64 + 2 * 64)
    per_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, float32
    rows = [(200, 199), (150, 149)]  # (context, prompt)
    if kind == "dense resident":
        kv = 2 * (200 + 150) * per_token  # every context token of both rows, both layers
    else:
        selected = 16 * (1 + 4 + 2)  # pages: sink 1, top_k 64 / 16 = 4, recent 16 tokens span up to 2
        representation = 2 * (2 * 16 * 4) / 16  # Quest: a min and a max K row per page of 16
        kv = 2 * (2 * selected * per_token + (200 + 150) * representation)
    assert floors.decode_floor_bytes(llm, rows) == weights + kv
    # a request whose prompt is below min_sparse_prompt_len reads its whole context in any store
    mixed = floors.decode_floor_bytes(llm, [(200, 199), (90, 89)])
    if kind != "dense resident":
        assert mixed == weights + 2 * (selected * per_token + 200 * representation + 90 * per_token)


@pytest.mark.parametrize("store", ["hierarchical", "resident"])
def test_the_bound_is_the_engines_own_plan(tiny, store) -> None:
    """bench.memory_plan equals the plan of an engine built with gpu_memory_utilization and the
    same inputs, and a run of such an engine reports that engine's plan (the one it admits by)."""
    options = dict(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=208, device_memory_bytes=2**24,
                   host_memory_bytes=2**22)
    planned = bench.memory_plan(tiny, load_config(quest(store)), "cpu", gpu_memory_utilization=0.7, **options)
    llm = LLM.from_model(tiny, quest(store), gpu_memory_utilization=0.7, **options)
    assert planned is not None and llm.engine.memory_plan == planned
    default = bench.memory_plan(tiny, load_config(quest(store)), "cpu", **options)  # 0.9 when none is given
    assert default == plan_for(tiny.parameters(), TINY, TINY.kv_layout(torch.float32), load_config(quest(store)),
                               device=torch.device("cpu"), gpu_memory_utilization=0.9, **options)
    r = bench.run_benchmark(llm, bench.BenchSpec(num_prompts=2, input_len=50, output_len=2, concurrency=3), default)
    assert r["memory_plan"] == planned.as_dict() and r["memory_bound_max"] == planned.max_requests
    options.pop("device_memory_bytes")
    assert bench.memory_plan(tiny, load_config(quest(store)), "cpu", **options) is None  # the CPU has no memory


def test_bench_cli_draws_lengths_and_fits_100_columns(monkeypatch, tmp_path) -> None:
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=100, force_terminal=False))
    path = tmp_path / "b.json"
    argv = ["bench", "--random", "tiny", "--no-progress", "--num-prompts", "4", "--input-len", "120", "--output-len", "5",
            "--input-len-dist", "uniform", "--range-ratio", "0.25", "--request-rate", "500", "--seed", "2",
            "--device-memory-gib", "0.01", "--host-memory-gib", "1", "--config", json.dumps(quest("hierarchical")),
            "--json", str(path)]
    assert cli.main(argv) == 0
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 100, text
    r = json.loads(path.read_text())
    spec = bench.BenchSpec(num_prompts=4, input_len=120, output_len=5, input_len_dist="uniform",
                           output_len_dist="uniform", range_ratio=0.25, request_rate=500, seed=2)
    work = bench.draw_workload(spec, TINY.vocab_size)
    assert r["input_lens"] == work.input_lens and r["output_lens"] == work.output_lens
    assert r["memory_plan"]["device_total_bytes"] == int(0.01 * 2**30) and r["memory_bound_max"] >= 1
    assert r["memory_plan"]["host_budget_bytes"] == 2**30 and r["memory_plan"]["gpu_memory_utilization"] == 0.9
    assert "hit" in text and "prefill TF/s" in text and r["max_model_len"] == work.max_model_len


def test_bench_bound_equals_plan_engine(monkeypatch, tmp_path) -> None:
    """`bench`'s memory-bound maximum is what `sparse-framework plan --engine` prints for the
    same model shape, config, max_model_len, step, rows and memory (the whole plan, not only
    its maximum)."""
    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=100, force_terminal=False))
    config = json.dumps(quest("hierarchical"))
    device, host = repr(3 * 2**20 / 2**30), repr(2**20 / 2**30)  # requests of 132 tokens fit; the host bounds
    path, planned = tmp_path / "b.json", tmp_path / "p.json"
    assert cli.main(["bench", "--random", "tiny", "--no-progress", "--num-prompts", "2", "--input-len", "128",
                     "--output-len", "4", "--concurrency", "2", "--max-num-batched-tokens", "64", "--config", config,
                     "--device-memory-gib", device, "--host-memory-gib", host, "--json", str(path)]) == 0
    assert cli.main(["plan", "--engine", "--model", "tiny", "--dtype", "float32", "--context", "132",
                     "--max-num-batched-tokens", "64", "--max-num-seqs", "2", "--config", config,
                     "--gpu-memory-gib", device, "--host-memory-gib", host, "--json", str(planned)]) == 0
    r, (p,) = json.loads(path.read_text()), json.loads(planned.read_text())
    assert r["max_model_len"] == 132 and r["memory_bound_max"] == p["max_requests"] >= 1
    assert r["memory_bound"] == p["limited_by"]
    assert r["memory_plan"] == {k: v for k, v in p.items() if k not in ("model", "config", "tensor_parallel_size")}


# -- DeepSeek-V3.2 (MLA + indexer + MoE) -------------------------------------------------------
DSV32 = ModelConfig.from_hf(RANDOM_MODELS["deepseek-v3.2-tiny"])


@pytest.fixture(scope="module")
def dsv32() -> torch.nn.Module:
    return random_model(DSV32, "float32", "cpu")


# deepseek-v3.2-tiny by hand: hidden 64, vocab 256, 4 heads, q LoRA 48, latent 32 + RoPE 8, nope 16,
# v 16, indexer 4 heads x 32, top-16, layer 0 a dense MLP of 96, layer 1 an MoE of 4 experts of 32
# (top-2) and one shared expert of 32
ATTN = 64 * 48 + 48 + 48 * 4 * (16 + 8) + 64 * 40 + 32 + 32 * 4 * (16 + 16) + 4 * 16 * 64  # + the q/kv norms
INDEXER = 48 * 4 * 32 + 64 * 32 + 2 * 32 + 64 * 4  # wq_b, wk, k_norm (weight, bias), weights_proj
EXPERT = 3 * 64 * 32
ROUTER = 4 * 64 + 4  # weight and correction bias


def test_the_mini_preset_has_deepseek_v32s_attention_shape_and_fits_an_h100() -> None:
    c = ModelConfig.from_hf(RANDOM_MODELS["deepseek-v3.2-mini"])
    m = c.mla
    assert (c.num_heads, c.hidden_size, c.vocab_size) == (128, 7168, 129280)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim) == (1536, 512, 64, 128, 128)
    assert (m.index_n_heads, m.index_head_dim, m.index_topk, m.latent_dim) == (64, 128, 2048, 576)
    assert m.mlp_layer_types[0] == "dense" and set(m.mlp_layer_types[1:]) == {"sparse"}
    assert m.n_routed_experts < 256 and m.yarn is not None  # the MoE is shrunk (random weights only)
    assert c.num_parameters() * 2 < 16 * 2**30  # bf16 weights leave an 80 GB H100 most of its memory
    assert c.kv_layout(torch.float8_e4m3fn).row_bytes == 656 and c.kv_layout(torch.bfloat16).row_bytes == 1152


def test_mla_prefill_flops_equal_a_hand_computation() -> None:
    """Per token: every parameter but the embedding, the head and the 2 experts of 4 a token
    is not routed to; attention: each query over min(16, p + 1) keys, QK^T over 16 + 8 and PV
    over 16 dims for 4 heads, and the indexer's 4 x (32 + 1) per causal pair."""
    per_token = 2 * (ATTN + INDEXER + 2 * 64) + 3 * 64 * 96 + (2 * EXPERT + EXPERT + ROUTER) + 64
    assert per_token == 91_492
    kept = {10: 55, 40: 16 * 17 // 2 + 24 * 16}  # (query, key) pairs the top-16 keeps
    causal = {10: 55, 40: 820}
    expected = sum(2 * per_token * n + 2 * 256 * 64 + 2 * 2 * (4 * 40 * kept[n] + 4 * 33 * causal[n]) for n in (10, 40))
    assert floors.prefill_flops(DSV32, [10, 40]) == expected == 10_044_736


def test_mla_decode_floor_equals_a_hand_computation(dsv32) -> None:
    """Weights: all but the embedding table (2 rows of it) and the routed experts not hit;
    per layer and row: the top-16 latent rows (40 float32 values) and every context token's
    indexer key (32 bfloat16 values)."""
    from sparse_framework.cli.engine import random_model_config

    config = random_model_config("deepseek-v3.2-tiny", "cpu")
    llm = LLM.from_model(dsv32, config, max_num_seqs=2, max_model_len=128)
    assert dsv32.config.num_parameters() == 2 * 256 * 64 + 2 * (ATTN + INDEXER + 2 * 64) + 3 * 64 * 96 + 5 * EXPERT + ROUTER + 64
    everything = 4 * dsv32.config.num_parameters()  # float32
    weights = everything - 4 * 256 * 64 + 4 * 2 * 64
    rows = [(100, 99), (10, 9)]
    kv = 2 * ((16 * 40 * 4 + 100 * 32 * 2) + (10 * 40 * 4 + 10 * 32 * 2))  # 2 layers; the short row: all 10
    assert floors.decode_floor_bytes(llm, rows) == weights + kv  # 2 rows x top-2: all 4 experts may be hit
    assert floors.decode_floor_bytes(llm, rows, [3]) == weights - 4 * EXPERT + kv  # measured: 3 of 4 hit
    assert floors.decode_floor_bytes(llm, rows[:1]) == weights - 4 * 2 * EXPERT - 4 * 64 + kv - 2 * (10 * 40 * 4 + 10 * 32 * 2)


def test_bench_runs_hierarchical_dsa_on_deepseek_v32_end_to_end(monkeypatch, tmp_path) -> None:
    """`bench --random deepseek-v3.2-tiny` with the preset's own config (DSA over the model's
    indexer, the hierarchical store): the run's figures are there and sane."""
    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=100, force_terminal=False))
    path = tmp_path / "b.json"
    assert cli.main(["bench", "--random", "deepseek-v3.2-tiny", "--no-progress", "--num-prompts", "3", "--input-len", "90",
                     "--output-len", "6", "--concurrency", "2", "--device-memory-gib", "0.05", "--host-memory-gib", "0.001",
                     "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["config"]["algorithm"] == "dsa" and r["config"]["store"] == "hierarchical"
    assert r["config"]["top_k"] == DSV32.mla.index_topk and r["config"]["extra"]["score_newest"] is True
    assert r["requests"] == 3 and r["output_tokens"] == 18
    assert 1 <= r["admitted_concurrency"] <= r["concurrency"] == 2 and r["memory_bound_max"] >= 1
    assert r["memory_bound"] == "host" and r["memory_plan"]["host_bytes_per_request"] == 96 * 2 * 40 * 4
    assert r["decode_step_rows"] == 2 and 0 < r["decode_step_floor_ms"] < r["decode_step_ms"]
    assert r["decode_step_weight_bytes"] < r["decode_step_floor_bytes"] and r["kv_row_bytes"] == 40 * 4
    assert 0 <= r["hit_rate"] <= 1 and r["buffer_misses"] > 0 and r["h2d_bytes"] > 0  # prompts > the 64-row buffer
    assert r["prefill_flops"] == floors.prefill_flops(DSV32, [90] * 3) and r["prefill_tflops"] > 0
    assert r["prefill_attention"] == "mla-masked-sdpa"  # the CPU's MLA prefill, not the other layers' choice


def test_progress_counts_tokens_so_it_moves_during_a_long_prefill(tiny) -> None:
    """`on_step(done, total)` counts prompt tokens prefilled + tokens decoded: the first prefill
    chunk already moves it (a count of finished requests stood at 0 through the whole prefill),
    it never goes back, and it ends at the total."""
    spec = bench.BenchSpec(num_prompts=2, input_len=200, output_len=4)
    llm = LLM.from_model(tiny, quest("resident"), max_num_seqs=2, max_num_batched_tokens=32, max_model_len=204)
    calls: list[tuple[int, int]] = []
    r = bench.run_benchmark(llm, spec, on_step=lambda done, total: calls.append((done, total)))
    total = 2 * 200 + 2 * (4 - 1)  # the last prefill chunk samples the first output token
    assert {t for _, t in calls} == {total}
    done = [d for d, _ in calls]
    assert done[0] == 32 and done == sorted(done) and done[-1] == total
    assert len(calls) == r["steps"] and sum(d < 400 for d in done) >= 12  # 13 prefill steps of 32 tokens


def test_bench_on_the_cpu_prints_no_hbm_floor_and_no_h100_peak(monkeypatch) -> None:
    """On the CPU the decode floor and the % of the matmul peak are "n/a" (they are an H100's
    HBM and tensor-core figures), and the captions say why; on CUDA they are figures."""
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=100, force_terminal=False))
    assert cli.main(["bench", "--random", "tiny", "--no-progress", "--num-prompts", "2", "--input-len", "40",
                     "--output-len", "3"]) == 0
    text = out.getvalue()
    rows = [line.split() for line in text.splitlines() if line.lstrip().startswith("40 ")]
    assert len(rows) == 2 and rows[0][9] == "n/a" and rows[1][3] == "n/a", text  # floor; % peak
    flat = " ".join(text.split())
    assert "floor: n/a on the CPU (the floors are for a GPU's HBM" in flat and "% peak: n/a on the CPU" in flat
    assert "0.0 " not in " ".join(rows[0][8:10]) + " "
    gpu = {"input_len": 40, "admitted_concurrency": 2, "concurrency": 2, "memory_bound_max": None, "memory_bound": "-",
           "output_tokens_per_s": 1.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0, "tpot_p50_ms": 1.0, "tpot_p99_ms": 1.0,
           "decode_step_ms": 2.0, "decode_step_floor_ms": 1.5, "preemptions": 0, "prefill_tflops": 79.0,
           "peak_tflops": 790.0, "hit_rate": None, "h2d_bytes": None, "h2d_gb_per_s": None, "peak_gpu_bytes": 2**30,
           "device_pool_bytes": 2**30, "host_pool_bytes": 0, "device": "cuda:0"}
    con = Console(width=100, record=True, color_system=None)
    for table in bench.bench_tables([gpu], "gpu"):
        con.print(table)
    shown = con.export_text()
    assert "n/a" not in shown and " 1.5 " in shown and " 10.0 " in shown
