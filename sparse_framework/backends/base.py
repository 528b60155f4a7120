"""Attention backends run a kernel over the device buffer with an adaptor's metadata.

Each backend declares what it supports; the coordinator checks those declarations against the
KV layout when it is built, so an unsupported combination fails before the first step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ..common.errors import ConfigError
from ..common.layout import KVLayout


class AttentionBackend(ABC):
    """Runs decode attention from (q, paged K/V views of the device buffer, metadata).

    Declarations:
      metadata_formats names of the adaptors whose plans `run` consumes; the first is the
                       default when the config leaves `adaptor` unset.
      device_types     torch device types it runs on.
      dtypes           KV/query dtypes it accepts.
      head_dims        supported head dims, or None for any.
    """

    metadata_formats: ClassVar[tuple[str, ...]] = ("flash_attention",)
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    head_dims: ClassVar[tuple[int, ...] | None] = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (a missing library), or None."""
        return None

    @classmethod
    def check_layout(cls, layout: KVLayout) -> None:
        """Raise ConfigError naming the first declaration the layout breaks. Messages start
        with a verb: the coordinator prefixes "backend '<registered name>' "."""
        reason = cls.unavailable_reason()
        if reason:
            raise ConfigError(f"is unavailable: {reason}")
        device_type = torch.device(layout.device).type
        if device_type not in cls.device_types:
            raise ConfigError(
                f"runs on {', '.join(cls.device_types)}, not on device {device_type!r}"
            )
        if layout.dtype not in cls.dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in cls.dtypes)
            raise ConfigError(f"supports dtypes {allowed}, not {layout.dtype}")
        if cls.head_dims is not None and layout.head_dim not in cls.head_dims:
            raise ConfigError(
                f"supports head_dim in {cls.head_dims}, not {layout.head_dim}"
            )

    @abstractmethod
    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Decode attention. q: [batch, num_q_heads, head_dim]; k_cache/v_cache: the paged
        view [num_pages, page_size, heads, head_dim] that matches the metadata (heads = 1
        when the metadata folds KV heads into the batch; v_cache's dim is 512 for an MLA
        latent of 576). Returns [batch, num_q_heads, v_dim] in q's dtype."""
