"""Host values to the device, and device values to the host, without waiting for the device.

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


def copy_to_host(src: torch.Tensor) -> torch.Tensor:
    """A host copy of `src`. From a CUDA device it is issued without synchronising: the source
    is made contiguous on the device and copied into a new pinned tensor; the caller must wait
    for the stream (an event recorded after the copy) before the host reads it. Elsewhere it
    is a plain copy."""
    if src.device.type != "cuda":
        return src.to("cpu", copy=True)
    out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    out.copy_(src.contiguous(), non_blocking=True)
    return out
