"""Integer arithmetic of pages and launch shapes, shared by the store and the kernels."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())
