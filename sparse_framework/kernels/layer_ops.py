"""A decoder layer's elementwise work in three Triton kernels, where torch needs ~35 ops.

  add_rms_norm    residual += x (rounded to the activations' dtype, as torch's add is), then
                  RMSNorm of the sum: statistic in float32, normalised value rounded to the
                  dtype, times the weight rounded again (transformers' Llama numerics)
  rope_qkv        the packed q/k/v projection output -> contiguous q, k (rotated by their
                  token's cos/sin in float32, rounded once) and v (copied)
  silu_mul        silu(gate) * up from the packed gate/up output

Why (each torch op is a kernel of a few µs and a node of the step's CUDA graph) and how far
the results may differ from torch's (at most one bf16 step): docs/kernels.md, "Layer ops".
The launchers check shapes and dtypes and never synchronise with the host, so a step using
them captures in a CUDA graph; tests/test_kernels_layer_ops.py compares each with its torch
twin under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import torch
import triton

from ..common.arith import pow2
from .launch import launch
from .triton.layer_ops import add_rms_norm_kernel, rope_qkv_kernel, silu_mul_kernel

__all__ = ["add_rms_norm", "rope_qkv", "silu_mul"]


def _launchable(*tensors: torch.Tensor) -> None:
    if tensors[0].device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the layer-op kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"layer ops: every tensor must be contiguous in its last dim, got strides {t.stride()}")


# -- residual add + RMSNorm ------------------------------------------------------------------------


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] (+ residual [T, N]) -> (RMSNorm(sum) * weight, sum). Without a residual the
    sum is x itself (returned as is)."""
    _launchable(x, weight, *(() if residual is None else (residual,)))
    if x.ndim != 2 or weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"add_rms_norm: x [T, N], residual [T, N] or None, weight [N]; got {tuple(x.shape)}, "
                         f"{None if residual is None else tuple(residual.shape)}, {tuple(weight.shape)}")
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    t, n = x.shape
    if t:
        res = x if residual is None else residual
        launch(add_rms_norm_kernel, (t,), x, res, weight, out, summed,
               n, x.stride(0), res.stride(0), out.stride(0), summed.stride(0), float(eps),
               HAS_RES=residual is not None, BLOCK=pow2(n), num_warps=4 if n <= 2048 else 8)
    return out, summed


# -- RoPE of q and k, v copied ---------------------------------------------------------------------


def rope_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq*D], k and v [T, Hkv*D] (rows may be strided: views into one packed q/k/v
    projection), cos/sin [T, D] -> q [T, Hq, D] and k [T, Hkv, D] rotated (RoPE, the two
    halves of each head rotating as pairs), v [T, Hkv, D]; all three contiguous."""
    _launchable(q, k, v, cos, sin)
    t = q.shape[0]
    if (q.shape != (t, num_heads * head_dim) or k.shape != (t, num_kv_heads * head_dim) or k.shape != v.shape
            or cos.shape != (t, head_dim) or sin.stride() != cos.stride() or head_dim % 2 or pow2(head_dim) != head_dim):
        raise ValueError(f"rope_qkv: q [T, {num_heads}*{head_dim}], k and v [T, {num_kv_heads}*{head_dim}], cos/sin "
                         f"[T, {head_dim}] sharing strides (head_dim a power of two); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(cos.shape)}")
    qo = torch.empty((t, num_heads, head_dim), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    vo = torch.empty((t, num_kv_heads, head_dim), dtype=v.dtype, device=v.device)
    if t:
        launch(rope_qkv_kernel, (t, num_heads + 2 * num_kv_heads), q, k, v, cos, sin, qo, ko, vo,
               q.stride(0), k.stride(0), v.stride(0), cos.stride(0), num_heads, num_kv_heads,
               D=head_dim, HALF=head_dim // 2, num_warps=1)
    return qo, ko, vo


# -- SiLU(gate) * up -------------------------------------------------------------------------------


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    _launchable(gate_up)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"silu_mul: gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    n = two_i // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2(n))
    if t:
        launch(silu_mul_kernel, (t, triton.cdiv(n, block)), gate_up, out, n, gate_up.stride(0), out.stride(0),
               BLOCK=block, num_warps=4)
    return out
