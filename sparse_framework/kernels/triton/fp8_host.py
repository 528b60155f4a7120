"""FP8 host rows (kv_store/fp8_host.py): quantising and dequantising row copies.

A host row of one KV head is HEAD_DIM float8_e4m3fn bytes followed by one scale byte, the
biased exponent of a power-of-two scale (UE8M0, as in OCP MX formats and FlashMLA's scales).
Encoding and decoding are done on the float32 bits with integer operations, not with
`.to(tl.float8e4nv)`: the result is then bit for bit the same as torch's round-to-nearest-even
cast (kv_store/fp8_host.py, tested) on any GPU and under the interpreter, whose fp8 casts
round differently (half up, subnormals flushed).

`quant_rows_kernel`: rows of the device dtype -> packed host rows (decode and prefill host
writes, retract, prefix-cache export). `dequant_rows_kernel`: packed host rows -> rows of the
device dtype (swap-in on the torch-planned path, resume, prefix-cache load). The fused
swap-in (`residency.copy_missing_kernel`) decodes with `decode_e4m3` in its own loop.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_exponent(amax):
    """Biased exponent (1..254) of the smallest power of two p with amax / p <= 448: from
    amax = 1.f x 2^e, p = 2^(e - 8) while 1.f <= 1.75 (448 = 1.75 x 2^8), else 2^(e - 7)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(e, 1), 254)


@triton.jit
def encode_e4m3(y):
    """float32 y (|y| <= 448) -> float8_e4m3fn bits (uint8), round to nearest even."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # normal (|y| >= 2^-6): keep 3 of 23 mantissa bits, rounding half to even; a carry
    # runs into the exponent as it should; rebias the exponent from 127 to 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    # subnormal: k x 2^-9, k = round-half-even(m x 2^(e - 14)) of the 24-bit significand m
    shift = tl.minimum(141 - (a >> 23), 31)
    m = (a & 0x7FFFFF) | 0x800000
    q = m >> shift
    rem = m - (q << shift)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return (tl.where(a >= 0x3C800000, normal, sub) | sign).to(tl.uint8)


@triton.jit
def decode_e4m3(byte, scale_byte):
    """float8_e4m3fn bits (uint8) x 2^(scale_byte - 127) -> float32, exact."""
    b = byte.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((b & 0x80) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # 2^-9
    sub = tl.where((b & 0x80) != 0, -sub, sub)
    scale = (scale_byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, sub) * scale


@triton.jit
def quant_rows_kernel(
    src_ptr,  # device rows (any float dtype), flat
    dst_ptr,  # uint8 host rows, flat
    src_off_ptr,  # int64 [N] element offsets of a row of HEADS x D in src (-1: skip)
    dst_off_ptr,  # int64 [N] byte offsets of its HEADS x (D + 1) bytes in dst (-1: skip)
    n_rows,
    D: tl.constexpr,
    DP: tl.constexpr,  # D rounded up to a power of two
):
    """Program (row, head): one head's D values -> D e4m3 bytes and their scale byte."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    src = tl.load(src_off_ptr + i)
    dst = tl.load(dst_off_ptr + i)
    if (src >= 0) & (dst >= 0):
        cols = tl.arange(0, DP)
        m = cols < D
        x = tl.load(src_ptr + src + h * D + cols, mask=m, other=0.0).to(tl.float32)
        e = scale_exponent(tl.max(tl.abs(x), axis=0))
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1 / 2^(e - 127), exact
        y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        row = dst_ptr + dst + h * (D + 1)
        tl.store(row + cols, encode_e4m3(y), mask=m)
        tl.store(row + D, e.to(tl.uint8))


@triton.jit
def dequant_rows_kernel(
    src_ptr,  # uint8 host rows, flat
    dst_ptr,  # device rows, flat
    src_off_ptr,  # int64 [N] byte offsets of a row of HEADS x (D + 1) bytes in src (-1: skip)
    dst_off_ptr,  # int64 [N] element offsets of its HEADS x D values in dst (-1: skip)
    n_rows,
    D: tl.constexpr,
    DP: tl.constexpr,
):
    """Program (row, head): D e4m3 bytes and their scale -> D values of dst's dtype."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    src = tl.load(src_off_ptr + i)
    dst = tl.load(dst_off_ptr + i)
    if (src >= 0) & (dst >= 0):
        cols = tl.arange(0, DP)
        m = cols < D
        row = src_ptr + src + h * (D + 1)
        q = tl.load(row + cols, mask=m, other=0)
        s = tl.load(row + D)
        tl.store(dst_ptr + dst + h * D + cols, decode_e4m3(q, s).to(dst_ptr.dtype.element_ty), mask=m)
