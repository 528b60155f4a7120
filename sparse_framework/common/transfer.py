"""Host values to the device without waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the
stream: the host waits until every kernel queued before the copy has run. An engine that
prepares step n+1 while the GPU still runs step n (async scheduling) must never do that on the
step's path, so the values go through pinned memory and a non-blocking copy instead (the
pinned block is kept by torch's caching host allocator until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
              device: str | torch.device) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` on `device`; on CUDA the copy does not synchronise."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=dev)
    return torch.tensor(values, dtype=dtype).pin_memory().to(dev, non_blocking=True)


def tensor_to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`; on CUDA through pinned memory, without synchronising."""
    dev = torch.device(device)
    if dev.type != "cuda" or t.device.type == "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)
