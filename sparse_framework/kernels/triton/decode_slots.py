"""The `@triton.jit` code of the decode step's bookkeeping (launched by `kernels/decode_slots.py`)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl


# -- logical positions -> device slots ------------------------------------------------------------
@triton.jit
def paged_slots_kernel(
    table_ptr, rows_ptr, pos_ptr, out_ptr,
    N, TP, s_table,
    P: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # P is a constexpr: a division by a power-of-two constant is a shift, not a 64-bit
    # division routine per element; positions stay in their own (int32) type until the address
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < N
    r = tl.load(rows_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b * N + i, mask=live, other=-1)
    page_no = pos // P
    ok = (pos >= 0) & (page_no < TP)
    page = tl.load(table_ptr + r * s_table + page_no, mask=live & ok, other=-1).to(tl.int64)
    slot = tl.where(ok & (page >= 0), page * P + pos % P, -1)
    tl.store(out_ptr + b * N + i, slot.to(out_ptr.dtype.element_ty), mask=live)


# -- this step's rows into their device slots ---------------------------------------------------
@triton.jit
def write_token_rows_kernel(
    rows_ptr, lens_ptr, table_ptr, slots_ptr,
    src0, dst0, src1, dst1,
    TP, P, s_table, D,
    s_sb, s_sh, s_sd,  # sources [B, H, D] (both share strides)
    s_dslot, s_dh,  # destination [slots, H, D] or [H, slots, D] of this layer (d contiguous)
    TWO: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)  # h * s_dh passes 2**31 in a head-major pool of > 2**31 / 8 elements per head
    r = tl.load(rows_ptr + b).to(tl.int64)
    pos = tl.load(lens_ptr + b).to(tl.int64) - 1
    page = tl.load(table_ptr + r * s_table + pos // P, mask=pos // P < TP, other=-1).to(tl.int64)
    slot = tl.where(page >= 0, page * P + pos % P, -1)
    if h == 0:
        tl.store(slots_ptr + b, slot)
    if slot >= 0:
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m = d < D
            src = b * s_sb + h * s_sh + d * s_sd
            dst = slot * s_dslot + h * s_dh + d
            tl.store(dst0 + dst, tl.load(src0 + src, mask=m), mask=m)
            if TWO:
                tl.store(dst1 + dst, tl.load(src1 + src, mask=m), mask=m)


# -- selection slots -> FlashAttention page table ----------------------------------------------
@triton.jit
def page_table_kernel(
    slots_ptr, lens_ptr, table_ptr, seqlens_ptr,
    H, W, NP, PS, HEAD_PAGES,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait(PDL)
    bh = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    length = tl.load(lens_ptr + bh)
    if tl.program_id(1) == 0:
        tl.store(seqlens_ptr + bh, length.to(tl.int32))
    live = p < NP
    used = live & (p < (length + PS - 1) // PS)
    first = tl.load(slots_ptr + bh * W + p * PS, mask=used, other=0).to(tl.int64)
    page = first // PS + (bh % H) * HEAD_PAGES
    tl.store(table_ptr + bh * NP + p, tl.where(used, page, 0).to(tl.int32), mask=live)


# -- a buffered layer's new token: its unit, then its rows and their host-write offsets ---------
@triton.jit
def new_token_units_kernel(
    sel_ptr, lens_ptr, ids_ptr, idx_ptr, rows_out_ptr, lens_out_ptr,
    S, U: tl.constexpr, BLOCK_U: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(sel_ptr + b).to(tl.int64)
    length = tl.load(lens_ptr + r)
    pos = length.to(tl.int64) - 1
    tl.store(rows_out_ptr + b, tl.load(ids_ptr + r).to(rows_out_ptr.dtype.element_ty))
    tl.store(lens_out_ptr + b, length.to(lens_out_ptr.dtype.element_ty))
    j = tl.arange(0, BLOCK_U)
    tok = pos // U * U + j
    tok = tl.where(tok <= pos, tok, -1).to(tl.int32)
    for s in range(S):
        tl.store(idx_ptr + (b * S + s) * U + j, tok, mask=j < U)


@triton.jit
def write_new_rows_kernel(
    sel_ptr, lens_ptr, ids_ptr, sparse_ptr, slots_ptr, host_table_ptr, dev_off_ptr, host_off_ptr, count_ptr,
    src0, dst0, src1, dst1,
    S, H, D, s_slb, s_sls,
    s_sb, s_sh, s_sd,  # sources [B, H, D] (both share strides)
    s_dslot, s_dh,  # destination [slots, H, D] or [H, slots, D] of this layer (d contiguous)
    HP, s_ht, TPH, host_base, host_row, host_head, dev_base, dev_slot, dev_head,
    PICK_U: tl.constexpr, WRITE: tl.constexpr, TWO: tl.constexpr, HEAD_MAJOR: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    r = tl.load(sel_ptr + b).to(tl.int64)
    pos = tl.load(lens_ptr + r).to(tl.int64) - 1
    if PICK_U > 0:  # the slots of the new token's unit: take the token's
        slot = tl.load(slots_ptr + b * s_slb + s * s_sls + pos % PICK_U).to(tl.int64)
    else:
        slot = tl.load(slots_ptr + b * s_slb + s * s_sls).to(tl.int64)
    if WRITE:
        if slot >= 0:
            if HEAD_MAJOR:  # stream s is KV head s
                h_lo = s
                h_hi = s + 1
            else:  # one stream: every head at the one slot
                h_lo = s * 0
                h_hi = H + s * 0
            for h in range(h_lo, h_hi):
                for d0 in range(0, D, BLOCK_D):
                    d = d0 + tl.arange(0, BLOCK_D)
                    m = d < D
                    src = r * s_sb + h * s_sh + d * s_sd
                    dst = slot * s_dslot + h * s_dh + d
                    tl.store(dst0 + dst, tl.load(src0 + src, mask=m), mask=m)
                    if TWO:
                        tl.store(dst1 + dst, tl.load(src1 + src, mask=m), mask=m)
    # the host copy of the token: its host row through the request's host page table, for
    # requests that keep one (sparse); the device row it is read from
    state = tl.load(ids_ptr + r).to(tl.int64)
    page = tl.load(host_table_ptr + state * s_ht + pos // HP, mask=pos // HP < TPH, other=-1).to(tl.int64)
    keeps = tl.load(sparse_ptr + r) != 0
    host_row_no = tl.where((page >= 0) & keeps, page * HP + pos % HP, -1)
    # (host_head and dev_head are 0 unless head-major, where stream s is head s)
    host = tl.where(host_row_no >= 0, host_base + host_row_no * host_row + s * host_head, -1)
    dev = tl.where((host >= 0) & (slot >= 0), dev_base + slot * dev_slot + s * dev_head, -1)
    tl.store(host_off_ptr + b * S + s, host)
    tl.store(dev_off_ptr + b * S + s, dev)
    if host >= 0:
        tl.atomic_add(count_ptr, 1)
