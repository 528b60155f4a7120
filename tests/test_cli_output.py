"""What the CLI prints is readable in a 100-column terminal: every table rendered at width 100
has no truncated cell ('…'), no line longer than 100 and no empty column; `--help-workload`
prints the defaults `run` uses; `--version`; `plugins` says whether each backend runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import re
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

import sparse_framework
from sparse_framework.cli import main as cli
from sparse_framework.backends.base import AttentionBackend
from sparse_framework.eval.runner import CellRecord
from sparse_framework.eval.sweep import results_table

WIDTH = 100
# min_sparse_prompt_len 100: the 40-token prompt decodes densely, the 300-token one sparsely;
# layer 0 dense (Quest's own first layer)
CFG = json.dumps({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 32, "page_size": 8, "min_sparse_prompt_len": 100,
                  "device_buffer_tokens": 256, "extra": {"dense_first_layers": 1}})


@pytest.fixture
def console(monkeypatch) -> Console:
    """The CLI's console, recording, at the width of a 100-column terminal."""
    rec = Console(width=WIDTH, record=True, force_terminal=False, color_system=None)
    monkeypatch.setattr(cli, "console", rec)
    return rec


def check_readable(text: str) -> None:
    """No truncated cell, no line over WIDTH, and no column whose cells are all blank (a column
    is found as a run of header-rule dashes; blank = only spaces in it on every body line)."""
    assert "…" not in text
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= WIDTH, [l for l in lines if len(l.rstrip()) > WIDTH]
    for i, line in enumerate(lines):
        if not re.fullmatch(r"\s*─[─ ]*─\s*", line):  # a table's header rule
            continue
        header_top = i - 1
        while header_top > 0 and lines[header_top - 1].strip():
            header_top -= 1
        body = []
        for row in lines[i + 1 :]:
            if not row.strip():
                break
            body.append(row)
        columns = _columns(lines[header_top:i])
        for start, stop in columns:
            cells = [row[start:stop] for row in body]
            assert any(c.strip() for c in cells), f"empty column under {lines[header_top:i]!r} at {start}:{stop}"


def _columns(header: list[str]) -> list[tuple[int, int]]:
    """Character spans of the header's words (a column = a span where some header line has text)."""
    width = max(len(h) for h in header)
    used = [any(i < len(h) and h[i] != " " for h in header) for i in range(width)]
    spans, start = [], None
    for i, u in enumerate(used + [False]):
        if u and start is None:
            start = i
        elif not u and start is not None:
            # a heading with a space ("rel err", "KV-only gain") is one column: merge single gaps
            if i + 1 < len(used) and used[i + 1] and all(h[i:i + 1] in (" ", "") for h in header) and _one_word_gap(header, i):
                continue
            spans.append((start, i))
            start = None
    return spans


def _one_word_gap(header: list[str], i: int) -> bool:
    """A single space inside one heading (not the gap between two headings)."""
    return any(0 < i < len(h) - 1 and h[i - 1] != " " and h[i + 1] != " " for h in header)


def test_run_table_fits_100_columns_and_reports_dense_fallbacks(console, tmp_path) -> None:
    out = tmp_path / "r.json"
    assert cli.main(["run", "--config", CFG, "--contexts", "40,300", "--steps", "2", "--no-progress",
                     "--json", str(out)]) == 0
    text = console.export_text()
    check_readable(text)
    assert "quest top_k=32 on torch_ref" in text
    assert "dense: prompt < 100" in text and "sparse, 1/2 layers dense" in text
    # the batch's figures once, below its rows
    assert text.count("ms/step") == 1 and text.count("buffer hit rate") == 1
    # 2 requests x 2 layers x 2 steps; dense: layer 0 for both (4), the short prompt's layer 1 (2)
    assert "dense decode layer-steps: 6 of 8 (dense layer 4, dense request 2)" in text
    results = json.loads(out.read_text())["results"]
    assert [r["dense_reason"] for r in results] == ["short prompt", None]
    assert [r["dense_layer_steps"] for r in results] == [{"dense layer": 2, "dense request": 2}, {"dense layer": 2}]
    assert [r["sparse_fraction"] for r in results] == [0.0, 0.5]


def test_run_table_names_the_cost_policy_as_the_reason(console) -> None:
    # sparse_policy "cost" without a fixed overhead: the 40-token prompt is below the break-even
    # (dense, decided at admission), the 300-token one above it; min_sparse_prompt_len unused
    cfg = {**json.loads(CFG), "min_sparse_prompt_len": 0, "sparse_policy": "cost", "policy_overhead_us": 0.0,
           "policy_overhead_growth_us": 0.0}
    assert cli.main(["run", "--config", json.dumps(cfg), "--contexts", "40,300", "--steps", "2",
                     "--no-progress"]) == 0
    text = console.export_text()
    check_readable(text)
    assert "dense: cost policy" in text and "dense: prompt <" not in text and "sparse, 1/2 layers dense" in text
    assert "the cost policy" in text and "min_sparse_prompt_len" not in text


