"""The generate wrapper `enable` installs on the model instance: each `model.generate(...)`
runs with a fresh SparseCache under the model's cache keyword and closes it when it returns.
Owns no state of its own (it sets the handle's `_uncached` flag while a
generate(use_cache=False) runs and sets a model-default cache_implementation aside)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .cache import SparseCache
from .compat import UnsupportedModelError


def _wrap_generate(handle: Any, generate: Callable[..., Any]) -> Callable[..., Any]:
    """generate(...) with a fresh SparseCache as its cache (under `handle.cache_kwarg`: no
    deprecation warning on transformers >= 5.24), closed when it returns. Takes a cache the
    caller made with `handle.new_cache()` under either name. `handle`: the SparseHandle
    (handle.py, which imports this module) being enabled."""
    name = handle.cache_kwarg

    def sparse_generate(*args: Any, **kwargs: Any) -> Any:
        given = [kwargs.pop(k) for k in ("past_key_values", "cache") if kwargs.get(k) is not None]
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)
        cache = given[0] if given else None
        gen_config = kwargs.get("generation_config") or handle.model.generation_config
        use_cache = kwargs.get("use_cache", getattr(gen_config, "use_cache", True))
        if len(given) > 1 or (cache is not None and not isinstance(cache, SparseCache)):
            what = "two caches" if len(given) > 1 else f"a {type(cache).__name__}"
            raise ValueError(f"sparse decode is enabled: pass no {name} (or one handle.new_cache()), not {what}")
        if kwargs.get("cache_implementation") is not None or "generation_config" in kwargs:
            _check_cache_implementation(kwargs.get("cache_implementation", getattr(gen_config, "cache_implementation", None)))
        elif getattr(gen_config, "cache_implementation", None) is not None:
            # the model's own default (e.g. Gemma's "hybrid" from the hub), not the caller's
            # request: set aside while this generate runs
            saved, gen_config.cache_implementation = gen_config.cache_implementation, None
            try:
                return sparse_generate(*args, **({name: cache} if cache is not None else {}), **kwargs)
            finally:
                gen_config.cache_implementation = saved
        if cache is not None:
            return generate(*args, **{name: cache}, **kwargs)
        if use_cache is False:  # every layer of every step runs dense sdpa: counted as such
            handle._uncached = True
            try:
                return generate(*args, **kwargs)
            finally:
                handle._uncached = False
        cache = handle.new_cache()
        try:
            return generate(*args, **{name: cache}, **kwargs)
        finally:
            cache.close()

    sparse_generate.__wrapped__ = generate  # type: ignore[attr-defined]
    sparse_generate.__doc__ = generate.__doc__
    return sparse_generate


def _check_cache_implementation(value: Any) -> None:
    """Sparse decode brings its own cache (a SparseCache); a cache_implementation the caller
    passes to generate would make transformers build another one."""
    if value is not None:
        raise UnsupportedModelError(
            f"generate(cache_implementation={value!r}) asks transformers for its own cache, but sparse decode "
            "keeps the K/V in its SparseCache; pass no cache_implementation while sparse decode is enabled, "
            "or disable the handle"
        )
