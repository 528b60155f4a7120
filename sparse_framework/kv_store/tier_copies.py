"""A whole request's rows moved between the tiers, outside the decode step.

`TierCopies` owns no state of its own: it moves rows between the parts that own them — the
device rows (`DeviceRows`: the pools and the page table), the host pool (`HostPool`) and the
slot maps of a buffered (request, layer) (`SlotMaps`) — for the store's lifecycle: a prompt's
rows at prefill, a buffer filled with its initial units (prefill, resume, spill), every token
of a request copied device -> host (retract, spill, a prefix cache's export) or host -> device
(resume, promote), a prefix cache's host pages into a prefill staging, and the read-back for
tests. Which rows go where (a request's mode per layer) is the store's decision; the decode
step's copies are the swap-in's (residency.py) and the decode writes' (decode_writes.py).
"""

from __future__ import annotations

import torch

from ..common.batch import Request
from ..common.flashmla_format import pack_flashmla_fp8
from .residency import BufferResidency


class TierCopies:
    """Whole-request row copies (module docstring), between the parts the swap-in
    (`residency`, whose `copy_in` brings host rows in) shares with the store: its layout, slot
    maps, device rows and host pool, and its geometry (unit, streams, device)."""

    def __init__(self, residency: BufferResidency) -> None:
        self.residency = residency
        self.layout, self.maps, self.device_rows = residency.layout, residency.maps, residency.device_rows
        self.host_pool = residency.host_pool
        self.unit, self.streams, self.device = residency.unit, residency.streams, residency.device
        self.row_heads = residency.row_heads

    def _all_tokens(self, request: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's row id [1] and every logical token [1, seq_len], on the device."""
        sid = torch.tensor([request.slot], device=self.device)
        return sid, torch.arange(request.seq_len, device=self.device).unsqueeze(0)

    def stored(self, k: torch.Tensor, v: torch.Tensor | None) -> list[torch.Tensor]:
        """K and V (or the latent) as stored: the layout's dtype; fp8 as bytes; an fp8 MLA
        latent packed into FlashMLA's 656-byte rows (on the writer's device, before any copy)."""
        return [self._store(k)] if self.layout.is_mla else [self._store(k), self._store(v)]  # type: ignore[arg-type]

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.is_flashmla_fp8:
            return pack_flashmla_fp8(x)
        x = x.to(self.layout.dtype)
        return x.view(torch.uint8) if self.layout.is_fp8 else x

    def write_prompt(self, layer: int, request: Request, rows: list[torch.Tensor], *, to_host: bool, resident: bool) -> None:
        """A prompt's stored rows [n, kv_heads, dim] of one layer: to its host pages (`to_host`;
        but a cached prefix, on borrowed pages) and to the device, every token (`resident`) or
        the initial units of its buffer."""
        n = rows[0].shape[0]
        sid = torch.tensor([request.slot], device=self.device)
        positions = torch.arange(n, device=self.device).unsqueeze(0)
        if to_host:  # offload the prompt to the host (but a cached prefix)
            c = request.cached_len  # tokens on borrowed host pages: never written
            host_off = self.host_pool.offsets(layer, self.host_pool.rows(sid, positions[:, c:])[0], 0)
            for buf, x in zip(self.host_pool.tensors, rows):
                src = x.contiguous()
                src_off = torch.arange(c, n, device=src.device) * self.layout.stored_row_elems
                self.host_pool.write_rows(src, buf, src_off, host_off, self.layout.num_kv_heads)
        if resident:
            self.device_rows.put(layer, self.device_rows.slots(layer, sid, positions)[0], rows)
        else:
            self.fill_buffer(layer, request, rows)

    def fill_buffer(self, layer: int, request: Request, rows: list[torch.Tensor] | None) -> None:
        """Map the initial units of a buffered (request, layer) to buffer units 0..m-1 and fill
        them, from `rows` (the prompt's K/V, prefill) or from the host (resume, spill)."""
        maps = self.maps
        units = maps.initial_units(request.seq_len)
        m = units.numel()
        r = request.slot
        bu = torch.arange(m, device=self.device)
        maps.l2s[layer, r, :, units] = bu.to(torch.int32)
        maps.s2l[layer, r, :, :m] = units.to(torch.int32)
        maps.last_used[layer, r, :, :m] = maps.clock
        tokens = (units.unsqueeze(1) * self.unit + torch.arange(self.unit, device=self.device)).flatten()
        pos = (bu.unsqueeze(1) * self.unit + torch.arange(self.unit, device=self.device)).flatten()
        keep = tokens < request.seq_len
        tokens, pos = tokens[keep], pos[keep]
        slots = self.device_rows.slots(layer, torch.tensor([r], device=self.device), pos.unsqueeze(0))[0]
        if rows is not None:
            self.device_rows.put(layer, slots, [x[tokens] for x in rows])
        else:
            self.residency.copy_in(layer, torch.tensor([r], device=self.device), tokens.unsqueeze(0), slots.unsqueeze(0))

    def copy_in(self, layer: int, request: Request) -> None:
        """Every token of the request from its host pages to its device pages of a resident layer."""
        sid, tokens = self._all_tokens(request)
        self.residency.copy_in(layer, sid, tokens, self.device_rows.slots(layer, sid, tokens))

    def to_host(self, request: Request) -> None:
        """Every layer's device rows of a request that keeps nothing on the host yet into its
        (reserved) host pages."""
        sid, tokens = self._all_tokens(request)
        self._device_to_host(sid, tokens, self.host_pool.rows(sid, tokens))

    def pages_to_host(self, request: Request, first_page: int, ids: torch.Tensor) -> None:
        """The request's device rows of pages first_page.. (every layer resident) into host pages `ids`."""
        p = self.host_pool.page_size
        sid = torch.tensor([request.slot], device=self.device)
        tokens = torch.arange(first_page * p, (first_page + ids.numel()) * p, device=self.device).unsqueeze(0)
        self._device_to_host(sid, tokens, self.host_pool.rows_of_pages(ids).to(self.device))

    def _device_to_host(self, sid: torch.Tensor, tokens: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Every layer and stream: the device rows of row `sid`'s logical `tokens` [1, n] to host rows (n)."""
        for layer in range(self.layout.num_layers):
            slots = self.device_rows.slots(layer, sid, tokens)
            for h in range(self.streams):
                src = self.device_rows.offsets(layer, slots, h).flatten()
                dst = self.host_pool.offsets(layer, host_rows, h).flatten()
                for dev_buf, host_buf in zip(self.device_rows.pool_of[layer].tensors, self.host_pool.tensors):
                    self.host_pool.write_rows(dev_buf, host_buf, src, dst, self.row_heads)

    def load_pages(self, ids: torch.Tensor, dst: list[torch.Tensor], start: int) -> None:
        """Host pages `ids`, every layer, into rows start.. of `dst` (`HierarchicalKVStore.load_pages`)."""
        rows = self.host_pool.rows_of_pages(ids).to(self.device)
        m, elems = rows.numel(), self.layout.stored_row_elems
        layers = torch.arange(self.layout.num_layers, device=self.device).view(-1, 1)
        src = self.host_pool.offsets(layers, rows.view(1, -1)).flatten()
        for d, h in zip(dst, self.host_pool.tensors):
            if d.dtype != self.layout.storage_dtype or d.shape[0] != self.layout.num_layers or start + m > d.shape[1]:
                raise ValueError(f"load_pages: {m} rows from {start} do not fit {tuple(d.shape)} {d.dtype}")
            dst_off = ((layers * d.shape[1] + start + torch.arange(m, device=self.device)) * elems).flatten()
            self.host_pool.read_rows(h, d, src, dst_off, self.layout.num_kv_heads)

    def read(self, layer: int, request: Request, from_host: bool) -> list[torch.Tensor]:
        """A request's rows of a layer in logical order, from the host (dequantised) or the
        device (`HierarchicalKVStore.read`)."""
        sid, tokens = self._all_tokens(request)
        if from_host:
            rows = self.host_pool.rows(sid, tokens)[0].cpu()
            return [self.host_pool.decode(buf[layer][rows]) for buf in self.host_pool.tensors]
        slots = self.device_rows.slots(layer, sid, tokens)[0]
        if self.device_rows.head_major:
            return [buf[:, slots].transpose(0, 1) for buf in self.device_rows.buffers(layer)]
        return [buf[slots] for buf in self.device_rows.buffers(layer)]
