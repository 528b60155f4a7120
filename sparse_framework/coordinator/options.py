"""Per-layer attention options: the q·k scale (Gemma's `query_pre_attn_scalar`), logit
soft-capping (Gemma 2's `attn_logit_softcapping`) and attention-sink logits (GPT-OSS's `sinks`,
`s_aux` in its attention call). The coordinator keeps one `AttentionOptions` per layer that sets
any (`SparseCoordinator.set_attention_options`) and hands them to the backend at decode and to
its own dense attention at prefill.

Semantics (common/softmax.softcap_and_sink_softmax is the reference):
  scale    logits s = scale * q.k; None is 1/sqrt(D), D q's head dim (the backends' default).
           Algorithms are handed q x (scale * sqrt(D)) (`query_factor`), whose q.k / sqrt(D) is
           the model's logit, as hosts multiplied q before the coordinator took the scale: an
           algorithm's softmax over q.k / sqrt(D) (SnapKV, PQCache, DSA's exact mass) sees the
           same numbers.
  softcap  logits s = scale * q.k become softcap * tanh(s / softcap) before the softmax.
  sinks    one learned logit per query head joins the softmax's denominator and has no value:
           out = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m)). Not soft-capped.
           (Unrelated to the config's `sink_tokens`, the first tokens a sparse selection
           always keeps.)
All None is the default path, unchanged: backends are then called without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import math

import torch

from ..backends.base import check_softcap_and_sinks
from ..common.errors import ConfigError


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """One layer's options. sinks: float32 [num_q_heads], contiguous, on the layout's device."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None
    scale: float | None = None

    @classmethod
    def make(
        cls, softcap: float | None, sinks: torch.Tensor | None, device: torch.device | str,
        scale: float | None = None, head_dim: int | None = None,
    ) -> AttentionOptions:
        """Checked options (ConfigError naming the field); sinks converted to float32 once
        (a bfloat16 parameter is copied: set the options again if the weights change). A scale
        equal to 1/sqrt(head_dim) (to 1e-9 relative) is stored as None, the default path."""
        check_softcap_and_sinks(softcap, sinks)
        if sinks is not None:
            if sinks.device.type != torch.device(device).type:
                raise ConfigError(f"sinks must be on the KV layout's device {str(device)!r}, got {sinks.device}")
            sinks = sinks.detach().to(torch.float32).contiguous()
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
                raise ConfigError(f"scale must be a finite float > 0 (or None: 1/sqrt(head_dim)), got {scale!r}")
            scale = float(scale)
            if head_dim is not None and math.isclose(scale * math.sqrt(head_dim), 1.0, rel_tol=1e-9):
                scale = None
        return cls(None if softcap is None else float(softcap), sinks, scale)

    @property
    def is_default(self) -> bool:
        return self.softcap is None and self.sinks is None and self.scale is None

    def query_factor(self, head_dim: int) -> float | None:
        """scale x sqrt(head_dim): what the algorithms' queries are multiplied by (module
        docstring); None when the scale is the default or the factor is 1 (to 1e-9)."""
        if self.scale is None:
            return None
        factor = self.scale * math.sqrt(head_dim)
        return None if math.isclose(factor, 1.0, rel_tol=1e-9) else factor

    def kwargs(self) -> dict[str, Any]:
        """The keywords a backend's `run` takes for the options set (none for the default)."""
        out: dict[str, Any] = {}
        if self.scale is not None:
            out["scale"] = self.scale
        if self.softcap is not None:
            out["softcap"] = self.softcap
        if self.sinks is not None:
            out["sinks"] = self.sinks
        return out

    def key(self) -> tuple:
        """What a captured decode graph depends on: the scale, the cap's value and the sinks'
        storage (a graph reads the sinks tensor in place, so new values in it need no new graph)."""
        return (self.scale, self.softcap, None if self.sinks is None else self.sinks.data_ptr())

    def check_heads(self, num_q_heads: int) -> None:
        """ValueError unless the sinks have one logit per query head of this call's q."""
        if self.sinks is not None and self.sinks.numel() != num_q_heads:
            raise ValueError(
                f"the layer's sinks have {self.sinks.numel()} logits but q has {num_q_heads} query heads; "
                "set_attention_options needs one sink logit per query head"
            )


DEFAULT = AttentionOptions()
