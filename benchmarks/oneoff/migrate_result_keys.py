"""One-off (issue 43): key the committed eval results by every resolved option.

Stored cells were keyed by the config as dumped then, which left out options at their
defaults. Step 16 changed defaults (Quest's range_weight 1 -> 0, store hierarchical ->
resident, sparse_policy always -> cost, backend torch_ref -> auto), so such a key would now
read as another config. This rewrites each record's `config` with every option spelt out as it
was when the record was made (`SparseConfig.key()`), states the old defaults in the experiment
files that made the records (Quest entries: range_weight 1.0; base store: hierarchical), and
recomputes each record's id from its experiment's cell, so that re-running a committed
experiment finds its records. Idempotent; run from the repository root:

    python benchmarks/oneoff/migrate_result_keys.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparse_framework.config import load_config  # noqa: E402
from sparse_framework.eval.experiment import expand, load_experiment  # noqa: E402

# the defaults before step 16, for the options a record's dump left out
OLD_DEFAULTS: dict[str, Any] = {"backend": "torch_ref", "store": "hierarchical", "sparse_policy": "always"}
OLD_EXTRA: dict[str, dict[str, Any]] = {"quest": {"range_weight": 1.0}}
PAIRS = ("accuracy_cpu", "accuracy_gpu", "fp8_host_cpu", "ruler_cpu", "ruler_gpu", "snapkv_rules_cpu")


def explicit(old: dict[str, Any]) -> dict[str, Any]:
    """A stored config dump with the old defaults filled in, as `SparseConfig.key()`."""
    data = {**OLD_DEFAULTS, **old}
    data["extra"] = {**OLD_EXTRA.get(data["algorithm"], {}), **data.get("extra", {})}
    return load_config(data).key()


def migrate_experiment(path: Path) -> None:
    exp = json.loads(path.read_text())
    exp.setdefault("base", {}).setdefault("store", OLD_DEFAULTS["store"])
    entries = []
    for entry in exp["algorithms"]:
        entry = {"algorithm": entry} if isinstance(entry, str) else entry
        for key, value in OLD_EXTRA.get(entry["algorithm"], {}).items():
            entry.setdefault("extra", {}).setdefault(key, value)
        entries.append(entry)
    exp["algorithms"] = entries
    path.write_text(json.dumps(exp, indent=1) + "\n")


def main() -> None:
    for name in PAIRS:
        exp_path, res_path = ROOT / "experiments" / f"{name}.json", ROOT / "benchmarks" / "results" / f"{name}.jsonl"
        migrate_experiment(exp_path)
        exp = load_experiment(exp_path)
        cells = {(c.workload.label, c.context, c.algorithm, c.backend, c.budget): c for c in expand(exp)}
        out, matched = [], 0
        for line in res_path.read_text().splitlines():
            rec = json.loads(line)
            if rec["config"] is not None:
                rec["config"] = explicit(rec["config"])
            cell = cells.get((rec["workload"], rec["context"], rec["algorithm"], rec["backend"], rec["budget"]))
            # a record made by an older version whose cell had another config (SnapKV's buffer once
            # was narrower) keeps its id: today's experiment has no such cell, and re-runs its own
            if rec["experiment"] == exp.name and cell is not None and (
                    cell.config is None or cell.config.key() == rec["config"]):
                rec["id"] = cell.id
                matched += 1
            out.append(json.dumps(rec, sort_keys=True))
        res_path.write_text("\n".join(out) + "\n")
        print(f"{name}: {matched} of {len(out)} records matched to their experiment's cells")


if __name__ == "__main__":
    main()
