"""Fused decode-path kernels of the hierarchical store (see kv_store/hierarchical.py).

`plan_residency_kernel`, one program per stream (request, or request x KV head):
look the selected units up in the logical->buffer map and stamp the hits with the step's
clock; only if something missed, mark the hits in a scratch row (protected), order the other
buffer units — free first, then least recently used, never a pinned one (sink, recent
window, newest) — by one in-register sort of packed (age, unit) keys; the j-th miss takes
the j-th victim; evict, remap, stamp. Writes each selected unit's buffer unit and miss flag.

`place_and_copy_kernel`, one program per selected token: the token's device slot (through
the device page table) for the adaptor, and, for a miss, the host row (through the host
page table) copied into that slot straight from pinned host memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

KEY_BITS = 20  # buffer units per stream < 2**20


@triton.jit
def plan_residency_kernel(
    idx_ptr,  # int32 [B, S, W] selected tokens, whole units, -1 padded
    rows_ptr,  # int64 [B] state rows
    lens_ptr,  # int32 [B] sequence lengths
    l2s_ptr,  # int32 [R, S, MAXU + 1] (this layer)
    s2l_ptr,  # int32 [R, S, UB + 1]
    used_ptr,  # int64 [R, S, UB + 1]
    clock_ptr,  # int64 []
    bu_ptr,  # out int32 [B, S, WU]
    miss_ptr,  # out int8 [B, S, WU]
    scratch_ptr,  # int64 [B * S, BLOCK_B]
    count_ptr,  # int64 [3]: hits, misses (tokens), rows copied
    S, W, WU, MAXU, UB, U, SINK, RECENT,
    BLOCK_W: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // S
    h = pid % S
    r = tl.load(rows_ptr + b)
    length = tl.load(lens_ptr + b)
    clock = tl.load(clock_ptr)
    l2s = l2s_ptr + (r * S + h) * (MAXU + 1)
    s2l = s2l_ptr + (r * S + h) * (UB + 1)
    used = used_ptr + (r * S + h) * (UB + 1)

    w = tl.arange(0, BLOCK_W)
    in_row = (w < WU) & (w * U < W)
    first = tl.load(idx_ptr + pid * W + w * U, mask=in_row, other=-1)
    valid = first >= 0
    unit = tl.where(valid, first // U, 0)
    cur = tl.load(l2s + unit, mask=valid, other=-1)
    hit = valid & (cur >= 0)
    miss = valid & (cur < 0)
    tokens = tl.minimum(U, length - unit * U)
    n_hit = tl.sum(tl.where(hit, tokens, 0), axis=0)
    n_miss_tok = tl.sum(tl.where(miss, tokens, 0), axis=0)
    tl.atomic_add(count_ptr, n_hit.to(tl.int64))
    tl.atomic_add(count_ptr + 1, n_miss_tok.to(tl.int64))
    tl.atomic_add(count_ptr + 2, n_miss_tok.to(tl.int64))
    tl.store(used + cur, clock, mask=hit)
    bu = tl.where(hit, cur, -1)
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    if n_miss > 0:
        # mark this call's hits in the scratch row: they are protected from eviction
        j = tl.arange(0, BLOCK_B)
        row = scratch_ptr + pid * BLOCK_B
        tl.store(row + j, tl.zeros([BLOCK_B], dtype=tl.int64))
        tl.debug_barrier()
        tl.store(row + cur, tl.full([BLOCK_W], 1, tl.int64), mask=hit)
        tl.debug_barrier()
        protected = tl.load(row + j) != 0
        tl.debug_barrier()
        in_buf = j < UB
        owner = tl.load(s2l + j, mask=in_buf, other=-1)
        age = tl.load(used + j, mask=in_buf, other=0)
        recent_start = tl.maximum(length - RECENT, 0) // U
        pinned = (owner >= 0) & ((owner * U < SINK) | (owner >= recent_start) | (owner >= (length - 1) // U))
        free = owner < 0
        eligible = in_buf & ~pinned & ~protected
        age = tl.where(free, -1, age)
        key = tl.where(eligible, ((age + 1) << 20) | j.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
        ordered = tl.sort(key)
        victim_of_rank = tl.where(ordered == 0x7FFFFFFFFFFFFFFF, UB, ordered & ((1 << 20) - 1))
        tl.store(row + j, victim_of_rank)
        tl.debug_barrier()
        rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        victim = tl.load(row + rank, mask=miss, other=0).to(tl.int32)
        # (victim == UB, the trash column, only if a selection and the pinned units overflow
        # the buffer, which the config check rules out; never evict or copy through it)
        old = tl.load(s2l + victim, mask=miss & (victim < UB), other=-1)
        tl.store(l2s + old, -1, mask=miss & (old >= 0))
        tl.debug_barrier()
        tl.store(l2s + unit, victim, mask=miss)
        tl.store(s2l + victim, unit, mask=miss)
        tl.store(used + victim, clock, mask=miss)
        bu = tl.where(miss, victim, bu)
    tl.store(bu_ptr + pid * WU + w, bu, mask=w < WU)
    tl.store(miss_ptr + pid * WU + w, miss.to(tl.int8), mask=w < WU)


@triton.jit
def place_and_copy_kernel(
    idx_ptr,  # int32 [B, S, W]
    bu_ptr,  # int32 [B, S, WU]
    miss_ptr,  # int8 [B, S, WU]
    rows_ptr,  # int64 [B]
    dev_table_ptr,  # int32 [R, TP_DEV] (this layer)
    host_table_ptr,  # int32 [R, TP_HOST]
    slots_ptr,  # out int32 [B, S, W]
    host0, dev0, host1, dev1,  # K and V (or the latent twice)
    S, W, WU, UB, U, P, TP_DEV, TP_HOST, HOST_BASE, DEV_BASE, HOST_SLOTS, DEV_SLOTS, HK,
    HEAD_MAJOR: tl.constexpr,
    TWO: tl.constexpr,
    ROW: tl.constexpr,
    COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    stream = pid // W
    i = pid % W
    b = stream // S
    h = stream % S
    t = tl.load(idx_ptr + pid)
    if t < 0:
        tl.store(slots_ptr + pid, -1)
    else:
        r = tl.load(rows_ptr + b)
        bu = tl.load(bu_ptr + stream * WU + i // U)
        pos = bu * U + t % U
        page = tl.load(dev_table_ptr + r * TP_DEV + pos // P, mask=bu < UB, other=-1).to(tl.int64)
        slot = tl.where(page >= 0, page * P + pos % P, -1)
        tl.store(slots_ptr + pid, slot.to(tl.int32))
        if (tl.load(miss_ptr + stream * WU + i // U) != 0) & (slot >= 0):
            hpage = tl.load(host_table_ptr + r * TP_HOST + t // P).to(tl.int64)
            hrow = hpage * P + t % P
            if HEAD_MAJOR:
                src = HOST_BASE + (hrow * HK + h) * ROW
                dst = DEV_BASE + (h * DEV_SLOTS + slot) * ROW
            else:
                src = HOST_BASE + hrow * ROW
                dst = DEV_BASE + slot * ROW
            for start in range(0, ROW, COLS):
                cols = start + tl.arange(0, COLS)
                m = cols < ROW
                tl.store(dev0 + dst + cols, tl.load(host0 + src + cols, mask=m), mask=m)
                if TWO:
                    tl.store(dev1 + dst + cols, tl.load(host1 + src + cols, mask=m), mask=m)
