"""benchmarks/prefix_cache_bench.py on the CPU (the tiny random model, tiny sizes): every
workload x config x cache cell lands in the JSON with its figures; the cache saves prefill
tokens where the prompts share pages and the steps compute exactly the prompt tokens it did
not serve; outputs with the cache on equal those with it off; --resume skips finished cells;
bad flags are clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import load_benchmark as _load


bench = _load("prefix_cache_bench")
PAGE = 16  # the configs' default page size
SIZES = ["--random", "tiny", "--device", "cpu", "--system-len", "192", "--question-len", "40", "--num-requests", "4",
         "--turns", "3", "--turn-len", "70", "--output-len", "4", "--top-k", "32", "--device-buffer-tokens", "160",
         "--min-sparse-prompt-len", "64", "--quest-dense-first-layers", "0", "--no-warmup"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prefix") / "r.json"
    assert bench.main([*SIZES, "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_every_cell_is_a_row_with_its_figures(results) -> None:
    data = json.loads(results.read_text())
    rows = {r["cell"]: r for r in data["results"]}
    assert sorted(rows) == sorted(f"{w}/{c}/cache-{s}" for w in ("shared-prefix", "chat")
                                  for c in ("dense", "quest-hier") for s in ("on", "off"))
    assert data["meta"]["sizes"]["system_len"] == 192 and "prefix_cache_bench.py" in data["meta"]["command"]
    for r in rows.values():
        assert "error" not in r, r
        expected = 4 if r["workload"] == "shared-prefix" else 3
        assert r["requests"] == expected and len(r["ttft_ms"]) == expected
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["output_tokens"] == 4 * expected
        assert r["output_tokens_per_s"] > 0 and r["elapsed_s"] > 0
        # every prompt token is either computed by a prefill step or served from the cache
        assert r["prefill_tokens_computed"] + r["prefill_tokens_saved"] == r["prompt_tokens"]
        # the step log's time: prefill and decode steps within the run, decode steps counted
        assert 0 < r["prefill_steps_s"] and 0 < r["decode_steps_s"]
        assert r["prefill_steps_s"] + r["decode_steps_s"] <= r["elapsed_s"] and r["decode_steps"] < r["steps"]
        assert 0 < r["decode_step_ms_p50"] <= 1e3 * r["decode_steps_s"]
    assert {r["config"]["store"] for r in rows.values() if r["config_name"] == "dense"} == {"resident"}
    assert {r["config"]["store"] for r in rows.values() if r["config_name"] == "quest-hier"} == {"hierarchical"}


@pytest.mark.slow
def test_the_cache_saves_prefill_and_changes_no_output(results) -> None:
    rows = {r["cell"]: r for r in json.loads(results.read_text())["results"]}
    for workload in ("shared-prefix", "chat"):
        for config in ("dense", "quest-hier"):
            off, on = rows[f"{workload}/{config}/cache-off"], rows[f"{workload}/{config}/cache-on"]
            assert off["prefill_tokens_saved"] == 0 and off["hit_rate"] is None and off["cache_stats"] is None
            assert on["prefill_tokens_saved"] > 0 and on["prompt_tokens"] == off["prompt_tokens"]
            assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
            assert on["hit_rate"] == pytest.approx(on["prefill_tokens_saved"] / on["prompt_tokens"])
            assert on["outputs_equal_cache_off"] is True and on["outputs_differing"] == 0
    # after-first: the three later requests each find the whole system prompt (192 = 12 pages)
    assert rows["shared-prefix/quest-hier/cache-on"]["prefill_tokens_saved"] == 3 * 192
    assert rows["shared-prefix/dense/cache-on"]["prefill_tokens_saved"] == 3 * 192


@pytest.mark.slow
def test_chat_prompts_extend_the_last_turn(results) -> None:
    rows = {r["cell"]: r for r in json.loads(results.read_text())["results"]}
    # turn t's prompt: 70 + t * (4 + 70) tokens
    assert rows["chat/dense/cache-off"]["prompt_tokens"] == sum(70 + t * 74 for t in range(3))
    # what turn t can reuse: the K/V written by turn t-1 (its prompt and all outputs but the
    # last), in whole pages
    cached = sum((70 + (t - 1) * 74 + 3) // PAGE * PAGE for t in (1, 2))
    assert rows["chat/quest-hier/cache-on"]["prefill_tokens_saved"] == cached


@pytest.mark.slow
def test_resume_skips_finished_cells(results, capsys) -> None:
    before = results.read_text()
    assert bench.main([*SIZES, "--resume", "--out", str(results)]) == 0
    assert json.loads(results.read_text())["results"] == json.loads(before)["results"]
    out = capsys.readouterr().out
    assert "cache-on:" not in out and "prefix cache: on vs off" in out


@pytest.mark.parametrize("arrival", [pytest.param("burst", marks=pytest.mark.slow), "sequential"])
def test_other_arrivals(tmp_path, arrival) -> None:
    out = tmp_path / "r.json"
    assert bench.main([*SIZES, "--workloads", "shared-prefix", "--configs", "quest-hier", "--arrival", arrival,
                       "--out", str(out)]) == 0
    on = {r["cell"]: r for r in json.loads(out.read_text())["results"]}["shared-prefix/quest-hier/cache-on"]
    assert on["outputs_equal_cache_off"] is True
    if arrival == "sequential":  # every later request finds the system prompt and nothing more
        assert on["prefill_tokens_saved"] == 3 * 192
    else:  # all at once: whatever the engine found (the first prompt may not be in yet), never more
        assert 0 <= on["prefill_tokens_saved"] <= 3 * 192


@pytest.mark.slow
def test_schedule_control_reruns_the_cache_off_with_half_the_tokens_per_step(tmp_path) -> None:
    out = tmp_path / "r.json"
    args = [*SIZES, "--workloads", "shared-prefix", "--configs", "dense", "--max-num-batched-tokens", "64",
            "--schedule-control", "--out", str(out)]
    assert bench.main(args) == 0
    rows = {r["cell"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == ["shared-prefix/dense/cache-off", "shared-prefix/dense/cache-off-half-step",
                            "shared-prefix/dense/cache-on"]
    control, off = rows["shared-prefix/dense/cache-off-half-step"], rows["shared-prefix/dense/cache-off"]
    assert control["schedule_control"] and control["max_num_batched_tokens"] == 32 == off["max_num_batched_tokens"] // 2
    assert control["steps"] > off["steps"] and control["prefill_tokens_saved"] == 0
    # float32 on the CPU: a changed schedule changes no output, and the control says so
    assert control["outputs_equal_cache_off"] is True and control["outputs_differing"] == 0
    # the control belongs to the pair: --resume without it runs nothing; with it, nothing either
    assert bench.main([*args, "--resume"]) == 0
    assert {r["cell"]: r for r in json.loads(out.read_text())["results"]} == rows


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(bench.ConfigError, match="--configs: unknown 'quest'"):
        bench.parse_args(["--configs", "quest"])
    with pytest.raises(bench.ConfigError, match="--workloads: unknown 'rag'"):
        bench.parse_args(["--workloads", "rag"])
    with pytest.raises(bench.ConfigError, match="--turn-len must be >= 1"):
        bench.parse_args(["--turn-len", "0"])


def test_time_limit_stops_starting_pairs(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert bench.main([*SIZES, "--workloads", "chat", "--time-limit-s", "0", "--out", str(out)]) == 0
    assert [r["cell"] for r in json.loads(out.read_text())["results"]] == ["chat/dense/cache-off", "chat/dense/cache-on"]


def test_compare_outputs_names_the_first_difference() -> None:
    assert bench.compare_outputs([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == {
        "outputs_equal_cache_off": True, "outputs_differing": 0, "first_differences": []}
    assert bench.compare_outputs([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == {
        "outputs_equal_cache_off": False, "outputs_differing": 1, "first_differences": [(1, 1)]}
    assert bench.compare_outputs([[1, 2]], [[1]])["first_differences"] == [(0, 1)]
