"""A bulk page allocator: a stack of free page ids in one tensor.

Allocation and release move whole runs of ids at once (no per-page Python loop); exhaustion
raises CapacityError naming the requested and free counts and changes nothing.
"""

from __future__ import annotations

import torch

from ..common.errors import CapacityError
from .pinned import pinned_zeros


def paged_slots_rows(
    table: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, page_size: int, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Slots of positions through the page tables of some rows: table [R, pages] int32 (-1
    for unmapped pages); rows [B] int; pos [B, ...] int. Returns `dtype` [B, ...]:
    table[rows[b], pos // page_size] * page_size + pos % page_size, and -1 where pos is -1
    or its page unmapped. The torch twin of `kernels.decode_slots.paged_slots_rows_triton`."""
    flat = pos.reshape(pos.shape[0], -1).long()
    safe = flat.clamp(min=0)
    page = table[rows.long()].gather(1, safe // page_size).long()
    slots = torch.where((flat >= 0) & (page >= 0), page * page_size + safe % page_size, -1)
    return slots.reshape(pos.shape).to(dtype)


class PageAllocator:
    """Free-page stack over ids 0..num_pages-1 (host-side bookkeeping, int64 CPU tensor)."""

    def __init__(self, num_pages: int, what: str) -> None:
        self.num_pages = num_pages
        self.what = what
        self._stack = torch.arange(num_pages - 1, -1, -1, dtype=torch.int64)  # top = end
        self._top = num_pages

    @property
    def free(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        return self.num_pages - self._top

    def alloc(self, n: int, page_tokens: int, who: str) -> torch.Tensor:
        """n page ids (int64 [n]); raises CapacityError if fewer than n are free."""
        if n > self._top:
            raise CapacityError(
                f"{self.what} full: {who} needs {n} more pages of {page_tokens} tokens "
                f"({n * page_tokens} tokens), {self._top} of {self.num_pages} pages are free"
            )
        ids = self._stack[self._top - n : self._top].flip(0).clone()
        self._top -= n
        return ids

    def release(self, ids: torch.Tensor) -> None:
        """Return ids (any order; each must be currently allocated)."""
        n = ids.numel()
        if self._top + n > self.num_pages:
            raise RuntimeError(f"{self.what}: releasing {n} pages would exceed the pool")
        self._stack[self._top : self._top + n] = ids.flatten().flip(0).to(torch.int64).cpu()
        self._top += n


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, what: str, knob: str, pin: bool = False) -> torch.Tensor:
    """torch.zeros, with a CapacityError that says how big the pool was and what sizes it.
    Pinned host pools come from `pinned.pinned_zeros` (huge pages registered with CUDA: ~10x
    faster than torch's pin_memory, with progress in the log for large pools)."""
    try:
        if pin and device.type == "cpu":
            return pinned_zeros(shape, dtype, what)
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raise CapacityError(
            f"cannot allocate the {what} ({size / 2**30:.1f} GiB on {device}): {str(exc).splitlines()[0]}; "
            f"lower max_requests / max_seq_len or set {knob}"
        ) from None
