"""Plugin discovery through `importlib.metadata` entry points.

Three groups — algorithms, adaptors, backends. Built-ins are registered by this project's own
pyproject.toml exactly as a third party registers its own. Entry points are read lazily and a
plugin's module is imported only when the plugin is asked for, so one broken plugin cannot
break the others: its import error is reported, by name, when (and only when) it is requested
or listed.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from .common.errors import PluginError, closest

GROUPS: dict[str, str] = {
    "algorithm": "sparse_framework.algorithms",
    "adaptor": "sparse_framework.adaptors",
    "backend": "sparse_framework.backends",
}


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin as `sparse-framework plugins` lists it."""

    kind: str
    name: str
    target: str
    distribution: str
    error: str | None = None


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "<unknown distribution>"


@functools.lru_cache(maxsize=None)
def _entry_points(kind: str) -> dict[str, list[EntryPoint]]:
    """name -> entry points of that name (more than one means a conflict)."""
    found: dict[str, list[EntryPoint]] = {}
    seen: set[tuple[str, str, str]] = set()
    for ep in entry_points(group=GROUPS[kind]):
        key = (ep.name, ep.value, _dist_name(ep))
        if key in seen:  # one distribution visible twice on sys.path (e.g. an editable install)
            continue
        seen.add(key)
        found.setdefault(ep.name, []).append(ep)
    return found


def _check_kind(kind: str) -> None:
    if kind not in GROUPS:
        raise PluginError(f"unknown plugin kind {kind!r}; allowed: {', '.join(GROUPS)}")


def names(kind: str, distribution: str | None = None) -> list[str]:
    """Registered names of one kind, sorted (nothing is imported).

    `distribution` keeps only the names that distribution registers (e.g. "sparse-framework"
    for the built-ins), so that output meant to be reproducible — the generated config
    reference — does not depend on which plugins happen to be installed.
    """
    _check_kind(kind)
    return sorted(
        name
        for name, eps in _entry_points(kind).items()
        if distribution is None or any(_dist_name(ep) == distribution for ep in eps)
    )


def _base_class(kind: str) -> type:
    if kind == "algorithm":
        from .algorithms.base import SparseAlgorithm

        return SparseAlgorithm
    if kind == "adaptor":
        from .adaptors.base import BackendAdaptor

        return BackendAdaptor
    from .backends.base import AttentionBackend

    return AttentionBackend


@functools.lru_cache(maxsize=None)
def load(kind: str, name: str) -> Any:
    """The plugin class registered as `name`; imports its module on first use.

    Raises PluginError for an unknown name (listing the registered ones and the closest),
    a name registered by two distributions (naming both), an import failure (with the
    exception), or an object that is not a subclass of the kind's base class.
    """
    _check_kind(kind)
    registered = _entry_points(kind)
    if name not in registered:
        known = ", ".join(sorted(registered)) or "none"
        raise PluginError(
            f"unknown {kind} {name!r}; registered {kind}s: {known}.{closest(name, registered)}"
        )
    eps = registered[name]
    if len(eps) > 1:
        owners = " and ".join(f"'{_dist_name(ep)}' ({ep.value})" for ep in eps)
        raise PluginError(
            f"{kind} name {name!r} is registered by more than one distribution: {owners}; "
            "uninstall one of them or rename its entry point"
        )
    ep = eps[0]
    try:
        obj = ep.load()
    except Exception as exc:  # a plugin may fail in any way; report it, keep the rest working
        raise PluginError(
            f"{kind} plugin {name!r} from distribution '{_dist_name(ep)}' ({ep.value}) "
            f"failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    base = _base_class(kind)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise PluginError(
            f"{kind} plugin {name!r} ({ep.value}) is {obj!r}, not a subclass of {base.__name__}"
        )
    return obj


def describe(kind: str) -> list[PluginInfo]:
    """Every plugin of one kind with its load status (imports each one)."""
    _check_kind(kind)
    infos = []
    for name, eps in sorted(_entry_points(kind).items()):
        try:
            load(kind, name)
            error = None
        except PluginError as exc:
            error = str(exc)
        dists = ", ".join(_dist_name(ep) for ep in eps)
        targets = ", ".join(ep.value for ep in eps)
        infos.append(PluginInfo(kind, name, targets, dists, error))
    return infos


def refresh() -> None:
    """Forget cached entry points and loaded classes (after installing a plugin at run time)."""
    importlib.invalidate_caches()
    _entry_points.cache_clear()
    load.cache_clear()
