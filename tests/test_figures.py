"""benchmarks/FIGURES.md traces every published figure to a committed result file (issue 44,
item 5): a result file it names that is moved or deleted fails here, and so does a README
figure whose result file git does not track."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "benchmarks" / "FIGURES.md"
RESULT_COLUMN = "result file"
PATH = re.compile(r"`((?:benchmarks|docs)/[^`\s]+)`")


def _tables() -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of FIGURES.md: (header cells, body rows' cells)."""
    tables: list[tuple[list[str], list[list[str]]]] = []
    header: list[str] | None = None
    for line in FIGURES.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            tables.append((header, []))
        elif not all(set(c) <= set("-: ") for c in cells):
            tables[-1][1].append(cells)
    return tables


def _traced_rows() -> list[tuple[str, str]]:
    """(id, result-file cell) of every row of the tables that have a result-file column."""
    rows = []
    for header, body in _tables():
        if RESULT_COLUMN not in header:
            continue
        col = header.index(RESULT_COLUMN)
        for cells in body:
            assert len(cells) == len(header), f"row {cells[0]}: {len(cells)} cells, header has {len(header)} (a '|' inside a cell?)"
            rows.append((cells[0], cells[col]))
    return rows


def _files(cell: str) -> dict[str, list[Path]]:
    """Each path named in a cell (a glob allowed) and the files it matches."""
    return {p: sorted(ROOT.glob(p)) if any(ch in p for ch in "*?[") else [ROOT / p] for p in PATH.findall(cell)}


def test_the_table_has_readme_rows_and_unique_ids() -> None:
    ids = [row_id for row_id, _ in _traced_rows()]
    assert any(i.startswith("R") for i in ids), "no README rows parsed"
    assert len(ids) == len(set(ids)), "duplicate row ids"


def test_every_named_result_file_exists() -> None:
    missing = []
    for row_id, cell in _traced_rows():
        files = _files(cell)
        assert files, f"row {row_id} names no result file under benchmarks/ or docs/"
        for pattern, matched in files.items():
            if not matched or not all(f.is_file() for f in matched):
                missing.append(f"{row_id}: {pattern}")
    assert not missing, "result files named in benchmarks/FIGURES.md are missing: " + ", ".join(missing)


def test_readme_figures_results_are_tracked_by_git() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", "--", "benchmarks", "docs"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    tracked = set(filter(None, out.split("\0")))
    untracked = []
    for row_id, cell in _traced_rows():
        if not row_id.startswith("R"):
            continue
        for matched in _files(cell).values():
            untracked += [f"{row_id}: {f.relative_to(ROOT).as_posix()}" for f in matched
                          if f.relative_to(ROOT).as_posix() not in tracked]
    assert not untracked, "README figures whose result file git does not track: " + ", ".join(untracked)
