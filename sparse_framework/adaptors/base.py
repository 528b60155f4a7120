"""Adaptors turn physical slots of a selection into one kernel family's metadata (the plan
step, once per layer and step); backends then run that kernel (the run step).

Adaptors are pure functions of their inputs, so every one of them is tested on the CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..common.settings import SparseSettings
    from ..common.layout import KVLayout


class BackendAdaptor(ABC):
    """Plans kernel metadata from physical slots.

    `plan(slots, lengths, *, page_size, num_slots)`:
      slots:   int32 [batch, heads, width], physical token slots of the device buffer in the
               selection's order, -1 after `lengths`; heads is 1 (per request) or
               num_kv_heads (per KV head).
      lengths: int32 [batch, heads].
      page_size: rows per page of the buffer view; slots come in whole aligned pages.
      num_slots: slots per KV head in the device buffer (for head-major page numbering).
    """

    @classmethod
    def check_config(cls, config: SparseSettings) -> None:
        """Reject settings the kernel family cannot serve (raise ValueError naming them)."""

    @classmethod
    def check_layout(cls, layout: KVLayout, config: SparseSettings) -> None:
        """Reject a KV layout the kernel family cannot serve (raise ConfigError naming the
        constraint); called when a coordinator is built, before the first step."""

    @abstractmethod
    def plan(
        self, slots: torch.Tensor, lengths: torch.Tensor, *, page_size: int, num_slots: int
    ) -> Any:
        """Kernel metadata for this layer and step."""
