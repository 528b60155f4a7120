"""Resident store: every token of every request lives in one paged device pool.

Pages of `page_size` tokens are handed out from a free list; each request owns a row of a
page table [max_requests, max_pages] (logical page -> physical page). This is the dense
baseline of the hierarchical store and the store used for short prompts.
"""

from __future__ import annotations

import torch

from ..batch import Batch, Request, Selection
from ..errors import CapacityError
from .base import KVStore
from .layout import KVLayout


class ResidentKVStore(KVStore):
    def __init__(
        self,
        layout: KVLayout,
        *,
        page_size: int,
        max_requests: int,
        max_seq_len: int,
        head_major: bool,
        capacity_tokens: int | None = None,
    ) -> None:
        self.layout = layout
        self.head_major = head_major
        self.page_size = page_size
        self.max_pages = -(-max_seq_len // page_size)
        if capacity_tokens is None:
            capacity_tokens = max_requests * self.max_pages * page_size
        self.num_pages = -(-capacity_tokens // page_size)
        slots = self.num_pages * page_size
        hk, d = layout.num_kv_heads, layout.head_dim
        shape = (layout.num_layers, hk, slots, d) if head_major else (layout.num_layers, slots, hk, d)
        self.k = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=layout.device)
        self.page_table = torch.full((max_requests, self.max_pages), -1, dtype=torch.int32, device=layout.device)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._owned: dict[int, list[int]] = {}  # request slot -> physical pages, in logical order

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def device_tokens(self, request: Request) -> int:
        return len(self._owned.get(request.slot, ())) * self.page_size

    def used_tokens(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_size

    # -- allocation (host-side bookkeeping, once per request or page boundary) -------------
    def _ensure_pages(self, request: Request, tokens: int) -> None:
        pages = self._owned.setdefault(request.slot, [])
        need = -(-tokens // self.page_size) - len(pages)
        if need <= 0:
            return
        if need > len(self._free):
            raise CapacityError(
                f"KV pool full: request {request.rid!r} needs {need} more pages of "
                f"{self.page_size} tokens, {len(self._free)} of {self.num_pages} are free"
            )
        new = [self._free.pop() for _ in range(need)]
        self.page_table[request.slot, len(pages) : len(pages) + need] = torch.tensor(new, dtype=torch.int32)
        pages.extend(new)

    def admit(self, request: Request) -> None:
        self._ensure_pages(request, request.prompt_len)

    def grow(self, batch: Batch) -> None:
        for request in batch.requests:
            self._ensure_pages(request, request.seq_len)

    def release(self, request: Request) -> None:
        pages = self._owned.pop(request.slot, [])
        self._free.extend(reversed(pages))
        self.page_table[request.slot] = -1

    # -- data path --------------------------------------------------------------------------
    def _slots(self, slot_ids: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        """Physical slots of logical positions. slot_ids: [B]; logical: [B, ...] (-1 kept)."""
        p = self.page_size
        pos = logical.long().clamp(min=0)
        table = self.page_table[slot_ids.long()]  # [B, max_pages]
        flat = pos.reshape(pos.shape[0], -1)
        phys = table.gather(1, flat // p).long() * p + flat % p
        return torch.where(logical.reshape_as(flat) >= 0, phys, -1).reshape(logical.shape)

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.head_major:
            self.k[layer][:, slots] = k.transpose(0, 1).to(self.layout.dtype)
            self.v[layer][:, slots] = v.transpose(0, 1).to(self.layout.dtype)
        else:
            self.k[layer][slots] = k.to(self.layout.dtype)
            self.v[layer][slots] = v.to(self.layout.dtype)

    def write_prefill(self, layer: int, request: Request, k: torch.Tensor, v: torch.Tensor) -> None:
        positions = torch.arange(k.shape[0], device=self.k.device).unsqueeze(0)
        slot_ids = torch.tensor([request.slot], device=self.k.device)
        self._write(layer, self._slots(slot_ids, positions)[0], k, v)

    def write_decode(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
        assert batch.seq_lens is not None and batch.slot_ids is not None
        positions = (batch.seq_lens.long() - 1).unsqueeze(1)
        self._write(layer, self._slots(batch.slot_ids, positions)[:, 0], k, v)

    def ensure_resident(self, layer: int, batch: Batch, selection: Selection) -> torch.Tensor:
        assert batch.slot_ids is not None
        return self._slots(batch.slot_ids, selection.indices).to(torch.int32)

    def paged_view(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.layout.head_dim
        if self.head_major:
            shape = (-1, page_size, 1, d)
        else:
            shape = (-1, page_size, self.layout.num_kv_heads, d)
        return self.k[layer].reshape(shape), self.v[layer].reshape(shape)

    def read(self, layer: int, request: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's K/V in logical order: [seq_len, kv_heads, dim] (tests, debugging)."""
        positions = torch.arange(request.seq_len, device=self.k.device).unsqueeze(0)
        slots = self._slots(torch.tensor([request.slot], device=self.k.device), positions)[0]
        if self.head_major:
            return self.k[layer][:, slots].transpose(0, 1), self.v[layer][:, slots].transpose(0, 1)
        return self.k[layer][slots], self.v[layer][slots]
