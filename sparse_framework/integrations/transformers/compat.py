"""What the integration needs of transformers, checked at import: the library itself, its
version (`MIN_TRANSFORMERS`), the cache keyword its models take (`cache_kwarg`), and the
error a model or version that cannot run through the integration raises. Owns no state."""

from __future__ import annotations

import inspect
from typing import Any

from ...common.errors import SparseFrameworkError

try:
    import transformers
    from packaging.version import Version
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "sparse_framework.integrations.transformers needs transformers: "
        'pip install -e ".[transformers]" (in a checkout of the repository)'
    ) from exc

NAME = "sparse_framework"  # the attention and mask functions' name in transformers' registries
MIN_TRANSFORMERS = "4.56"


class UnsupportedModelError(SparseFrameworkError, ValueError):
    """The model (or the installed transformers) cannot run through the integration; the
    message says why and what works."""


def check_transformers_version(version: str | None = None) -> None:
    """ImportError unless `version` (default: the installed transformers) is supported."""
    version = transformers.__version__ if version is None else version
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"sparse_framework's transformers integration needs transformers >= {MIN_TRANSFORMERS} "
            f"(its Cache layers and attention/mask registries), found {version}; "
            f"pip install 'transformers>={MIN_TRANSFORMERS}'"
        )


check_transformers_version()


def cache_kwarg(model: Any) -> str:
    """The keyword under which `model(...)` and `model.generate(...)` take a cache: "cache"
    where the model's forward names it so (transformers >= 5.24, which deprecates
    `past_key_values` for removal in 5.40), "past_key_values" before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"

