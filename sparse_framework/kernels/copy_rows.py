"""Row copy between any two tensors a GPU can address (device or pinned host memory), launched
by `kv_store/copy.py`'s `copy_rows` (its launch shape is there). The kernel is
`kernels/triton/copy_rows.py`'s; this module keeps its name where the launchers import it."""

from __future__ import annotations

from .triton.copy_rows import copy_rows_kernel

__all__ = ["copy_rows_kernel"]
