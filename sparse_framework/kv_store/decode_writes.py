"""The hierarchical store's decode writes (`HierarchicalKVStore.writes`).

A decode token's K/V go to the device at once (its resident slot, or a unit of the request's
buffer: the new token's unit is placed like a miss, `SlotMaps.victims(..., 1)`), and to the host
at the step's end, on a side CUDA stream (`end_step`); `sync` (the store's `begin_step`) makes the
compute stream wait for the last step's writes, so that no step reads a host row before its copy
completed.

`DecodeWrites` owns the queue of host writes, the side stream and the event of the last step's
writes, and the count of rows written to the host. What it shares is passed to it by the store,
which owns it: the slot maps (`SlotMaps`; the swap-in places units in them too), the device rows
(`DeviceRows`: the pools and the store's page table), the host pool, and the swap-in
(`BufferResidency`), whose fused planner places a new token's unit.
"""

from __future__ import annotations

import contextlib

import torch

from ..common.batch import Batch
from ..common.layout import KVLayout
from .copy import write_token_rows
from .device_pools import DeviceRows
from .host_pool import HostPool
from .residency import BufferResidency
from .slot_maps import SlotMaps


class DecodeWrites:
    """The decode-time writes, to the device and (queued) to the host (module docstring).

    layout, unit (selection granularity), streams (per request, or per KV head), dense_layers,
    all_resident (the resident store: no host copy), impl ("triton" or "torch") and device: the
    store's geometry. maps, device_rows, host_pool, residency: the store's, shared (module
    docstring).
    """

    def __init__(
        self,
        *,
        layout: KVLayout,
        maps: SlotMaps,
        device_rows: DeviceRows,
        host_pool: HostPool,
        residency: BufferResidency,
        unit: int,
        streams: int,
        dense_layers: frozenset[int],
        all_resident: bool,
        impl: str,
        device: torch.device,
    ) -> None:
        self.layout, self.maps, self.device_rows, self.host_pool = layout, maps, device_rows, host_pool
        self.residency = residency
        self.unit, self.streams, self.dense_layers = unit, streams, dense_layers
        self.all_resident, self.impl, self.device = all_resident, impl, device
        self.page_size, self.head_major = device_rows.page_size, device_rows.head_major
        self.buffer_units = maps.buffer_units
        self.row_heads = 1 if self.head_major else layout.num_kv_heads  # KV heads in one stream's row
        self.rows_out = torch.zeros(layout.num_layers, dtype=torch.int64, device=device)  # token rows device -> host
        self._uncounted = torch.zeros(3, dtype=torch.int64, device=device)  # counters of the new tokens' placement
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, dev off, host off)
        self._side = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._writes_done: torch.cuda.Event | None = None

    # -- decode -----------------------------------------------------------------------------
    def write_decode(self, layer: int, batch: Batch, data: list[torch.Tensor]) -> None:
        """The batch's new token rows (`data`: K and V, or the latent, [batch, kv_heads, dim]
        each, as stored) to the device, their host copy queued for `end_step`."""
        assert batch.seq_lens is not None and batch.slot_ids is not None
        buffering = self.residency.buffers_rows_of(batch)  # False: every row resident in every layer
        if not buffering or layer in self.dense_layers or batch.num_sparse == 0:
            # the whole batch is resident in this layer: find the slots and write, one kernel on CUDA
            if self.impl == "triton":
                from ..kernels.decode_slots import write_token_rows_triton as write
            else:
                write = write_token_rows
            if any(x.stride() != data[0].stride() for x in data):
                data = [x.contiguous() for x in data]
            slots = write(
                self.device_rows.buffers(layer), self.device_rows.table[layer], batch.slot_ids, batch.seq_lens,
                data, self.page_size, self.head_major,
            )
            if buffering and batch.num_sparse:
                everything = torch.arange(len(batch), device=self.device)
                # every stream's host copy (head-major: one per KV head, all at the token's slot)
                per_stream = slots.view(-1, 1).expand(-1, self.streams)
                if self.impl == "triton":  # the offsets in one launch
                    self._write_and_queue(layer, batch, everything, per_stream, 0, data, write=False)
                else:
                    self._queue_host_write(layer, batch, everything, per_stream)
            return
        # a batch with sparse requests in a sparse layer: dense requests stay resident
        assert batch.sparse_rows is not None and batch.dense_rows is not None
        resident = batch.dense_rows if batch.num_sparse < len(batch) else None
        buffered = batch.sparse_rows
        if resident is not None:
            pos = batch.seq_lens[resident].long() - 1
            slots = self.device_rows.slots(layer, batch.slot_ids[resident], pos.unsqueeze(1))  # [n, 1]
            if self.impl == "triton":
                self._write_and_queue(layer, batch, resident, slots.expand(-1, self.streams), 0, data)
            else:
                self.device_rows.put(layer, slots[:, 0], [x[resident] for x in data])
                self._queue_host_write(layer, batch, resident, slots.expand(-1, self.streams))
        if self.impl == "triton":
            self._place_and_write_fused(layer, batch, buffered, data)
            return
        rows, p = batch.slot_ids[buffered], batch.seq_lens[buffered].long() - 1
        unit = (p // self.unit).view(-1, 1, 1).expand(-1, self.streams, 1)  # [n, S, 1]
        fresh = (p % self.unit == 0).view(-1, 1, 1).expand(-1, self.streams, 1)
        spilled = self.residency.spills.rows(rows) if self.residency.spills.enabled else None
        if spilled is not None:  # a hybrid store's resident rows take no buffer unit
            fresh = fresh & spilled.view(-1, 1, 1)
        heads = torch.arange(self.streams, device=self.device).view(1, -1)
        existing = self.maps.l2s[layer, rows.view(-1, 1), heads, unit[..., 0]].long().unsqueeze(-1)
        nothing = torch.zeros(rows.numel(), self.streams, self.buffer_units, dtype=torch.bool, device=self.device)
        victim = self.maps.victims(layer, rows, batch.seq_lens[buffered], nothing, 1)
        self.maps.assign(layer, rows, unit, fresh, victim)
        bu = torch.where(fresh, victim, existing)[..., 0]  # [n, S]
        self.maps.last_used[layer, rows.view(-1, 1), heads, bu] = self.maps.clock
        pos = torch.where(bu >= 0, bu * self.unit + (p % self.unit).view(-1, 1), -1)  # -1: not placed (resident)
        slots = self.device_rows.slots(layer, rows, pos)  # [n, S]
        if spilled is not None:  # ... but their token's own slot, through the page table
            own = self.device_rows.slots(layer, rows, p.view(-1, 1)).expand(-1, self.streams)
            slots = torch.where(spilled.view(-1, 1), slots, own)
        self.device_rows.put(layer, slots if self.head_major else slots[:, 0], [x[buffered] for x in data])
        self._queue_host_write(layer, batch, buffered, slots)

    def _place_and_write_fused(self, layer: int, batch: Batch, sel: torch.Tensor, data: list[torch.Tensor]) -> None:
        """The new tokens of batch rows `sel` placed in their buffers, written and queued for the
        host in three launches instead of ~50 torch ops per layer (the torch path of
        `write_decode`): each stream's "selection" is the unit of its new token (the tokens past
        it -1), planned by the residency kernel — a fresh unit misses and takes a victim exactly as
        `SlotMaps.victims(..., 1)` picks one (free, then least recently used, never pinned;
        nothing protected), an existing unit hits and is stamped; nothing is copied (the unit's
        earlier tokens are on the device) and the hit/miss counters are not touched — then one
        kernel writes the rows and the offsets of their host copy."""
        from ..kernels.decode_slots import new_token_units_triton

        idx, rows, lens = new_token_units_triton(sel, batch.seq_lens, batch.slot_ids, self.streams, self.unit)
        slots, _, _ = self.residency.plan_residency(layer, idx, rows, lens, self._uncounted, block_w=2)
        self._write_and_queue(layer, batch, sel, slots, self.unit, data)

    def _write_and_queue(
        self, layer: int, batch: Batch, sel: torch.Tensor, slots: torch.Tensor, pick_unit: int,
        data: list[torch.Tensor], write: bool = True,
    ) -> None:
        """`DeviceRows.put` then `_queue_host_write` of rows `sel` in one launch (kernels/decode_slots.py
        `write_new_rows_triton`; slots [n, S] or, with pick_unit, the new token's unit [n, S, u])."""
        from ..kernels.decode_slots import write_new_rows_triton

        assert batch.slot_ids is not None and batch.seq_lens is not None and batch.sparse_mask is not None
        hp, pool = self.host_pool, self.device_rows.pool_of[layer]
        hk, hw, dw = self.layout.num_kv_heads, hp.head_width, self.layout.stored_head_dim
        major = self.head_major
        host = (layer * hp.host_slots * hk * hw, hk * hw, hw if major else 0)
        i = pool.index[layer]
        dev = (i * hk * pool.slots * dw, dw, pool.slots * dw) if major else (i * pool.slots * hk * dw, hk * dw, 0)
        if any(x.stride() != data[0].stride() for x in data):
            data = [x.contiguous() for x in data]
        dev_off, host_off = write_new_rows_triton(
            self.device_rows.buffers(layer), data, sel, batch.seq_lens, batch.slot_ids, batch.sparse_mask, slots,
            pick_unit, hp.host_table, hp.page_size, host, dev, self.rows_out[layer : layer + 1], major, write,
        )
        self._pending.append((layer, dev_off.flatten(), host_off.flatten()))

    def _queue_host_write(self, layer: int, batch: Batch, sel: torch.Tensor, slots: torch.Tensor) -> None:
        """Remember the device→host copy of rows `sel`'s new token (device slots [n, S]);
        requests in dense mode keep no host copy."""
        assert batch.slot_ids is not None and batch.seq_lens is not None
        if self.all_resident or batch.num_sparse == 0:
            return
        heads = torch.arange(self.streams, device=self.device).view(1, -1) if self.head_major else 0
        pos = batch.seq_lens[sel].long().unsqueeze(1) - 1
        host_rows = self.host_pool.rows(batch.slot_ids[sel], pos).expand(-1, self.streams)
        host_rows = torch.where(batch.sparse_mask[sel].view(-1, 1), host_rows, -1)
        host_off = self.host_pool.offsets(layer, host_rows, heads)
        dev_off = torch.where(host_off >= 0, self.device_rows.offsets(layer, slots, heads), -1)
        self.rows_out[layer] += (host_off >= 0).sum()
        self._pending.append((layer, dev_off.flatten(), host_off.flatten()))

    def pending_mark(self) -> int:
        """How many host writes are queued (see `take_pending`)."""
        return len(self._pending)

    def take_pending(self, mark: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Unqueue and return the host writes queued since `mark`: a decode layer captured in a
        CUDA graph queues its writes once, while captured; `queue_pending` queues them again
        after every replay (their offset tensors are the graph's, refilled by the replay)."""
        taken = self._pending[mark:]
        del self._pending[mark:]
        return taken

    def queue_pending(self, writes: list[tuple[int, torch.Tensor, torch.Tensor]] | None) -> None:
        self._pending.extend(writes or ())

    def end_step(self, batch: Batch) -> None:
        """Start this step's device→host writes (on a side stream on CUDA)."""
        if not self._pending:
            return
        # one copy per device pool (its offsets address that pool's tensors)
        groups = []
        for pool in self.device_rows.pools:
            mine = [p for p in self._pending if self.device_rows.pool_of[p[0]] is pool]
            if mine:
                groups.append((pool, torch.cat([p[1] for p in mine]), torch.cat([p[2] for p in mine])))
        self._pending.clear()
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
            for pool, src_off, dst_off in groups:
                for dev_buf, host_buf in zip(pool.tensors, self.host_pool.tensors):
                    self.host_pool.write_rows(dev_buf, host_buf, src_off, dst_off, self.row_heads)
        if self._side is None:
            return
        for _, src_off, dst_off in groups:
            src_off.record_stream(self._side)
            dst_off.record_stream(self._side)
        self._writes_done = torch.cuda.Event()
        self._writes_done.record(self._side)

    def sync(self) -> None:
        """The compute stream waits (on the GPU) for the last step's host writes."""
        if self._writes_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._writes_done)
            self._writes_done = None
