"""The shape of a model's KV cache: what every store, algorithm and backend agrees on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .flashmla_format import LATENT_DIM, NOPE_DIM, PACKED_BYTES

FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def check_device(device: str | torch.device) -> torch.device:
    """The torch device named, or ValueError saying what is wrong (unknown name, or CUDA
    asked for where this torch build or machine has none)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r} asked for, but CUDA is not available here "
            f"(torch {torch.__version__}); use 'cpu'"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


@dataclass(frozen=True)
class KVLayout:
    """Per layer and token: what is cached.

    kind "mha" (MHA/GQA): one K row and one V row of `num_kv_heads x head_dim` elements.
    kind "mla": one latent row of `head_dim` elements (e.g. 576 = 512 + 64 RoPE dims) for
    one KV head; K is the whole row and V its first `v_head_dim` (512) elements.
    Any floating dtype; fp8 rows are stored as bytes (`storage_dtype` uint8): an MHA fp8 row
    as its raw fp8 values, an fp8 MLA latent (float8_e4m3fn, 576 / 512 only) as FlashMLA's
    656-byte "FP8 with scale" row (common/flashmla_format.py), the one format FlashMLA's
    sparse decode reads. `stored_head_dim` is the stored width either way.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    kind: Literal["mha", "mla"] = "mha"
    v_head_dim: int | None = None
    # store layer i is model layer model_layers[i] (a sliding-window hybrid stores only its
    # full-attention layers); None: the same numbering. Rules that speak of the network's depth
    # (Quest's dense_first_layers) count in model layers.
    model_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # num_layers may be 0: a model whose every layer is sliding-window keeps nothing in
        # the store (integrations/transformers/enabling.py), and the coordinator only tracks requests
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ValueError(f"KVLayout.num_layers must be a non-negative int, got {self.num_layers!r}")
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"KVLayout.dtype must be a floating torch.dtype, got {self.dtype!r}")
        check_device(self.device)
        if self.model_layers is not None:
            ids = tuple(self.model_layers)
            increasing = list(ids) == sorted(set(ids)) and all(isinstance(i, int) and i >= 0 for i in ids)
            if len(ids) != self.num_layers or not increasing:
                raise ValueError(f"KVLayout.model_layers must be {self.num_layers} increasing model layer indices "
                                 f"(one per store layer), got {self.model_layers!r}")
            object.__setattr__(self, "model_layers", ids)
        if self.kind not in ("mha", "mla"):
            raise ValueError(f"KVLayout.kind must be 'mha' or 'mla', got {self.kind!r}")
        if self.kind == "mla":
            if self.num_kv_heads != 1:
                raise ValueError(f"an MLA layout has one latent KV head, got num_kv_heads={self.num_kv_heads}")
            if self.v_head_dim is None:
                object.__setattr__(self, "v_head_dim", min(512, self.head_dim))
            if not 1 <= self.v_head_dim <= self.head_dim:
                raise ValueError(f"KVLayout.v_head_dim must be in 1..head_dim ({self.head_dim}), got {self.v_head_dim}")
            if self.is_fp8 and (
                self.dtype != torch.float8_e4m3fn or (self.head_dim, self.v_head_dim) != (LATENT_DIM, NOPE_DIM)
            ):
                raise ValueError(
                    "an fp8 MLA layout is stored in FlashMLA's 656-byte FP8 row, which needs dtype "
                    f"float8_e4m3fn, head_dim {LATENT_DIM} and v_head_dim {NOPE_DIM}; got {self.dtype}, "
                    f"head_dim {self.head_dim}, v_head_dim {self.v_head_dim}"
                )
        elif self.v_head_dim not in (None, self.head_dim):
            raise ValueError("KVLayout.v_head_dim differs from head_dim only in MLA layouts")
        else:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @classmethod
    def mla(cls, num_layers: int, latent_dim: int = 576, v_head_dim: int = 512, **kw: object) -> KVLayout:
        """DeepSeek-style MLA layout: one latent row (512 + 64) per token."""
        return cls(num_layers, 1, latent_dim, kind="mla", v_head_dim=v_head_dim, **kw)  # type: ignore[arg-type]

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def is_flashmla_fp8(self) -> bool:
        """fp8 MLA: latents stored packed in FlashMLA's 656-byte rows (not 576 raw fp8 bytes)."""
        return self.is_mla and self.is_fp8

    @property
    def stored_head_dim(self) -> int:
        """Storage elements of one token's row per KV head in one stored tensor: head_dim, or
        656 (bytes) for an fp8 MLA latent. Every store tensor's last dim, copy and offset uses it."""
        return PACKED_BYTES if self.is_flashmla_fp8 else self.head_dim

    @property
    def stored_row_elems(self) -> int:
        """Storage elements of one token's row over all KV heads in one stored tensor."""
        return self.num_kv_heads * self.stored_head_dim

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the stored tensors: uint8 bytes for fp8, else `dtype`."""
        return torch.uint8 if self.is_fp8 else self.dtype

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def tensors_per_token(self) -> int:
        """Stored rows per token and layer: K and V (MHA) or the latent (MLA)."""
        return 1 if self.is_mla else 2

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or latent) row over all KV heads, in one layer, as stored
        (656 for an fp8 MLA latent)."""
        return self.stored_row_elems * self.element_size

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Everything one token stores in one layer (K + V, or the latent)."""
        return self.tensors_per_token * self.row_bytes

    @property
    def bytes_per_token(self) -> int:
        """Everything one token stores over all layers."""
        return self.num_layers * self.bytes_per_token_per_layer


def resolve_impl(impl: str, device: str | torch.device) -> str:
    """A kernel choice: "auto" is Triton on CUDA and torch elsewhere (Triton on the CPU only
    runs under its slow interpreter)."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be auto, torch or triton, got {impl!r}")
    if impl != "auto":
        return impl
    return "triton" if torch.device(device).type == "cuda" else "torch"
