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

`HierarchicalKVStore` is the facade the coordinator, the engine and the prefix cache talk to.
It owns the store's settings (geometry, pool sizes, which layers are dense, which store it
is) and composes the parts that own the state, passing each what it shares with the others:
  device_pools.py  the device pools (`DevicePool`) and their addressing (`DeviceRows`)
  device_pages.py  the pages each (request, layer) holds and the device page table (`DevicePages`)
  host_pool.py     the host tier (`HostPool`)
  slot_maps.py     the buffers' logical→unit maps and recency (`SlotMaps`)
  residency.py     the swap-in and prefetch, with their counters (`BufferResidency`)
  decode_writes.py the decode writes and the queue of host writes (`DecodeWrites`)
  placement.py     each request's mode and its admission, growth, retract / resume and release,
                   with the retracted rows (`RequestPlacement`)
  spill_policy.py  a hybrid store's spills and promotions (`HybridSpilling`, over spills.py)
  tier_copies.py   a whole request's rows between the tiers (`TierCopies`: no state of its own)
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet

import torch

from ..common.arith import cdiv
from ..common.batch import Batch, Request, Selection
from ..common.layout import KVLayout, resolve_impl
from .base import KVStore
from .decode_writes import DecodeWrites
from .device_pages import DevicePages
from .device_pools import DENSE_LAYERS, DevicePool, DeviceRows, buffer_pages, size_device_pools
from .fp8_host import check_host_kv_dtype, is_fp8_host
from .host_pool import HostPool
from .placement import BUFFERED, RESIDENT, RequestPlacement
from .residency import BufferResidency, CopyShapes
from .slot_maps import SlotMaps
from .spills import SpilledRequests
from .tier_copies import TierCopies

