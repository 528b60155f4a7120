"""benchmarks/accuracy.py: the sweep that generates docs/accuracy.md."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy.py"
LABELS = ["quest", "snapkv", "pqcache"]


def _load_module():
    spec = importlib.util.spec_from_file_location("benchmarks_accuracy", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


accuracy = _load_module()


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """contexts 2048 (sparse: min_sparse_prompt_len is 2048) x fractions 1/16, 1/4 x 3 algorithms."""
    tmp = tmp_path_factory.mktemp("accuracy")
    json_path, md_path = tmp / "acc.json", tmp / "acc.md"
    argv = ["--contexts", "2048", "--fractions", "1/16,1/4", "--algorithms", ",".join(LABELS), "--steps", "2",
            "--json", str(json_path), "--markdown", str(md_path), "--no-progress"]
    assert accuracy.main(argv) == 0
    command = (f"python benchmarks/accuracy.py --contexts 2048 --fractions 1/16,1/4 "
               f"--algorithms quest,snapkv,pqcache --steps 2 --json {json_path} --markdown {md_path}")
    return json.loads(json_path.read_text()), md_path.read_text(), command


def test_json_has_every_cell_with_sane_metrics(tiny_sweep) -> None:
    data, _, command = tiny_sweep
    cells = data["cells"]
    assert data["complete"] is True
    assert data["command"] == command
    assert data["workload"]["decode_steps"] == 2 and data["workload"]["needle_strength"] == 1.25
    assert len(cells) == 3 * 1 * 2
    assert {(c["label"], c["fraction"]) for c in cells} == {(a, f) for a in LABELS for f in ("1/16", "1/4")}
    for c in cells:
        assert c["context"] == 2048 and c["mode"] == "sparse"
        assert c["top_k"] == {"1/16": 128, "1/4": 512}[c["fraction"]]
        assert c["device_buffer_tokens"] % 16 == 0
        assert c["device_buffer_tokens"] >= c["top_k"] + 16 + 64
        assert 0 < c["recall"] <= 1.0 + 1e-9
        assert c["rel_error"] >= 0
        assert 0 <= c["needle_hit_rate"] <= 1
        assert c["selected_tokens"] >= c["top_k"]
        assert c["selected_tokens"] < 2048 and c["kv_read_fraction"] < 1  # every layer selects


def test_more_budget_is_not_much_worse(tiny_sweep) -> None:
    data, _, _ = tiny_sweep
    recall = {(c["label"], c["fraction"]): c["recall"] for c in data["cells"]}
    for label in LABELS:
        assert recall[label, "1/4"] >= recall[label, "1/16"] - 0.05, label


def test_markdown_has_labels_tables_and_the_reproduce_command(tiny_sweep) -> None:
    _, md, command = tiny_sweep
    assert command in md
    assert md.index(command) < md.index("## Attention recall")  # the command is at the top
    for label in LABELS:
        assert f"| {label} |" in md
    for heading in ("## Attention recall", "## Output relative error", "## Needle hit rate", "## Selected tokens",
                    "## Summary: per-algorithm means"):
        assert heading in md
    assert "| algorithm | 1/16 (128) | 1/4 (512) | mean |" in md


def test_bad_label_exits_nonzero_naming_it(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--algorithms", "quest,not-an-algo", "--json", str(tmp_path / "a.json"),
         "--markdown", str(tmp_path / "a.md"), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "--algorithms" in proc.stderr and "'not-an-algo'" in proc.stderr
    assert "exact-topk" in proc.stderr  # the allowed labels are listed
    assert not (tmp_path / "a.json").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--contexts", "4096,0"], "--contexts"),
        (["--fractions", "0"], "(0, 1]"),
        (["--fractions", "1/4,1.5"], "--fractions"),
        (["--algorithms", ""], "allowed labels"),
    ],
)
def test_bad_options_exit_with_the_option_named(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        accuracy.main(argv)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


def test_reproduce_command_of_the_defaults() -> None:
    args = accuracy.build_parser().parse_args([])
    assert accuracy.reproduce_command(args) == "python benchmarks/accuracy.py"
    assert args.algorithms == ["quest", "snapkv", "pqcache", "dsa-bf16", "dsa-fp8", "exact-topk"]
    assert [str(f) for f in args.fractions] == ["1/64", "1/32", "1/16", "1/8", "1/4"]
    assert args.contexts == [4096, 8192, 16384, 32768]
