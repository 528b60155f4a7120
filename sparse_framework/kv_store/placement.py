"""Where each request's rows live, and the moves of its life: admission, growth, retract /
resume and release.

`RequestPlacement` owns which requests are retracted (`retracted`: their device pages given
back, their K/V on the host until `resume`) and decides, per request and layer, where the rows
live (`mode`: every token on the device, or a buffer over the host copy; `keeps_host`). It
changes the parts that own the rows through their own methods: the device pages
(`DevicePages`), the host pages (`HostPool`), the slot maps (`SlotMaps`), the row copies
between the tiers (`TierCopies`); and it composes the hybrid store's spills (`HybridSpilling`),
which read the retracted rows and keep the admitted requests they choose among. The store
(`HierarchicalKVStore`) is its one user.
"""

from __future__ import annotations

import torch

from ..common.arith import cdiv
from ..common.batch import Batch, Request
from ..common.errors import CapacityError
from .decode_writes import DecodeWrites
from .device_pages import DevicePages
from .spill_policy import HybridSpilling
from .spills import SpilledRequests
from .tier_copies import TierCopies

RESIDENT, BUFFERED = "resident", "buffered"  # a (request, layer)'s mode


class RequestPlacement:
    """Where each request's rows live, and the moves of its life (module docstring).
    dense_layers, sparse_layers, all_resident (the resident store), hybrid and buffer_tokens:
    the store's settings; the parts: the store's, shared (the layout, host pool and slot maps
    are the row copies', `copies`)."""

    def __init__(
        self,
        *,
        pages: DevicePages,
        spills: SpilledRequests,
        writes: DecodeWrites,
        copies: TierCopies,
        dense_layers: frozenset[int],
        sparse_layers: list[int],
        all_resident: bool,
        hybrid: bool,
        buffer_tokens: int,
    ) -> None:
        self.pages, self.spills, self.writes, self.copies = pages, spills, writes, copies
        self.layout, self.host_pool, self.maps = copies.layout, copies.host_pool, copies.maps
        self.dense_layers, self.sparse_layers = dense_layers, sparse_layers
        self.all_resident, self.hybrid = all_resident, hybrid
        self.page_size, self.buffer_tokens = pages.page_size, buffer_tokens
        self.retracted: set[int] = set()
        # the hybrid store's spills and promotions, with the admitted requests they choose among
        self.spilling = HybridSpilling(
            spills=spills, pages=pages, copies=copies, writes=writes, retracted=self.retracted,
            sparse_layers=sparse_layers, buffer_tokens=buffer_tokens,
        )

    def keeps_host(self, request: Request) -> bool:
        """Sparse requests keep every token on the host; resident-only ones do not, nor do a
        hybrid store's until they are spilled."""
        if self.all_resident or request.dense:
            return False
        return not self.hybrid or request.slot in self.spills

    def mode(self, request: Request, layer: int) -> str:
        resident = self.all_resident or request.dense or layer in self.dense_layers
        if self.hybrid and request.slot not in self.spills:
            resident = True
        return RESIDENT if resident else BUFFERED

    def _alloc_device(self, request: Request, layers: list[int], tokens: int) -> None:
        """All-or-nothing: device pages for the given layers, `tokens` in each resident one and
        a buffer in each buffered one (`DevicePages.alloc`), or raise unchanged."""
        want = {RESIDENT: tokens, BUFFERED: self.buffer_tokens}
        self.pages.alloc(request, {layer: want[self.mode(request, layer)] for layer in layers})

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
        live = self.spilling.live
        live[request.slot] = request
        try:
            if not self.hybrid:
                self._admit(request, cached_pages)
                return
            self.spills.mark(request.slot, False)
            # whole where there is (or spilling makes) the room; a dense request only whole
            if self.spilling.make_room(cdiv(request.prompt_len, self.page_size), keep=request) or request.dense:
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
            self.spilling.spill_count += 1
        except CapacityError:
            del live[request.slot]
            raise

    def _admit(self, request: Request, cached_pages: torch.Tensor | None) -> None:
        layers = list(range(self.layout.num_layers))
        try:
            if self.keeps_host(request):
                if cached_pages is not None and cached_pages.numel():
                    self.host_pool.adopt(request, cached_pages)
                self.host_pool.reserve(request, request.prompt_len)
            self._alloc_device(request, layers, request.prompt_len)
        except CapacityError:
            self.host_pool.free(request)
            raise
        self.maps.reset(request.slot)

    def _growth_error(self, starting: list[Request], spare: int = 0) -> CapacityError | None:
        """Why the requests `starting` a new page cannot each get one (None: they can), with
        `spare` more free pages in each sparse layer (what spills would free)."""
        host_need = sum(1 for r in starting if self.keeps_host(r))
        if host_need > self.host_pool.host_alloc.free:
            try:
                self.host_pool.host_alloc.alloc(host_need, self.page_size, f"{host_need} requests")
            except CapacityError as exc:  # (the allocator's own message; nothing was taken)
                return exc
        for layer in range(self.layout.num_layers):
            growing = [r for r in starting if self.mode(r, layer) == RESIDENT]
            if len(growing) > self.pages.allocs[layer].free + (0 if layer in self.dense_layers else spare):
                who = ", ".join(repr(r.rid) for r in growing[:4]) + (", ..." if len(growing) > 4 else "")
                return self.pages.no_room(layer, len(growing), f"request(s) {who}", any(r.dense for r in growing))
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
        spare = sum(freed for freed, _ in self.spilling.spillable())
        if self._growth_error(starting, spare) is not None:
            return False
        self.spilling.make_room(self._sparse_growth(starting))
        return self._growth_error(starting) is None

    def _sparse_growth(self, starting: list[Request]) -> int:
        """Pages the requests starting one need in each sparse layer (the whole ones)."""
        layers = self.sparse_layers
        return sum(1 for r in starting if self.mode(r, layers[0]) == RESIDENT) if layers else 0

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
            self.spilling.make_room(self._sparse_growth(starting), advanced=advanced)
            error = self._growth_error(starting)
        if error is not None:
            raise error
        for r in starting:
            if self.keeps_host(r):
                self.host_pool.reserve(r, r.seq_len)
            self._alloc_device(r, list(range(self.layout.num_layers)), r.seq_len)

    def release(self, request: Request) -> None:
        self.writes.sync()
        self.pages.free(request.slot)
        self.host_pool.free(request)
        self.maps.reset(request.slot)
        self.retracted.discard(request.slot)
        self.spills.mark(request.slot, False)
        self.spilling.live.pop(request.slot, None)
        if self.hybrid and self.spills.slots:
            self.spilling.promote_while_room()

    def retract(self, request: Request) -> None:
        """Preempt: free the request's device memory, keep (or make) its host copy."""
        self.writes.sync()
        if not self.keeps_host(request):  # resident-only requests get a host copy first
            self.host_pool.reserve(request, request.seq_len)
            self.copies.to_host(request)
        self.pages.free(request.slot)
        self.maps.reset(request.slot)
        self.retracted.add(request.slot)

    def resume(self, request: Request) -> None:
        """Bring a retracted request back: device pages, resident layers copied in whole,
        buffered layers refilled with the sink and recent window."""
        if request.slot not in self.retracted:
            raise ValueError(f"request {request.rid!r} is not retracted")
        self._alloc_device(request, list(range(self.layout.num_layers)), request.seq_len)
        for layer in range(self.layout.num_layers):
            if self.mode(request, layer) == RESIDENT:
                self.copies.copy_in(layer, request)
            else:
                self.copies.fill_buffer(layer, request, None)
        if not self.keeps_host(request):
            # later writes to these host pages are queued after this copy on the same
            # stream (prefill) or on the side stream, which waits for it (end_step)
            self.host_pool.free(request)
        self.retracted.discard(request.slot)

