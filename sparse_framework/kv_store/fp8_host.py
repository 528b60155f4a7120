"""FP8 host tier (SparseConfig.host_kv_dtype = "fp8_e4m3"): K and V rows of an MHA/GQA layout
kept in pinned host memory as float8_e4m3fn with one scale per token and KV head.

Why: the host tier holds every token of every sparse request, so its bytes per token bound
how many long requests the hierarchical store serves (engine/memory.py). FP8 halves them
(bf16) while the device buffer, and so every attention kernel, keeps the model's dtype: rows
are quantised when the store writes its host copy and dequantised when they are copied back
into the device buffer.

One KV head's host row (`head_bytes`: head_dim + 1 bytes):

    bytes 0..D-1   the values divided by the scale, float8_e4m3fn, rounded to nearest even
    byte  D        the scale's biased exponent (UE8M0): scale = 2^(byte - 127)

The scale is the smallest power of two with absmax / scale <= 448 (e4m3's largest finite
value), per token and KV head. Why this scale:
- per token and head: a row is quantised from that row alone, so a decode token's host write
  needs nothing but its own values (no running per-channel statistic to keep or revise);
- absmax, not a clipped percentile: e4m3 is a floating-point format, so every element keeps
  3 mantissa bits (relative error <= 2^-4) however large the row's outlier is, down to about
  absmax x 2^-14 (below that subnormal, absolute error <= scale x 2^-10). SmolLM2's keys have
  outlier channels of 4.5-14x the median channel (docs/algorithms.md, "Quest and PQCache on a
  real model"): some 4 binades, far inside e4m3's 15 binades of normal values. (Per-token int8, where an outlier takes
  the resolution from every other channel, is what pushes KIVI-style schemes to per-channel
  key scales; fp8 does not need them.)
- a power of two, stored as its exponent byte (not a float32 or bf16 scale): dividing by it
  is exact, so the only rounding is e4m3's; dequantised values (4 significant bits times a
  power of two) are exact in bfloat16 and float32; the torch path and the Triton kernels
  (integer code on the float32 bits, kernels/triton/fp8_host.py) agree bit for bit; and it costs one
  byte per head row, not two or four (a power of two loses nothing here: e4m3's relative
  precision is the same in every binade).

Bytes per token and layer: 2 x kv_heads x (head_dim + 1), against 2 x kv_heads x head_dim x 2
in bf16: 0.508x at head_dim 64 (SmolLM2), 0.504x at 128 (Llama-3-8B), so the host-bound
request count grows 1.97x / 1.98x (float32 layouts: 3.9x).

Not for: an fp8 layout (the rows already are fp8; an fp8 MLA latent is FlashMLA's 656-byte row
on both tiers) nor an MLA latent in another dtype (one 576-wide latent row per token; its fp8
form is FlashMLA's, `KVLayout.mla(..., dtype=torch.float8_e4m3fn)`): refused, as is the
resident store, which keeps no host tier to shrink (`check_host_kv_dtype`).
"""

from __future__ import annotations

import torch

from ..common.arith import pow2
from ..common.errors import ConfigError
from ..common.layout import KVLayout
from .copy import _as_kernel_arg, span_index, uses_triton

HOST_KV_DTYPES = ("auto", "fp8_e4m3")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 1  # the scale's exponent byte after each head's values


def check_host_kv_dtype(host_kv_dtype: str, layout: KVLayout, *, resident: bool = False) -> None:
    """ConfigError naming `host_kv_dtype` where the setting cannot apply (module docstring)."""
    if host_kv_dtype not in HOST_KV_DTYPES:
        raise ConfigError(f"`host_kv_dtype` = {host_kv_dtype!r}: allowed {', '.join(map(repr, HOST_KV_DTYPES))}")
    if host_kv_dtype == "auto":
        return
    if resident:
        raise ConfigError(f"`host_kv_dtype` = {host_kv_dtype!r} with store 'resident': the resident store keeps no "
                          "host tier; use store 'hierarchical' or host_kv_dtype 'auto'")
    if layout.is_fp8:
        what = "FlashMLA's 656-byte FP8 rows" if layout.is_flashmla_fp8 else f"{layout.dtype} rows"
        raise ConfigError(f"`host_kv_dtype` = {host_kv_dtype!r}: this layout's rows already are fp8 ({what}, on both "
                          "tiers); use host_kv_dtype 'auto'")
    if layout.is_mla:
        raise ConfigError(f"`host_kv_dtype` = {host_kv_dtype!r} is for MHA/GQA layouts; an MLA latent's fp8 form is "
                          "FlashMLA's 656-byte row on both tiers: a layout with dtype float8_e4m3fn "
                          "(KVLayout.mla(..., dtype=torch.float8_e4m3fn)), with host_kv_dtype 'auto'")


def is_fp8_host(host_kv_dtype: str) -> bool:
    return host_kv_dtype == "fp8_e4m3"


def head_bytes(layout: KVLayout) -> int:
    """Bytes of one KV head's fp8 host row: head_dim values and the scale byte."""
    return layout.head_dim + SCALE_BYTES


def host_bytes_per_token_per_layer(layout: KVLayout, host_kv_dtype: str = "auto") -> int:
    """What one token keeps on the host in one layer: the layout's stored rows ("auto") or
    the fp8 rows with their scales. Refuses what `check_host_kv_dtype` refuses."""
    check_host_kv_dtype(host_kv_dtype, layout)
    if not is_fp8_host(host_kv_dtype):
        return layout.bytes_per_token_per_layer
    return layout.tensors_per_token * layout.num_kv_heads * head_bytes(layout)


