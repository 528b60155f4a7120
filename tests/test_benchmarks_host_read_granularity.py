"""benchmarks/host_read_granularity.py's row offsets (the benchmark itself needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from helpers import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def granularity():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # its `from timing import ...`
        yield load_benchmark("host_read_granularity")


@pytest.mark.parametrize("run", [1, 4, 16])
def test_offsets_are_distinct_rows_in_runs(granularity, run: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(run)
    off = granularity.offsets(n_host_rows=1000, rows=64, run=run, row=128, device="cpu")
    rows = off // 128
    assert off.dtype == torch.int64 and bool((off % 128 == 0).all())
    assert rows.unique().numel() == 64 and int(rows.max()) < 1000
    runs = rows.view(-1, run)  # each run: consecutive rows from a multiple of `run`
    assert torch.equal(runs - runs[:, :1], torch.arange(run).expand_as(runs)) and bool((runs[:, 0] % run == 0).all())


def test_offsets_refuse_what_cannot_fit(granularity) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="do not fit"):
        granularity.offsets(n_host_rows=10, rows=16, run=1, row=128, device="cpu")
    with pytest.raises(ValueError, match="do not fit"):
        granularity.offsets(n_host_rows=100, rows=20, run=16, row=128, device="cpu")


def test_strided_runs_take_one_lane_of_a_block(granularity) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    rows = granularity.offsets(n_host_rows=1024, rows=128, run=16, row=1, device="cpu", stride=8).view(-1, 16)
    assert rows.flatten().unique().numel() == 128 and int(rows.max()) < 1024
    assert torch.equal(rows - rows[:, :1], (torch.arange(16) * 8).expand_as(rows))  # every 8th row
    assert torch.equal(rows[:, 0] // 128, rows[:, -1] // 128)  # inside one block of 16 x 8 rows
