"""The store interface the coordinator talks to.

Step 1 ships a resident store (every token on the device); the hierarchical store (host pool
+ per-request device buffer + swap-in) implements the same interface, so the coordinator,
algorithms and backends do not change when it arrives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..batch import Batch, Request, Selection
from .layout import KVLayout


class KVStore(ABC):
    """Holds every live request's K/V per layer and maps logical tokens to physical slots.

    Buffers are viewed as pages for the kernels: token-major [num_slots, kv_heads, dim]
    (per-request selections) or head-major [kv_heads, num_slots, dim] (per-KV-head
    selections, whose page tables fold KV heads into the batch).
    """

    layout: KVLayout
    head_major: bool

    @property
    @abstractmethod
    def num_slots(self) -> int:
        """Physical token slots per KV head and layer."""

    @abstractmethod
    def admit(self, request: Request) -> None:
        """Reserve room for a new request's prompt (raises CapacityError when full)."""

    @abstractmethod
    def grow(self, batch: Batch) -> None:
        """Make room for this decode step's new token of every request (after `seq_len` was
        advanced)."""

    @abstractmethod
    def write_prefill(self, layer: int, request: Request, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt's K/V: [prompt_len, kv_heads, dim] at positions 0..prompt_len-1."""

    @abstractmethod
    def write_decode(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's K/V: [batch, kv_heads, dim], row i at position seq_lens[i]-1."""

    @abstractmethod
    def ensure_resident(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        """Make the selected tokens resident; return their physical slots, int32 shaped like
        `selection.indices`, -1 where the selection is padded."""

    @abstractmethod
    def paged_view(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer viewed as [num_pages, page_size, heads, dim] (heads = 1 in the
        head-major layout, whose page p of KV head h is page h * num_slots // page_size + p)."""

    @abstractmethod
    def release(self, request: Request) -> None:
        """Free everything the request holds."""

    @abstractmethod
    def device_tokens(self, request: Request) -> int:
        """Token slots the request holds on the device (per layer and KV head)."""

    @abstractmethod
    def used_tokens(self) -> int:
        """Token slots currently owned by requests (per layer and KV head)."""

    def device_bytes(self) -> int:
        """Bytes of KV held on the device for live requests, over all layers."""
        return self.used_tokens() * self.layout.bytes_per_token
