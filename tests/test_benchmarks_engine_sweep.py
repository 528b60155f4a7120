"""benchmarks/engine_sweep.py and plot_engine_sweep.py on the CPU (tiny random model): every
cell lands in the JSON, --resume skips them, a failing cell is recorded and the sweep goes
on, and the plots and page are made from the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import load_benchmark as _load


sweep = _load("engine_sweep")
plotter = _load("plot_engine_sweep")
SMALL = ["--random", "tiny", "--device", "cpu", "--output-len", "4", "--top-k", "32", "--device-buffer-tokens", "160",
         "--min-sparse-prompt-len", "64", "--quest-dense-first-layers", "0", "--no-warmup"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "results.json"
    argv = [*SMALL, "--lengths", "96,160", "--configs", "dense,quest-hier", "--concurrency", "1,2", "--out", str(out),
            "--device-memory-gib", "0.01", "--host-memory-gib", "1"]
    assert sweep.main(argv) == 0
    return out


@pytest.mark.slow
def test_every_cell_is_a_row_and_resume_skips_them(swept, capsys) -> None:
    rows = json.loads(swept.read_text())
    assert sorted(r["cell"] for r in rows) == sorted(
        f"{n}/{c}/{k}" for n in (96, 160) for c in ("dense", "quest-hier") for k in ("1", "2"))
    for r in rows:
        assert "error" not in r, r
        assert r["input_lens"] == [r["length"]] * r["concurrency"] and r["output_lens"] == [4] * r["concurrency"]
        assert r["admitted_concurrency"] == r["concurrency"] and r["memory_bound_max"] >= 1
        assert r["memory_bound_max"] == r["memory_plan"]["max_requests"] and r["memory_plan"]["num_seqs"] <= r["concurrency"]
        assert r["memory_plan"]["device_total_bytes"] == int(0.01 * 2**30) and r["memory_plan"]["host_budget_bytes"] == 2**30
        assert (r["hit_rate"] is None) == (r["config_name"] == "dense")
    assert {r["config"]["store"] for r in rows if r["config_name"] == "dense"} == {"resident"}
    before = swept.read_text()
    capsys.readouterr()
    assert sweep.main([*SMALL, "--lengths", "96,160", "--configs", "dense,quest-hier", "--concurrency", "1,2",
                       "--out", str(swept), "--resume"]) == 0
    assert "8 already in" in capsys.readouterr().out and swept.read_text() == before


@pytest.mark.slow
def test_failing_cells_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch) -> None:
    out = tmp_path / "r.json"
    calls = {"n": 0}
    real = sweep.bench.run_benchmark

    def fail_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("pretend out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep.bench, "run_benchmark", fail_once)
    argv = [*SMALL, "--lengths", "96", "--configs", "dense", "--concurrency", "1,max", "--host-memory-gib", "1",
            "--device-memory-gib", "0.0000001", "--out", str(out)]
    assert sweep.main(argv) == 0
    rows = {r["cell"]: r for r in json.loads(out.read_text())}
    assert rows["96/dense/1"]["error"] == "MemoryError: pretend out of memory"
    assert rows["96/dense/max"]["error"].startswith("CapacityError: no request of max_model_len=100 fits")
    # with room for 3 rows in the engine's plan, 'max' runs 3 requests, all admitted together
    gib = total_for_rows(3.5, sweep.parse_args(argv)) / 2**30
    argv[argv.index("0.0000001")] = repr(gib)
    out.unlink()
    assert sweep.main(argv) == 0
    row = {r["cell"]: r for r in json.loads(out.read_text())}["96/dense/max"]
    assert "error" not in row and row["concurrency"] == row["memory_bound_max"] == row["admitted_concurrency"] == 3
    assert row["memory_plan"]["limited_by"] == "device" and row["requests"] == 3 and row["preemptions"] == 0


def total_for_rows(rows: float, args) -> int:  # type: ignore[no-untyped-def]
    """Device bytes whose fraction leaves room for `rows` request rows of a 'max' cell of the
    dense config at 96 + 4 tokens (from the plan's own terms)."""
    from sparse_framework.config import load_config
    from sparse_framework.engine.memory import plan_for
    from sparse_framework.engine.models import ModelConfig, random_model

    model = random_model(ModelConfig.from_hf(sweep.RANDOM_MODELS["tiny"]), "float32", "cpu")
    config = load_config(sweep.sweep_configs("torch_ref", 32, 160, 64, 0)["dense"])
    probe = plan_for(model.parameters(), model.config, model.config.kv_layout(sweep.torch.float32), config,
                     device=sweep.torch.device("cpu"), max_model_len=100, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                     device_memory_bytes=2**30, host_memory_bytes=2**30)
    fixed = probe.weight_bytes + probe.activation_bytes + probe.staging_bytes
    return int((fixed + rows * probe.device_bytes_per_request) / args.gpu_memory_utilization) + 1


def test_max_on_the_cpu_needs_device_memory(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert sweep.main([*SMALL, "--lengths", "96", "--configs", "dense", "--concurrency", "max", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert "--device-memory-gib" in row["error"] and "concurrency" not in row


def test_time_limit_stops_starting_cells(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert sweep.main([*SMALL, "--lengths", "96", "--configs", "dense", "--concurrency", "1,2", "--time-limit-s", "0",
                       "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 1  # the first cell starts; after it the limit has passed


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(sweep.ConfigError, match="--configs: unknown 'quest'"):
        sweep.parse_args(["--configs", "quest"])
    with pytest.raises(sweep.ConfigError, match="'zero' is neither a positive integer nor 'max'"):
        sweep.parse_args(["--concurrency", "zero"])
    with pytest.raises(sweep.ConfigError, match="--device-memory-gib must be > 0"):
        sweep.parse_args(["--device-memory-gib", "0"])


@pytest.mark.slow
def test_plots_and_page_from_the_json(swept, tmp_path) -> None:
    rows = json.loads(swept.read_text())
    rows.append({"cell": "96/dsa-resident/max", "length": 96, "config_name": "dsa-resident",
                 "concurrency_label": "max", "error": "CapacityError: no request fits"})
    source = tmp_path / "with_error.json"
    source.write_text(json.dumps(rows))
    page = tmp_path / "docs" / "sweep.md"
    page.parent.mkdir()
    assert plotter.main([str(source), "--out-dir", str(tmp_path / "docs" / "png"), "--markdown", str(page)]) == 0
    for name in ("throughput.png", "decode_throughput.png", "tpot.png", "memory.png"):
        data = (tmp_path / "docs" / "png" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"](png/{name})" in page.read_text()
    text = page.read_text()
    table = [line for line in text.splitlines() if line.startswith("| 96 ") or line.startswith("| 160 ")]
    assert len(table) == 8 and all(line.count("|") == 16 for line in table)
    assert "- 96/dsa-resident/max: CapacityError: no request fits" in text
