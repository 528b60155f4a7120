"""The hierarchical store's fused decode-path kernels, launched by `kv_store/residency.py`
(their launch shapes are there): `plan_residency_kernel` and `copy_missing_kernel`. Their code
and what they do: `kernels/triton/residency.py`; this module keeps their names where the
launchers import them."""

from __future__ import annotations

from .triton.residency import copy_missing_kernel, plan_residency_kernel

__all__ = ["plan_residency_kernel", "copy_missing_kernel"]
