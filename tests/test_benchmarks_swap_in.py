"""benchmarks/swap_in.py's `--copy-shapes` entries (the benchmark itself needs CUDA):
programs:cols:warps with an optional rows per iteration (BLOCK_R, 1 when left out)."""

from __future__ import annotations

import pytest

from helpers import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def swap_in():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # its `from timing import ...`
        yield load_benchmark("swap_in")


def test_copy_shapes_take_an_optional_rows_field(swap_in) -> None:  # type: ignore[no-untyped-def]
    assert swap_in.copy_shape("2048:1024:8") == (2048, 1024, 8, 1)
    assert swap_in.copy_shape("16:128:4:32") == (16, 128, 4, 32)
    for bad in ("2048:1024", "1:2:3:4:5", "16:128:4:3", "16:128:4:0"):
        with pytest.raises(SystemExit, match="--copy-shapes"):
            swap_in.copy_shape(bad)
