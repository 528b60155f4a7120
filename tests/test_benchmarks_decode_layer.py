"""benchmarks/decode_layer.py times the sparse decode layer: every request of a cell decodes
sparsely at any context and batch, the short cells below the cost policy's break-even too (an
H200 run under the cost default timed the dense path in 21-24 of its 36 cells)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_layer  # noqa: E402


@pytest.mark.parametrize("context,batch", [(1024, 1), (4096, 2)])
def test_a_short_cell_times_the_sparse_layer(context: int, batch: int) -> None:
    cell = decode_layer.Cell("mha", "quest", context, batch, torch.device("cpu"), 0)
    assert cell.step_batch.num_sparse == batch and not cell.coord.dense_layers
    width = int(cell.select().lengths.max())
    assert width == min(context, 2048 + 16 + 64)  # top_k + sink + recent: a selection where the context is longer


def test_a_cell_that_would_time_dense_attention_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    common = {k: v for k, v in decode_layer.COMMON.items() if k != "sparse_policy"}  # the cost default
    monkeypatch.setattr(decode_layer, "COMMON", common)
    with pytest.raises(RuntimeError, match="would decode densely"):
        decode_layer.Cell("mha", "quest", 1024, 1, torch.device("cpu"), 0)
