"""FlashMLA's 656-byte FP8 MLA row: bytes decoded by hand, the scale rule, round-trip bounds.

The reference decoder here reads the bytes without torch's fp8 support: e4m3 from its bit
fields, the scales and the bf16 RoPE values with `struct`, all in float64.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.common.flashmla_format import PACKED_BYTES, pack_flashmla_fp8, unpack_flashmla_fp8


def e4m3(byte: int) -> float:
    """float8_e4m3fn from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities,
    S.1111.111 is NaN; exponent 0 is subnormal."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 15 and man == 7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def decode_row(row: bytes) -> tuple[list[float], list[float], list[float]]:
    """(512 NoPE fp8 values, 4 scales, 64 RoPE values), each as float64, from one 656-byte row."""
    assert len(row) == 656
    nope = [e4m3(b) for b in row[:512]]
    scales = list(struct.unpack("<4f", row[512:528]))
    rope = [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack("<64H", row[528:656])]
    return nope, scales, rope


def test_hand_computed_row() -> None:
    """One row worked out on paper: each 128-dim tile gets its own power-of-two scale."""
    lat = torch.zeros(576)
    lat[0:128] = 1.0  # amax 1: 1/448 -> 2^-8, 1 / 2^-8 = 256 = e4m3 0x78
    # lat[128:256] = 0: amax / 448 = 0 is clamped to 1e-4 -> 2^-13, values 0x00
    lat[256:384] = -448.0  # amax 448: scale 1, -448 = 0xFE
    lat[384:512] = 3.0  # 3/448 -> 2^-7, 3 / 2^-7 = 384 = 1.5 * 2^8 = 0x7C
    lat[512:] = 1.0  # bf16 0x3F80
    row = pack_flashmla_fp8(lat)
    assert row.shape == (656,) and row.dtype == torch.uint8
    b = bytes(row.tolist())
    assert b[0:128] == b"\x78" * 128 and b[128:256] == b"\x00" * 128
    assert b[256:384] == b"\xfe" * 128 and b[384:512] == b"\x7c" * 128
    assert struct.unpack("<4f", b[512:528]) == (2.0**-8, 2.0**-13, 1.0, 2.0**-7)
    assert b[528:656] == b"\x80\x3f" * 64
    assert torch.equal(unpack_flashmla_fp8(row), lat)


magnitudes = st.sampled_from([0.0, 1e-7, 1e-3, 0.37, 1.0, 5.0, 448.0, 3e4])


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3),
    mags=st.lists(magnitudes, min_size=4, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_bytes_follow_the_format_and_round_trip_within_the_fp8_step(rows, mags, dtype, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(rows, 576, generator=g)
    for t, m in enumerate(mags):  # each tile its own magnitude, so the scales differ
        lat[:, 128 * t : 128 * (t + 1)] *= m
    lat[:, 512:] *= 10
    lat = lat.to(dtype)
    packed = pack_flashmla_fp8(lat)
    assert packed.shape == (rows, PACKED_BYTES) and packed.dtype == torch.uint8
    back = unpack_flashmla_fp8(packed)
    assert back.dtype == torch.float32 and back.shape == (rows, 576)
    for r in range(rows):
        nope, scales, rope = decode_row(bytes(packed[r].tolist()))
        x = lat[r].double()
        for t in range(4):
            tile = x[128 * t : 128 * (t + 1)]
            amax = float(tile.abs().max())
            s = scales[t]
            # a power of two, the smallest one >= max(amax / 448, 1e-4) (up to float32 rounding of amax / 448)
            mant, _ = math.frexp(s)
            assert mant == 0.5, s
            floor = max(amax / 448, 1e-4)
            assert floor * (1 - 2**-20) <= s < 2 * floor
            deq = torch.tensor(nope[128 * t : 128 * (t + 1)], dtype=torch.float64) * s
            err = (deq - tile).abs()
            # half an e4m3 step: |q| / 16 in a normal binade, 2^-10 among subnormals; never more
            # than half the largest step (16) in scale units
            assert bool((err <= torch.maximum(tile.abs() / 16, torch.full_like(tile, s * 2**-10))).all())
            assert float(err.max()) <= 16 * s
            assert torch.equal(back[r, 128 * t : 128 * (t + 1)].double(), deq)  # unpack == hand decode, exactly
        want_rope = lat[r, 512:].to(torch.bfloat16).double()
        assert torch.equal(torch.tensor(rope, dtype=torch.float64), want_rope)  # RoPE exact in bf16
        assert torch.equal(back[r, 512:].double(), want_rope)


def test_bfloat16_latents_pack_like_flashmla_tile_by_tile() -> None:
    """FlashMLA's quantize_k_cache, written out tile by tile in its own terms: amax in the
    input dtype, / 448 in float32, clamp 1e-4, 2^ceil(log2), x.float() / scale -> e4m3."""
    g = torch.Generator().manual_seed(3)
    lat = (torch.randn(50, 1, 576, generator=g) * torch.rand(50, 1, 1, generator=g) * 30).to(torch.bfloat16)
    packed = pack_flashmla_fp8(lat)
    assert packed.shape == (50, 1, 656)
    for t in range(4):
        tile = lat[..., 128 * t : 128 * (t + 1)]
        inv = tile.abs().max(dim=-1).values.float() / 448.0
        scale = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil()).to(torch.float32)
        assert torch.equal(packed[..., 512 + 4 * t : 516 + 4 * t].contiguous().view(torch.float32)[..., 0], scale)
        q = (tile.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        assert torch.equal(packed[..., 128 * t : 128 * (t + 1)], q.view(torch.uint8))
    assert torch.equal(packed[..., 528:].contiguous().view(torch.bfloat16), lat[..., 512:])


def test_shapes_devices_and_errors() -> None:
    assert pack_flashmla_fp8(torch.zeros(0, 576)).shape == (0, 656)
    x = torch.randn(2, 3, 1, 576)
    packed = pack_flashmla_fp8(x)
    assert packed.shape == (2, 3, 1, 656)
    assert torch.equal(unpack_flashmla_fp8(packed[:, 1:]), unpack_flashmla_fp8(packed)[:, 1:])  # strided input
    with pytest.raises(ValueError, match=r"float latent \[\.\.\., 576\]"):
        pack_flashmla_fp8(torch.zeros(2, 512))
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 656\]"):
        unpack_flashmla_fp8(torch.zeros(2, 656))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_packs_the_same_bytes_as_the_cpu() -> None:
    lat = (torch.randn(300, 576) * 7).to(torch.bfloat16)
    got = pack_flashmla_fp8(lat.cuda())
    assert got.is_cuda and torch.equal(got.cpu(), pack_flashmla_fp8(lat))
    assert torch.equal(unpack_flashmla_fp8(got).cpu(), unpack_flashmla_fp8(got.cpu()))