log = logging.getLogger(__name__)


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
        # the pages each request holds per layer and the device page table (device_pages.py):
        # only admission, growth, retract / resume, release and spills change them
        self.pages = DevicePages(
            self._pool, page_size=page_size, max_requests=max_requests, max_pages=self.max_pages,
            table_pages=max(self.max_pages, self.buffer_tokens // page_size), buffer_tokens=self.buffer_tokens,
            min_sparse_prompt_len=self.min_sparse_prompt_len, device=dev,
        )
        self.dev_alloc, self.dev_table = self.pages.allocs, self.pages.table
        # the pools and the page table, as the swap-in and the decode writes address them
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
        # a whole request's rows between the tiers: prefill, retract / resume, spills, the
        # prefix cache's pages (tier_copies.py)
        self.copies = TierCopies(self.residency)
        # each request's mode per layer and the moves of its life: admission, growth, retract /
        # resume, release, and a hybrid store's spills and promotions (placement.py, spill_policy.py)
        self.placement = RequestPlacement(
            pages=self.pages, spills=self.spills, writes=self.writes, copies=self.copies,
            dense_layers=self.dense_layers, sparse_layers=self.sparse_layers, all_resident=resident_only,
            hybrid=hybrid, buffer_tokens=self.buffer_tokens,
        )
        self.spilling = self.placement.spilling
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
        self.writes.write_decode(layer, batch, self.copies.stored(k, v))

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

    def mode(self, request: Request, layer: int) -> str:
        """"resident" (every token on the device) or "buffered" (`RequestPlacement.mode`)."""
        return self.placement.mode(request, layer)

    def decode_key(self, batch: Batch) -> tuple:
        """What a captured decode graph of this batch depends on beyond its composition:
        whether a row is buffered (a hybrid store's spilled request), which picks the path."""
        return (self.buffers_rows_of(batch),) if self.hybrid else ()

    def buffers_rows_of(self, batch: Batch) -> bool:
        """Whether a row of the batch is buffered in the sparse layers: a sparse request of the
        hierarchical store, a spilled one of the hybrid store; never in the resident store."""
        return self.residency.buffers_rows_of(batch)

    # -- admission, growth, retract / resume, release (placement.py `RequestPlacement`) -------
    def admit(self, request: Request, cached_pages: torch.Tensor | None = None) -> None:
        """Reserve host pages (sparse requests) and device pages for the prompt; all or nothing.
        `cached_pages`: a prefix cache's host pages of its first `request.cached_len` tokens,
        borrowed. A hybrid store spills running requests for the room, or admits it spilled
        (`RequestPlacement.admit`)."""
        self.placement.admit(request, cached_pages)

    def can_grow(self, requests: list[Request]) -> bool:
        """Whether one more token of each request finds room; a hybrid store spills running
        requests where that makes it (`RequestPlacement.can_grow`)."""
        return self.placement.can_grow(requests)

    def needs_page(self, request: Request) -> bool:
        """Whether the request's next decode token starts a new page (`RequestPlacement.needs_page`)."""
        return self.placement.needs_page(request)

    def grow(self, batch: Batch) -> None:
        """Pages for this step's new tokens (only at page boundaries); all or nothing."""
        self.placement.grow(batch)

    def retract(self, request: Request) -> None:
        """Preempt: free the request's device memory, keep (or make) its host copy."""
        self.placement.retract(request)

    def resume(self, request: Request) -> None:
        """Bring a retracted request back: device pages, resident layers copied in whole,
        buffered layers refilled with the sink and recent window."""
        self.placement.resume(request)

    def release(self, request: Request) -> None:
        self.placement.release(request)

    # -- pages for a prefix cache (engine/prefix_cache.py) ------------------------------------
    def keeps_host(self, request: Request) -> bool:
        """Whether the request's K/V live on the host (its host pages can be cached as they are;
        `RequestPlacement.keeps_host`)."""
        return self.placement.keeps_host(request)

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
        self.copies.load_pages(ids, dst, start)

    def export_pages(self, request: Request, first_page: int, num_pages: int) -> torch.Tensor:
        """Copy the request's device K/V of pages first_page..first_page+num_pages-1 (every
        layer resident: a request that keeps nothing on the host) into newly allocated host
        pages, returned (owned by the caller; CapacityError, nothing taken, without room)."""
        if self.keeps_host(request):
            raise ValueError(f"request {request.rid!r} keeps its K/V on the host: use host_page_ids")
        ids = self.host_alloc.alloc(num_pages, self.page_size, f"prefix cache of {request.rid!r}")
        if num_pages == 0:
            return ids
        self.writes.sync()
        self.copies.pages_to_host(request, first_page, ids)
        return ids

    # -- the hybrid store's spills (spill_policy.py `HybridSpilling`, which owns their counts) -------
    @property
    def spill_count(self) -> int:
        """Requests spilled so far (stats)."""
        return self.spilling.spill_count

    @property
    def promote_count(self) -> int:
        """Spilled requests made whole again (stats)."""
        return self.spilling.promote_count

    def make_room(self, pages: int, keep: Request | None = None, advanced: AbstractSet[int] = frozenset()) -> bool:
        """Free `pages` pages in every sparse layer of a hybrid store, spilling running requests
        if needed; True when the room is there (`HybridSpilling.make_room`)."""
        return self.spilling.make_room(pages, keep, advanced)

    def spill(self, request: Request) -> None:
        """Move a whole request of a hybrid store to the host tier, losslessly (`HybridSpilling.spill`)."""
        self.spilling.spill(request)

    def promote(self, request: Request) -> None:
        """Make a spilled request of a hybrid store whole on the device again (`HybridSpilling.promote`)."""
        self.spilling.promote(request)

    # -- prefill ----------------------------------------------------------------------------
    def write_prefill(self, layer: int, request: Request, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.copies.write_prompt(layer, request, self.copies.stored(k, v), to_host=self.keeps_host(request),
                                 resident=self.mode(request, layer) == RESIDENT)

    # -- views and accounting ---------------------------------------------------------------
    def paged_view(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_pages, page_size, heads, dim] views of a layer's device pool, K and V (no copy;
        `DeviceRows.paged_view`)."""
        return self.device_rows.paged_view(layer, page_size)

    def read(self, layer: int, request: Request) -> list[torch.Tensor]:
        """A request's rows in logical order, [seq_len, kv_heads, dim] per stored tensor
        (K, V; or the latent) as stored (fp8 as bytes; an fp8 MLA latent as its packed
        656-byte rows, which `unpack_flashmla_fp8` turns back into latents): from the device
        for a resident (request, layer), else from the host (fp8 host rows dequantised to the
        layout's dtype: what a swap-in would bring back). Synchronises; for tests and
        debugging."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        from_host = self.mode(request, layer) == BUFFERED or request.slot in self.placement.retracted
        return self.copies.read(layer, request, from_host)

    def device_tokens(self, request: Request) -> int:
        """Device token slots the request holds, averaged over layers."""
        return self.pages.held(request.slot) * self.page_size // max(1, self.layout.num_layers)  # 0 layers: nothing held

    def host_tokens(self, request: Request) -> int:
        return self.host_pool.tokens(request)

    def used_tokens(self) -> int:
        return self.pages.used_pages * self.page_size // max(1, self.layout.num_layers)

    def device_bytes(self) -> int:
        return self.pages.used_pages * self.page_size * self.layout.bytes_per_token_per_layer

    def pool_stats(self) -> list[dict[str, object]]:
        """Per pool (the device pools, then the host pool): kind, layers, tokens per layer,
        bytes, tokens and bytes used now (summed over layers), and how it was sized."""
        return [pool.stats() for pool in self.pools] + [self.host_pool.stats()]

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
