"""Plugin discovery through `importlib.metadata` entry points.

Four groups — algorithms, adaptors, backends, and the algorithms' twins inside vLLM (`vllm`:
a `PagedAlgorithm` registered under its algorithm's name). Built-ins are registered by this project's own
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
    "vllm": "sparse_framework.vllm",
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

    `distribution` keeps only the names that distribution registers (e.g. BUILTIN
    for the built-ins), so that output meant to be reproducible — the generated config
    reference — does not depend on which plugins happen to be installed.
    """
    _check_kind(kind)
    out = []
    for name, eps in _entry_points(kind).items():
        mine = [ep for ep in eps if distribution is None or _dist_name(ep) == distribution]
        if mine:
            out.append(name)
        if len(eps) > 1:  # every clashing registration stays reachable, and listed, by its full name
            out += [qualified(ep) for ep in mine if distribution is None and _dist_name(ep) != BUILTIN]
    return sorted(out)


def qualified(ep: EntryPoint) -> str:
    """"distribution:name", the name that selects this entry point whatever else is installed."""
    return f"{_dist_name(ep)}:{ep.name}"


# kinds whose base class lives above the registry (importing it would make a circle): checked by
# its qualified name in the plugin's MRO instead
BASE_BY_NAME = {"vllm": "sparse_framework.integrations.vllm.paged_base.PagedAlgorithm"}


def _is_plugin(kind: str, obj: Any) -> tuple[bool, str]:
    """Whether `obj` is a subclass of the kind's base class, and that base's name."""
    if kind in BASE_BY_NAME:
        qualname = BASE_BY_NAME[kind]
        ok = isinstance(obj, type) and any(f"{c.__module__}.{c.__qualname__}" == qualname for c in obj.__mro__)
        return ok, qualname.rsplit(".", 1)[1]
    base = _base_class(kind)
    return isinstance(obj, type) and issubclass(obj, base), base.__name__


def _base_class(kind: str) -> type:
    if kind == "algorithm":
        from .algorithms.base import SparseAlgorithm

        return SparseAlgorithm
    if kind == "adaptor":
        from .adaptors.base import BackendAdaptor

        return BackendAdaptor
    from .backends.base import AttentionBackend

    return AttentionBackend


BUILTIN = "sparse-decode-framework"  # the distribution of the built-in plugins (pyproject.toml's name)


def _choose(kind: str, name: str) -> EntryPoint:
    """The entry point a name selects (the rule of docs/plugins.md, "Name clashes"):
    "dist:name" selects that distribution's; a bare name registered once selects it; a bare
    name registered by the built-ins and by others selects the built-in (the others are
    listed by `plugins` and reachable as "dist:name"); a bare name registered by two or more
    other distributions is refused, naming them."""
    registered = _entry_points(kind)
    dist, sep, bare = name.rpartition(":")
    if sep:
        eps = [ep for ep in registered.get(bare, []) if _dist_name(ep) == dist]
        if not eps:
            owners = ", ".join(f"'{_dist_name(ep)}'" for ep in registered.get(bare, [])) or "no distribution"
            raise PluginError(f"{kind} {name!r}: distribution {dist!r} registers no {kind} {bare!r} ({bare!r} is registered by {owners})")
        return eps[0]
    if name not in registered:
        known = ", ".join(sorted(registered)) or "none"
        raise PluginError(
            f"unknown {kind} {name!r}; registered {kind}s: {known}.{closest(name, registered)}"
        )
    eps = registered[name]
    if len(eps) == 1:
        return eps[0]
    builtin = [ep for ep in eps if _dist_name(ep) == BUILTIN]
    if builtin:
        return builtin[0]
    eps = sorted(eps, key=_dist_name)
    owners = " and ".join(f"'{_dist_name(ep)}' ({ep.value})" for ep in eps)
    choices = " or ".join(f"'{qualified(ep)}'" for ep in eps)
    raise PluginError(
        f"{kind} name {name!r} is registered by more than one distribution: {owners}; select one as "
        f"{choices}, or uninstall one of them"
    )


@functools.lru_cache(maxsize=None)
def load(kind: str, name: str) -> Any:
    """The plugin class registered as `name` (or "distribution:name"); imports its module on
    first use. A name several distributions register is resolved by `_choose`'s rule.

    Raises PluginError for an unknown name (listing the registered ones and the closest),
    a bare name two third-party distributions register (naming both), an import failure
    (with the exception), or an object that is not a subclass of the kind's base class.
    """
    _check_kind(kind)
    ep = _choose(kind, name)
    try:
        obj = ep.load()
    except Exception as exc:  # a plugin may fail in any way; report it, keep the rest working
        raise PluginError(
            f"{kind} plugin {name!r} from distribution '{_dist_name(ep)}' ({ep.value}) "
            f"failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    ok, base = _is_plugin(kind, obj)
    if not ok:
        raise PluginError(f"{kind} plugin {name!r} ({ep.value}) is {obj!r}, not a subclass of {base}")
    return obj


def describe(kind: str) -> list[PluginInfo]:
    """Every plugin of one kind with its load status (imports each one)."""
    _check_kind(kind)
    infos = []
    for name, eps in sorted(_entry_points(kind).items()):
        # one row per registration, the built-in first: a clash hides none of them
        for ep in sorted(eps, key=lambda ep: (_dist_name(ep) != BUILTIN, _dist_name(ep))):
            shown = name if len(eps) == 1 or _dist_name(ep) == BUILTIN else qualified(ep)
            try:
                load(kind, shown)
                error = None
            except PluginError as exc:
                error = str(exc)
            infos.append(PluginInfo(kind, shown, ep.value, _dist_name(ep), error))
    return infos


def refresh() -> None:
    """Forget cached entry points and loaded classes (after installing a plugin at run time)."""
    importlib.invalidate_caches()
    _entry_points.cache_clear()
    load.cache_clear()
