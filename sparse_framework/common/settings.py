"""`SparseSettings`: the part of a validated config that plugins read.

The plugin base classes (algorithms, adaptors, backends) type their `config` arguments with
this protocol instead of importing `config.SparseConfig`: the config resolves plugins through
the registry, the registry checks them against the base classes, so a base class that
imported the config would close an import circle. `config.SparseConfig` satisfies it.
"""

from __future__ import annotations

from typing import Any, Protocol


class SparseSettings(Protocol):
    """The framework-level fields of a config, and the algorithm's parsed extra-config."""

    algorithm: str
    backend: str
    store: str
    top_k: int
    page_size: int
    device_buffer_tokens: int
    sink_tokens: int
    recent_tokens: int
    min_sparse_prompt_len: int
    dense_layers: list[int]

    @property
    def extra_config(self) -> Any:
        """The algorithm's own options (its pydantic `Config` model)."""
        ...
