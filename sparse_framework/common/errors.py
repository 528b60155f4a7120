"""Exceptions that users see. Each names what was wrong and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class SparseFrameworkError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(SparseFrameworkError, ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


class UnsupportedFeatureError(ConfigError, NotImplementedError):
    """A backend, or the library under it, cannot apply an attention option that a layer
    needs (logit soft-capping, attention-sink logits). The message names the option and the
    backends that can. A ConfigError (the combination is refused when configured) and a
    NotImplementedError (the backend has no implementation of it)."""


class PluginError(SparseFrameworkError, LookupError):
    """A plugin is unknown, duplicated, broken, or of the wrong kind."""


class CapacityError(SparseFrameworkError, RuntimeError):
    """A KV pool cannot hold what was asked; the message gives the requested and free sizes."""


class LimitError(CapacityError, ValueError):
    """A request exceeds a limit the coordinator was built with (max_requests, max_seq_len).
    A CapacityError, like a full pool; also a ValueError, as these errors were before."""


class HookOrderError(SparseFrameworkError, ValueError):
    """A `SparseCoordinator` hook was called out of order, or on a request that cannot take it
    now. The message names the hook, the layer and what was expected; the call changed nothing.

    `hook`: the hook refused ("attention_begin", ...); `layer`: its layer, None for step- and
    request-level hooks.
    """

    def __init__(self, message: str, hook: str, layer: int | None = None) -> None:
        super().__init__(message)
        self.hook = hook
        self.layer = layer


class LockError(SparseFrameworkError, RuntimeError):
    """A lock reference was misused: released twice, taken on a node that cannot hold it, or
    driven below zero. The message names the node and its lock counts; nothing was changed."""


def closest(name: str, choices: Iterable[str]) -> str:
    """' Did you mean 'x'?' for the closest choice, or '' when nothing is close."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""