def test_plan_table_fits_and_labels_every_row(console) -> None:
    assert cli.main(["plan", "--context", "16384,1048576"]) == 0
    text = console.export_text()
    check_readable(text)
    assert text.count("resident ") >= 2 and "buffer 4,096 (config)" in text and "buffer 2,144 (min)" in text


def test_plugins_say_whether_each_backend_runs_here(console, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["plugins"]) == 0
    printed = console.export_text()
    check_readable(printed)
    text = " ".join(printed.split())
    assert "torch_ref built-in runs here" in text
    import torch

    if not torch.cuda.is_available():
        assert "triton built-in cannot run here: needs a CUDA GPU" in text
        assert "flashmla built-in cannot run here:" in text


def test_backend_availability_is_a_cheap_classmethod(monkeypatch) -> None:
    import torch

    from sparse_framework.backends.flash_attn import FlashAttnBackend
    from sparse_framework.backends.torch_ref import TorchRefBackend
    from sparse_framework.backends.triton import TritonBackend

    assert TorchRefBackend.availability() == (True, "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, _ = TritonBackend.availability()
    assert ok == (TritonBackend.unavailable_reason() is None)  # the interpreter runs it on the CPU
    monkeypatch.delenv("TRITON_INTERPRET")
    assert TritonBackend.availability() == (False, TritonBackend.availability()[1])
    assert "needs a CUDA GPU" in TritonBackend.availability()[1]
    ok, why = FlashAttnBackend.availability()
    assert not ok and "needs a CUDA GPU" in why

    class CudaOnly(AttentionBackend):  # the base class: a declared device type that is not here
        device_types = ("cuda",)

        def run(self, *args, **kwargs):
            raise NotImplementedError

    assert CudaOnly.availability() == (False, "needs a cuda device (no CUDA GPU visible)")


def test_help_workload_prints_the_defaults_run_uses(console) -> None:
    assert cli.main(["run", "--help-workload"]) == 0
    text = console.export_text()
    check_readable(text)
    printed = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\w+)\s+(\[[^\]]*\]|\S+)\s", line + " ")
        if m and m.group(1) in cli.WorkloadConfig.model_fields:
            printed[m.group(1)] = json.loads(m.group(2))
    used = cli._workload(cli._parser().parse_args(["run"])).model_dump()
    assert printed == used
    assert printed["needle_strength"] == 1.25


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"sparse-framework {sparse_framework.__version__}"


def _record(**kw) -> CellRecord:
    base = dict(id="x", experiment="e", workload="reference/passkey", context=4096, algorithm="quest",
                backend="torch_ref", budget="1/16", top_k=256, status="ok")
    return CellRecord(**{**base, **kw})


def test_eval_table_fits_marks_never_sparse_cells_and_lists_failures() -> None:
    metrics = {"accuracy": 0.75, "recall": 0.9123, "rel_error": 0.1234, "kl": 1.5e-3, "needle_hit_rate": 0.8,
               "device_kv_fraction": 0.25, "moved_kib_per_token": 1234.5, "ms_per_token": 123.4}
    records = [
        _record(algorithm="dense", backend="dense", budget="dense", top_k=None,
                metrics={**metrics, "sparse_fraction": None}),
        _record(algorithm="dsa-keys", backend="triton", metrics={**metrics, "sparse_fraction": 1.0}),
        _record(budget="1/4", top_k=1024, metrics={**metrics, "sparse_fraction": 0.0}),
        _record(workload="synthetic", metrics={"recall": 0.9, "sparse_fraction": 0.9375}),
        _record(status="error", budget="1/2", error="ConfigError: " + "a long message " * 12),
    ]
    con = Console(width=WIDTH, record=True, color_system=None)
    con.print(results_table(records, title="experiment 'e' on cpu"))
    text = con.export_text()
    check_readable(text)
    assert "never" in text and "decoded densely throughout" in text
    assert "94%" in text  # a partly dense cell: its share of sparse layer-steps
    assert "a long message " * 3 in " ".join(text.split())  # the failure's error, whole
    assert "KL" in text and "acc" in text  # the reference workload's own metrics


