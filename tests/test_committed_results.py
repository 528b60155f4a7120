"""The committed eval results are keyed by every resolved option (issue 43): a default changed
later (Quest's range_weight, the store, the policy, the backend) never changes what a stored
cell means, and each committed experiment file still names the cells its records hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparse_framework.config import load_config
from sparse_framework.eval.experiment import expand, load_experiment

ROOT = Path(__file__).resolve().parents[1]
PAIRS = sorted(p.stem for p in (ROOT / "benchmarks" / "results").glob("*.jsonl"))


@pytest.mark.parametrize("name", PAIRS)
def test_every_stored_config_spells_out_every_option(name: str) -> None:
    for line in (ROOT / "benchmarks" / "results" / f"{name}.jsonl").read_text().splitlines():
        config = json.loads(line)["config"]
        if config is None:
            continue
        assert config["backend"] != "auto", "a stored cell names the backend it ran"
        assert load_config(config).key() == config, f"{name}: a stored config leaves options to the defaults"


@pytest.mark.parametrize("name", PAIRS)
def test_the_committed_experiment_names_its_records(name: str) -> None:
    exp = load_experiment(ROOT / "experiments" / f"{name}.json")
    cells = {c.id: c for c in expand(exp)}
    records = [json.loads(line) for line in (ROOT / "benchmarks" / "results" / f"{name}.jsonl").read_text().splitlines()]
    ours = [r for r in records if r["id"] in cells]
    assert len(ours) >= 0.7 * len(records), f"{name}: {len(ours)} of {len(records)} records are cells of the experiment"
    for rec in ours:
        cell = cells[rec["id"]]
        assert (rec["algorithm"], rec["budget"], rec["context"]) == (cell.algorithm, cell.budget, cell.context)
        assert rec["config"] == (None if cell.config is None else cell.config.key())


def test_a_stored_quest_cell_keeps_the_bound_it_ran_with() -> None:
    """Quest's records from before the default moved to the midpoint (range_weight 0) say 1.0."""
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "results" / "ruler_gpu.jsonl").read_text().splitlines()]
    weights = {r["algorithm"]: r["config"]["extra"]["range_weight"] for r in rows
               if r["config"] and r["config"]["algorithm"] == "quest" and r["experiment"] == "ruler-gpu"}
    assert weights["quest"] == 1.0 and weights["quest-rw0.0"] == 0.0
