"""Fused bookkeeping of a decode step: one Triton launch each where torch needs 10-20 ops.

Profiling one DSA decode layer at 128K x 8 requests on an H100 (docs/performance.md) showed
~60 small torch kernels (casts, gathers, `where` masks) costing ~120 µs of a ~315 µs step,
more than the attention itself. Three of their groups are pure index arithmetic over tensors
that are already on the device, and each becomes one kernel here:

  write_token_rows   this step's K/V row of every request into its device slot (the slot
                     found through the request's page table at position seq_len - 1)
  paged_slots_rows   logical positions -> device slots through per-request page tables
  page_table         physical slots of a selection -> FlashAttention's page table and
                     sequence lengths (`adaptors/flash_attention.py`)

Each has a torch twin (the reference, used on the CPU, in the module that owns the data:
kv_store/pages.py, kv_store/copy.py, adaptors/flash_attention.py) with the same signature;
kernels import nothing above them, so the twins are not imported here. The tests
compare them under TRITON_INTERPRET=1 on random inputs. None of them synchronises with the
host, so a decode step that uses them still captures in a CUDA graph. On sm_90+ GPUs they
launch with PDL (kernels/pdl.py), waiting for their predecessor first thing.
"""

from __future__ import annotations

import os

import torch

from ..common.arith import cdiv, pow2
from . import pdl
from .launch import launch
from .triton.decode_slots import (
    new_token_units_kernel,
    page_table_kernel,
    paged_slots_kernel,
    write_new_rows_kernel,
    write_token_rows_kernel,
)

__all__ = ["paged_slots_rows_triton", "write_token_rows_triton", "page_table_triton", "new_token_units_triton",
           "write_new_rows_triton"]


SLOTS_PROGRAMS = 256  # paged_slots_kernel's grid aims at this many programs (`programs=`'s default)


def _launchable(*tensors: torch.Tensor) -> None:
    if tensors[0].device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the decode-slot kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")


# -- logical positions -> device slots ------------------------------------------------------------


