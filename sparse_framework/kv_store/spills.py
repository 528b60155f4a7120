"""Which requests of a hybrid store live in the host tier (`"store": "hybrid"`, docs/kv_store.md).

A hybrid store keeps every request resident on the device, as the resident store does, until
admission or growth needs room the device pool no longer has; then it *spills* running
requests: their K/V is copied to the pinned host pool and their sparse layers shrink to the
hierarchical store's device buffer. Which requests are spilled is state the store, its
swap-in (`residency.BufferResidency`) and its decode writes (`decode_writes.DecodeWrites`) all
read, so it lives here, in one object they share, twice:

- `slots`, on the host: what admission, growth, retract / resume and the prefix cache ask
  (no device synchronisation), and what picks a decode step's path (`any_in`): a batch
  without a spilled row runs exactly the resident store's path;
- `flags`, on the device ([max_requests] int32, 1 = spilled): what the fused residency
  kernel reads per row, so that one launch serves a batch that mixes resident and spilled
  rows, and a captured CUDA graph stays right when a request of its batch is spilled later
  (the graph's key says whether any row is spilled: `HierarchicalKVStore.decode_key`).
"""

from __future__ import annotations

import torch

from ..common.batch import Batch


class SpilledRequests:
    """The spilled requests of a hybrid store by state row (`enabled` False: never any)."""

    def __init__(self, max_requests: int, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.flags = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.slots: set[int] = set()

    def mark(self, slot: int, spilled: bool) -> None:
        """Record that state row `slot` is (or no longer is) spilled, on both sides."""
        if spilled == (slot in self.slots):
            return
        (self.slots.add if spilled else self.slots.discard)(slot)
        self.flags[slot] = int(spilled)

    def __contains__(self, slot: int) -> bool:
        return slot in self.slots

    def any_in(self, batch: Batch) -> bool:
        """Whether a row of the batch is spilled (host state: no device synchronisation)."""
        return bool(self.slots) and any(r.slot in self.slots for r in batch.requests)

    def rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """bool [n]: which of the state rows `slot_ids` are spilled (device, graph-safe)."""
        return self.flags[slot_ids] != 0
