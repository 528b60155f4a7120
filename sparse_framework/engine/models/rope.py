"""Rotary position embeddings: the default (RoFormer) frequencies, Llama 3.1's rescaling and
linear position interpolation (Gemma 3's global layers).

The numerics follow transformers' so a checkpoint decodes the same tokens here and there:
inverse frequencies in float32, angles `position x inv_freq` in float32, cos/sin cast to the
activations' dtype, and the rotation applied to the two halves of each head (not interleaved
pairs). Angles are computed from the positions each step (no O(max_positions) table), so any
position up to the model's limit costs nothing to support.
"""

from __future__ import annotations

import math

import torch

from .config import Llama3RopeScaling, LinearRopeScaling, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim / 2] float32: theta^(-2i / head_dim), then the scaling if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    return inv_freq if scaling is None else _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Slow frequencies (wavelength above old_len / low_freq_factor) divided by `factor`, fast
    ones (below old_len / high_freq_factor) kept, the band between blended linearly in
    old_len / wavelength."""
    old_len = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long_wave = wavelength > old_len / s.low_freq_factor
    short_wave = wavelength < old_len / s.high_freq_factor
    # blend weight 0 at the long-wave edge, 1 at the short-wave edge
    smooth = (old_len / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return torch.where(long_wave, inv_freq / s.factor, torch.where(short_wave, inv_freq, blended))


class RotaryEmbedding:
    """cos/sin for a step's positions. Not an nn.Module on purpose: casting the model to bf16
    must not cast the float32 frequencies (long-context angles would drift), and materialising
    a meta-device model must not leave them uninitialised."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> (cos, sin), each [T, head_dim] in `dtype`. The frequencies are
        copied to a device once (before any CUDA-graph capture, whose warm-up calls this)."""
        inv = self._on_device.get(positions.device)
        if inv is None:
            inv = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by its token's angles (cos/sin [T, D]): the first and second halves
    of each head are the two coordinates of D/2 rotating pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