def paged_slots_rows_triton(
    table: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, page_size: int, dtype: torch.dtype = torch.int64,
    *, programs: int = SLOTS_PROGRAMS,
) -> torch.Tensor:
    """`paged_slots_rows` in one kernel. Positions whose page is unmapped (or beyond
    the table) give -1 instead of an undefined slot. `programs`: the grid aimed at."""
    _launchable(table, rows, pos)
    b = pos.shape[0]
    flat = pos.reshape(b, -1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.shape[1]
    out = torch.empty((b, n), dtype=dtype, device=pos.device)
    if out.numel():
        # small blocks: the kernel is a chain of dependent loads, so many programs hide it
        block = max(64, min(1024, pow2(cdiv(b * n, programs))))
        use_pdl = pdl.enabled(pos.device)
        launch(paged_slots_kernel, (b, cdiv(n, block)),
            table, rows, flat, out, n, table.shape[1], table.stride(0), P=page_size, BLOCK=block, PDL=use_pdl,
            num_warps=max(1, min(4, block // 32)), launch_pdl=use_pdl,
        )
    return out.view(pos.shape)


# -- this step's rows into their device slots ---------------------------------------------------


def write_token_rows_triton(
    bufs: list[torch.Tensor], table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
    data: list[torch.Tensor], page_size: int, head_major: bool,
) -> torch.Tensor:
    """`write_token_rows` in one kernel (K and V together)."""
    _launchable(table, rows, seq_lens, *bufs, *data)
    if len(bufs) not in (1, 2) or len(data) != len(bufs):
        raise ValueError(f"write_token_rows: one or two buffers with as many sources, got {len(bufs)} and {len(data)}")
    if any(x.stride() != data[0].stride() for x in data) or any(b.stride() != bufs[0].stride() for b in bufs):
        raise ValueError("write_token_rows: K and V (and their buffers) must share strides")
    if any(b.stride(-1) != 1 for b in bufs) or any(x.dtype != b.dtype for x, b in zip(data, bufs)):
        raise ValueError("write_token_rows: buffers must be contiguous in the last dim and of the sources' dtype")
    n, h, d = data[0].shape
    slots = torch.empty(n, dtype=torch.int64, device=rows.device)
    if n == 0:
        return slots
    s_slot, s_h = (bufs[0].stride(1), bufs[0].stride(0)) if head_major else (bufs[0].stride(0), bufs[0].stride(1))
    two = len(bufs) == 2
    use_pdl = pdl.enabled(rows.device)
    launch(write_token_rows_kernel, (n, h),
        rows, seq_lens, table, slots,
        data[0], bufs[0], data[-1], bufs[-1],
        table.shape[1], page_size, table.stride(0), d,
        *data[0].stride(), s_slot, s_h,
        TWO=two, BLOCK_D=min(1024, pow2(d)), PDL=use_pdl, launch_pdl=use_pdl,
    )
    return slots


# -- selection slots -> FlashAttention page table ----------------------------------------------


def page_table_triton(
    slots: torch.Tensor, lengths: torch.Tensor, page_size: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`page_table_torch` in one kernel."""
    _launchable(slots, lengths)
    b, h, width = slots.shape
    slots = slots if slots.is_contiguous() else slots.contiguous()
    lengths = lengths if lengths.is_contiguous() else lengths.contiguous()
    n_pages = -(-width // page_size)
    table = torch.empty((b * h, n_pages), dtype=torch.int32, device=slots.device)
    seqlens = torch.empty(b * h, dtype=torch.int32, device=slots.device)
    if b * h:
        block = min(1024, pow2(max(n_pages, 1)))
        use_pdl = pdl.enabled(slots.device)
        launch(page_table_kernel, (b * h, max(1, cdiv(n_pages, block))),
            slots, lengths, table, seqlens, h, width, n_pages, page_size,
            num_slots // page_size if h > 1 else 0, BLOCK=block, PDL=use_pdl, launch_pdl=use_pdl,
        )
    return table, seqlens


# -- a buffered layer's new token: its unit, then its rows and their host-write offsets ---------


def new_token_units_triton(
    sel: torch.Tensor, seq_lens: torch.Tensor, slot_ids: torch.Tensor, streams: int, unit: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For batch rows `sel` [n]: the unit of each one's new token (position seq_len - 1) as a
    one-unit selection int32 [n, streams, unit] (-1 past the token), and the rows' state ids
    and lengths [n] — the residency kernel's inputs for placing the new tokens, in one launch."""
    _launchable(sel, seq_lens, slot_ids)
    n = sel.numel()
    idx = torch.empty((n, streams, unit), dtype=torch.int32, device=sel.device)
    rows = torch.empty(n, dtype=slot_ids.dtype, device=sel.device)
    lens = torch.empty(n, dtype=seq_lens.dtype, device=sel.device)
    if n:
        use_pdl = pdl.enabled(sel.device)
        launch(new_token_units_kernel, (n,), sel, seq_lens, slot_ids, idx, rows, lens, streams,
               U=unit, BLOCK_U=pow2(unit), PDL=use_pdl, launch_pdl=use_pdl)
    return idx, rows, lens


def write_new_rows_triton(
    bufs: list[torch.Tensor], data: list[torch.Tensor], sel: torch.Tensor, seq_lens: torch.Tensor,
    slot_ids: torch.Tensor, sparse_mask: torch.Tensor, slots: torch.Tensor, pick_unit: int,
    host_table: torch.Tensor, host_page_size: int, host: tuple[int, int, int], dev: tuple[int, int, int],
    count: torch.Tensor, head_major: bool, write: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's token of batch rows `sel` [n] into its device slots, and the offsets of its
    device→host copy, in one launch (the torch form: `DeviceRows.put` then
    `DecodeWrites._queue_host_write`, kv_store/decode_writes.py).

    slots: [n, S] device slots per stream (S = KV heads in the head-major layout, else 1), or
    with `pick_unit` u > 0 [n, S, u] slots of the new token's unit, of which position
    (seq_len - 1) % u is taken. data[i]: [B, H, D] (the whole batch; rows `sel` are read) into
    bufs[i] (one layer: [slots, H, D], or [H, slots, D] head-major); `write` False computes
    the offsets only. host = (base, row, head) and dev = (base, slot, head) element strides of
    the host and device offsets. Returns (device offsets, host offsets) int64 [n, S], -1 where
    the request keeps no host copy (`sparse_mask` false) or the host page or device slot is
    missing; `count` [1] grows by the host offsets kept."""
    _launchable(sel, seq_lens, slot_ids, slots, host_table)
    if len(bufs) not in (1, 2) or len(data) != len(bufs):
        raise ValueError(f"write_new_rows: one or two buffers with as many sources, got {len(bufs)} and {len(data)}")
    if any(x.stride() != data[0].stride() for x in data) or any(b.stride() != bufs[0].stride() for b in bufs):
        raise ValueError("write_new_rows: K and V (and their buffers) must share strides")
    if any(b.stride(-1) != 1 for b in bufs) or any(x.dtype != b.dtype for x, b in zip(data, bufs)):
        raise ValueError("write_new_rows: buffers must be contiguous in the last dim and of the sources' dtype")
    if pick_unit and slots.stride(-1) != 1:
        raise ValueError("write_new_rows: a unit's slots must be contiguous")
    n, s = slots.shape[0], slots.shape[1]
    streams = data[0].shape[1] if head_major else 1
    if s != streams:  # one launch column per stream: fewer would skip the other heads' host copies
        raise ValueError(f"write_new_rows: slots need one column per stream ({streams}), got {tuple(slots.shape)}")
    dev_off = torch.empty((n, s), dtype=torch.int64, device=sel.device)
    host_off = torch.empty((n, s), dtype=torch.int64, device=sel.device)
    if n == 0:
        return dev_off, host_off
    _, h, d = data[0].shape
    s_slot, s_h = (bufs[0].stride(1), bufs[0].stride(0)) if head_major else (bufs[0].stride(0), bufs[0].stride(1))
    use_pdl = pdl.enabled(sel.device)
    launch(write_new_rows_kernel, (n, s),
        sel, seq_lens, slot_ids, sparse_mask, slots, host_table, dev_off, host_off, count,
        data[0], bufs[0], data[-1], bufs[-1],
        s, h, d, slots.stride(0), slots.stride(1),
        *data[0].stride(), s_slot, s_h,
        host_page_size, host_table.stride(0), host_table.shape[1], *host, *dev,
        PICK_U=pick_unit, WRITE=write, TWO=len(bufs) == 2, HEAD_MAJOR=head_major, BLOCK_D=min(1024, pow2(d)),
        PDL=use_pdl, launch_pdl=use_pdl,
    )
    return dev_off, host_off
