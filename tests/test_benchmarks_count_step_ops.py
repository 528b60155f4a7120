"""benchmarks/count_step_ops.py on the CPU (Triton interpreted, in a subprocess): the counts
per part of a decode layer add up, the parts that run Triton kernels count their launches,
and the hierarchical store's write of the new token is where the torch ops are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "count_step_ops.py"


def _counts(config: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--config", config, "--context", "256", "--batch", "2"],
                          capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^  (\S.*?)\s{2,}(\d+)  \(", done.stdout, flags=re.M)
    return {name.strip(): int(n) for name, n in rows}


@pytest.mark.slow
def test_counts_per_part_of_a_decode_layer() -> None:
    pytest.importorskip("triton")
    hier = _counts('{"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "backend": "triton"}')
    resident = _counts('{"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "backend": "triton", "store": "resident"}')
    parts = {"store.write_decode", "algorithm.select", "store.ensure_resident", "adaptor.plan", "backend.run",
             "coordinator._append", "outside the coordinator"}
    assert set(hier) == parts == set(resident)
    # the resident store writes a token with one Triton launch per layer (2 layers); the
    # hierarchical one places it in the buffer (one launch) and queues its host copy in torch
    assert resident["store.write_decode"] == 2 and hier["store.write_decode"] > resident["store.write_decode"]
    # swap-in: the residency and copy kernels per layer; resident: the slot lookup only
    assert hier["store.ensure_resident"] == 4 and resident["store.ensure_resident"] == 2
    assert hier["backend.run"] == resident["backend.run"] > 0 and hier["outside the coordinator"] > 0
