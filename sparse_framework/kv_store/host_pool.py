"""The host tier of the hierarchical store: every token of every sparse request, all layers.

Pages a request *borrows* (`adopt`, `lend`) belong to someone else — the engine's prefix
cache (engine/prefix_cache.py) — and are mapped into the request's page table read-only:
`free` gives back only the request's own pages, and nothing writes a borrowed page (a
borrowed page is always a whole page of the prefix before the request's first own token).
"""

from __future__ import annotations

import torch


from ..common.batch import Request
from ..common.layout import KVLayout
from ..common.transfer import tensor_to_device
from ..common.arith import cdiv
from .copy import copy_rows
from .fp8_host import copy_from_host, copy_to_host, dequantize_rows, head_bytes
from .pages import PageAllocator, allocate_pool, paged_slots_rows


class HostPool:
    """K/V (or latent) rows token-major, [layers, slots, kv_heads, dim] per stored tensor,
    pinned on CUDA machines so that kernels read and write them directly; handed out in pages
    of `page_size` tokens, one page table row per request. dim is the stored width: 656 bytes
    for an fp8 MLA latent, the same packed row as on the device, so swap-ins only move bytes;
    with `fp8` (host_kv_dtype "fp8_e4m3", fp8_host.py) head_dim + 1 bytes, quantised by
    `write_rows` and dequantised by `read_rows`, the only ways rows enter and leave."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        page_size: int,
        max_requests: int,
        max_pages: int,
        capacity_tokens: int,
        pin: bool,
        device: torch.device,
        head_major: bool = False,
        rule: str = "",
        fp8: bool = False,
    ) -> None:
        self.layout = layout
        self.fp8 = fp8
        # stored elements of one KV head's row, and their dtype
        self.head_width = head_bytes(layout) if fp8 else layout.stored_head_dim
        self.dtype = torch.uint8 if fp8 else layout.storage_dtype
        self.page_size = page_size
        self.device = device
        self.rule = rule  # how capacity_tokens was chosen, in words (stats, logs)
        pages = cdiv(capacity_tokens, page_size)
        self.host_slots = pages * page_size
        shape = (layout.num_layers, self.host_slots, layout.num_kv_heads, self.head_width)
        self.tensors = [
            allocate_pool(shape, self.dtype, torch.device("cpu"), "host KV pool", "host_capacity_tokens", pin)
            for _ in range(layout.tensors_per_token)
        ]
        self.host_alloc = PageAllocator(pages, "host KV pool")
        self.host_table = torch.full((max_requests, max_pages), -1, dtype=torch.int32, device=device)
        self._host_pages: dict[int, torch.Tensor] = {}
        self._borrowed: dict[int, torch.Tensor] = {}  # slot -> page ids it maps but does not own
        self.head_major = head_major  # per-KV-head streams address one head's part of a row

    def tokens(self, request: Request) -> int:
        ids = self._host_pages.get(request.slot)
        return 0 if ids is None else ids.numel() * self.page_size

    def reserve(self, request: Request, tokens: int) -> None:
        have = self._host_pages.get(request.slot)
        n = cdiv(tokens, self.page_size) - (0 if have is None else have.numel())
        if n <= 0:
            return
        ids = self.host_alloc.alloc(n, self.page_size, f"request {request.rid!r}")
        have = ids[:0] if have is None else have
        self.host_table[request.slot, have.numel() : have.numel() + n] = tensor_to_device(ids.to(torch.int32), self.device)
        self._host_pages[request.slot] = torch.cat([have, ids])

    def free(self, request: Request) -> None:
        """Release the request's own pages (borrowed ones stay with their owner)."""
        ids = self._host_pages.pop(request.slot, None)
        borrowed = self._borrowed.pop(request.slot, None)
        if ids is not None:
            if borrowed is not None:
                ids = ids[~torch.isin(ids, borrowed)]
            self.host_alloc.release(ids)
        self.host_table[request.slot] = -1

    def page_ids(self, request: Request) -> torch.Tensor:
        """The request's host page ids in logical order (int64, CPU; borrowed ones included)."""
        ids = self._host_pages.get(request.slot)
        return torch.empty(0, dtype=torch.int64) if ids is None else ids

    def owned_ids(self, request: Request) -> torch.Tensor:
        """The request's pages that `free` will release."""
        ids = self.page_ids(request)
        borrowed = self._borrowed.get(request.slot)
        return ids if borrowed is None else ids[~torch.isin(ids, borrowed)]

    def adopt(self, request: Request, ids: torch.Tensor) -> None:
        """Map borrowed pages `ids` as the request's first pages (before it holds any)."""
        if request.slot in self._host_pages:
            raise ValueError(f"request {request.rid!r} already holds host pages; adopt a prefix before reserving")
        ids = ids.to(torch.int64).cpu()
        if ids.numel() == 0:
            return
        self.host_table[request.slot, : ids.numel()] = tensor_to_device(ids.to(torch.int32), self.device)
        self._host_pages[request.slot] = ids.clone()
        self._borrowed[request.slot] = ids.clone()

    def lend(self, request: Request, ids: torch.Tensor) -> None:
        """Pages of the request that now belong to someone else (it keeps reading them)."""
        ids = ids.to(torch.int64).cpu()
        if ids.numel() == 0:
            return
        if not bool(torch.isin(ids, self.page_ids(request)).all()):
            raise ValueError(f"request {request.rid!r}: lend only pages the request maps")
        have = self._borrowed.get(request.slot)
        self._borrowed[request.slot] = ids.clone() if have is None else torch.cat([have, ids]).unique()

    def rows_of_pages(self, ids: torch.Tensor) -> torch.Tensor:
        """Host slots of whole pages `ids` in order (int64, CPU)."""
        ids = ids.to(torch.int64).cpu()
        return (ids.unsqueeze(1) * self.page_size + torch.arange(self.page_size)).flatten()

    def rows(self, slot_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Host slots of logical tokens. slot_ids: [B]; tokens: [B, ...]; -1 kept."""
        return paged_slots_rows(self.host_table, slot_ids, tokens, self.page_size)

    @property
    def row_elems(self) -> int:
        """Stored elements of one token's row over all KV heads in one tensor, one layer."""
        return self.layout.num_kv_heads * self.head_width

    @property
    def bytes_per_token_per_layer(self) -> int:
        return len(self.tensors) * self.row_elems * self.tensors[0].element_size()

    def write_rows(self, src: torch.Tensor, dst: torch.Tensor, src_off: torch.Tensor, dst_off: torch.Tensor,
                   heads: int) -> None:
        """Rows of `heads` KV heads in the device format (the layout's stored rows) at element
        offsets src_off of `src` into host tensor `dst` at offsets dst_off (`offsets`),
        quantised on the way with `fp8`. -1 offsets skip."""
        if self.fp8:
            copy_to_host(src, dst, src_off, dst_off, heads, self.layout.head_dim)
        else:
            copy_rows(src, dst, src_off, dst_off, heads * self.head_width)

    def read_rows(self, src: torch.Tensor, dst: torch.Tensor, src_off: torch.Tensor, dst_off: torch.Tensor,
                  heads: int) -> None:
        """`write_rows` back: host rows of `heads` KV heads into device-format rows of `dst`,
        dequantised to dst's dtype with `fp8`."""
        if self.fp8:
            copy_from_host(src, dst, src_off, dst_off, heads, self.layout.head_dim)
        else:
            copy_rows(src, dst, src_off, dst_off, heads * self.head_width)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Host rows [..., kv_heads, width] as the device stores them (dequantised with fp8)."""
        return dequantize_rows(rows, self.layout.dtype) if self.fp8 else rows

    def offsets(self, layer: int, rows: torch.Tensor, head: torch.Tensor | int = 0) -> torch.Tensor:
        hk, d = self.layout.num_kv_heads, self.head_width
        if self.head_major:
            off = ((layer * self.host_slots + rows) * hk + head) * d
        else:
            off = (layer * self.host_slots + rows) * hk * d
        return torch.where(rows >= 0, off, -1)

    def stats(self) -> dict[str, object]:
        """How the pool was sized and what it holds now (as `DevicePool.stats`, summed over layers)."""
        layers = self.layout.num_layers
        per_token = self.bytes_per_token_per_layer * layers
        return {
            "kind": "host",
            "layers": layers,
            "tokens_per_layer": self.host_slots,
            "bytes": self.host_slots * per_token,
            "used_tokens": self.host_alloc.used * self.page_size * layers,
            "used_bytes": self.host_alloc.used * self.page_size * per_token,
            "rule": self.rule,
        }
