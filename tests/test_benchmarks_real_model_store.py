"""benchmarks/real_model_store.py's core on the CPU over a tiny random model (no checkpoint):
the per-step counter deltas add up to the store's totals, hit rates are rates, the
hierarchical store's answers equal the resident store's, and the tables fit 80 columns."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from helpers import load_benchmark as _load


bench = _load("real_model_store")
SMALL = {"sink_tokens": 4, "recent_tokens": 8}  # so that 4 x top_k is more than the least buffer
CONFIGS = {"quest": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", **SMALL, "extra": {"dense_first_layers": 0}},
           "dsa": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", **SMALL, "extra": {"source": "keys"}}}


def _tiny():  # type: ignore[no-untyped-def]
    from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
    from sparse_framework.engine.models import ModelConfig, random_model

    return random_model(ModelConfig.from_hf(RANDOM_MODELS["tiny"]), "float32", "cpu")


def _prompts(lengths: tuple[int, ...]) -> list:
    gen = torch.Generator().manual_seed(0)
    return [bench.Prompt("random", i, torch.randint(1, 500, (n,), generator=gen).tolist(), (), 12)
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return bench.run_grid(_tiny(), None, _prompts((300, 260)), CONFIGS, [32], [1, 4], backend="torch_ref",
                          ignore_eos=True)


@pytest.mark.slow
def test_step_deltas_add_up_to_the_store_totals(rows) -> None:
    hier = [r for r in rows if r["store"] == "hierarchical"]
    assert len(hier) == 4 and {r["name"] for r in hier} == {"quest", "dsa"}
    for r in hier:
        run = r["run"]
        steps = [s for a in run["answers"] for s in a["steps"]]
        assert len(steps) == 2 * 11  # 12 tokens: the first comes from the prefill
        for i in range(3):  # hits, misses, bytes_in
            assert sum(s[i] for s in steps) + run["non_decode"][i] == run["totals"][i]
        assert run["non_decode"][:2] == [0, 0]  # only decode steps select
        assert sum(h + m for h, m in run["layers"]) == run["totals"][0] + run["totals"][1] > 0
        assert r["decode_steps"] == 22 and r["bytes_per_step"] > 0 and r["bytes_first_step"] > r["bytes_later_step"]
        assert r["pcie_floor_ms_per_step"] == pytest.approx(1e3 * r["bytes_per_step"] / 55e9)


@pytest.mark.slow
def test_hit_rates_are_rates(rows) -> None:
    for r in (r for r in rows if r["store"] == "hierarchical"):
        rates = [r["hit_rate"], r["hit_rate_first"], r["hit_rate_later"], *r["layer_hit_rate"].values(),
                 *(x for x in r["hit_rate_by_bucket"].values() if x is not None)]
        assert all(0 <= x <= 1 for x in rates), rates
        assert r["layer_hit_rate"]["min"] <= r["layer_hit_rate"]["median"] <= r["layer_hit_rate"]["max"]
        assert r["hit_rate_first"] < r["hit_rate_later"]  # the first step finds only sink + recent
    by_buffer = {(r["name"], r["multiple"]): r["hit_rate"] for r in rows if r["store"] == "hierarchical"}
    assert by_buffer["quest", 4] > by_buffer["quest", 1] and by_buffer["dsa", 4] > by_buffer["dsa", 1]


@pytest.mark.slow
def test_hierarchical_answers_equal_the_resident_ones(rows) -> None:
    resident = {r["name"]: r for r in rows if r["store"] == "resident" and r["name"] != "dense"}
    for r in (r for r in rows if r["store"] == "hierarchical"):
        assert r["same"] == 2 and r["differs"] == []
        ref = [a["token_ids"] for a in resident[r["name"]]["run"]["answers"]]
        assert [a["token_ids"] for a in r["run"]["answers"]] == ref
        assert r["run"]["totals"] is not None and resident[r["name"]]["run"]["totals"] is None


def test_a_warm_up_request_is_left_out_of_the_totals() -> None:
    llm = bench.LLM.from_model(_tiny(), {**CONFIGS["quest"], "backend": "torch_ref", "top_k": 32, "store": "hierarchical",
                               "device_buffer_tokens": 96, "min_sparse_prompt_len": 100}, max_num_seqs=1,
                               max_model_len=320, async_scheduling=False)
    run = bench.run_engine(llm, _prompts((300,)), ignore_eos=True, warmup=True)
    steps = run["answers"][0]["steps"]
    assert len(steps) == 11 and sum(s[1] for s in steps) == run["totals"][1] > 0
    assert sum(s[0] for s in steps) == run["totals"][0]
    assert sum(s["hits"] + s["misses"] for s in llm.engine.runner.coord.store.stats()) > sum(run["totals"][:2])


def test_buffers_start_at_the_least_the_config_accepts() -> None:
    base = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 512, "backend": "torch_ref"}
    least = bench.min_buffer(base)  # 512 + sink 16 + recent 64 in whole pages of 16, plus misalignment
    assert least % 16 == 0 and least >= 512 + 16 + 64
    with pytest.raises(bench.ConfigError):
        bench.load_config({**base, "store": "hierarchical", "device_buffer_tokens": least - 16})
    assert bench.buffer_tokens(base, 1) == least and bench.buffer_tokens(base, 4) == 2048


@pytest.mark.slow
def test_tables_fit_80_columns(rows) -> None:
    out = io.StringIO()
    console = Console(file=out, width=80)
    for table in bench.tables(rows, 2):
        console.print(table)
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "quest k32" in text and "dense" in text and "HiSparse" in text


def test_arguments() -> None:
    args = bench.parse_args(["--context", "8192", "--device", "cpu"])
    assert args.top_ks == [512, 1024] and args.multiples == [1, 2, 4] and args.backend == "torch_ref"
    with pytest.raises(bench.ConfigError, match="unknown"):
        bench.parse_args(["--configs", "nsa"])
    with pytest.raises(bench.ConfigError, match="fraction"):
        bench.parse_args(["--top-k", "half"])


@pytest.mark.slow
def test_snapkv_gets_a_reference_per_buffer() -> None:
    """SnapKV keeps as many decoded tokens as the buffer leaves room for, resident store or
    not: each buffer is compared with a resident run of the same device_buffer_tokens."""
    snapkv = {"snapkv": {"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", **SMALL}}
    rows = bench.run_grid(_tiny(), None, _prompts((300,)), snapkv, [32], [1, 4], backend="torch_ref", dense=False,
                          ignore_eos=True)
    assert [r["label"] for r in rows] == ["resident", "48 (1x)", "resident 128", "128 (4x)"]
    assert [r["config"]["device_buffer_tokens"] for r in rows] == [48, 48, 128, 128]
    assert all(r["same"] == 1 for r in rows if r["store"] == "hierarchical")
