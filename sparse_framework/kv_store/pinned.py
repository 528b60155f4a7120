"""Pinned host memory for the host KV pool, allocated fast and with progress for large pools.

`torch.zeros(..., pin_memory=True)` goes through torch's caching host allocator: it rounds
every block up to a power of two (a 17 GiB pool pins 32 GiB) and pins with cudaHostAlloc,
one thread faulting the pages in: 1.8 GB/s on the H100 machine (benchmarks/host_pinning.py,
docs/kv_store.md). Here the pool is anonymous memory advised for transparent huge pages
(512x fewer pages to fault in and lock), faulted in by a thread pool (the zero fill) and
registered with one cudaHostRegister: 17 GB/s there, the exact size, and the same zero-copy
reads and host->device copies. Where that fails (no cudaHostRegister, no mmap) the torch way
is the fallback. Only torch and the standard library are imported here (the benchmark loads
this file on machines without the package's dependencies).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
CHUNK = 256 << 20  # bytes zero-filled per task
LOG_BYTES = 1 << 30  # pools from this size on are logged (INFO) before and after
PROGRESS_SECONDS = 3.0  # a progress line at most this often while filling


_LIVE: dict[int, int] = {}  # start address -> bytes of every registered region alive


class _Region:
    """An anonymous mapping registered with CUDA, unregistered when the last tensor viewing it
    is gone: the tensors are made over `owner()`, a buffer object whose finalizer releases the
    region, and torch keeps that object alive as long as any view of the storage lives (a
    finalizer on one tensor object would unregister memory its views still read)."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.map.madvise(mmap.MADV_HUGEPAGE, 0, len(self.map))
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.offset = (-base) % HUGE_PAGE
        self.ptr = base + self.offset
        self.nbytes = nbytes
        self.registered = False

    def owner(self) -> ctypes.Array:
        """The region's aligned bytes as a buffer whose collection releases the region."""
        array_type = type("PinnedBytes", (ctypes.c_char * self.nbytes,), {})  # a subclass takes weakrefs
        owner = array_type.from_buffer(self.map, self.offset)
        weakref.finalize(owner, self.release)
        return owner

    def register(self) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(self.ptr, self.nbytes, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed (cudaError {err})")
        self.registered = True
        _LIVE[self.ptr] = self.nbytes

    def release(self) -> None:
        if self.registered:
            self.registered = False
            _LIVE.pop(self.ptr, None)
            try:
                torch.cuda.cudart().cudaHostUnregister(self.ptr)
            except Exception:  # noqa: BLE001 (interpreter shutdown: the driver may be gone)
                pass


def is_gpu_readable(t: torch.Tensor) -> bool:
    """Whether the GPU may read and write host tensor `t` directly: pinned by torch, or inside
    a region registered here (torch's `is_pinned` need not know about those)."""
    if t.is_pinned():
        return True
    start = t.data_ptr()
    return any(ptr <= start < ptr + n for ptr, n in _LIVE.items())


def fill_zero(t: torch.Tensor, threads: int, progress: Callable[[int], None] | None = None) -> None:
    """Zero a contiguous tensor in chunks from a thread pool (torch releases the GIL): the
    first touch faults the pages in, in parallel. `progress(bytes_done)` after each chunk."""
    flat = t.view(-1).view(torch.uint8)
    chunks = [(s, min(CHUNK, flat.numel() - s)) for s in range(0, flat.numel(), CHUNK)]
    done = 0
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for n in pool.map(lambda c: (flat[c[0] : c[0] + c[1]].zero_(), c[1])[1], chunks):
            done += n
            if progress is not None:
                progress(done)


def _registered_zeros(shape: tuple[int, ...], dtype: torch.dtype, progress: Callable[[int], None]) -> torch.Tensor:
    numel = torch.Size(shape).numel()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    region = _Region(nbytes)
    raw = torch.frombuffer(region.owner(), dtype=torch.uint8)  # every view keeps the owner alive
    fill_zero(raw, min(16, os.cpu_count() or 1), progress)
    region.register()
    return raw.view(dtype).view(shape)


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field ("MemAvailable", "MemTotal") in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    """A zero-filled pinned host tensor (module docstring): huge pages registered with CUDA,
    or torch's pin_memory where that fails. Pools of LOG_BYTES or more log INFO lines: the
    size, progress every PROGRESS_SECONDS while filling, and the time and rate at the end."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    available = meminfo_bytes("MemAvailable")
    if available is not None and nbytes > available:  # touching more would wake the OOM killer
        raise RuntimeError(f"{nbytes / 2**30:.1f} GiB asked, {available / 2**30:.1f} GiB of host memory available")
    loud = nbytes >= LOG_BYTES
    start = last = time.perf_counter()
    if loud:
        log.info("pinning %.1f GiB of host memory for the %s", nbytes / 2**30, what)

    def progress(done: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if loud and now - last >= PROGRESS_SECONDS:
            last = now
            log.info("%s: %.1f of %.1f GiB (%.0f%%)", what, done / 2**30, nbytes / 2**30, 100 * done / max(nbytes, 1))

    how = "huge pages + cudaHostRegister"
    try:
        t: torch.Tensor | None = _registered_zeros(shape, dtype, progress)
    except (RuntimeError, OSError, ValueError, AttributeError, AssertionError) as exc:
        how = f"torch pin_memory: {exc}"
        t = None  # (outside the handler: the failed region is freed first)
    if t is None:
        t = torch.zeros(shape, dtype=dtype, pin_memory=True)
    if loud:
        seconds = time.perf_counter() - start
        log.info("pinned %.1f GiB for the %s in %.1f s (%.1f GB/s, %s)", nbytes / 2**30, what, seconds,
                 nbytes / max(seconds, 1e-9) / 1e9, how)
    return t
