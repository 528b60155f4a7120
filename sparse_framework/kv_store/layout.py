"""The shape of a model's KV cache: what every store, algorithm and backend agrees on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """MHA/GQA KV layout: per layer and token, one K row and one V row of
    `num_kv_heads x head_dim` elements of `dtype`.

    (The MLA latent layout arrives with the hierarchical store, step 2.)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"KVLayout.dtype must be a floating torch.dtype, got {self.dtype!r}")

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K + V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers."""
        return self.num_layers * self.bytes_per_token_per_layer
