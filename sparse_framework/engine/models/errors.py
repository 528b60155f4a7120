"""The errors of reading a model: its config (unsupported features) and its checkpoint."""

from __future__ import annotations

from ...common.errors import ConfigError, SparseFrameworkError


class UnsupportedModelError(ConfigError):
    """The checkpoint's architecture or one of its features is not implemented; the message
    names it and what is supported."""


class CheckpointError(SparseFrameworkError, ValueError):
    """A checkpoint directory cannot be read: missing directory, config or weights, or a tensor
    missing, unexpected or of the wrong shape. The message names the path or tensor."""