# -- torch: the reference, and the path on the CPU --------------------------------------------
def _scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 biased exponent (1..254) of the smallest power of two p with amax / p <= 448."""
    bits = amax.float().contiguous().view(torch.int32)
    return ((bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).int()).clamp(1, 254)


def _encode_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float32 y (|y| <= 448) -> float8_e4m3fn bits as uint8, round to nearest even: the same
    integer code as kernels/triton/fp8_host.py `encode_e4m3` (equal to `y.to(torch.float8_e4m3fn)`)."""
    b = y.contiguous().view(torch.int32)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    shift = (141 - (a >> 23)).clamp(max=31)
    m = (a & 0x7FFFFF) | 0x800000
    q = m >> shift
    rem = m - (q << shift)
    half = torch.ones_like(shift) << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).int()
    return (torch.where(a >= 0x3C800000, normal, sub) | sign).to(torch.uint8)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype, any device) -> uint8 [..., D + 1] host rows (module
    docstring), one scale per row of the last dim."""
    xf = x.float()
    e = _scale_exponent(xf.abs().amax(-1))
    inv = ((254 - e) << 23).view(torch.float32)  # 1 / scale, exact
    y = (xf * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return torch.cat([_encode_e4m3(y), e.to(torch.uint8).unsqueeze(-1)], dim=-1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., D + 1] host rows -> [..., D] of `dtype`: e4m3 value x scale, exact in float32
    and bfloat16 (float16: rounded where a value falls below its normal range)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"dequantize_rows: need uint8 host rows, got {packed.dtype}")
    values = packed[..., :-1].contiguous().view(torch.float8_e4m3fn).float()
    scale = (packed[..., -1:].int() << 23).view(torch.float32)
    return (values * scale).to(dtype)


# -- row copies between the tiers -------------------------------------------------------------
def _launch(kernel: object, src: torch.Tensor, dst: torch.Tensor, src_off: torch.Tensor, dst_off: torch.Tensor,
            heads: int, head_dim: int) -> None:
    n = src_off.numel()
    if n:
        kernel[(n, heads)](_as_kernel_arg(src), _as_kernel_arg(dst), src_off, dst_off, n,  # type: ignore[index]
                           D=head_dim, DP=pow2(head_dim))


def copy_to_host(
    src: torch.Tensor, dst: torch.Tensor, src_off: torch.Tensor, dst_off: torch.Tensor, heads: int, head_dim: int,
    impl: str = "auto",
) -> None:
    """Quantising `copy_rows`: for every i with src_off[i] >= 0 and dst_off[i] >= 0, the
    `heads` x `head_dim` values at element offset src_off[i] of `src` (a float tensor: the
    device buffer, or prefill rows) become `heads` host rows of head_dim + 1 bytes at byte
    offset dst_off[i] of `dst` (uint8, the host pool). Offsets: int64 [N] on the launching device."""
    if dst.dtype != torch.uint8 or not src.dtype.is_floating_point:
        raise TypeError(f"copy_to_host: float rows into uint8 host rows, got {src.dtype} -> {dst.dtype}")
    if uses_triton(src, dst, src_off, dst_off, impl, "copy_to_host"):
        from ..kernels.triton.fp8_host import quant_rows_kernel

        _launch(quant_rows_kernel, src, dst, src_off, dst_off, heads, head_dim)
        return
    live = (src_off >= 0) & (dst_off >= 0)
    s = span_index(src_off, live, heads * head_dim)
    rows = src.view(-1)[s.to(src.device)].view(-1, heads, head_dim)
    d = span_index(dst_off, live, heads * (head_dim + SCALE_BYTES))
    dst.view(-1)[d.to(dst.device)] = quantize_rows(rows).reshape(-1).to(dst.device)


def copy_from_host(
    src: torch.Tensor, dst: torch.Tensor, src_off: torch.Tensor, dst_off: torch.Tensor, heads: int, head_dim: int,
    impl: str = "auto",
) -> None:
    """Dequantising `copy_rows`, the inverse of `copy_to_host`: `heads` host rows at byte
    offset src_off[i] of `src` (uint8) become heads x head_dim values of dst's dtype at
    element offset dst_off[i] of `dst`."""
    if src.dtype != torch.uint8 or not dst.dtype.is_floating_point:
        raise TypeError(f"copy_from_host: uint8 host rows into float rows, got {src.dtype} -> {dst.dtype}")
    if uses_triton(src, dst, src_off, dst_off, impl, "copy_from_host"):
        from ..kernels.triton.fp8_host import dequant_rows_kernel

        _launch(dequant_rows_kernel, src, dst, src_off, dst_off, heads, head_dim)
        return
    live = (src_off >= 0) & (dst_off >= 0)
    s = span_index(src_off, live, heads * (head_dim + SCALE_BYTES))
    packed = src.view(-1)[s.to(src.device)].view(-1, heads, head_dim + SCALE_BYTES).to(dst.device)
    d = span_index(dst_off, live, heads * head_dim)
    dst.view(-1)[d.to(dst.device)] = dequantize_rows(packed, dst.dtype).reshape(-1)
