"""benchmarks/side_by_side.py's merge and table (the runs themselves need CUDA and vLLM): ratios to
vLLM dense and to the floor come from the rows, failed paths stay visible, bad flags are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def sbs():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # its `from timing import ...`
        yield load_benchmark("side_by_side")


def row(path: str, step: float, floor: float, prefill: float, ctx: int = 16384) -> dict:
    return {"path": path, "context": ctx, "batch": 8, "step_ms": step, "floor_ms": floor, "prefill_s": prefill}


def test_merge_prints_ratios_to_vllm_dense_and_the_floor(sbs, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    vllm = tmp_path / "v.json"
    engine = tmp_path / "e.json"
    vllm.write_text(json.dumps({"device": "H200", "rows": [row("vllm-dense", 9.0, 7.5, 4.0)]}))
    engine.write_text(json.dumps({"device": "H200", "rows": [
        row("engine-dense", 12.0, 7.5, 5.0), row("engine-resident", 6.0, 4.0, 4.0),
        {"path": "engine-hierarchical", "context": 16384, "batch": 8, "error": "CUDA out of memory"},
        row("engine-dense", 20.0, 12.5, 10.0, ctx=32768)]}))
    out = tmp_path / "m.json"
    assert sbs.main(["--merge", str(vllm), str(engine), "--out", str(out)]) == 1  # a failed row: exit 1
    lines = {line.split()[0] + " " + line.split()[1]: line for line in capsys.readouterr().out.splitlines()
             if line.startswith(("vllm-", "engine-"))}
    assert lines["engine-dense 16Kx8"].split()[2:] == ["12.00", "7.50", "1.60", "0.75x", "5.00", "0.80x"]
    assert lines["engine-resident 16Kx8"].split()[2:] == ["6.00", "4.00", "1.50", "1.50x", "4.00", "1.00x"]
    assert "CUDA out of memory" in lines["engine-hierarchical 16Kx8"]
    assert lines["engine-dense 32Kx8"].split()[-3:] == ["-", "10.00", "-"]  # no vLLM row at 32K: no ratio
    merged = json.loads(out.read_text())
    assert len(merged["rows"]) == 5 and merged["command"].startswith("python benchmarks/side_by_side.py --merge")


@pytest.mark.parametrize("argv, message", [
    ([], "give one of --group or --paths"),
    (["--paths", "engine-dense,sglang"], "unknown path 'sglang'"),
    (["--group", "engine", "--contexts", "16K"], "comma-separated integers"),
])
def test_bad_flags_name_the_flag(sbs, argv, message, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        sbs.parse_args(argv)
    assert message in capsys.readouterr().err