def run_readme_program(heading: str, capsys) -> str:  # noqa: ANN001
    """Run the first Python block under `heading` of the README, exactly as printed; its output."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index(heading):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    return capsys.readouterr().out


def test_readme_ten_lines_find_the_passkey(capsys) -> None:
    """The README's "Ten lines of Python", as printed there: the generated tokens are the passkey."""
    out = run_readme_program("## Ten lines of Python", capsys)
    generated, expected = re.findall(r"\[[\d, ]+\]", out)[:2]
    assert generated == expected, out[:200]
    assert "'sparse_fraction': 1.0" in out  # every decode layer-step was sparse


def test_readme_from_python_runs_as_written(capsys) -> None:
    """The README's "From Python" program, exactly as printed there, on the CPU."""
    out = run_readme_program("### From Python", capsys)
    assert "'dense_layer_steps': {'dense layer': 4}" in out and "'layer_steps': 16" in out


@pytest.mark.parametrize(
    ("module", "results", "args"),
    [
        ("decode_layer", "decode_layer_h100", ()),
        ("eager_overhead", "eager_overhead_h100", (64,)),
        ("graph_overhead_parts", "graph_overhead_parts_h100", None),
        ("selection", "selection_h100", ("cuda", 8)),
    ],
)
def test_benchmark_tables_fit_100_columns(module: str, results: str, args, monkeypatch) -> None:
    """Each benchmark's printed table, from the results it committed (H100), at width 100."""
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(root))
    bench = __import__(module)
    rows = json.loads((root / "results" / f"{results}.json").read_text())["results"]
    if args is None:  # the parts are the columns after the cell's own
        args = ([k for k in rows[0] if k not in ("shape", "algorithm", "context", "batch")], 64)
    con = Console(width=WIDTH, record=True, color_system=None)
    con.print(bench.results_table(rows, *args))
    text = con.export_text()
    check_readable(text)
    assert str(rows[0]["context"]) in text


# -- an 80-column terminal: words and figures whole, the least important columns left out --------
NARROW = 80


class Recorder(Console):
    """A console of `width` columns that keeps what it was asked to print (the tables)."""

    def __init__(self, width: int = NARROW) -> None:
        super().__init__(width=width, record=True, force_terminal=False, color_system=None)
        self.printed: list = []

    def print(self, *objects, **kwargs) -> None:  # type: ignore[override]
        self.printed.extend(objects)
        super().print(*objects, **kwargs)


def _tables(objects) -> list:
    from rich.console import Group
    from rich.table import Table

    found = []
    for obj in objects:
        if isinstance(obj, Table):
            found.append(obj)
        elif isinstance(obj, Group):
            found += _tables(obj.renderables)
    return found


def _one_line(header) -> str:
    text = header.plain if hasattr(header, "plain") else str(header)
    return " ".join(text.split()).replace("/ ", "/")


def check_whole(console: Recorder, keep: dict[str, set[str]] | None = None) -> set[str]:
    """At the console's width: no line too long, nothing cut ('…'), and every word of every
    heading and cell of the printed tables in the output whole (as many times as the tables
    hold it), except the columns named as left out under a table. Returns those; `keep`:
    per table title, headings that must not be left out."""
    width = console.width
    text = console.export_text(clear=False)
    lines = text.splitlines()
    assert "…" not in text, text
    assert max(len(line.rstrip()) for line in lines) <= width, [line for line in lines if len(line.rstrip()) > width]
    flat = " ".join(text.split())
    dropped = {name for note in re.findall(rf"not shown at {width} columns: (.*?) \(a wider terminal", flat)
               for name in note.split(", ")}
    tables = _tables(console.printed)
    assert tables
    want: Counter = Counter()
    for table in tables:
        for column in table.columns:
            name = _one_line(column.header)
            if name in dropped:
                assert name not in (keep or {}).get(str(table.title), set()), (table.title, name)
                continue
            want.update(str(column.header).split())  # "ms/\ntok": "ms/" and "tok"
            for cell in column.cells:
                want.update((cell.plain if hasattr(cell, "plain") else str(cell)).split())
    missing = want - Counter(text.split())
    assert not missing, (missing, text)
    return dropped


