"""The hierarchical store's swap-in of a decode selection (`HierarchicalKVStore.residency`):
look the selected units up in the buffer's maps, evict victims for the misses, copy the misses'
rows host -> device (zero-copy on CUDA), and the prefetch of a predicted selection on a side
stream.

`BufferResidency` owns the swap-in's counters (hits, misses, rows copied in; the prefetch's),
its timing and the prefetch's side stream and pending copies. What it shares is passed to it by
the store, which owns it: the slot maps (`SlotMaps`: l2s, s2l, last_used, the recency clock;
the decode writes place new tokens in them too), the device rows (`DeviceRows`: the pools and
the store's page table) and the host pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..common.arith import pow2
from ..common.batch import Batch, Selection
from ..common.layout import KVLayout
from .device_pools import DeviceRows
from .host_pool import HostPool
from .spills import SpilledRequests
from .slot_maps import SlotMaps

@dataclass(frozen=True)
class CopyShapes:
    """The launch shapes of `copy_missing_kernel`, held by the `BufferResidency` that launches it
    (its `copy_shapes`, default today's measured values; `HierarchicalKVStore(copy_shapes=...)`,
    or a benchmark sets one on the instance: benchmarks/swap_in.py --copy-shapes,
    benchmarks/gpu/fused_layer_gpu_runs.sh).

    copy_programs, copy_cols, copy_warps, copy_rows: the decode path's copy: programs, columns
    of a tile, warps, rows per loop iteration (BLOCK_R). One row per iteration: two measured no
    faster with a grid this wide (docs/kv_store.md).

    narrow_row, narrow_programs, narrow_warps, narrow_rows: rows of at most `narrow_row`
    elements (one KV head's row in the head-major layout: Quest, SnapKV, PQCache; 256 bytes for
    Llama-3-8B) take their own shape: 8 warps on a [1, 128] tile leave most threads idle and one
    256-byte PCIe read in flight per program. 1,024 programs of 4 warps with 8 rows an iteration
    cut the 16K x 8 step's copy from 2.52 to 2.03 ms (docs/changelog.md, "Stop 41";
    `fused_layer_gpu_runs.sh copy-grid`); wider rows keep the shape above, measured on them.

    prefetch_programs, prefetch_rows: the prefetch's copy on its side stream (columns and warps:
    copy_cols, copy_warps). It is there to overlap the main stream's compute, but copy_programs
    persistent programs hold every SM until the whole copy is done, so the layer's GEMMs could
    not run beside it (stop 38 measured no overlap). A few programs leave most SMs to the
    compute (16 of the H100's 132), and many rows per iteration keep each one's PCIe reads in
    flight: 32 head-major rows of 128 bf16 are 8 KiB a tensor per program. On the H100 the copy
    then overlaps (docs/changelog.md, "Stop 40"); 16 x 32, 32 x 16 and 8 x 64 step within 2%.
    """

    copy_programs: int = 2048
    copy_cols: int = 1024
    copy_warps: int = 8
    copy_rows: int = 1
    narrow_row: int = 256
    narrow_programs: int = 1024
    narrow_warps: int = 4
    narrow_rows: int = 8
    prefetch_programs: int = 16
    prefetch_rows: int = 32

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CopyShapes.{name} must be a positive int, got {value!r}")
        for name in ("copy_cols", "copy_rows", "narrow_rows", "prefetch_rows"):  # tl.arange lengths
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"CopyShapes.{name} must be a power of two, got {value}")

    def decode(self, row_elems: int) -> tuple[int, int, int]:
        """The decode path's copy launch for rows of `row_elems` elements: (programs, rows per
        loop iteration, warps), the narrow rows' shape or the others' (the class docstring)."""
        if row_elems <= self.narrow_row:
            return self.narrow_programs, self.narrow_rows, self.narrow_warps
        return self.copy_programs, self.copy_rows, self.copy_warps


def decode_copy_shape(row_elems: int, shapes: CopyShapes = CopyShapes()) -> tuple[int, int, int]:
    """`shapes.decode(row_elems)` (default: the default shapes)."""
    return shapes.decode(row_elems)


class BufferResidency:
    """Making selections of buffered rows resident, and the prefetch (module docstring).

    layout, unit (selection granularity), streams (per request, or per KV head), max_units
    (units of max_seq_len), all_resident (the resident store: nothing is ever swapped), impl
    ("triton" or "torch") and device: the store's geometry. maps, device_rows, host_pool and
    spills (a hybrid store's spilled requests: only their rows are buffered): the store's,
    shared (module docstring). copy_shapes: the launch shapes of the fused copy
    (`CopyShapes`, default its defaults); an attribute, so a benchmark may set another on the
    instance.
    """

    def __init__(
        self,
        *,
        layout: KVLayout,
        maps: SlotMaps,
        device_rows: DeviceRows,
        host_pool: HostPool,
        spills: SpilledRequests,
        unit: int,
        streams: int,
        max_units: int,
        all_resident: bool,
        impl: str,
        device: torch.device,
        copy_shapes: CopyShapes | None = None,
    ) -> None:
        self.copy_shapes = CopyShapes() if copy_shapes is None else copy_shapes
        self.layout, self.maps, self.device_rows, self.host_pool = layout, maps, device_rows, host_pool
        self.spills = spills
        self.unit, self.streams, self.max_units = unit, streams, max_units
        self.all_resident, self.impl, self.device = all_resident, impl, device
        self.page_size, self.head_major = device_rows.page_size, device_rows.head_major
        self.buffer_units = maps.buffer_units
        self.row_heads = 1 if self.head_major else layout.num_kv_heads  # KV heads in one stream's row
        self.row_elems = layout.stored_head_dim * self.row_heads  # elements of one stream's row, one tensor
        L = layout.num_layers
        # per layer: hits, misses (selected tokens), rows copied host -> device
        self.counts = torch.zeros(L, 3, dtype=torch.int64, device=device)
        self.hits, self.misses, self.rows_in = self.counts[:, 0], self.counts[:, 1], self.counts[:, 2]
        self.timing = True  # time swap-ins (turn off while capturing a CUDA graph)
        self._swap_seconds = [0.0] * L
        self._swap_events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        # prefetch(): per layer its hits, misses and rows copied; its copies' side stream and events
        self.prefetch_counts = torch.zeros(L, 3, dtype=torch.int64, device=device)
        self._prefetch_side = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._prefetches: dict[int, tuple[torch.cuda.Event, tuple[torch.Tensor, ...]]] = {}

    def swap_seconds(self) -> list[float]:
        """Per layer: seconds spent swapping in so far (waits for the timed CUDA events)."""
        for layer, start, end in self._swap_events:
            end.synchronize()
            self._swap_seconds[layer] += start.elapsed_time(end) / 1000
        self._swap_events.clear()
        return list(self._swap_seconds)

    # -- selection --------------------------------------------------------------------------
    def resident_slots(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        assert batch.slot_ids is not None
        if self.impl == "triton":  # one kernel instead of ~13 torch ops on the decode path
            from ..kernels.decode_slots import paged_slots_rows_triton
            return paged_slots_rows_triton(self.device_rows.table[layer], batch.slot_ids, selection.indices, self.page_size, torch.int32)
        return self.device_rows.slots(layer, batch.slot_ids, selection.indices, torch.int32)

    def ensure_resident(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        """Swap in the missing units of a selection of buffered rows; return device slots.

        1. look every selected unit up in the logical→buffer map (hits, misses);
        2. protect the hits, pick victims among the other units (free first, then least
           recently used; never pinned ones), evict them and map the misses there;
        3. copy the misses' rows host→device (zero-copy gather on CUDA);
        4. stamp recency and count hits, misses and rows moved.
        """
        assert batch.slot_ids is not None and batch.seq_lens is not None
        if not self.buffers_rows_of(batch):  # (the resident store, or a hybrid batch without a spilled row)
            return self.resident_slots(layer, batch, selection)
        self.join_prefetch(layer)
        if self.impl == "triton":
            return self._ensure_resident_fused(layer, batch, selection)
        u = self.unit
        idx = selection.indices
        resident = None
        if self.spills.enabled:  # a hybrid store's resident rows: page-table look-ups, no swap
            resident = ~self.spills.rows(batch.slot_ids).view(-1, 1, 1)
            looked_up = self.resident_slots(layer, batch, selection)
            idx = torch.where(resident, -1, idx)
        b, s, w = idx.shape
        first = idx[..., ::u]
        units = first.long().div(u, rounding_mode="floor")  # [B, S, Wu], -1 stays -1
        valid = first >= 0
        rows = batch.slot_ids
        ri = rows.view(-1, 1, 1)
        hi = torch.arange(s, device=self.device).view(1, -1, 1)
        cur = self.maps.l2s[layer, ri, hi, units.clamp(min=0)].long()
        hit = valid & (cur >= 0)
        miss = valid & (cur < 0)
        protect = torch.zeros(b, s, self.buffer_units + 1, dtype=torch.bool, device=self.device)
        protect.scatter_(2, torch.where(hit, cur, self.buffer_units), True)
        wu = units.shape[-1]
        victims = self.maps.victims(layer, rows, batch.seq_lens, protect[..., : self.buffer_units],
                                    min(wu, self.buffer_units), need=miss.sum(-1))
        if wu > victims.shape[-1]:
            victims = torch.nn.functional.pad(victims, (0, wu - victims.shape[-1]), value=self.buffer_units)
        rank = (miss.long().cumsum(-1) - 1).clamp(min=0)
        victim = victims.gather(-1, rank)
        self.maps.assign(layer, rows, units, miss, victim)
        bu = torch.where(hit, cur, torch.where(miss, victim, -1))  # [B, S, Wu]
        self.maps.last_used[layer, ri, hi, torch.where(valid, bu, self.buffer_units)] = self.maps.clock
        # token-level positions
        offs = torch.arange(u, device=self.device)
        tok_bu = (bu.unsqueeze(-1) * u + offs).flatten(-2)[..., :w]
        tok_bu = torch.where(idx >= 0, tok_bu, -1)
        slots = self.device_rows.slots(layer, rows, tok_bu)  # [B, S, W]
        tok_miss = miss.unsqueeze(-1).expand(-1, -1, -1, u).flatten(-2)[..., :w] & (idx >= 0)
        src_tokens = torch.where(tok_miss, idx.long(), -1)
        start = self._timer() if self.timing else None
        self.copy_in(layer, rows, src_tokens, torch.where(tok_miss, slots, -1))
        if start is not None:
            self._stop_timer(layer, start)
        self.hits[layer] += (hit.unsqueeze(-1).expand(-1, -1, -1, u).flatten(-2)[..., :w] & (idx >= 0)).sum()
        self.misses[layer] += tok_miss.sum()
        if resident is not None:
            return torch.where(resident, looked_up, slots.to(torch.int32))
        return slots.to(torch.int32)

    def buffers_rows_of(self, batch: Batch) -> bool:
        """Whether any row of the batch is buffered in the sparse layers (a hybrid store: only
        its spilled requests; the resident store: none), so that a batch without any runs the
        resident store's path."""
        if self.all_resident:
            return False
        return not self.spills.enabled or self.spills.any_in(batch)

    def _ensure_resident_fused(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        """`ensure_resident` in two kernel launches (kernels/triton/residency.py)."""
        idx = selection.indices.contiguous()
        start = self._timer() if self.timing else None
        slots, todo, n_todo = self._plan_selection(layer, batch, idx, self.counts[layer])
        programs, block_r, warps = self.copy_shapes.decode(self.row_elems)
        self._copy_missing(layer, idx, slots, todo, n_todo, batch.slot_ids, programs=programs, block_r=block_r, warps=warps)
        if start is not None:
            self._stop_timer(layer, start)
        return slots

    def _copy_missing(
        self, layer: int, idx: torch.Tensor, slots: torch.Tensor, todo: torch.Tensor, n_todo: torch.Tensor,
        rows: torch.Tensor, *, programs: int, block_r: int, warps: int,
    ) -> None:
        """One launch of `copy_missing_kernel`: the rows `_plan_residency` found missing, host → device,
        by a grid of `programs` of `warps` warps copying `block_r` rows per loop iteration each (BLOCK_R)."""
        from ..kernels import pdl
        from ..kernels.launch import launch
        from ..kernels.triton.residency import copy_missing_kernel
        from .copy import _as_kernel_arg

        b, s, w = idx.shape
        use_pdl = pdl.enabled(idx.device)
        host = [_as_kernel_arg(t) for t in self.host_pool.tensors]
        pool = self.device_rows.pool_of[layer]
        dev = pool.tensors
        two = len(dev) == 2
        hp = self.host_pool  # host rows: the device's, or fp8 ones the kernel dequantises (FP8_HOST)
        launch(copy_missing_kernel, (programs,),
            todo, n_todo, idx, slots, rows, self.host_pool.host_table,
            host[0], dev[0], host[1] if two else host[0], dev[1] if two else dev[0],
            s, w, self.page_size, self.host_pool.host_table.shape[-1],
            layer * self.host_pool.host_slots * hp.row_elems, pool.layer_offset(layer),
            pool.slots, self.layout.num_kv_heads, b * s, BLOCK_S=pow2(b * s),
            HEAD_MAJOR=self.head_major, TWO=two, ROW=self.row_elems, COLS=min(self.copy_shapes.copy_cols, pow2(self.row_elems)),
            PDL=use_pdl, HROW=hp.head_width * self.row_heads, FP8_HOST=hp.fp8, HEAD_DIM=self.layout.head_dim,
            BLOCK_R=block_r, num_warps=warps, launch_pdl=use_pdl,
        )

    # -- prefetch (SparseConfig.prefetch) ---------------------------------------------------------
    def prefetch(self, layer: int, batch: Batch, selection: Selection) -> None:
        """Make a predicted selection of a later layer resident ahead of that layer's own
        `ensure_resident`: the same plan (its hits and misses counted in `prefetch_counts`, not
        the layer's), its copy on a side stream on CUDA, so that it overlaps the compute queued
        meanwhile. That layer's `ensure_resident` (or the step's end) waits for the copy first;
        its own selection then finds the prefetched rows resident and copies what the
        prediction missed. Nothing else changes: a prefetch only moves rows into the buffer."""
        assert batch.slot_ids is not None and batch.seq_lens is not None
        if not self.buffers_rows_of(batch):
            return
        self.join_prefetch(layer)
        # never the unit of the newest token: `write_decode` places it (a fresh unit must be unmapped
        # there); selections list whole units in ascending order, so this cuts each one's tail
        newest = ((batch.seq_lens.long() - 1) // self.unit * self.unit).view(-1, 1, 1)
        idx = torch.where(selection.indices < newest, selection.indices, -1)
        selection = Selection(idx, (idx >= 0).sum(-1, dtype=torch.int32), selection.page_size)
        if self.impl != "triton" or self._prefetch_side is None:  # inline: the plain path, recounted
            before = self.counts[layer].clone()
            self.ensure_resident(layer, batch, selection)
            self.prefetch_counts[layer] += self.counts[layer] - before
            self.counts[layer].copy_(before)
            return
        idx = idx.contiguous()
        slots, todo, n_todo = self._plan_selection(layer, batch, idx, self.prefetch_counts[layer])
        side = self._prefetch_side
        side.wait_stream(torch.cuda.current_stream(self.device))
        shapes = self.copy_shapes
        with torch.cuda.stream(side):
            self._copy_missing(layer, idx, slots, todo, n_todo, batch.slot_ids,
                               programs=shapes.prefetch_programs, block_r=shapes.prefetch_rows, warps=shapes.copy_warps)
        done = torch.cuda.Event()
        done.record(side)
        # the side stream's inputs stay referenced until the main stream has waited for it
        self._prefetches[layer] = (done, (idx, slots, todo, n_todo, batch.slot_ids, batch.seq_lens))

    def join_prefetch(self, layer: int | None = None) -> None:
        """The main stream waits for the prefetch copy of `layer` (None: of every layer)."""
        for key in list(self._prefetches) if layer is None else [layer]:
            pending = self._prefetches.pop(key, None)
            if pending is not None:
                torch.cuda.current_stream(self.device).wait_event(pending[0])

    def _plan_selection(
        self, layer: int, batch: Batch, idx: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_plan_residency` of a selection idx [B, S, W] of the batch's rows, counted in `counts`."""
        assert batch.slot_ids is not None and batch.seq_lens is not None
        return self.plan_residency(layer, idx, batch.slot_ids, batch.seq_lens, counts,
                                    block_w=pow2(-(-idx.shape[-1] // self.unit)))

    def plan_residency(
        self, layer: int, idx: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, counts: torch.Tensor, *,
        block_w: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One launch of `plan_residency_kernel` over selections idx [B, S, W] (whole units,
        -1 padded) of state `rows` [B] with lengths `lens` [B]: (device slots [B, S, W], the
        missed entries, their count per stream); hits and misses are added to `counts` [3]."""
        from ..kernels import pdl
        from ..kernels.launch import launch
        from ..kernels.triton.residency import plan_residency_kernel

        b, s, w = idx.shape
        u = self.unit
        block_b = pow2(self.buffer_units)
        scratch = torch.empty((b * s, block_b), dtype=torch.int64, device=self.device)
        slots = torch.empty_like(idx)
        todo = torch.empty(b * s * w, dtype=torch.int64, device=self.device)
        n_todo = torch.empty(b * s, dtype=torch.int32, device=self.device)  # every entry written
        use_pdl = pdl.enabled(idx.device)
        launch(plan_residency_kernel, (b * s,),
            idx, rows, lens, self.maps.l2s[layer], self.maps.s2l[layer], self.maps.last_used[layer],
            self.maps.clock, self.device_rows.table[layer], slots, todo, n_todo, scratch, counts, self.spills.flags,
            s, w, -(-w // u), self.max_units, self.buffer_units, u, self.page_size, self.device_rows.table.shape[-1],
            self.maps.sink_tokens, self.maps.recent_tokens,
            BLOCK_W=block_w, BLOCK_B=block_b, BLOCK_U=pow2(u), PDL=use_pdl, HYBRID=self.spills.enabled,
            num_warps=8 if block_b <= 2048 else 16, launch_pdl=use_pdl,
        )
        return slots, todo, n_todo

    def copy_in(self, layer: int, rows: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        """Host→device copy of logical `tokens` [B, S, W] (or [B, W] for all streams) into
        device `slots` (same shape), -1 entries skipped."""
        if tokens.dim() == 2:
            tokens = tokens.unsqueeze(1).expand(-1, self.streams, -1)
            slots = slots.unsqueeze(1).expand(-1, self.streams, -1)
        heads = torch.arange(self.streams, device=self.device).view(1, -1, 1) if self.head_major else 0
        host_rows = self.host_pool.rows(rows, tokens)
        src = self.host_pool.offsets(layer, host_rows, heads)
        dst = self.device_rows.offsets(layer, slots, heads)
        src = torch.where(dst >= 0, src, -1).flatten()
        dst = dst.flatten()
        for dev_buf, host_buf in zip(self.device_rows.pool_of[layer].tensors, self.host_pool.tensors):
            self.host_pool.read_rows(host_buf, dev_buf, src, dst, self.row_heads)
        self.rows_in[layer] += (src >= 0).sum()

    def _timer(self) -> object:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _stop_timer(self, layer: int, start: object) -> None:
        if isinstance(start, float):
            self._swap_seconds[layer] += time.perf_counter() - start
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._swap_events.append((layer, start, end))  # type: ignore[arg-type]
