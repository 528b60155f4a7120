"""Fused decode-path kernels of the hierarchical store (see kv_store/hierarchical.py).

`plan_residency_kernel`, one program per stream (request, or request x KV head):
look the selected units up in the logical->buffer map and stamp the hits with the step's
clock; only if something missed, mark the hits in a scratch row (protected), choose as many
victims as there are misses among the other buffer units — free first, then least recently
used, never a pinned one (sink, recent window, newest) — by bisecting for the age at the cut
(a few reductions; a full sort of the buffer's 4096 keys took ~100 µs, 8 streams on 8 SMs);
the j-th miss takes the j-th victim in unit order; evict, remap, stamp. Writes each selected
unit's buffer unit and miss flag.

The same kernel then writes every selected token's device slot (for the adaptor), and each
stream's missed tokens, compacted, with their count (a plain store: nothing to zero before
the launch). `copy_missing_kernel`, a fixed grid walking those lists as one, copies each
missed row into its slot straight from pinned host memory (BLOCK_R rows per iteration of a
program), so a step without misses costs one vector load per copy program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .fp8_host import decode_e4m3


@triton.jit
def plan_residency_kernel(
    idx_ptr,  # int32 [B, S, W] selected tokens, whole units, -1 padded
    rows_ptr,  # int64 [B] state rows
    lens_ptr,  # int32 [B] sequence lengths
    l2s_ptr,  # int32 [R, S, MAXU + 1] (this layer)
    s2l_ptr,  # int32 [R, S, UB + 1]
    used_ptr,  # int64 [R, S, UB + 1]
    clock_ptr,  # int64 []
    dev_table_ptr,  # int32 [R, TP_DEV] (this layer)
    slots_ptr,  # out int32 [B, S, W]: device slot of every selected token, -1 padded
    todo_ptr,  # out int64 [B * S * W]: flat entries (stream * W + i) of missed tokens, each
               # stream's compacted at the start of its own W entries
    n_todo_ptr,  # out int32 [B * S]: entries of each stream in todo (always written)
    scratch_ptr,  # int64 [B * S, BLOCK_B]
    count_ptr,  # int64 [3]: hits, misses (tokens), rows copied
    spilled_ptr,  # int32 [R]: 1 where the row is spilled (HYBRID; else never read)
    S, W, WU, MAXU, UB, U, P, TP_DEV, SINK, RECENT,
    BLOCK_W: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_U: tl.constexpr,
    PDL: tl.constexpr,
    HYBRID: tl.constexpr,
):
    pdl.wait(PDL)
    pid = tl.program_id(0)
    b = pid // S
    h = pid % S
    r = tl.load(rows_ptr + b)
    resident = False
    if HYBRID:  # a hybrid store's row that is not spilled holds every token in its pages
        resident = tl.load(spilled_ptr + r) == 0
    if resident:
        _resident_slots(idx_ptr, dev_table_ptr, slots_ptr, n_todo_ptr, pid, r, W, WU, U, P, TP_DEV,
                        BLOCK_W, BLOCK_U)
    else:
        _plan_buffered(idx_ptr, lens_ptr, l2s_ptr, s2l_ptr, used_ptr, clock_ptr, dev_table_ptr, slots_ptr,
                       todo_ptr, n_todo_ptr, scratch_ptr, count_ptr, pid, b, h, r,
                       S, W, WU, MAXU, UB, U, P, TP_DEV, SINK, RECENT, BLOCK_W, BLOCK_B, BLOCK_U)


@triton.jit
def _resident_slots(idx_ptr, dev_table_ptr, slots_ptr, n_todo_ptr, pid, r, W, WU, U, P, TP_DEV,
                    BLOCK_W: tl.constexpr, BLOCK_U: tl.constexpr):
    """A resident row's selected tokens: their slots through the page table; nothing to copy."""
    w = tl.arange(0, BLOCK_W)
    o = tl.arange(0, BLOCK_U)
    entry = w[:, None] * U + o[None, :]
    in_sel = (w[:, None] < WU) & (o[None, :] < U) & (entry < W)
    tok = tl.load(idx_ptr + pid * W + entry, mask=in_sel, other=-1)
    page = tl.load(dev_table_ptr + r * TP_DEV + tok // P, mask=tok >= 0, other=-1).to(tl.int64)
    slot = tl.where(page >= 0, page * P + tok % P, -1)
    tl.store(slots_ptr + pid * W + entry, slot.to(tl.int32), mask=in_sel)
    tl.store(n_todo_ptr + pid, 0)


@triton.jit
def _plan_buffered(idx_ptr, lens_ptr, l2s_ptr, s2l_ptr, used_ptr, clock_ptr, dev_table_ptr, slots_ptr,
                   todo_ptr, n_todo_ptr, scratch_ptr, count_ptr, pid, b, h, r,
                   S, W, WU, MAXU, UB, U, P, TP_DEV, SINK, RECENT,
                   BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_U: tl.constexpr):
    """A buffered row's plan (the module docstring)."""
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
        # the victims: the `need` eligible units of lowest (age, unit), free ones (age -1)
        # first, taken in ascending unit order. A = the need-th lowest age + 1, by bisection
        # over the ages present (log2 of their span steps, a reduction each), not a sort
        a1 = tl.where(free, 0, age + 1)
        need = tl.minimum(n_miss, tl.sum(eligible.to(tl.int32), axis=0))
        lo = tl.min(tl.where(eligible, a1, 0x7FFFFFFFFFFFFFFF), axis=0)
        hi = tl.max(tl.where(eligible, a1, -1), axis=0)
        while lo < hi:
            mid = lo + (hi - lo) // 2
            enough = tl.sum((eligible & (a1 <= mid)).to(tl.int32), axis=0) >= need
            hi = tl.where(enough, mid, hi)
            lo = tl.where(enough, lo, mid + 1)
        below = eligible & (a1 < lo)
        at = eligible & (a1 == lo)  # ties at the cut: the lowest units
        take = below | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= need - tl.sum(below.to(tl.int32), axis=0)))
        tl.store(row + j, tl.full([BLOCK_B], UB, tl.int64))  # ranks past the victims: trash
        tl.debug_barrier()
        tl.store(row + tl.cumsum(take.to(tl.int32), axis=0) - 1, j.to(tl.int64), mask=take)
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
    # every selected token's slot: unit w's tokens are entries w*U .. w*U+U-1 of the row
    o = tl.arange(0, BLOCK_U)
    entry = w[:, None] * U + o[None, :]
    in_sel = (w[:, None] < WU) & (o[None, :] < U) & (entry < W)
    tok = tl.load(idx_ptr + pid * W + entry, mask=in_sel, other=-1)
    placed = (tok >= 0) & (bu[:, None] >= 0) & (bu[:, None] < UB)
    pos = bu[:, None] * U + o[None, :]
    page = tl.load(dev_table_ptr + r * TP_DEV + pos // P, mask=placed, other=-1).to(tl.int64)
    slot = tl.where(page >= 0, page * P + pos % P, -1)
    tl.store(slots_ptr + pid * W + entry, slot.to(tl.int32), mask=in_sel)
    # this stream's missed tokens, compacted, for the copy kernel (a plain store of the count:
    # no counter to zero before the launch, no atomic)
    todo = miss[:, None] & (slot >= 0)
    n_todo = tl.sum(tl.sum(todo.to(tl.int32), axis=1), axis=0)
    tl.store(n_todo_ptr + pid, n_todo)
    if n_todo > 0:
        flat = tl.reshape(todo.to(tl.int32), [BLOCK_W * BLOCK_U])
        rank = tl.cumsum(flat, axis=0) - 1
        where = tl.reshape(pid * W + entry, [BLOCK_W * BLOCK_U]).to(tl.int64)
        tl.store(todo_ptr + pid * W + rank, where, mask=flat != 0)


@triton.jit
def copy_missing_kernel(
    todo_ptr,  # int64 [B * S * W] flat entries of missed tokens, per stream
    n_todo_ptr,  # int32 [B * S] entries per stream
    idx_ptr,  # int32 [B, S, W]
    slots_ptr,  # int32 [B, S, W]
    rows_ptr,  # int64 [B]
    host_table_ptr,  # int32 [R, TP_HOST]
    host0, dev0, host1, dev1,  # K and V (or the latent twice)
    S, W, P, TP_HOST, HOST_BASE, DEV_BASE, DEV_SLOTS, HK, NS,
    BLOCK_S: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    TWO: tl.constexpr,
    ROW: tl.constexpr,
    COLS: tl.constexpr,
    PDL: tl.constexpr,
    HROW: tl.constexpr,  # host elements of a stream's row: ROW, or its fp8 bytes with FP8_HOST
    FP8_HOST: tl.constexpr = False,  # host rows of HEAD_DIM e4m3 bytes + a scale byte per head
    HEAD_DIM: tl.constexpr = 1,
    BLOCK_R: tl.constexpr = 1,  # missed rows per loop iteration (a power of two)
):
    """A fixed grid walks the streams' to-do lists as one: the k-th missed row overall is
    found from the prefix sums of the per-stream counts (one vector load per program, so
    nothing to do costs one load per program).

    Each iteration of a program's loop copies the BLOCK_R consecutive rows k = base ..
    base + BLOCK_R - 1 of that walk (masked past its n rows) as a [BLOCK_R, COLS] tile:
    their streams by one [BLOCK_R, BLOCK_S] compare against the prefix sums, their look-ups
    (to-do entry -> token and device slot, state row -> host page) as vector loads, the rows
    as 2-D loads and stores; program p takes rows p * BLOCK_R .. and every
    num_programs * BLOCK_R-th after. Why: a program has at most one tile's loads in flight,
    so a small grid reaches PCIe's rate only with many rows per tile. The decode path's copy
    keeps one row per iteration over a grid that fills every SM (two MLA rows measured no
    faster there, docs/kv_store.md); the prefetch's copy on its side stream runs a few
    programs of many rows each, so that the compute it should overlap keeps the other SMs
    (kv_store/residency.py, CopyShapes.prefetch_programs). BLOCK_R = 1 walks the rows as the one-row
    loop before it did (its loads now [1]-vectors, masked).

    FP8_HOST (kv_store/fp8_host.py): the host rows are fp8 with a scale byte after each
    head's HEAD_DIM values, dequantised to the device's dtype on the way
    (kernels/triton/fp8_host.py `decode_e4m3`)."""
    pdl.wait(PDL)
    si = tl.arange(0, BLOCK_S)
    count = tl.load(n_todo_ptr + si, mask=si < NS, other=0)
    ends = tl.cumsum(count, axis=0)
    begins = ends - count
    n = tl.sum(count, axis=0)
    rr = tl.arange(0, BLOCK_R)
    for base in range(tl.program_id(0) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        k = base + rr
        live = k < n
        # row k's stream: how many streams' rows all come before it (BLOCK_S past n: masked)
        owner = tl.sum((ends[None, :] <= k[:, None]).to(tl.int32), axis=1)
        begin = tl.sum(tl.where(si[None, :] == owner[:, None], begins[None, :], 0), axis=1)
        e = tl.load(todo_ptr + owner.to(tl.int64) * W + (k - begin), mask=live, other=0)
        stream = e // W
        b = stream // S
        h = stream % S
        t = tl.load(idx_ptr + e, mask=live, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + e, mask=live, other=0).to(tl.int64)
        r = tl.load(rows_ptr + b, mask=live, other=0)
        page = tl.load(host_table_ptr + r * TP_HOST + t // P, mask=live, other=0).to(tl.int64)
        hrow = page * P + t % P
        if HEAD_MAJOR:
            src = HOST_BASE + (hrow * HK + h) * HROW
            dst = DEV_BASE + (h * DEV_SLOTS + slot) * ROW
        else:
            src = HOST_BASE + hrow * HROW
            dst = DEV_BASE + slot * ROW
        src = src[:, None]  # [BLOCK_R, 1]
        dst = dst[:, None]
        for start in range(0, ROW, COLS):
            cols = start + tl.arange(0, COLS)
            m = live[:, None] & (cols < ROW)[None, :]  # [BLOCK_R, COLS]
            cols = cols[None, :]
            if FP8_HOST:  # device column c: head c // HEAD_DIM, its value c % HEAD_DIM, then its scale
                head = src + (cols // HEAD_DIM) * (HEAD_DIM + 1)
                byte = head + cols % HEAD_DIM
                value = decode_e4m3(tl.load(host0 + byte, mask=m, other=0),
                                    tl.load(host0 + head + HEAD_DIM, mask=m, other=0))
                tl.store(dev0 + dst + cols, value.to(dev0.dtype.element_ty), mask=m)
                if TWO:
                    value = decode_e4m3(tl.load(host1 + byte, mask=m, other=0),
                                        tl.load(host1 + head + HEAD_DIM, mask=m, other=0))
                    tl.store(dev1 + dst + cols, value.to(dev1.dtype.element_ty), mask=m)
            else:
                tl.store(dev0 + dst + cols, tl.load(host0 + src + cols, mask=m), mask=m)
                if TWO:
                    tl.store(dev1 + dst + cols, tl.load(host1 + src + cols, mask=m), mask=m)
