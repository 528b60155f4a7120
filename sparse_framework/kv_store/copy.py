"""Copying rows between the host pool and the device buffer.

On CUDA a Triton kernel reads (or writes) pinned host memory directly — a device-side
zero-copy gather, 6-14x faster than gathering on the CPU and then copying (DESIGN.md,
measured ceilings). On the CPU the same offsets drive a torch index copy, so every caller's
logic is exercised in CI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..common.arith import pow2
from .pages import paged_slots_rows
from .pinned import is_gpu_readable


class _HostPointer:
    """Hands Triton the device-visible address of pinned host memory (UVA), which Triton
    otherwise refuses for a CPU tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self._tensor.data_ptr()


def _as_kernel_arg(t: torch.Tensor) -> torch.Tensor | _HostPointer:
    if t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return t
    if not is_gpu_readable(t):
        raise ValueError("copy_rows: a host tensor read or written by the GPU must be pinned")
    return _HostPointer(t)


def uses_triton(src: torch.Tensor, dst: torch.Tensor, src_off: torch.Tensor, dst_off: torch.Tensor, impl: str,
                what: str) -> bool:
    """The checks every offset-driven row copy makes (`copy_rows`, fp8_host's quantising and
    dequantising copies), and which path runs: the Triton kernel (True) when `impl` asks for
    it or, with "auto", when a tensor is on CUDA; else the torch index copy. `what` names the
    caller in the messages."""
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"{what}: src and dst must be contiguous")
    if src_off.shape != dst_off.shape:
        raise ValueError(f"{what}: offset shapes differ: {tuple(src_off.shape)} vs {tuple(dst_off.shape)}")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"{what}: impl must be auto, torch or triton, got {impl!r}")
    on_gpu = src.is_cuda or dst.is_cuda
    if impl == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{what}: the Triton kernel needs a CUDA tensor or TRITON_INTERPRET=1")
    return not (impl == "torch" or (impl == "auto" and not on_gpu))


def span_index(off: torch.Tensor, live: torch.Tensor, width: int) -> torch.Tensor:
    """Flat indices of the `width` consecutive elements at each live offset (the torch path's
    gather/scatter index of a row copy): [live rows x width], on the offsets' device."""
    return (off[live].unsqueeze(1) + torch.arange(width, device=off.device)).reshape(-1)


@dataclass(frozen=True)
class RowCopyShape:
    """The launch shape of `copy_rows`' kernel: rows per program, columns per inner step, warps.
    The defaults were measured on an H100 by benchmarks/swap_in.py --sweep-kernel, which passes
    others as `copy_rows(..., shape=)`."""

    rows_per_program: int = 1
    cols: int = 128
    warps: int = 4


ROW_COPY_SHAPE = RowCopyShape()


def copy_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_off: torch.Tensor,
    dst_off: torch.Tensor,
    row: int,
    impl: str = "auto",
    *,
    shape: RowCopyShape | None = None,
) -> None:
    """For every i with src_off[i] >= 0 and dst_off[i] >= 0 copy `row` contiguous elements
    from flat element offset src_off[i] of `src` to dst_off[i] of `dst`. Offsets: int64 [N] on the device that
    launches (the GPU whenever either side is on it); src/dst: contiguous, same dtype.

    No host synchronisation on CUDA: entries with a negative offset are skipped in the kernel.
    impl: "auto" (Triton when a tensor is on CUDA, else torch), "torch" or "triton" (on the
    CPU only under TRITON_INTERPRET=1, for tests). shape: the kernel's launch shape
    (`RowCopyShape`; None: `ROW_COPY_SHAPE`, the defaults).
    """
    if src.dtype != dst.dtype:
        raise TypeError(f"copy_rows: src is {src.dtype}, dst is {dst.dtype}")
    if not uses_triton(src, dst, src_off, dst_off, impl, "copy_rows"):
        live = (src_off >= 0) & (dst_off >= 0)
        d = span_index(dst_off, live, row)
        dst.view(-1)[d.to(dst.device)] = src.view(-1)[span_index(src_off, live, row).to(src.device)].to(dst.device)
        return
    from ..kernels.triton.copy_rows import copy_rows_kernel
    from ..kernels.launch import launch

    n = src_off.numel()
    if n == 0:
        return
    if shape is None:
        shape = ROW_COPY_SHAPE
    rows_per_program, warps = shape.rows_per_program, shape.warps
    cols = min(shape.cols, pow2(row))
    grid = (-(-n // rows_per_program),)
    launch(copy_rows_kernel, grid,
        _as_kernel_arg(src), _as_kernel_arg(dst), src_off, dst_off, n,
        ROW=row, ROWS_PER_PROGRAM=rows_per_program, COLS=cols, num_warps=warps,
    )



def write_token_rows(
    bufs: list[torch.Tensor], table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
    data: list[torch.Tensor], page_size: int, head_major: bool,
) -> torch.Tensor:
    """Write data[i][b] ([B, H, D], the buffers' dtype) at position seq_lens[b] - 1 of row
    rows[b] of the page table into bufs[i] (one layer: [slots, H, D], or [H, slots, D] when
    head_major). That position's page must be mapped (the store's `grow` maps it). Returns
    the slots, int64 [B]. The torch twin of `kernels.decode_slots.write_token_rows_triton`."""
    pos = (seq_lens.long() - 1).view(-1, 1)
    slots = paged_slots_rows(table, rows, pos, page_size)[:, 0]
    put_rows(bufs, slots, data, head_major)
    return slots


def put_rows(bufs: list[torch.Tensor], slots: torch.Tensor, data: list[torch.Tensor], head_major: bool) -> None:
    """data[i]: [n, kv_heads, dim] into bufs[i] (one layer: [slots, H, D], or [H, slots, D]
    when head_major) at slots [n] (all heads), or, head-major only, at slots [n, kv_heads]
    (one slot per head)."""
    for buf, x in zip(bufs, data):
        if not head_major:
            buf[slots] = x
        elif slots.dim() == 1:
            buf[:, slots] = x.transpose(0, 1)
        else:
            heads = torch.arange(x.shape[1], device=slots.device).expand_as(slots)
            buf[heads, slots] = x
