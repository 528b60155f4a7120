"""Attention backends run a kernel over the device buffer with an adaptor's metadata.

Each backend declares what it supports; the coordinator checks those declarations against the
KV layout when it is built, so an unsupported combination fails before the first step.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ..common.errors import ConfigError, UnsupportedFeatureError
from ..common.layout import KVLayout


class AttentionBackend(ABC):
    """Runs decode attention from (q, paged K/V views of the device buffer, metadata).

    Declarations:
      metadata_formats names of the adaptors whose plans `run` consumes; the first is the
                       default when the config leaves `adaptor` unset.
      device_types     torch device types it runs on.
      dtypes           KV/query dtypes it accepts.
      head_dims        supported head dims, or None for any.
      supports_softcap whether `run` applies logit soft-capping (`softcap=`, Gemma 2).
      supports_sinks   whether `run` takes per-head sink logits (`sinks=`, GPT-OSS's s_aux).

    A backend that does not declare them is never called with them: the
    coordinator refuses such a layer (`check_attention_options`) when it is configured.
    """

    metadata_formats: ClassVar[tuple[str, ...]] = ("flash_attention",)
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    head_dims: ClassVar[tuple[int, ...] | None] = None
    supports_softcap: ClassVar[bool] = False
    supports_sinks: ClassVar[bool] = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (a missing library), or None."""
        return None

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(True, "") when the backend can run on this machine, else (False, a short reason):
        no device of a declared type (a CUDA backend without a GPU), or `unavailable_reason`.
        Cheap: `sparse-framework plugins` calls it for every backend, so overrides look for
        libraries with `importlib.util.find_spec` rather than importing them."""
        reasons = []
        if not _device_present(cls.device_types):
            reasons.append(f"needs a {' or '.join(cls.device_types)} device (no CUDA GPU visible)")
        why = cls.unavailable_reason()
        if why:
            reasons.append(why)
        return not reasons, "; ".join(reasons)

    @classmethod
    def check_layout(cls, layout: KVLayout) -> None:
        """Raise ConfigError naming the first declaration the layout breaks. Messages start
        with a verb: the coordinator prefixes "backend '<registered name>' "."""
        reason = cls.unavailable_reason()
        if reason:
            raise ConfigError(f"is unavailable: {reason}")
        device_type = torch.device(layout.device).type
        if device_type not in cls.device_types:
            raise ConfigError(
                f"runs on {', '.join(cls.device_types)}, not on device {device_type!r}"
            )
        if layout.dtype not in cls.dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in cls.dtypes)
            raise ConfigError(f"supports dtypes {allowed}, not {layout.dtype}")
        if cls.head_dims is not None and layout.head_dim not in cls.head_dims:
            raise ConfigError(
                f"supports head_dim in {cls.head_dims}, not {layout.head_dim}"
            )

    @classmethod
    def check_attention_options(cls, softcap: float | None, sinks: torch.Tensor | None) -> None:
        """Raise UnsupportedFeatureError (a ConfigError) naming the option (`softcap`, `sinks`)
        this backend cannot apply. Messages start with a verb, like `check_layout`'s. Backends
        whose support depends on an installed library override this and look at the library."""
        missing = [n for n, given in (("softcap", softcap is not None), ("sinks", sinks is not None))
                   if given and not getattr(cls, f"supports_{n}")]
        if missing:
            raise UnsupportedFeatureError(f"does not support {_describe(missing)}; use backend 'torch_ref' or 'triton'")

    @abstractmethod
    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Decode attention. q: [batch, num_q_heads, head_dim]; k_cache/v_cache: the paged
        view [num_pages, page_size, heads, head_dim] that matches the metadata (heads = 1
        when the metadata folds KV heads into the batch; v_cache's dim is 512 for an MLA
        latent of 576). Returns [batch, num_q_heads, v_dim] in q's dtype.

        A backend that declares `supports_softcap` / `supports_sinks` also takes them as keywords:
        `softcap: float | None` (logits = softcap * tanh(scale * q.k / softcap)) and
        `sinks: float32 [num_q_heads] | None` (a logit per query head in the softmax's
        denominator, with no value); see `common.softmax.softcap_and_sink_softmax`. They are passed
        only when set, so backends without them keep this signature."""


OPTION_NAMES = {"softcap": "softcap (logit soft-capping)", "sinks": "sinks (attention-sink logits)"}


def _describe(options: list[str]) -> str:
    """'softcap (logit soft-capping) and sinks (...)' for the option names given."""
    return " and ".join(OPTION_NAMES[o] for o in options)


def fold_sinks(sinks: torch.Tensor, batch: int, kv_heads: int) -> torch.Tensor:
    """Sinks [Hq] as [batch * kv_heads, Hq // kv_heads]: per sequence of metadata that folds
    the KV heads into the batch (sequence i = request i // kv_heads, KV head i % kv_heads,
    whose query heads are that head's group)."""
    return sinks.reshape(1, kv_heads, -1).expand(batch, -1, -1).reshape(batch * kv_heads, -1)


def check_softcap_and_sinks(softcap: float | None, sinks: torch.Tensor | None) -> None:
    """ConfigError unless softcap is None or a finite number > 0 and sinks is None or a 1-D
    floating tensor (whose length, one per query head, is checked against q when it runs)."""
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0
    ):
        raise ConfigError(f"softcap must be None (off) or a finite number > 0 (Gemma 2: 50.0), got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or not sinks.dtype.is_floating_point:
            got = f"{sinks.dtype} {list(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ConfigError(f"sinks must be None or a 1-D floating tensor, one logit per query head, got {got}")


def _device_present(device_types: tuple[str, ...]) -> bool:
    """Whether this machine has a device of one of the types (the CPU always; CUDA if visible)."""
    return "cpu" in device_types or ("cuda" in device_types and torch.cuda.is_available())


def module_missing(name: str, install: str) -> str | None:
    """"<name> not installed (<install>)" when the module cannot be found, without importing it."""
    import importlib.util

    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        found = False
    return None if found else f"{name} not installed ({install})"