@pytest.fixture
def narrow(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(cli, "console", rec)
    return rec


def test_run_table_is_whole_at_80_columns(narrow) -> None:
    assert cli.main(["run", "--config", CFG, "--contexts", "40,300", "--steps", "2", "--no-progress"]) == 0
    assert check_whole(narrow) == set()  # the mode wraps at its spaces; every column stays
    assert "1/2" in narrow.export_text(clear=False).split()


def test_plan_table_is_whole_at_80_columns(narrow) -> None:
    assert cli.main(["plan", "--context", "16384,1048576"]) == 0
    check_whole(narrow, keep={str(t.title): {"context", "store", "device/req", "requests", "gain"}
                              for t in _tables(narrow.printed)})
    text = narrow.export_text(clear=False)
    assert "1,048,576" in text.split() and "489.07x" in text.split()


def test_plugins_and_workload_options_are_whole_at_80_columns(narrow) -> None:
    assert cli.main(["plugins"]) == 0
    assert cli.main(["run", "--help-workload"]) == 0
    assert check_whole(narrow) == set()


def test_eval_table_at_80_columns_leaves_out_costs_first_and_says_so() -> None:
    metrics = {"accuracy": 0.75, "recall": 0.9123, "rel_error": 0.1234, "kl": 1.5e-3, "needle_hit_rate": 0.8,
               "device_kv_fraction": 0.25, "moved_kib_per_token": 1234.5, "ms_per_token": 123.4, "hit_rate": 0.97}
    records = [
        _record(algorithm="dense", backend="dense", budget="dense", top_k=None, metrics={**metrics, "sparse_fraction": None}),
        _record(algorithm="dsa-keys", backend="triton", metrics={**metrics, "sparse_fraction": 1.0}),
        _record(budget="1/4", top_k=1024, metrics={**metrics, "sparse_fraction": 0.0}),
    ]
    con = Recorder()
    con.print(results_table(records, title="experiment 'e' on cpu"))
    dropped = check_whole(con, keep={"reference/passkey": {"context", "algorithm", "budget", "acc", "recall", "rel err"}})
    assert dropped == {"moved KiB/tok", "dev hits"}  # the costs go first, named under the table
    wide = Recorder(WIDTH)
    wide.print(results_table(records))
    assert check_whole(wide) == set()  # at 100 columns nothing is left out


def _gpu_bench_result(**kw) -> dict:
    """A `run_benchmark` result with an H100's figures (large enough to need every digit)."""
    r = dict(input_len=131072, admitted_concurrency=48, concurrency=64, memory_bound_max=1234, memory_bound="device",
             output_tokens_per_s=12345.6, ttft_p50_ms=123456.0, ttft_p99_ms=234567.0, tpot_p50_ms=45.6,
             tpot_p99_ms=78.9, decode_step_ms=40.1, decode_step_floor_ms=12.3, preemptions=17, prefill_tflops=456.7,
             peak_tflops=790.0, hit_rate=0.987, h2d_bytes=123.4e9, h2d_gb_per_s=45.67, peak_gpu_bytes=75 * 2**30,
             device_pool_bytes=60 * 2**30, host_pool_bytes=900 * 2**30, device="cuda:0")
    return {**r, **kw}


def test_bench_tables_are_whole_at_80_columns() -> None:
    from sparse_framework.bench.offline import bench_tables

    con = Recorder()
    for table in bench_tables([_gpu_bench_result()], "bench: llama-3-8b, 64 x (131072 in, 32 out), all at once"):
        con.print(table)
    keep = {"in", "conc", "tok/s", "TTFT p50", "TPOT p50", "step", "prefill TF/s", "hit", "GPU peak"}
    dropped = check_whole(con, keep={str(t.title): keep for t in _tables(con.printed)})
    text = con.export_text(clear=False).split()
    for figure in ("131,072", "48/64", "12,345.6", "123,456", "45.6", "40.1", "457", "98.7%", "75.00"):
        assert figure in text, figure
    assert dropped <= {"TTFT p99", "TPOT p99", "preempt", "floor", "H2D GB/s", "host", "dev pools", "% peak"}


@pytest.mark.parametrize("gib", ["80", pytest.param("0.1", marks=pytest.mark.slow)])
def test_plan_engine_is_whole_at_80_columns(gib: str) -> None:
    """`plan --engine` (the memory plan, and the error when nothing fits) in an 80-column
    terminal: no line longer, no word or number split across lines."""
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "sparse_framework.cli.main", "plan", "--engine", "--gpu-memory-gib", gib,
                           "--host-memory-gib", "64"], capture_output=True, text=True, env=env, timeout=120)
    lines = (done.stdout + done.stderr).splitlines()
    assert lines and max(len(line.rstrip()) for line in lines) <= 80, lines
    words = (done.stdout + done.stderr).split()
    assert "16,384," in words and "…" not in done.stdout + done.stderr
    for word in words:  # a number cut at a line end would leave a fragment such as "19." or ".02"
        assert not re.fullmatch(r"\d+\.|\.\d+", word), (word, lines)
    if gib == "0.1":
        assert "short," in words and "nothing" in words
