"""Which logical units of a buffered (request, layer) sit in which device-buffer unit.

Per layer, request and stream: logical unit → buffer unit (`l2s`), its inverse (`s2l`) and
the step each buffer unit was last used (`last_used`), all device tensors with one trash
column at the end, so that masked updates write there instead of being filtered (no host
synchronisation). The torch reference of the victim choice lives here; the fused kernels of
kernels/triton/residency.py implement the same rules.
"""

from __future__ import annotations

import torch

from ..common.arith import cdiv



class SlotMaps:
    def __init__(
        self,
        *,
        num_layers: int,
        max_requests: int,
        streams: int,
        max_units: int,
        buffer_units: int,
        unit: int,
        sink_tokens: int,
        recent_tokens: int,
        device: torch.device,
    ) -> None:
        self.device = device
        self.unit, self.buffer_units = unit, buffer_units
        self.sink_tokens, self.recent_tokens = sink_tokens, recent_tokens
        shape = (num_layers, max_requests, streams)
        self.l2s = torch.full((*shape, max_units + 1), -1, dtype=torch.int32, device=device)
        self.s2l = torch.full((*shape, buffer_units + 1), -1, dtype=torch.int32, device=device)
        self.last_used = torch.full((*shape, buffer_units + 1), -1, dtype=torch.int64, device=device)
        self._trash_l, self._trash_s = max_units, buffer_units
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        self._minus_one = torch.full((), -1, dtype=torch.int32, device=device)  # (a CUDA graph may not copy a scalar in)

    def reset(self, slot: int) -> None:
        """Forget every mapping of a request's state row."""
        self.l2s[:, slot] = -1
        self.s2l[:, slot] = -1
        self.last_used[:, slot] = -1

    def initial_units(self, seq_len: int) -> torch.Tensor:
        """Units a fresh buffer holds: the sink, the recent window and the newest unit."""
        u = self.unit
        sink = set(range(cdiv(self.sink_tokens, u)))
        newest = (seq_len - 1) // u
        recent = set(range(min(max(0, seq_len - self.recent_tokens) // u, newest), newest + 1))
        units = sorted(x for x in sink | recent if x * u < seq_len)
        if len(units) > self.buffer_units:
            raise ValueError(
                f"sink + recent window ({len(units)} units of {u}) exceed device_buffer_tokens "
                f"({self.buffer_units * self.unit} tokens)"
            )
        return torch.tensor(units, dtype=torch.long, device=self.device)

    def victims(
        self, layer: int, rows: torch.Tensor, seq_lens: torch.Tensor, protect: torch.Tensor, count: int,
        need: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Buffer units to evict, per stream: the `count` first in eviction order (free units
        first, then least recently used; never a protected unit or one holding a pinned (sink,
        recent, newest) unit). With `need` (int [B, S]), only each stream's need[b, s] first
        are chosen (fewer if fewer may go) and they come in ascending unit order, then
        `buffer_units` (the trash column) fills the row: the order the fused kernel produces
        without sorting (it finds the need-th oldest age by bisection, kernels/triton/residency.py).
        rows: [B] state rows; protect: bool [B, S, buffer_units]. -> int64 [B, S, count]."""
        owner = self.s2l[layer, rows, :, : self.buffer_units].long()  # [B, S, Ub]
        lens = seq_lens.long().view(-1, 1, 1)
        u = self.unit
        pinned = (owner >= 0) & (
            (owner * u < self.sink_tokens)
            | (owner >= (lens - self.recent_tokens).clamp(min=0) // u)
            | (owner >= (lens - 1) // u)
        )
        age = torch.where(owner < 0, -1, self.last_used[layer, rows, :, : self.buffer_units])
        # (age, unit) packed in one key: ties go to the lower unit, as in the fused kernel
        key = ((age + 1) << 20) | torch.arange(self.buffer_units, device=self.device)
        key = key.masked_fill(pinned | protect, torch.iinfo(torch.int64).max)
        order = key.topk(count, dim=-1, largest=False).indices
        if need is None:
            return order
        chosen = torch.arange(count, device=self.device) < need.unsqueeze(-1)
        chosen &= key.gather(-1, order) < torch.iinfo(torch.int64).max  # never a pinned or protected unit
        return torch.where(chosen, order, self.buffer_units).sort(dim=-1).values

    def assign(self, layer: int, rows: torch.Tensor, units: torch.Tensor, take: torch.Tensor, victims: torch.Tensor) -> None:
        """Map logical `units` [B, S, W] to buffer units `victims` where `take`, evicting the
        victims' old units; masked entries write to the trash columns."""
        b, s, w = units.shape
        ri = rows.view(-1, 1, 1).expand(b, s, w)
        hi = torch.arange(s, device=self.device).view(1, -1, 1).expand(b, s, w)
        old = self.s2l[layer, ri, hi, victims].long()
        self.l2s[layer, ri, hi, torch.where(take & (old >= 0), old, self._trash_l)] = self._minus_one
        self.l2s[layer, ri, hi, torch.where(take, units, self._trash_l)] = victims.to(torch.int32)
        self.s2l[layer, ri, hi, torch.where(take, victims, self._trash_s)] = units.to(torch.int32)
