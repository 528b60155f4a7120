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
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..common.batch import Batch, Request, Selection
from ..common.errors import CapacityError
from ..common.transfer import tensor_to_device
from .base import KVStore
from .copy import put_rows, write_token_rows
from ..common.flashmla_format import pack_flashmla_fp8
from .fp8_host import check_host_kv_dtype, is_fp8_host
from .host_pool import HostPool
from ..common.arith import cdiv, pow2
from ..common.layout import KVLayout, resolve_impl
from .device_pools import DENSE_LAYERS, RESIDENT, DevicePool, buffer_pages, size_device_pools
from .pages import paged_slots_rows
from .slot_maps import SlotMaps

log = logging.getLogger(__name__)
_RESIDENT, _BUFFERED = "resident", "buffered"
# launch shape of copy_missing_kernel (benchmarks/swap_in.py --copy-shapes)
COPY_PROGRAMS, COPY_COLS, COPY_WARPS = 2048, 1024, 8



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
        impl: str = "auto",
        host_kv_dtype: str = "auto",
    ) -> None:
        if page_size % unit:
            raise ValueError(f"unit ({unit}) must divide page_size ({page_size})")
        self.layout = layout
        self.page_size = page_size
        self.unit = unit
        self.head_major = per_kv_head
        self.streams = layout.num_kv_heads if per_kv_head else 1
        self.buffer_tokens = buffer_pages(device_buffer_tokens, page_size, max_seq_len) * page_size
        self.buffer_units = self.buffer_tokens // unit
        self.sink_tokens, self.recent_tokens = sink_tokens, recent_tokens
        self.dense_layers = frozenset(dense_layers)
        self.all_resident = resident_only
        # "triton": the fused kernels of kernels/residency.py (CUDA, or the CPU interpreter);
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
            capacity_tokens=device_capacity_tokens,
        )
        knobs = {DENSE_LAYERS: "fewer dense_layers"}
        self.pools = [DevicePool(s, layout, head_major=per_kv_head, knob=knobs.get(s.kind, "device_capacity_tokens")) for s in sizings]
        self._pool = [next(p for p in self.pools if layer in p.index) for layer in range(L)]
        self.dev_alloc = [self._pool[layer].alloc[layer] for layer in range(L)]
        table_pages = max(self.max_pages, self.buffer_tokens // page_size)
        self.dev_table = torch.full((L, max_requests, table_pages), -1, dtype=torch.int32, device=dev)
        self._dev_pages: dict[tuple[int, int], torch.Tensor] = {}

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

        # per layer: hits, misses (selected tokens), rows copied host -> device
        self.counts = torch.zeros(L, 3, dtype=torch.int64, device=dev)
        self._uncounted = torch.zeros(3, dtype=torch.int64, device=dev)  # counters of the decode writes' placement
        self.hits, self.misses, self.rows_in = self.counts[:, 0], self.counts[:, 1], self.counts[:, 2]
        self.rows_out = torch.zeros(L, dtype=torch.int64, device=dev)  # token rows device -> host
        self.timing = True  # time swap-ins (turn off while capturing a CUDA graph)
        self._swap_seconds = [0.0] * L
        self._swap_events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, dev off, host off)
        self._side = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        # prefetch(): per layer its hits, misses and rows copied; its copies' side stream and events
        self.prefetch_counts = torch.zeros(L, 3, dtype=torch.int64, device=dev)
        self._prefetch_side = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self._prefetches: dict[int, tuple[torch.cuda.Event, tuple[torch.Tensor, ...]]] = {}
        self._writes_done: torch.cuda.Event | None = None
        self._retracted: set[int] = set()
        for pool in self.pools:
            log.info(
                "device KV pool of the %s: %d layer(s) x %d tokens = %.2f GiB (%s)",
                pool.kind.replace("_", " "), len(pool.layers), pool.slots, pool.bytes / 2**30, pool.sizing.rule,
            )

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
        return self._pool[layer].buffers(layer)

    @property
    def row_elems(self) -> int:
        """Storage elements of one stream's row (one KV head, or all heads) in one tensor."""
        return self.layout.stored_head_dim * self.row_heads

    @property
    def row_heads(self) -> int:
        """KV heads in one stream's row: one (head-major), or all."""
        return 1 if self.head_major else self.layout.num_kv_heads

    def _keeps_host(self, request: Request) -> bool:
        """Sparse requests keep every token on the host; resident-only ones do not."""
        return not (self.all_resident or request.dense)

    def mode(self, request: Request, layer: int) -> str:
        resident = self.all_resident or request.dense or layer in self.dense_layers
        return _RESIDENT if resident else _BUFFERED

    def _phys(self, layer: int, slot_ids: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Device slots of positions (logical tokens of a resident layer, or buffer positions
        of a buffered one). slot_ids: [B]; pos: [B, ...] int, -1 kept. Returns `dtype`.
        In torch ops: the decode step's look-up (`resident_slots`) has its own kernel."""
        return paged_slots_rows(self.dev_table[layer], slot_ids, pos, self.page_size, dtype)

    def _dev_off(self, layer: int, slots: torch.Tensor, head: torch.Tensor | int = 0) -> torch.Tensor:
        """Flat element offsets, into the tensors of the layer's pool, of a stream's row at
        device slots (-1 kept)."""
        return self._pool[layer].offsets(layer, slots, head)

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
        put_rows(self.layer_buffers(layer), slots, rows, self.head_major)

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
        then offloads only the tokens after them. Others keep nothing on the host."""
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
        return not (self.all_resident or dense)

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
        self._sync_writes()
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
        self._sync_writes()
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

    def _growth_error(self, starting: list[Request]) -> CapacityError | None:
        """Why the requests `starting` a new page cannot each get one (None: they can)."""
        host_need = sum(1 for r in starting if self._keeps_host(r))
        if host_need > self.host_alloc.free:
            try:
                self.host_alloc.alloc(host_need, self.page_size, f"{host_need} requests")
            except CapacityError as exc:  # (the allocator's own message; nothing was taken)
                return exc
        for layer in range(self.layout.num_layers):
            growing = [r for r in starting if self.mode(r, layer) == _RESIDENT]
            if len(growing) > self.dev_alloc[layer].free:
                who = ", ".join(repr(r.rid) for r in growing[:4]) + (", ..." if len(growing) > 4 else "")
                return self._no_room(layer, len(growing), f"request(s) {who}", any(r.dense for r in growing))
        return None

    def can_grow(self, requests: list[Request]) -> bool:
        """Whether one more token of each request (its next decode step) finds room; changes
        nothing. What an engine asks before a step, to preempt instead of failing it."""
        starting = [r for r in requests if self.needs_page(r)]
        return not starting or self._growth_error(starting) is None

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
        if error is not None:
            raise error
        for r in starting:
            if self._keeps_host(r):
                self.host_pool.reserve(r, r.seq_len)
            self._alloc_device(r, list(range(self.layout.num_layers)), self._device_tokens_for(r, r.seq_len))

    def release(self, request: Request) -> None:
        self._sync_writes()
        self._free_device(request)
        self.host_pool.free(request)
        self.maps.reset(request.slot)
        self._retracted.discard(request.slot)

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
            self._copy_in(layer, torch.tensor([r], device=self.device), tokens.unsqueeze(0), slots.unsqueeze(0))

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

    # -- decode -----------------------------------------------------------------------------
    def begin_step(self, batch: Batch) -> None:
        """Wait (on the GPU) for last step's host writes; advance the recency clock."""
        self._sync_writes()
        self.clock += 1

    def write_decode(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor | None) -> None:
        assert batch.seq_lens is not None and batch.slot_ids is not None
        data = self._tensors(k, v)
        if self.all_resident or layer in self.dense_layers or batch.num_sparse == 0:
            # the whole batch is resident in this layer: find the slots and write, one kernel on CUDA
            if self.impl == "triton":
                from ..kernels.decode_slots import write_token_rows_triton as write
            else:
                write = write_token_rows
            if any(x.stride() != data[0].stride() for x in data):
                data = [x.contiguous() for x in data]
            slots = write(
                self.layer_buffers(layer), self.dev_table[layer], batch.slot_ids, batch.seq_lens,
                data, self.page_size, self.head_major,
            )
            if not self.all_resident and batch.num_sparse:
                everything = torch.arange(len(batch), device=self.device)
                if self.impl == "triton":  # the offsets in one launch
                    self._write_and_queue(layer, batch, everything, slots.view(-1, 1), 0, data, write=False)
                else:
                    self._queue_host_write(layer, batch, everything, slots.view(-1, 1).expand(-1, self.streams))
            return
        # a batch with sparse requests in a sparse layer: dense requests stay resident
        assert batch.sparse_rows is not None and batch.dense_rows is not None
        resident = batch.dense_rows if batch.num_sparse < len(batch) else None
        buffered = batch.sparse_rows
        if resident is not None:
            pos = batch.seq_lens[resident].long() - 1
            slots = self._phys(layer, batch.slot_ids[resident], pos.unsqueeze(1))  # [n, 1]
            if self.impl == "triton":
                self._write_and_queue(layer, batch, resident, slots.expand(-1, self.streams), 0, data)
            else:
                self._write_dev(layer, slots[:, 0], [x[resident] for x in data])
                self._queue_host_write(layer, batch, resident, slots.expand(-1, self.streams))
        if self.impl == "triton":
            self._place_and_write_fused(layer, batch, buffered, data)
            return
        rows, p = batch.slot_ids[buffered], batch.seq_lens[buffered].long() - 1
        unit = (p // self.unit).view(-1, 1, 1).expand(-1, self.streams, 1)  # [n, S, 1]
        fresh = (p % self.unit == 0).view(-1, 1, 1).expand(-1, self.streams, 1)
        heads = torch.arange(self.streams, device=self.device).view(1, -1)
        existing = self.l2s[layer, rows.view(-1, 1), heads, unit[..., 0]].long().unsqueeze(-1)
        nothing = torch.zeros(rows.numel(), self.streams, self.buffer_units, dtype=torch.bool, device=self.device)
        victim = self.maps.victims(layer, rows, batch.seq_lens[buffered], nothing, 1)
        self.maps.assign(layer, rows, unit, fresh, victim)
        bu = torch.where(fresh, victim, existing)[..., 0]  # [n, S]
        self.last_used[layer, rows.view(-1, 1), heads, bu] = self.clock
        slots = self._phys(layer, rows, bu * self.unit + (p % self.unit).view(-1, 1))  # [n, S]
        self._write_dev(layer, slots if self.head_major else slots[:, 0], [x[buffered] for x in data])
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
        slots, _, _ = self._plan_residency(layer, idx, rows, lens, self._uncounted, block_w=2)
        self._write_and_queue(layer, batch, sel, slots, self.unit, data)

    def _write_and_queue(
        self, layer: int, batch: Batch, sel: torch.Tensor, slots: torch.Tensor, pick_unit: int,
        data: list[torch.Tensor], write: bool = True,
    ) -> None:
        """`_write_dev` then `_queue_host_write` of rows `sel` in one launch (kernels/decode_slots.py
        `write_new_rows_triton`; slots [n, S] or, with pick_unit, the new token's unit [n, S, u])."""
        from ..kernels.decode_slots import write_new_rows_triton

        assert batch.slot_ids is not None and batch.seq_lens is not None and batch.sparse_mask is not None
        hp, pool = self.host_pool, self._pool[layer]
        hk, hw, dw = self.layout.num_kv_heads, hp.head_width, self.layout.stored_head_dim
        major = self.head_major
        host = (layer * hp.host_slots * hk * hw, hk * hw, hw if major else 0)
        i = pool.index[layer]
        dev = (i * hk * pool.slots * dw, dw, pool.slots * dw) if major else (i * pool.slots * hk * dw, hk * dw, 0)
        if any(x.stride() != data[0].stride() for x in data):
            data = [x.contiguous() for x in data]
        dev_off, host_off = write_new_rows_triton(
            self.layer_buffers(layer), data, sel, batch.seq_lens, batch.slot_ids, batch.sparse_mask, slots,
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
        dev_off = torch.where(host_off >= 0, self._dev_off(layer, slots, heads), -1)
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
        self._join_prefetch()  # a prefetch whose layer never asked for its rows (the step went dense)
        if not self._pending:
            return
        # one copy per device pool (its offsets address that pool's tensors)
        groups = []
        for pool in self.pools:
            mine = [p for p in self._pending if self._pool[p[0]] is pool]
            if mine:
                groups.append((pool, torch.cat([p[1] for p in mine]), torch.cat([p[2] for p in mine])))
        self._pending.clear()
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
            for pool, src_off, dst_off in groups:
                for dev_buf, host_buf in zip(pool.tensors, self.host):
                    self.host_pool.write_rows(dev_buf, host_buf, src_off, dst_off, self.row_heads)
        if self._side is None:
            return
        for _, src_off, dst_off in groups:
            src_off.record_stream(self._side)
            dst_off.record_stream(self._side)
        self._writes_done = torch.cuda.Event()
        self._writes_done.record(self._side)

    def _sync_writes(self) -> None:
        if self._writes_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._writes_done)
            self._writes_done = None

    # -- selection --------------------------------------------------------------------------
    def resident_slots(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        assert batch.slot_ids is not None
        if self.impl == "triton":  # one kernel instead of ~13 torch ops on the decode path
            from ..kernels.decode_slots import paged_slots_rows_triton
            return paged_slots_rows_triton(self.dev_table[layer], batch.slot_ids, selection.indices, self.page_size, torch.int32)
        return self._phys(layer, batch.slot_ids, selection.indices, torch.int32)

    def ensure_resident(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        """Swap in the missing units of a selection of buffered rows; return device slots.

        1. look every selected unit up in the logical→buffer map (hits, misses);
        2. protect the hits, pick victims among the other units (free first, then least
           recently used; never pinned ones), evict them and map the misses there;
        3. copy the misses' rows host→device (zero-copy gather on CUDA);
        4. stamp recency and count hits, misses and rows moved.
        """
        assert batch.slot_ids is not None and batch.seq_lens is not None
        if self.all_resident:
            return self.resident_slots(layer, batch, selection)
        self._join_prefetch(layer)
        if self.impl == "triton":
            return self._ensure_resident_fused(layer, batch, selection)
        u = self.unit
        idx = selection.indices
        b, s, w = idx.shape
        first = idx[..., ::u]
        units = first.long().div(u, rounding_mode="floor")  # [B, S, Wu], -1 stays -1
        valid = first >= 0
        rows = batch.slot_ids
        ri = rows.view(-1, 1, 1)
        hi = torch.arange(s, device=self.device).view(1, -1, 1)
        cur = self.l2s[layer, ri, hi, units.clamp(min=0)].long()
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
        self.last_used[layer, ri, hi, torch.where(valid, bu, self.buffer_units)] = self.clock
        # token-level positions
        offs = torch.arange(u, device=self.device)
        tok_bu = (bu.unsqueeze(-1) * u + offs).flatten(-2)[..., :w]
        tok_bu = torch.where(idx >= 0, tok_bu, -1)
        slots = self._phys(layer, rows, tok_bu)  # [B, S, W]
        tok_miss = miss.unsqueeze(-1).expand(-1, -1, -1, u).flatten(-2)[..., :w] & (idx >= 0)
        src_tokens = torch.where(tok_miss, idx.long(), -1)
        start = self._timer() if self.timing else None
        self._copy_in(layer, rows, src_tokens, torch.where(tok_miss, slots, -1))
        if start is not None:
            self._stop_timer(layer, start)
        self.hits[layer] += (hit.unsqueeze(-1).expand(-1, -1, -1, u).flatten(-2)[..., :w] & (idx >= 0)).sum()
        self.misses[layer] += tok_miss.sum()
        return slots.to(torch.int32)

    def _ensure_resident_fused(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        """`ensure_resident` in two kernel launches (kernels/residency.py)."""
        idx = selection.indices.contiguous()
        start = self._timer() if self.timing else None
        slots, todo, n_todo = self._plan_selection(layer, batch, idx, self.counts[layer])
        self._copy_missing(layer, idx, slots, todo, n_todo, batch.slot_ids)
        if start is not None:
            self._stop_timer(layer, start)
        return slots

    def _copy_missing(
        self, layer: int, idx: torch.Tensor, slots: torch.Tensor, todo: torch.Tensor, n_todo: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """One launch of `copy_missing_kernel`: the rows `_plan_residency` found missing, host → device."""
        from ..kernels import pdl
        from ..kernels.launch import launch
        from ..kernels.residency import copy_missing_kernel
        from .copy import _as_kernel_arg

        b, s, w = idx.shape
        use_pdl = pdl.enabled(idx.device)
        host = [_as_kernel_arg(t) for t in self.host]
        pool = self._pool[layer]
        dev = pool.tensors
        two = len(dev) == 2
        hp = self.host_pool  # host rows: the device's, or fp8 ones the kernel dequantises (FP8_HOST)
        launch(copy_missing_kernel, (COPY_PROGRAMS,),
            todo, n_todo, idx, slots, rows, self.host_table,
            host[0], dev[0], host[1] if two else host[0], dev[1] if two else dev[0],
            s, w, self.page_size, self.host_table.shape[-1],
            layer * self.host_slots * hp.row_elems, pool.layer_offset(layer),
            pool.slots, self.layout.num_kv_heads, b * s, BLOCK_S=pow2(b * s),
            HEAD_MAJOR=self.head_major, TWO=two, ROW=self.row_elems, COLS=min(COPY_COLS, pow2(self.row_elems)),
            PDL=use_pdl, HROW=hp.head_width * self.row_heads, FP8_HOST=hp.fp8, HEAD_DIM=self.layout.head_dim,
            num_warps=COPY_WARPS, launch_pdl=use_pdl,
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
        if self.all_resident:
            return
        self._join_prefetch(layer)
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
        with torch.cuda.stream(side):
            self._copy_missing(layer, idx, slots, todo, n_todo, batch.slot_ids)
        done = torch.cuda.Event()
        done.record(side)
        # the side stream's inputs stay referenced until the main stream has waited for it
        self._prefetches[layer] = (done, (idx, slots, todo, n_todo, batch.slot_ids, batch.seq_lens))

    def _join_prefetch(self, layer: int | None = None) -> None:
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
        return self._plan_residency(layer, idx, batch.slot_ids, batch.seq_lens, counts,
                                    block_w=pow2(-(-idx.shape[-1] // self.unit)))

    def _plan_residency(
        self, layer: int, idx: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, counts: torch.Tensor, *,
        block_w: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One launch of `plan_residency_kernel` over selections idx [B, S, W] (whole units,
        -1 padded) of state `rows` [B] with lengths `lens` [B]: (device slots [B, S, W], the
        missed entries, their count per stream); hits and misses are added to `counts` [3]."""
        from ..kernels import pdl
        from ..kernels.launch import launch
        from ..kernels.residency import plan_residency_kernel

        b, s, w = idx.shape
        u = self.unit
        block_b = pow2(self.buffer_units)
        scratch = torch.empty((b * s, block_b), dtype=torch.int64, device=self.device)
        slots = torch.empty_like(idx)
        todo = torch.empty(b * s * w, dtype=torch.int64, device=self.device)
        n_todo = torch.empty(b * s, dtype=torch.int32, device=self.device)  # every entry written
        use_pdl = pdl.enabled(idx.device)
        launch(plan_residency_kernel, (b * s,),
            idx, rows, lens, self.l2s[layer], self.s2l[layer], self.last_used[layer],
            self.clock, self.dev_table[layer], slots, todo, n_todo, scratch, counts,
            s, w, -(-w // u), self.max_units, self.buffer_units, u, self.page_size, self.dev_table.shape[-1],
            self.sink_tokens, self.recent_tokens,
            BLOCK_W=block_w, BLOCK_B=block_b, BLOCK_U=pow2(u), PDL=use_pdl,
            num_warps=8 if block_b <= 2048 else 16, launch_pdl=use_pdl,
        )
        return slots, todo, n_todo

    def _copy_in(self, layer: int, rows: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        """Host→device copy of logical `tokens` [B, S, W] (or [B, W] for all streams) into
        device `slots` (same shape), -1 entries skipped."""
        if tokens.dim() == 2:
            tokens = tokens.unsqueeze(1).expand(-1, self.streams, -1)
            slots = slots.unsqueeze(1).expand(-1, self.streams, -1)
        heads = torch.arange(self.streams, device=self.device).view(1, -1, 1) if self.head_major else 0
        host_rows = self.host_pool.rows(rows, tokens)
        src = self.host_pool.offsets(layer, host_rows, heads)
        dst = self._dev_off(layer, slots, heads)
        src = torch.where(dst >= 0, src, -1).flatten()
        dst = dst.flatten()
        for dev_buf, host_buf in zip(self._pool[layer].tensors, self.host):
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

    # -- retract / resume -------------------------------------------------------------------
    def retract(self, request: Request) -> None:
        """Preempt: free the request's device memory, keep (or make) its host copy."""
        self._sync_writes()
        if not self._keeps_host(request):  # resident-only requests get a host copy first
            self.host_pool.reserve(request, request.seq_len)
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
                self._copy_in(layer, sid, tokens, self._phys(layer, sid, tokens))
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
        for layer, start, end in self._swap_events:
            end.synchronize()
            self._swap_seconds[layer] += start.elapsed_time(end) / 1000
        self._swap_events.clear()
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
                "swap_seconds": self._swap_seconds[layer],
            }
            for layer in range(self.layout.num_layers)
        ]


