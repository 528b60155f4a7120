"""How the Triton kernels multiply query and key tiles, and the launch checks the scoring
kernels share. Its own module because every scoring family (`kernels/scoring.py`: Quest,
PQCache, SnapKV; `kernels/dsa_index.py`: DSA's indexer), the block-table Quest pass
(`kernels/paged_scores.py`) and the decode attention (`kernels/sparse_decode.py`) use it:

  _dot_mode / _dot    the product of queries and keys of any float dtype (fp8 keys as uint8
                      bits) with float32 sums: exact where the operands allow, tf32x3
                      (~float32) on tensor cores otherwise, plain float32 when interpreted
  _pow2               the power-of-two block size that covers n (Triton's tiles need one)
  _interpreted        TRITON_INTERPRET=1: the kernels run on the CPU (tests)
  _launchable         the tensors are on one device the kernels can run on
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _launchable(*tensors: torch.Tensor, kernels: str = "scoring") -> None:
    """`kernels` names the family in the error (scoring, decode)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if tensors[0].device.type != "cuda" and not _interpreted():
        raise RuntimeError(f"the Triton {kernels} kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")


DOT_16BIT, DOT_SPLIT3, DOT_TF32X3, DOT_IEEE = 0, 1, 2, 3


def _dot_mode(a: torch.dtype, b: torch.dtype) -> tuple[int, tl.dtype]:
    """How a kernel multiplies queries of dtype `a` with keys of dtype `b` (uint8: fp8 bits),
    and the dtype the keys are converted to. Every mode accumulates in float32:
      DOT_16BIT   both the same 16-bit dtype (or fp8 keys, exact in it): exact products
      DOT_SPLIT3  float32 queries, keys exact in bf16 (bf16, fp8): the queries split into three
                  bf16 parts (24 significant bits, all of float32's) -> exact products
      DOT_TF32X3  other float32 operands, on tensor cores (~float32 accuracy); plain "ieee"
                  float32 dots are ~100x slower on an H100
      DOT_IEEE    the interpreter: everything in float32 (it multiplies bf16 tiles as their
                  uint16 storage, triton 3.9)"""
    if a == torch.float16 and b in (a, torch.uint8):
        return DOT_16BIT, tl.float16
    if _interpreted():
        return DOT_IEEE, tl.float32
    if a == torch.bfloat16 and b in (a, torch.uint8):
        return DOT_16BIT, tl.bfloat16
    if a == torch.float32 and b in (torch.bfloat16, torch.uint8):
        return DOT_SPLIT3, tl.bfloat16
    return DOT_TF32X3, tl.float32


