"""The store interface the coordinator talks to (implemented by HierarchicalKVStore)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..common.batch import Batch, Request, Selection
from ..common.layout import KVLayout


class KVStore(ABC):
    """Holds every live request's K/V per layer and maps logical tokens to device slots.

    Device buffers are viewed as pages for the kernels: token-major [slots, kv_heads, dim]
    (per-request selections) or head-major [kv_heads, slots, dim] (per-KV-head selections,
    whose page tables fold KV heads into the batch).
    """

    layout: KVLayout
    head_major: bool
    page_size: int

    @property
    @abstractmethod
    def num_slots(self) -> int:
        """Device token slots per KV head and layer."""

    # lifecycle
    @abstractmethod
    def admit(self, request: Request) -> None:
        """Reserve room for a new request's prompt (CapacityError when full; nothing changes)."""

    @abstractmethod
    def retract(self, request: Request) -> None:
        """Preempt: release the request's device memory, keep its KV on the host."""

    @abstractmethod
    def resume(self, request: Request) -> None:
        """Undo `retract`: attention afterwards is bit-identical to never having retracted."""

    @abstractmethod
    def release(self, request: Request) -> None:
        """Free everything the request holds."""

    # per step
    def begin_step(self, batch: Batch) -> None:
        """Start of a forward pass (wait for last step's asynchronous writes)."""

    def end_step(self, batch: Batch) -> None:
        """End of a forward pass (start asynchronous writes)."""

    def decode_key(self, batch: Batch) -> tuple:
        """What a decode step's captured graph depends on in the store's state beyond the
        batch's composition (the hybrid store: whether a row is spilled); () for none."""
        return ()

    @abstractmethod
    def grow(self, batch: Batch) -> None:
        """Make room for this decode step's new token of every request (after `seq_len` was
        advanced); all or nothing."""

    @abstractmethod
    def write_prefill(self, layer: int, request: Request, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store a prompt's K/V: [prompt_len, kv_heads, dim] (v None for MLA latents)."""

    @abstractmethod
    def write_decode(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store this step's K/V: [batch, kv_heads, dim], row i at position seq_lens[i]-1."""

    @abstractmethod
    def ensure_resident(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        """Make a selection of the batch's (sparse) requests resident; return device slots,
        int32 shaped like `selection.indices`, -1 where the selection is padded."""

    @abstractmethod
    def resident_slots(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        """Device slots of tokens of requests whose whole sequence is on the device (dense
        requests and dense layers)."""

    @abstractmethod
    def paged_view(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer viewed as [num_pages, page_size, heads, dim] (heads = 1 in the
        head-major layout, whose page p of KV head h is page h * num_slots // page_size + p)."""

    # accounting
    @abstractmethod
    def device_tokens(self, request: Request) -> int:
        """Device token slots the request holds (per layer, averaged over layers)."""

    @abstractmethod
    def used_tokens(self) -> int:
        """Device token slots owned by requests (per layer, averaged over layers)."""

    @abstractmethod
    def device_bytes(self) -> int:
        """Bytes of KV held on the device for live requests, over all layers."""
