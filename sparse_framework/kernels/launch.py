"""Cheap re-launches of compiled Triton kernels, for the eager decode path.

Why: `kernel[grid](*args)` binds every argument, derives its specialisation and looks the
compiled kernel up on each call: on the H100 machine's host 25-29 µs for a 15-argument kernel,
of which the compiled kernel's own launcher is ~10 µs, and an eager decode layer launches
8-11 kernels. `launch` does the lookup once per call site and specialisation: the first call
goes through Triton (which compiles and launches) and remembers the compiled kernel; later
calls with an argument signature that Triton would specialise the same way call the compiled
kernel's launcher directly. A layer's host time falls by 75-100 µs (11-13%,
benchmarks/eager_overhead.py, docs/performance.md "Eager overhead").

The cache key holds everything Triton 3.6 specialises on, and more: per tensor its dtype and
whether its address is 16-byte aligned; per int whether it is 1, a multiple of 16, and in
int32 / uint64 range; the type of other scalars; every keyword argument (constexprs and
launch options, by value). Any argument it cannot key (a tensor passed by keyword, an object
of another type, a constexpr passed by position), a launch hook (profilers), or a changed
global that the kernel reads sends the call through Triton as usual.

`FAST`: "auto" (the default) uses the direct path on CUDA with a Triton version it was
checked against (`VERIFIED`); "on" uses it with any Triton version (its launcher's calling
convention must match 3.6's); "off" always goes through Triton. Never under the interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import triton

try:  # Triton >= 3.4; launch hooks (profilers) are then honoured by going through Triton
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no hooks to honour
    _knobs = None

__all__ = ["FAST", "MODES", "VERIFIED", "launch", "signature", "cache_size", "clear"]

MODES = ("auto", "on", "off")
FAST = "auto"  # one of MODES
VERIFIED = ("3.6",)  # Triton major.minor versions whose launcher convention the direct call follows
MAX_ENTRIES = 4096  # a bound on the cache; it is cleared when full (never reached in practice)

_compiled: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
_Tensor = torch.Tensor
_INT32_MIN, _INT32_MAX, _UINT64_HALF = -(2**31), 2**31 - 1, 2**63
_BOOL, _FLOAT = "bool", "float"


def signature(args: Sequence[object]) -> tuple | None:
    """What Triton's specialisation can depend on in the positional arguments (a superset of
    what Triton 3.6 looks at), one entry per argument; None if an argument cannot be keyed.
    A flat loop, not a call per argument: this runs on every launch."""
    key: list[object] = []
    append = key.append
    for x in args:
        t = type(x)
        if t is int:  # 1 (baked in), multiple of 16, int32 range, uint64 upper half: a code 0-15
            append((x == 1) << 3 | ((x & 15) == 0) << 2 | (_INT32_MIN <= x <= _INT32_MAX) << 1 | (x >= _UINT64_HALF))
        elif t is bool:
            append(_BOOL)
        elif t is float:
            append(_FLOAT)
        elif x is None:
            append(None)
        elif isinstance(x, _Tensor):
            append((x.dtype, (x.data_ptr() & 15) == 0))
        else:
            return None
    return tuple(key)


def _version_verified() -> bool:
    return ".".join(triton.__version__.split(".")[:2]) in VERIFIED


_VERIFIED_HERE = _version_verified()


def _enabled() -> bool:
    if FAST not in MODES:
        raise ValueError(f"kernels.launch.FAST must be one of {MODES}, got {FAST!r}")
    if FAST == "off" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return FAST == "on" or _VERIFIED_HERE


def _hook_set(hook: object) -> bool:
    # Triton 3.6: None or a callable; later versions: a chain of callables, maybe empty
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    if _knobs is None:
        return False
    return _hook_set(_knobs.runtime.launch_enter_hook) or _hook_set(_knobs.runtime.launch_exit_hook)


def _globals_changed(kernel: Any) -> bool:
    """Triton refuses to run a kernel whose globals changed since it was compiled; so do we."""
    used = getattr(kernel, "used_global_vals", None)
    if not used:
        return False
    missing = object()
    return any(globals_dict.get(name, missing) != val for (name, _), (val, globals_dict) in used.items())


def _current_device() -> int:
    return torch.cuda.current_device()  # what Triton's CUDA driver asks torch for


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def launch(kernel: Any, grid: Sequence[int], *args: object, **kwargs: object) -> None:
    """`kernel[grid](*args, **kwargs)`, through the compiled kernel's launcher when this
    call site and argument signature have been seen before (see the module docstring).
    Positional arguments are the kernel's runtime arguments in order; constexprs and launch
    options go by keyword (a tensor passed by keyword always goes through Triton)."""
    if not _enabled() or _hooks_set():
        kernel[grid](*args, **kwargs)
        return
    sig = signature(args)
    for v in kwargs.values():
        if isinstance(v, _Tensor):
            sig = None
    if sig is None:
        kernel[grid](*args, **kwargs)
        return
    device = _current_device()
    key = (kernel, device, sig, tuple(kwargs.items()))
    try:
        hit = _compiled.get(key)
    except TypeError:  # an unhashable keyword value
        kernel[grid](*args, **kwargs)
        return
    if hit is None or _globals_changed(kernel):
        compiled = kernel[grid](*args, **kwargs)
        order = tuple(kernel.arg_names[len(args):])
        # a constexpr passed by position is keyed by its class only, not its value: never cache it
        by_position = any(i < len(args) for i in getattr(kernel, "constexprs", ()))
        if compiled is not None and not by_position and all(name in kwargs for name in order):
            if len(_compiled) >= MAX_ENTRIES:
                _compiled.clear()
            _compiled[key] = (compiled, order)
        return
    compiled, order = hit
    n = len(grid)
    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _current_stream(device),
                 compiled.function, compiled.packed_metadata, None, None, None, *args, *[kwargs[k] for k in order])


def cache_size() -> int:
    """How many (call site, signature) entries `launch` holds."""
    return len(_compiled)


def clear() -> None:
    """Forget every compiled kernel `launch` holds (the next calls go through Triton)."""
    _compiled.clear()
