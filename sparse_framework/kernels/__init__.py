"""Triton kernels only; the wrappers that check inputs and launch them live beside their users."""
