"""The hybrid store's policy: which running requests spill to the host tier, and when spilled
ones become whole on the device again (`"store": "hybrid"`, docs/kv_store.md).

`HybridSpilling` owns the state the policy alone reads: the admitted requests by state row
(`live`, the candidates to spill or promote) and the counts of spills and promotions (stats).
Which requests are spilled is `SpilledRequests` (spills.py), shared with the swap-in and the
decode writes; the device pages are `DevicePages`' and the host pages the `HostPool`'s. A spill
copies a whole request to its host pages and shrinks its sparse layers to a buffer; a promotion
copies it back whole and frees its host pages. Both are lossless.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from ..common.arith import cdiv
from ..common.batch import Request
from .decode_writes import DecodeWrites
from .device_pages import DevicePages
from .spills import SpilledRequests
from .tier_copies import TierCopies


class HybridSpilling:
    """Spills and promotions of a hybrid store (module docstring); `spills.enabled` False: the
    store is not hybrid and `spill` refuses. `retracted`: the store's retracted rows, shared
    (read only: a retracted request is neither spilled nor promoted). The host pool and slot
    maps are the row copies' (`copies`); sparse_layers and buffer_tokens the store's geometry."""

    def __init__(
        self,
        *,
        spills: SpilledRequests,
        pages: DevicePages,
        copies: TierCopies,
        writes: DecodeWrites,
        retracted: AbstractSet[int],
        sparse_layers: list[int],
        buffer_tokens: int,
    ) -> None:
        self.spills, self.pages, self.copies, self.writes = spills, pages, copies, writes
        self.host_pool, self.maps = copies.host_pool, copies.maps  # (the store's, shared)
        self.retracted, self.sparse_layers, self.buffer_tokens = retracted, sparse_layers, buffer_tokens
        self.page_size, self.max_pages = pages.page_size, pages.max_pages
        self.live: dict[int, Request] = {}  # admitted requests by state row (the hybrid store spills among them)
        self.spill_count = 0  # requests spilled so far (stats)
        self.promote_count = 0  # spilled requests made whole again (stats)

    def sparse_pages(self, request: Request) -> int:
        """Device pages the request holds in one sparse layer."""
        layers = self.sparse_layers
        return self.pages.held(request.slot, layers[0]) if layers else 0

    def sparse_free(self) -> int:
        """Free pages in every sparse layer (the fewest of any)."""
        return self.pages.free_pages(self.sparse_layers)

    def spillable(self, keep: Request | None = None) -> list[tuple[int, Request]]:
        """Running requests a spill would shrink, with the pages per sparse layer it frees,
        the most first (fewest spills for the room): whole, sparse, holding more than a buffer."""
        buffer = self.buffer_tokens // self.page_size
        found = []
        for slot, r in self.live.items():
            if r is keep or r.dense or slot in self.spills or slot in self.retracted or r.seq_len < r.prompt_len:
                continue  # (a prompt not handed over yet has nothing to spill: it is admitted again whole)
            freed = self.sparse_pages(r) - buffer
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
        short = pages - self.sparse_free()
        if short <= 0:
            return True
        victims = []
        for freed, r in self.spillable(keep):
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
        if not self.spills.enabled or request.dense or request.slot in self.spills or request.slot in self.retracted:
            raise ValueError(f"request {request.rid!r}: only a live, whole, sparse request of a hybrid store spills")
        self.writes.sync()
        self.host_pool.reserve(request, request.seq_len)
        self.copies.to_host(request)
        for layer in self._switch_tier(request, spilled=True):
            self.copies.fill_buffer(layer, request, None)
        self.spill_count += 1

    def _switch_tier(self, request: Request, spilled: bool) -> list[int]:
        """Re-place a request's sparse layers on the device for its new tier (spilled: a buffer;
        whole: every token): their pages released and taken anew, the maps reset; the rows are
        the caller's to copy. Returns the sparse layers."""
        layers = self.sparse_layers
        self.pages.release(request.slot, layers)
        self.spills.mark(request.slot, spilled)
        self.maps.reset(request.slot)
        tokens = self.buffer_tokens if spilled else request.seq_len  # (a sparse layer of a hybrid store)
        self.pages.alloc(request, {layer: tokens for layer in layers})
        return layers

    def promote_while_room(self) -> None:
        """Make spilled requests whole again, the smallest first, while the sparse layers' pool
        keeps the room of one more whole request of max_seq_len after each: room freed by a
        finished request goes to the spilled ones, but not the room the next admission needs,
        which would spill them again at once."""
        if not self.sparse_layers:
            return
        waiting = sorted((r for slot, r in self.live.items() if slot in self.spills and slot not in self.retracted),
                         key=lambda r: r.seq_len)
        for r in waiting:
            if self.sparse_free() - self._promotion_pages(r) < self.max_pages:
                return
            self.promote(r)

    def _promotion_pages(self, request: Request) -> int:
        """Pages per sparse layer a spilled request takes beyond its buffer when made whole."""
        return cdiv(request.seq_len, self.page_size) - self.sparse_pages(request)

    def promote(self, request: Request) -> None:
        """Make a spilled request of a hybrid store whole on the device again: its sparse layers'
        buffers are released, every token is copied back from its host pages, which are freed
        (it keeps nothing on the host, as before its spill). Lossless. CapacityError, with
        nothing changed, when the sparse layers' pool lacks the room."""
        if request.slot not in self.spills or request.slot in self.retracted:
            raise ValueError(f"request {request.rid!r}: only a live, spilled request of a hybrid store is promoted")
        layers = self.sparse_layers
        need = self._promotion_pages(request)
        short = [layer for layer in layers if self.pages.allocs[layer].free < need]
        if short:
            raise self.pages.no_room(short[0], need, f"request {request.rid!r} made whole", False)
        self.writes.sync()  # its last decode tokens' host copies land before they are read back
        self._switch_tier(request, spilled=False)
        for layer in layers:
            self.copies.copy_in(layer, request)
        # later writes to these host pages are queued after this copy (resume's argument)
        self.host_pool.free(request)
        self.promote_count += 1

