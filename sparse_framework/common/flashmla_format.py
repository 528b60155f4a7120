"""FlashMLA's "FP8 with scale" MLA cache row: 656 bytes per token (DeepSeek V3.2's format).

FlashMLA's sparse decode kernel reads nothing else (its README, `flash_mla_interface.py` and
`tests/quant.py`), so the store keeps fp8 MLA latents in exactly this layout: the kernel then
reads the device buffer as it is, and every byte the store moves or counts is a byte the kernel
reads. One token's row, all little-endian:

    bytes   0..511   the "NoPE" part: latent dims 0..511 as float8_e4m3fn, divided by their scale
    bytes 512..527   4 float32 scales, one per 128 NoPE dims (scale i covers dims 128i..128i+127)
    bytes 528..655   the "RoPE" part: latent dims 512..575 as bfloat16, not quantised

Scale rule (FlashMLA tests/quant.py, DeepSeek's "ue8m0" scales): per 128-dim tile,
scale = 2 ** ceil(log2(max(amax / 448, 1e-4))), a power of two no smaller than amax / 448
(448 is the largest finite e4m3 value), so value / scale always fits e4m3 and dividing by the
scale is exact. Dequantised values (e4m3 value x power of two) are exact in bfloat16 and float32,
which is why the kernel's bf16 dequantisation and `unpack_flashmla_fp8`'s float32 one agree bit
for bit. For a bfloat16 latent `pack_flashmla_fp8` gives FlashMLA's own `quantize_k_cache` bytes;
a float32 latent is quantised from its float32 values (no bf16 rounding first, except RoPE).
"""

from __future__ import annotations

import torch

LATENT_DIM = 576  # the MLA latent: NoPE (also V) + RoPE
NOPE_DIM = 512  # quantised dims, and V's dims
ROPE_DIM = LATENT_DIM - NOPE_DIM  # 64
TILE = 128  # NoPE dims per scale
NUM_SCALES = NOPE_DIM // TILE  # 4
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1e-4  # FlashMLA clamps amax / 448 to at least this before rounding up
SCALE_OFFSET = NOPE_DIM  # 512
ROPE_OFFSET = SCALE_OFFSET + 4 * NUM_SCALES  # 528
PACKED_BYTES = ROPE_OFFSET + 2 * ROPE_DIM  # 656


def pack_flashmla_fp8(latent: torch.Tensor) -> torch.Tensor:
    """latent [..., 576] (any float dtype, any device) -> uint8 [..., 656] FlashMLA rows.

    Vectorised over every leading dim; the result is a new contiguous tensor on latent's device.
    """
    if latent.shape[-1] != LATENT_DIM or not latent.dtype.is_floating_point:
        raise ValueError(
            f"pack_flashmla_fp8: need a float latent [..., {LATENT_DIM}] ({NOPE_DIM} NoPE + {ROPE_DIM} RoPE dims), "
            f"got {latent.dtype} {list(latent.shape)}"
        )
    lead = latent.shape[:-1]
    nope = latent[..., :NOPE_DIM].float().reshape(*lead, NUM_SCALES, TILE)
    scale = torch.pow(2.0, (nope.abs().amax(-1) / FP8_MAX).clamp_min(MIN_SCALE).log2().ceil())
    # the clamp never changes a value when log2 is exact; it only guards the cast against a
    # log2 that rounds one ulp low (no e4m3 NaN can come out of this function)
    values = (nope / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    rope = latent[..., NOPE_DIM:].to(torch.bfloat16).contiguous()
    return torch.cat(
        [values.view(torch.uint8).reshape(*lead, NOPE_DIM), scale.contiguous().view(torch.uint8), rope.view(torch.uint8)],
        dim=-1,
    )


def unpack_flashmla_fp8(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] FlashMLA rows -> float32 [..., 576] latents (NoPE · scale, RoPE)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] != PACKED_BYTES:
        raise ValueError(
            f"unpack_flashmla_fp8: need uint8 [..., {PACKED_BYTES}] FlashMLA rows, got {packed.dtype} {list(packed.shape)}"
        )
    lead = packed.shape[:-1]
    # view(dtype) of a byte slice needs a contiguous, aligned last dim: copy the small parts
    values = packed[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float().reshape(*lead, NUM_SCALES, TILE)
    scale = packed[..., SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)
    rope = packed[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(values * scale.unsqueeze(-1)).reshape(*lead, NOPE_DIM), rope], dim=-1)
