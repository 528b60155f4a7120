"""Programmatic dependent launch (PDL) for the decode path's kernels, on sm_90+ GPUs: a kernel
is launched (`launch_pdl=True`) while its predecessor still runs, and its programs block in
`griddepcontrol.wait` (`wait`, kernels/triton/pdl.py) until the predecessor's writes are
visible. Why (a decode layer is a chain of small kernels whose launch and ramp-up show):
docs/kernels.md, "Programmatic dependent launch".

The contract every kernel launched this way follows, so that a chain is safe whatever
precedes it (an engine's own kernels included):

* `wait` (griddepcontrol.wait) runs in every program, before the program reads anything its
  predecessor may write and before it writes anything. Most kernels call it first thing.
* `wait` is followed by `launch_dependents`, so a kernel's successor can launch only once
  every program of the kernel has passed its wait: by then the kernel's own predecessor has
  completed. A kernel whose predecessor is one of ours (same function, known order) may
  therefore read, *before* its wait, data that the predecessor does not write — the top-k's
  radix passes load their chunk of scores that way (kernels/topk.py).
* A kernel launched without PDL (torch ops, any kernel not listed here) waits for its
  predecessor to complete, as always, so mixing is safe.

`enabled(device)` says whether to launch with PDL: "auto" (the default) on CUDA devices of
compute capability 9.0 or more; never under the interpreter or on the CPU. Set `PDL` to "off"
to compare (benchmarks/decode_layer.py --pdl off) or "on" to force it.
"""

from __future__ import annotations

from functools import cache

import torch

from .triton.pdl import wait

__all__ = ["MODES", "PDL", "enabled", "wait"]

MODES = ("auto", "on", "off")
PDL = "auto"  # one of MODES


@cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring)."""
    if PDL not in MODES:
        raise ValueError(f"kernels.pdl.PDL must be one of {MODES}, got {PDL!r}")
    if PDL == "off" or device.type != "cuda":
        return False
    return PDL == "on" or _capable(device.index if device.index is not None else torch.cuda.current_device())


