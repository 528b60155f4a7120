"""The two-tier KV store: full KV in pinned host memory, a fixed device buffer per request.

Tiers and modes
  host     every token of every live sparse request, all layers ([layers, host slots,
           kv_heads, dim] per tensor, pinned on CUDA machines), paged by `page_size`.
  device   one paged pool per layer. A (request, layer) is either *resident* (every token
           on the device: short prompts, `dense_layers`) or *buffered* (a fixed buffer of
           `device_buffer_tokens` slots holding the sink, the recent window and whatever the
           algorithm selected lately).

Buffered (request, layer)s are managed in *units* (a page for page-granular algorithms, a
token otherwise) and per *stream* (one per request, or one per KV head when the algorithm
selects per KV head). Per stream the store keeps a logical→buffer-unit map, its inverse and
the step each unit was last used, all in device tensors, so that the decode path —
`write_decode`, `ensure_resident` — runs without a host synchronisation or a Python loop
over requests (masked writes go to a trash column instead of being filtered).

Asynchronous host writes: a decode token's rows go to the device buffer at once and to the
host at `end_step`, on a side CUDA stream; `begin_step` makes the compute stream wait for
them, so no step reads a host row before its copy completed.

The store is split in parts that own their state: the decode writes are
`decode_writes.DecodeWrites` (`self.writes`: the queue of host writes, their side stream and
the rows written out), the swap-in of a selection (and the prefetch)
`residency.BufferResidency` (`self.residency`: the swap-in's counters, timing and prefetch
copies); admission, prefill, retract/resume and the accounting are here. The store owns what
they share and passes it to them: the slot maps (`SlotMaps`), the host pool (`HostPool`) and the
device rows (`DeviceRows`: the pools and the device page table, which only the store maps).
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet

import torch

from ..common.batch import Batch, Request, Selection
from ..common.errors import CapacityError
from ..common.transfer import tensor_to_device
from .base import KVStore
from .decode_writes import DecodeWrites
from .residency import BufferResidency, CopyShapes
from ..common.flashmla_format import pack_flashmla_fp8
from .fp8_host import check_host_kv_dtype, is_fp8_host
from .host_pool import HostPool
from ..common.arith import cdiv
from ..common.layout import KVLayout, resolve_impl
from .device_pools import DENSE_LAYERS, RESIDENT, DevicePool, DeviceRows, buffer_pages, size_device_pools
from .slot_maps import SlotMaps
from .spills import SpilledRequests

log = logging.getLogger(__name__)
_RESIDENT, _BUFFERED = "resident", "buffered"



class HierarchicalKVStore(KVStore):
    """See the module docstring. `unit` is the selection granularity (page_size or 1)."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        page_size: int,
        device_buffer_tokens: int,
        sink_tokens: int,
        recent_tokens: int,
        dense_layers: list[int] | tuple[int, ...] = (),
        unit: int = 1,
        per_kv_head: bool = False,
        max_requests: int = 8,
        max_seq_len: int = 32768,
        device_capacity_tokens: int | None = None,
        host_capacity_tokens: int | None = None,
        min_sparse_prompt_len: int | None = None,
        pin_memory: bool | None = None,
        resident_only: bool = False,
        hybrid: bool = False,
        impl: str = "auto",
        host_kv_dtype: str = "auto",
        copy_shapes: CopyShapes | None = None,
    ) -> None:
        if page_size % unit:
            raise ValueError(f"unit ({unit}) must divide page_size ({page_size})")
        if hybrid and resident_only:
            raise ValueError("a store is hybrid or resident-only, not both")
        self.layout = layout
        self.page_size = page_size
        self.unit = unit
        self.head_major = per_kv_head
        self.streams = layout.num_kv_heads if per_kv_head else 1
        self.buffer_tokens = buffer_pages(device_buffer_tokens, page_size, max_seq_len) * page_size
        self.buffer_units = self.buffer_tokens // unit
        self.sink_tokens, self.recent_tokens = sink_tokens, recent_tokens
        self.dense_layers = frozenset(dense_layers)
        self.sparse_layers = [layer for layer in range(layout.num_layers) if layer not in self.dense_layers]
        self.all_resident = resident_only
        # "triton": the fused kernels of kernels/triton/residency.py (CUDA, or the CPU interpreter);
        # "torch": the same algorithm in torch ops, the reference.
        self.impl = resolve_impl(impl, layout.device)
        self.max_requests, self.max_seq_len = max_requests, max_seq_len
        self.max_pages = cdiv(max_seq_len, page_size)
        self.max_units = cdiv(max_seq_len, unit)
        L = layout.num_layers
        dev = torch.device(layout.device)
        self.device = dev

        # pools per layer kind (device_pools.py): dense layers keep every token, sparse
        # layers a buffer per sparse request and room for requests that decode densely
        self.min_sparse_prompt_len = max_seq_len if min_sparse_prompt_len is None else min_sparse_prompt_len
        self.device_capacity_tokens = device_capacity_tokens
        sizings = size_device_pools(
            num_layers=L, dense_layers=self.dense_layers, page_size=page_size,
            device_buffer_tokens=device_buffer_tokens, min_sparse_prompt_len=self.min_sparse_prompt_len,
            max_requests=max_requests, max_seq_len=max_seq_len, resident_only=resident_only,
            capacity_tokens=device_capacity_tokens, hybrid=hybrid,
        )
        knobs = {DENSE_LAYERS: "fewer dense_layers"}
        self.pools = [DevicePool(s, layout, head_major=per_kv_head, knob=knobs.get(s.kind, "device_capacity_tokens")) for s in sizings]
        self._pool = [next(p for p in self.pools if layer in p.index) for layer in range(L)]
        self.dev_alloc = [self._pool[layer].alloc[layer] for layer in range(L)]
        table_pages = max(self.max_pages, self.buffer_tokens // page_size)
        self.dev_table = torch.full((L, max_requests, table_pages), -1, dtype=torch.int32, device=dev)
        self._dev_pages: dict[tuple[int, int], torch.Tensor] = {}
        # the pools and the page table, as the swap-in and the decode writes address them (the
        # table is this store's: only _alloc_device / _free_device change it)
        self.device_rows = DeviceRows(self.pools, self._pool, self.dev_table, page_size=page_size, head_major=per_kv_head)

        if host_capacity_tokens is None:
            host_capacity_tokens = 0 if resident_only else max_requests * self.max_pages * page_size
            host_rule = ("resident store: none until a request is retracted (host_capacity_tokens)" if resident_only
                         else f"max_requests {max_requests} x max_seq_len {max_seq_len}: every token of every sparse request")
        else:
            host_rule = f"host_capacity_tokens {host_capacity_tokens}"
        pin = dev.type == "cuda" if pin_memory is None else pin_memory
        # host_kv_dtype "fp8_e4m3": fp8 host rows, dequantised on the way in (fp8_host.py)
        check_host_kv_dtype(host_kv_dtype, layout, resident=resident_only)
        self.host_kv_dtype = host_kv_dtype
        self.host_pool = HostPool(
            layout, page_size=page_size, max_requests=max_requests, max_pages=self.max_pages,
            capacity_tokens=host_capacity_tokens, pin=pin, device=dev, head_major=per_kv_head, rule=host_rule,
            fp8=is_fp8_host(host_kv_dtype),
        )
        self.host, self.host_slots = self.host_pool.tensors, self.host_pool.host_slots
        self.host_alloc, self.host_table = self.host_pool.host_alloc, self.host_pool.host_table

        self.maps = SlotMaps(
            num_layers=L, max_requests=max_requests, streams=self.streams, max_units=self.max_units,
            buffer_units=self.buffer_units, unit=unit, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
            device=dev,
        )
        self.l2s, self.s2l, self.last_used = self.maps.l2s, self.maps.s2l, self.maps.last_used
        self.clock = self.maps.clock
        # a hybrid store's requests spilled to the host tier (spills.py); never any otherwise
        self.hybrid = hybrid
        self.spills = SpilledRequests(max_requests, dev, enabled=hybrid)
        self.spill_count = 0  # requests spilled so far (stats)
        self.promote_count = 0  # spilled requests made whole again (stats)

        # the swap-in of selections and the prefetch (residency.py), with their counters and the
        # launch shapes of its copies (copy_shapes: `CopyShapes`, None for the measured defaults)
        self.residency = BufferResidency(
            layout=layout, maps=self.maps, device_rows=self.device_rows, host_pool=self.host_pool,
            spills=self.spills, unit=unit, streams=self.streams, max_units=self.max_units, all_resident=resident_only, impl=self.impl, device=dev,
            copy_shapes=copy_shapes,
        )
        # the decode writes and their queue of host writes (decode_writes.py)
        self.writes = DecodeWrites(
            layout=layout, maps=self.maps, device_rows=self.device_rows, host_pool=self.host_pool,
            residency=self.residency, unit=unit, streams=self.streams, dense_layers=self.dense_layers,
            all_resident=resident_only, impl=self.impl, device=dev,
        )
        self._retracted: set[int] = set()
        self._live: dict[int, Request] = {}  # admitted requests by state row (the hybrid store spills among them)
        for pool in self.pools:
            log.info(
                "device KV pool of the %s: %d layer(s) x %d tokens = %.2f GiB (%s)",
                pool.kind.replace("_", " "), len(pool.layers), pool.slots, pool.bytes / 2**30, pool.sizing.rule,
            )

    # -- decode steps and writes (decode_writes.py `DecodeWrites`, which owns the host writes) ---
    def begin_step(self, batch: Batch) -> None:
        """Wait (on the GPU) for last step's host writes; advance the recency clock."""
        self.writes.sync()
        self.maps.clock += 1

    def write_decode(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.writes.write_decode(layer, batch, self._tensors(k, v))

    def end_step(self, batch: Batch) -> None:
        """Start this step's device→host writes (on a side stream on CUDA)."""
        self.residency.join_prefetch()  # a prefetch whose layer never asked for its rows (the step went dense)
        self.writes.end_step(batch)

    def pending_mark(self) -> int:
        """How many host writes are queued (`DecodeWrites.pending_mark`)."""
        return self.writes.pending_mark()

    def take_pending(self, mark: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Unqueue and return the host writes queued since `mark` (`DecodeWrites.take_pending`)."""
        return self.writes.take_pending(mark)

    def queue_pending(self, writes: list[tuple[int, torch.Tensor, torch.Tensor]] | None) -> None:
        """Queue host writes again (`DecodeWrites.queue_pending`)."""
        self.writes.queue_pending(writes)

    @property
    def rows_out(self) -> torch.Tensor:
        """Per layer: token rows written device -> host."""
        return self.writes.rows_out

    # -- the swap-in (residency.py `BufferResidency`, which owns its counters) ----------------
    def resident_slots(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        return self.residency.resident_slots(layer, batch, selection)

    def ensure_resident(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        """Swap in the missing units of a selection of buffered rows; return device slots
        (`BufferResidency.ensure_resident`)."""
        return self.residency.ensure_resident(layer, batch, selection)

    def prefetch(self, layer: int, batch: Batch, selection: Selection) -> None:
        """Make a predicted selection of a later layer resident ahead of that layer's own
        `ensure_resident` (`BufferResidency.prefetch`)."""
        self.residency.prefetch(layer, batch, selection)

    @property
    def counts(self) -> torch.Tensor:
        """Per layer: hits, misses (selected tokens), rows copied host -> device [layers, 3]."""
        return self.residency.counts

    @property
    def hits(self) -> torch.Tensor:
        return self.residency.hits

    @property
    def misses(self) -> torch.Tensor:
        return self.residency.misses

    @property
    def rows_in(self) -> torch.Tensor:
        return self.residency.rows_in

    @property
    def prefetch_counts(self) -> torch.Tensor:
        """Per layer: the prefetch's hits, misses and rows copied [layers, 3]."""
        return self.residency.prefetch_counts

    @property
    def timing(self) -> bool:
        """Whether swap-ins are timed (turn off while capturing a CUDA graph)."""
        return self.residency.timing

    @timing.setter
    def timing(self, on: bool) -> None:
        self.residency.timing = on

    # -- geometry -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Slots per layer (and KV head) of the pool of the sparse layers (of every layer in the
        resident store; of the dense layers when every layer is dense). `layer_slots` for one layer."""
        return self.pools[0].slots

    def layer_slots(self, layer: int) -> int:
        """Device token slots per KV head in the layer's pool (what its page tables address)."""
        return self._pool[layer].slots

    def pool_of(self, layer: int) -> DevicePool:
        """The device pool holding the layer (device_pools.py)."""
        return self._pool[layer]

    def layer_buffers(self, layer: int) -> list[torch.Tensor]:
        """The layer's device rows per stored tensor (K and V, or the latent):
        [slots, kv_heads, dim], or [kv_heads, slots, dim] head-major."""
        return self.device_rows.buffers(layer)

    @property
    def row_elems(self) -> int:
        """Storage elements of one stream's row (one KV head, or all heads) in one tensor."""
        return self.layout.stored_head_dim * self.row_heads

    @property
    def row_heads(self) -> int:
        """KV heads in one stream's row: one (head-major), or all."""
        return 1 if self.head_major else self.layout.num_kv_heads

    def _keeps_host(self, request: Request) -> bool:
        """Sparse requests keep every token on the host; resident-only ones do not, nor do a
        hybrid store's until they are spilled."""
        if self.all_resident or request.dense:
            return False
        return not self.hybrid or request.slot in self.spills

    def mode(self, request: Request, layer: int) -> str:
        resident = self.all_resident or request.dense or layer in self.dense_layers
        if self.hybrid and request.slot not in self.spills:
            resident = True
        return _RESIDENT if resident else _BUFFERED

    def decode_key(self, batch: Batch) -> tuple:
        """What a captured decode graph of this batch depends on beyond its composition:
        whether a row is buffered (a hybrid store's spilled request), which picks the path."""
        return (self.buffers_rows_of(batch),) if self.hybrid else ()

    def buffers_rows_of(self, batch: Batch) -> bool:
        """Whether a row of the batch is buffered in the sparse layers: a sparse request of the
        hierarchical store, a spilled one of the hybrid store; never in the resident store."""
        return self.residency.buffers_rows_of(batch)

    def _phys(self, layer: int, slot_ids: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Device slots of positions (logical tokens of a resident layer, or buffer positions
        of a buffered one). slot_ids: [B]; pos: [B, ...] int, -1 kept. Returns `dtype`.
        In torch ops: the decode step's look-up (`resident_slots`) has its own kernel."""
        return self.device_rows.slots(layer, slot_ids, pos, dtype)

    def _dev_off(self, layer: int, slots: torch.Tensor, head: torch.Tensor | int = 0) -> torch.Tensor:
        """Flat element offsets, into the tensors of the layer's pool, of a stream's row at
        device slots (-1 kept)."""
        return self.device_rows.offsets(layer, slots, head)

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        """Rows as stored: the layout's dtype; fp8 as bytes; an fp8 MLA latent packed into
        FlashMLA's 656-byte rows (on the writer's device, before any copy)."""
        if self.layout.is_flashmla_fp8:
            return pack_flashmla_fp8(x)
        x = x.to(self.layout.dtype)
        return x.view(torch.uint8) if self.layout.is_fp8 else x

    def _tensors(self, k: torch.Tensor, v: torch.Tensor | None) -> list[torch.Tensor]:
        return [self._store(k)] if self.layout.is_mla else [self._store(k), self._store(v)]  # type: ignore[arg-type]

    def _write_dev(self, layer: int, slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """rows[i]: [n, kv_heads, dim] to device slots [n] (all heads), or, in the head-major
        layout, slots [n, kv_heads] (one slot per head)."""
        self.device_rows.put(layer, slots, rows)

    def _alloc_device(self, request: Request, layers: list[int], tokens_for: dict[str, int]) -> None:
        """All-or-nothing: allocate device pages for the given layers or raise unchanged."""
        needs = {}
        for layer in layers:
            have = self._dev_pages.get((layer, request.slot))
            want = cdiv(tokens_for[self.mode(request, layer)], self.page_size)
            n = want - (0 if have is None else have.numel())
            if n > 0:
                needs[layer] = n
        for layer, n in needs.items():
            if n > self.dev_alloc[layer].free:
                raise self._no_room(layer, n, f"request {request.rid!r}", request.dense)
        if not needs:
            return
        # the page-table entries of every layer in one host->device copy: a copy per layer
        # synchronises with the device each time (32 per request at every page boundary)
        layer_ids, cols, values = [], [], []
        for layer, n in needs.items():
            ids = self.dev_alloc[layer].alloc(n, self.page_size, f"request {request.rid!r}")
            have = self._dev_pages.get((layer, request.slot), ids[:0])
            layer_ids.append(torch.full((n,), layer))
            cols.append(torch.arange(have.numel(), have.numel() + n))
            values.append(ids)
            self._dev_pages[(layer, request.slot)] = torch.cat([have, ids])
        index = tensor_to_device(torch.stack([torch.cat(layer_ids), torch.cat(cols)]), self.device)
        self.dev_table[index[0], request.slot, index[1]] = tensor_to_device(torch.cat(values).to(torch.int32), self.device)

    def _no_room(self, layer: int, pages: int, who: str, dense_request: bool) -> CapacityError:
        """The CapacityError for a layer's pool without `pages` free pages: what is full, why the
        request(s) need the room, and the settings that make room."""
        pool, alloc, p = self._pool[layer], self.dev_alloc[layer], self.page_size
        full = f"max_requests x max_seq_len = {self.max_requests * self.max_pages * p}"
        head = (
            f"device KV pool of the {pool.kind.replace('_', ' ')} full in layer {layer}: {who} needs {pages} more "
            f"pages of {p} tokens ({pages * p} tokens), {alloc.free} of {alloc.num_pages} pages are free"
        )
        if pool.kind == RESIDENT:
            why = "the resident store keeps every token of every request on the device"
            fix = (f"raise device_capacity_tokens (now {pool.slots} tokens per layer; {full} fits any mix), "
                   "lower max_requests / max_seq_len, or use the hierarchical store")
        elif pool.kind == DENSE_LAYERS:
            why = f"dense layers ({sorted(pool.layers)}, dense_layers) keep every token of every request"
            fix = "lower max_requests / max_seq_len or remove the layer from dense_layers"
        elif dense_request:
            why = (f"a request whose prompt is shorter than min_sparse_prompt_len ({self.min_sparse_prompt_len}) "
                   "decodes densely and keeps every token in every layer")
            fix = (f"raise device_capacity_tokens (now {pool.slots} tokens per layer; {full} fits any mix), "
                   "lower min_sparse_prompt_len so that it decodes sparsely, or generate fewer tokens")
        else:
            why = f"a sparse request holds a buffer of device_buffer_tokens ({self.buffer_tokens}) in every sparse layer"
            fix = (f"raise device_capacity_tokens (now {pool.slots} tokens per layer) or lower device_buffer_tokens; "
                   "requests that decode densely (prompts shorter than min_sparse_prompt_len) may hold the rest")
        return CapacityError(f"{head}: {why}; {fix}")

    def _free_device(self, request: Request) -> None:
        for layer in range(self.layout.num_layers):
            ids = self._dev_pages.pop((layer, request.slot), None)
            if ids is not None:
                self.dev_alloc[layer].release(ids)
        self.dev_table[:, request.slot] = -1

    def _device_tokens_for(self, request: Request, tokens: int) -> dict[str, int]:
        return {_RESIDENT: tokens, _BUFFERED: self.buffer_tokens}

    def admit(self, request: Request, cached_pages: torch.Tensor | None = None) -> None:
        """Reserve host pages (sparse requests) and device pages for the prompt; all or nothing.

        `cached_pages`: host pages that already hold the K/V of the prompt's first
        `request.cached_len` tokens (a prefix cache's, engine/prefix_cache.py). A request that
        keeps its K/V on the host maps them read-only as its first pages (borrowed: never
        written, never freed by it) and reserves pages for the rest only; `write_prefill`
        then offloads only the tokens after them. Others keep nothing on the host.

        A hybrid store admits a request whole on the device; where the sparse layers' pool
        lacks the room, it first spills running requests (`make_room`), and if that cannot
        make it, it admits a sparse request spilled (its prompt to the host, a buffer on the
        device)."""
        self._live[request.slot] = request
        try:
            if not self.hybrid:
                self._admit(request, cached_pages)
                return
            self.spills.mark(request.slot, False)
            # whole where there is (or spilling makes) the room; a dense request only whole
            if self.make_room(cdiv(request.prompt_len, self.page_size), keep=request) or request.dense:
                try:
                    self._admit(request, cached_pages)
                    return
                except CapacityError:
                    if request.dense:  # (the error says why)
                        raise
            self.spills.mark(request.slot, True)  # no room to be whole: admitted to the host tier
            try:
                self._admit(request, cached_pages)
            except CapacityError:
                self.spills.mark(request.slot, False)
                raise
            self.spill_count += 1
        except CapacityError:
            del self._live[request.slot]
            raise

    def _admit(self, request: Request, cached_pages: torch.Tensor | None) -> None:
        layers = list(range(self.layout.num_layers))
        try:
            if self._keeps_host(request):
                if cached_pages is not None and cached_pages.numel():
                    self.host_pool.adopt(request, cached_pages)
                self.host_pool.reserve(request, request.prompt_len)
            self._alloc_device(request, layers, self._device_tokens_for(request, request.prompt_len))
        except CapacityError:
            self.host_pool.free(request)
            raise
        self.maps.reset(request.slot)

    # -- pages for a prefix cache (engine/prefix_cache.py) ------------------------------------
    def keeps_host(self, request: Request) -> bool:
        """Whether the request's K/V live on the host (its host pages can be cached as they are)."""
        return self._keeps_host(request)

    def keeps_host_for(self, prompt_len: int, dense: bool | None = None) -> bool:
        """`keeps_host` of a request with this prompt before it is admitted: `dense` as the
        coordinator will decide it (None: its config rule, prompts shorter than
        min_sparse_prompt_len dense)."""
        if dense is None:
            dense = prompt_len < self.min_sparse_prompt_len
        return not (self.all_resident or self.hybrid or dense)  # a hybrid store admits requests whole

    def host_page_ids(self, request: Request) -> torch.Tensor:
        """The request's host pages in logical order (borrowed ones included)."""
        return self.host_pool.page_ids(request)

    def lend_host_pages(self, request: Request, ids: torch.Tensor) -> None:
        """Pages of the request that a prefix cache now owns: the request still reads them,
        `release` no longer frees them."""
        self.host_pool.lend(request, ids)

    def release_host_pages(self, ids: torch.Tensor) -> None:
        """Give pages owned by a prefix cache back to the host pool."""
        if ids.numel():
            self.host_alloc.release(ids)

    def load_pages(self, ids: torch.Tensor, dst: list[torch.Tensor], start: int) -> None:
        """Copy the K/V of whole host pages `ids`, every layer, into rows start.. of `dst`
        (one [layers, rows, kv_heads, dim] tensor per stored tensor on the layout's device:
        the prefill staging). One copy per tensor, read straight from pinned memory on CUDA
        (ordered after the side stream's host writes: no host synchronisation)."""
        if ids.numel() == 0:
            return
        self.writes.sync()
        rows = self.host_pool.rows_of_pages(ids).to(self.device)
        m, elems = rows.numel(), self.layout.stored_row_elems
        layers = torch.arange(self.layout.num_layers, device=self.device).view(-1, 1)
        src = self.host_pool.offsets(layers, rows.view(1, -1)).flatten()
        for d, h in zip(dst, self.host):
            if d.dtype != self.layout.storage_dtype or d.shape[0] != self.layout.num_layers or start + m > d.shape[1]:
                raise ValueError(f"load_pages: {m} rows from {start} do not fit {tuple(d.shape)} {d.dtype}")
            dst_off = ((layers * d.shape[1] + start + torch.arange(m, device=self.device)) * elems).flatten()
            self.host_pool.read_rows(h, d, src, dst_off, self.layout.num_kv_heads)

    def export_pages(self, request: Request, first_page: int, num_pages: int) -> torch.Tensor:
        """Copy the request's device K/V of pages first_page..first_page+num_pages-1 (every
        layer resident: a request that keeps nothing on the host) into newly allocated host
        pages, returned (owned by the caller; CapacityError, nothing taken, without room)."""
        if self._keeps_host(request):
            raise ValueError(f"request {request.rid!r} keeps its K/V on the host: use host_page_ids")
        ids = self.host_alloc.alloc(num_pages, self.page_size, f"prefix cache of {request.rid!r}")
        if num_pages == 0:
            return ids
        self.writes.sync()
        p = self.page_size
        sid = torch.tensor([request.slot], device=self.device)
        tokens = torch.arange(first_page * p, (first_page + num_pages) * p, device=self.device).unsqueeze(0)
        host_rows = self.host_pool.rows_of_pages(ids).to(self.device)
        for layer in range(self.layout.num_layers):
            slots = self._phys(layer, sid, tokens)[0]
            for h in range(self.streams):
                src = self._dev_off(layer, slots, h).flatten()
                dst = self.host_pool.offsets(layer, host_rows, h).flatten()
                for dev_buf, host_buf in zip(self._pool[layer].tensors, self.host):
                    self.host_pool.write_rows(dev_buf, host_buf, src, dst, self.row_heads)
        return ids

    def _growth_error(self, starting: list[Request], spare: int = 0) -> CapacityError | None:
        """Why the requests `starting` a new page cannot each get one (None: they can), with
        `spare` more free pages in each sparse layer (what spills would free)."""
        host_need = sum(1 for r in starting if self._keeps_host(r))
        if host_need > self.host_alloc.free:
            try:
                self.host_alloc.alloc(host_need, self.page_size, f"{host_need} requests")
            except CapacityError as exc:  # (the allocator's own message; nothing was taken)
                return exc
        for layer in range(self.layout.num_layers):
            growing = [r for r in starting if self.mode(r, layer) == _RESIDENT]
            if len(growing) > self.dev_alloc[layer].free + (0 if layer in self.dense_layers else spare):
                who = ", ".join(repr(r.rid) for r in growing[:4]) + (", ..." if len(growing) > 4 else "")
                return self._no_room(layer, len(growing), f"request(s) {who}", any(r.dense for r in growing))
        return None

    def can_grow(self, requests: list[Request]) -> bool:
        """Whether one more token of each request (its next decode step) finds room. What an
        engine asks before a step, to preempt instead of failing it; it changes nothing, but a
        hybrid store spills running requests (`make_room`) where that makes the room."""
        starting = [r for r in requests if self.needs_page(r)]
        if not starting or self._growth_error(starting) is None:
            return True
        if not self.hybrid:
            return False
        spare = sum(freed for freed, _ in self._spillable())
        if self._growth_error(starting, spare) is not None:
            return False
        self.make_room(self._sparse_growth(starting))
        return self._growth_error(starting) is None

    def _sparse_growth(self, starting: list[Request]) -> int:
        """Pages the requests starting one need in each sparse layer (the whole ones)."""
        layers = self.sparse_layers
        return sum(1 for r in starting if self.mode(r, layers[0]) == _RESIDENT) if layers else 0

    def needs_page(self, request: Request) -> bool:
        """Whether the request's next decode token starts a new page (the only growth that
        takes room: `can_grow` of requests that do not is always True)."""
        return request.seq_len % self.page_size == 0

    def grow(self, batch: Batch) -> None:
        """Pages for this step's new tokens (only at page boundaries); all or nothing."""
        starting = [r for r in batch.requests if (r.seq_len - 1) % self.page_size == 0]
        if not starting:
            return
        error = self._growth_error(starting)
        if error is not None and self.hybrid:  # spill (the batch's rows as before this step)
            advanced = {r.slot for r in batch.requests}
            self.make_room(self._sparse_growth(starting), advanced=advanced)
            error = self._growth_error(starting)
        if error is not None:
            raise error
        for r in starting:
            if self._keeps_host(r):
                self.host_pool.reserve(r, r.seq_len)
            self._alloc_device(r, list(range(self.layout.num_layers)), self._device_tokens_for(r, r.seq_len))

    def release(self, request: Request) -> None:
        self.writes.sync()
        self._free_device(request)
        self.host_pool.free(request)
        self.maps.reset(request.slot)
        self._retracted.discard(request.slot)
        self.spills.mark(request.slot, False)
        self._live.pop(request.slot, None)
        if self.hybrid and self.spills.slots:
            self._promote_while_room()

    # -- the hybrid store's spills (spills.py) ------------------------------------------------
    def _sparse_pages(self, request: Request) -> int:
        """Device pages the request holds in one sparse layer."""
        layers = self.sparse_layers
        ids = self._dev_pages.get((layers[0], request.slot)) if layers else None
        return 0 if ids is None else ids.numel()

    def _sparse_free(self) -> int:
        """Free pages in every sparse layer (the fewest of any)."""
        return min(self.dev_alloc[layer].free for layer in self.sparse_layers)

    def _spillable(self, keep: Request | None = None) -> list[tuple[int, Request]]:
        """Running requests a spill would shrink, with the pages per sparse layer it frees,
        the most first (fewest spills for the room): whole, sparse, holding more than a buffer."""
        buffer = self.buffer_tokens // self.page_size
        found = []
        for slot, r in self._live.items():
            if r is keep or r.dense or slot in self.spills or slot in self._retracted or r.seq_len < r.prompt_len:
                continue  # (a prompt not handed over yet has nothing to spill: it is admitted again whole)
            freed = self._sparse_pages(r) - buffer
            if freed > 0:
                found.append((freed, r))
        return sorted(found, key=lambda x: -x[0])

    def make_room(self, pages: int, keep: Request | None = None, advanced: AbstractSet[int] = frozenset()) -> bool:
        """Free `pages` pages in every sparse layer of a hybrid store, spilling running
        requests (the largest first) if needed; True when the room is there. Spills nobody
        when spilling everyone it could would still not make the room. Not `keep`.
        `advanced`: state rows whose seq_len already counts a token not written yet (a step
        being begun: `grow`), spilled as they were before it."""
        if not self.sparse_layers:
            return True
        short = pages - self._sparse_free()
        if short <= 0:
            return True
        victims = []
        for freed, r in self._spillable(keep):
            if short <= 0:
                break
            victims.append(r)
            short -= freed
        if short > 0:
            return False
        for r in victims:
            if r.slot in advanced:  # its newest token is not written yet: spill what is
                r.seq_len -= 1
                try:
                    self.spill(r)
                finally:
                    r.seq_len += 1
            else:
                self.spill(r)
        return True

    def spill(self, request: Request) -> None:
        """Move a whole request of a hybrid store to the host tier: every layer's K/V to its
        host pages, then its sparse layers shrink to a buffer refilled with the sink and the
        recent window (as after `resume`); later selections swap in what they need. Lossless:
        attention reads the same rows (fp8 host rows: their round trip). CapacityError, with
        nothing changed, when the host pool has no room for it."""
        if not self.hybrid or request.dense or request.slot in self.spills or request.slot in self._retracted:
            raise ValueError(f"request {request.rid!r}: only a live, whole, sparse request of a hybrid store spills")
        self.writes.sync()
        self.host_pool.reserve(request, request.seq_len)
        self._copy_to_host(request)
        for layer in self._switch_tier(request, spilled=True):
            self._fill_buffer(layer, request, None)
        self.spill_count += 1

    def _switch_tier(self, request: Request, spilled: bool) -> list[int]:
        """Re-place a request's sparse layers on the device for its new tier (spilled: a buffer;
        whole: every token): their pages released and taken anew, the maps reset; the rows are
        the caller's to copy. Returns the sparse layers."""
        layers = self.sparse_layers
        for layer in layers:
            self.dev_alloc[layer].release(self._dev_pages.pop((layer, request.slot)))
        self.dev_table[layers, request.slot] = -1
        self.spills.mark(request.slot, spilled)
        self.maps.reset(request.slot)
        self._alloc_device(request, layers, self._device_tokens_for(request, request.seq_len))
        return layers

    def _promote_while_room(self) -> None:
        """Make spilled requests whole again, the smallest first, while the sparse layers' pool
        keeps the room of one more whole request of max_seq_len after each: room freed by a
        finished request goes to the spilled ones, but not the room the next admission needs,
        which would spill them again at once."""
        if not self.sparse_layers:
            return
        waiting = sorted((r for slot, r in self._live.items() if slot in self.spills and slot not in self._retracted),
                         key=lambda r: r.seq_len)
        for r in waiting:
            if self._sparse_free() - self._promotion_pages(r) < self.max_pages:
                return
            self.promote(r)

    def _promotion_pages(self, request: Request) -> int:
        """Pages per sparse layer a spilled request takes beyond its buffer when made whole."""
        return cdiv(request.seq_len, self.page_size) - self._sparse_pages(request)

    def promote(self, request: Request) -> None:
        """Make a spilled request of a hybrid store whole on the device again: its sparse layers'
        buffers are released, every token is copied back from its host pages, which are freed
        (it keeps nothing on the host, as before its spill). Lossless. CapacityError, with
        nothing changed, when the sparse layers' pool lacks the room."""
        if request.slot not in self.spills or request.slot in self._retracted:
            raise ValueError(f"request {request.rid!r}: only a live, spilled request of a hybrid store is promoted")
        layers = self.sparse_layers
        need = self._promotion_pages(request)
        short = [layer for layer in layers if self.dev_alloc[layer].free < need]
        if short:
            raise self._no_room(short[0], need, f"request {request.rid!r} made whole", False)
        self.writes.sync()  # its last decode tokens' host copies land before they are read back
        self._switch_tier(request, spilled=False)
        sid = torch.tensor([request.slot], device=self.device)
        tokens = torch.arange(request.seq_len, device=self.device).unsqueeze(0)
        for layer in layers:
            self.residency.copy_in(layer, sid, tokens, self._phys(layer, sid, tokens))
        # later writes to these host pages are queued after this copy (resume's argument)
        self.host_pool.free(request)
        self.promote_count += 1

    def _copy_to_host(self, request: Request) -> None:
        """Every layer's device rows of a request that keeps nothing on the host yet into its
        (reserved) host pages."""
        sid = torch.tensor([request.slot], device=self.device)
        tokens = torch.arange(request.seq_len, device=self.device).unsqueeze(0)
        host_rows = self.host_pool.rows(sid, tokens)
        for layer in range(self.layout.num_layers):
            slots = self._phys(layer, sid, tokens)
            for h in range(self.streams):
                src = self._dev_off(layer, slots, h).flatten()
                dst = self.host_pool.offsets(layer, host_rows, h).flatten()
                for dev_buf, host_buf in zip(self._pool[layer].tensors, self.host):
                    self.host_pool.write_rows(dev_buf, host_buf, src, dst, self.row_heads)

    # -- prefill ----------------------------------------------------------------------------
    def _fill_buffer(self, layer: int, request: Request, rows: list[torch.Tensor] | None) -> None:
        """Map the initial units of a buffered (request, layer) to buffer units 0..m-1 and fill
        them, from `rows` (the prompt's K/V, prefill) or from the host (resume)."""
        units = self.maps.initial_units(request.seq_len)
        m = units.numel()
        r = request.slot
        bu = torch.arange(m, device=self.device)
        self.l2s[layer, r, :, units] = bu.to(torch.int32)
        self.s2l[layer, r, :, :m] = units.to(torch.int32)
        self.last_used[layer, r, :, :m] = self.clock
        tokens = (units.unsqueeze(1) * self.unit + torch.arange(self.unit, device=self.device)).flatten()
        pos = (bu.unsqueeze(1) * self.unit + torch.arange(self.unit, device=self.device)).flatten()
        keep = tokens < request.seq_len
        tokens, pos = tokens[keep], pos[keep]
        slots = self._phys(layer, torch.tensor([r], device=self.device), pos.unsqueeze(0))[0]
        if rows is not None:
            self._write_dev(layer, slots, [x[tokens] for x in rows])
        else:
            self.residency.copy_in(layer, torch.tensor([r], device=self.device), tokens.unsqueeze(0), slots.unsqueeze(0))

    def write_prefill(self, layer: int, request: Request, k: torch.Tensor, v: torch.Tensor | None) -> None:
        rows = self._tensors(k, v)
        n = k.shape[0]
        sid = torch.tensor([request.slot], device=self.device)
        positions = torch.arange(n, device=self.device).unsqueeze(0)
        if self._keeps_host(request):  # offload the prompt to the host (but a cached prefix)
            c = request.cached_len  # tokens on borrowed host pages: never written
            host_off = self.host_pool.offsets(layer, self.host_pool.rows(sid, positions[:, c:])[0], 0)
            for buf, x in zip(self.host, rows):
                src = x.contiguous()
                src_off = torch.arange(c, n, device=src.device) * self.layout.stored_row_elems
                self.host_pool.write_rows(src, buf, src_off, host_off, self.layout.num_kv_heads)
        if self.mode(request, layer) == _RESIDENT:
            self._write_dev(layer, self._phys(layer, sid, positions)[0], rows)
        else:
            self._fill_buffer(layer, request, rows)

    # -- retract / resume -------------------------------------------------------------------
    def retract(self, request: Request) -> None:
        """Preempt: free the request's device memory, keep (or make) its host copy."""
        self.writes.sync()
        if not self._keeps_host(request):  # resident-only requests get a host copy first
            self.host_pool.reserve(request, request.seq_len)
            self._copy_to_host(request)
        self._free_device(request)
        self.maps.reset(request.slot)
        self._retracted.add(request.slot)

    def resume(self, request: Request) -> None:
        """Bring a retracted request back: device pages, resident layers copied in whole,
        buffered layers refilled with the sink and recent window."""
        if request.slot not in self._retracted:
            raise ValueError(f"request {request.rid!r} is not retracted")
        self._alloc_device(request, list(range(self.layout.num_layers)), self._device_tokens_for(request, request.seq_len))
        sid = torch.tensor([request.slot], device=self.device)
        tokens = torch.arange(request.seq_len, device=self.device).unsqueeze(0)
        for layer in range(self.layout.num_layers):
            if self.mode(request, layer) == _RESIDENT:
                self.residency.copy_in(layer, sid, tokens, self._phys(layer, sid, tokens))
            else:
                self._fill_buffer(layer, request, None)
        if not self._keeps_host(request):
            # later writes to these host pages are queued after this copy on the same
            # stream (prefill) or on the side stream, which waits for it (end_step)
            self.host_pool.free(request)
        self._retracted.discard(request.slot)

    # -- views and accounting ---------------------------------------------------------------
    def paged_view(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_pages, page_size, heads, dim] views of a layer's device pool (no copy). An fp8
        MLA latent comes as FlashMLA's uint8 rows [.., 1, 656] for both K and V (the same
        tensor: V is part of the packed NoPE bytes); consumers unpack (`unpack_flashmla_fp8`)."""
        heads = 1 if self.head_major else self.layout.num_kv_heads
        shape = (-1, page_size, heads, self.layout.stored_head_dim)
        bufs = self.layer_buffers(layer)
        k = bufs[0].reshape(shape)
        if self.layout.is_flashmla_fp8:
            return k, k
        v = k[..., : self.layout.v_head_dim] if self.layout.is_mla else bufs[1].reshape(shape)
        if self.layout.is_fp8:
            return k.view(self.layout.dtype), v.view(self.layout.dtype)
        return k, v

    def read(self, layer: int, request: Request) -> list[torch.Tensor]:
        """A request's rows in logical order, [seq_len, kv_heads, dim] per stored tensor
        (K, V; or the latent) as stored (fp8 as bytes; an fp8 MLA latent as its packed
        656-byte rows, which `unpack_flashmla_fp8` turns back into latents): from the device
        for a resident (request, layer), else from the host (fp8 host rows dequantised to the
        layout's dtype: what a swap-in would bring back). Synchronises; for tests and
        debugging."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sid = torch.tensor([request.slot], device=self.device)
        tokens = torch.arange(request.seq_len, device=self.device).unsqueeze(0)
        if self.mode(request, layer) == _BUFFERED or request.slot in self._retracted:
            rows = self.host_pool.rows(sid, tokens)[0].cpu()
            return [self.host_pool.decode(buf[layer][rows]) for buf in self.host]
        slots = self._phys(layer, sid, tokens)[0]
        if self.head_major:
            return [buf[:, slots].transpose(0, 1) for buf in self.layer_buffers(layer)]
        return [buf[slots] for buf in self.layer_buffers(layer)]

    def device_tokens(self, request: Request) -> int:
        """Device token slots the request holds, averaged over layers."""
        pages = sum(ids.numel() for (layer, slot), ids in self._dev_pages.items() if slot == request.slot)
        return pages * self.page_size // max(1, self.layout.num_layers)  # 0 layers: nothing held

    def host_tokens(self, request: Request) -> int:
        return self.host_pool.tokens(request)

    def used_tokens(self) -> int:
        return sum(a.used for a in self.dev_alloc) * self.page_size // max(1, self.layout.num_layers)

    def device_bytes(self) -> int:
        return sum(a.used for a in self.dev_alloc) * self.page_size * self.layout.bytes_per_token_per_layer

    def pool_stats(self) -> list[dict[str, object]]:
        """Per pool (the device pools, then the host pool): kind, layers, tokens per layer,
        bytes, tokens and bytes used now (summed over layers), and how it was sized."""
        host = self.host_pool
        per_token = host.bytes_per_token_per_layer * self.layout.num_layers
        return [pool.stats() for pool in self.pools] + [{
            "kind": "host",
            "layers": self.layout.num_layers,
            "tokens_per_layer": host.host_slots,
            "bytes": host.host_slots * per_token,
            "used_tokens": host.host_alloc.used * self.page_size * self.layout.num_layers,
            "used_bytes": host.host_alloc.used * self.page_size * per_token,
            "rule": host.rule,
        }]

    def stats(self) -> list[dict[str, float]]:
        """Per layer: hits, misses, rows and bytes moved each way, swap-in time (syncs). With
        prefetch: `misses` are the selected rows the prediction did not bring in (copied on the
        critical path), `prefetch_rows` those it copied ahead (whether selected or not), and
        `bytes_in` counts both."""
        swap_seconds = self.residency.swap_seconds()
        # bytes that crossed between the tiers, as the host stores them (fp8 host rows: fewer)
        row_bytes = self.host_pool.bytes_per_token_per_layer * self.row_heads // self.layout.num_kv_heads
        return [
            {
                "layer": layer,
                "pool": self._pool[layer].kind,
                "hits": int(self.hits[layer]),
                "misses": int(self.misses[layer]),
                "bytes_in": int(self.rows_in[layer] + self.prefetch_counts[layer, 2]) * row_bytes,
                "prefetch_rows": int(self.prefetch_counts[layer, 2]),
                "bytes_out": int(self.rows_out[layer]) * row_bytes,
                "swap_seconds": swap_seconds[layer],
            }
            for layer in range(self.layout.num_layers)
        ]


