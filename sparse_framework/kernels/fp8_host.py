"""FP8 host rows (kv_store/fp8_host.py, which launches the row kernels): quantising and
dequantising row copies, and `decode_e4m3` for the fused swap-in. Their code and the format:
`kernels/triton/fp8_host.py`; this module keeps their names where the launchers import them."""

from __future__ import annotations

from .triton.fp8_host import decode_e4m3, dequant_rows_kernel, encode_e4m3, quant_rows_kernel, scale_exponent

__all__ = ["scale_exponent", "encode_e4m3", "decode_e4m3", "quant_rows_kernel", "dequant_rows_kernel"]
