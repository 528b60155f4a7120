"""`LayerMap`: which layers of a hybrid model are full attention and which slide.

A full-attention layer goes through the coordinator (sparse or dense as configured, its KV in
the store), a sliding-window layer through a `SlidingWindowKV` ring (its last `window` keys on
the device, nothing on the host). The store and the ring number their own layers from 0, so a
model layer needs a map to either: `store[layer]` / `ring[layer]`.

Shared by the serving engine (engine/runner.py) and the transformers integration,
whose `LayerMap.of` reads the same facts from a transformers config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class LayerMap:
    """`full`: model layer indices in store order (store layer i is model layer full[i]);
    `sliding`: in ring order; `window`: the sliding layers' window (None without any)."""

    num_layers: int
    full: tuple[int, ...]
    sliding: tuple[int, ...] = ()
    window: int | None = None

    @cached_property
    def store(self) -> dict[int, int]:
        """model layer -> store layer, for full-attention layers."""
        return {layer: i for i, layer in enumerate(self.full)}

    @cached_property
    def ring(self) -> dict[int, int]:
        """model layer -> ring layer, for sliding-window layers."""
        return {layer: i for i, layer in enumerate(self.sliding)}

    @classmethod
    def all_full(cls, num_layers: int) -> LayerMap:
        return cls(num_layers, tuple(range(num_layers)))

    @classmethod
    def from_types(cls, layer_types: Sequence[str], window: int | None, max_seq_len: int) -> LayerMap:
        """From per-layer types ("full_attention" / "sliding_attention"). A sliding layer
        whose window is >= max_seq_len never binds: it is routed as a full layer (its
        attention is the same), so a short context costs no ring."""
        other = sorted(set(layer_types) - {FULL, SLIDING})
        if other:
            raise ConfigError(f"layer types {other} are not supported; supported: {FULL!r}, {SLIDING!r}")
        if SLIDING in layer_types and (not isinstance(window, int) or window < 1):
            raise ConfigError(f"sliding_window must be a positive int when a layer slides, got {window!r}")
        binds = window is not None and window < max_seq_len
        sliding = tuple(i for i, t in enumerate(layer_types) if t == SLIDING and binds)
        full = tuple(i for i in range(len(layer_types)) if i not in sliding)
        return cls(len(layer_types), full, sliding, window if sliding else None)
