"""The attention function registered in transformers as "sparse_framework" and what it reads
per call: it routes a call that belongs to a SparseCache's step to that cache (cache.py),
runs transformers' sdpa attention (or the eager formula for a soft-cap or sinks) otherwise.
Owns the routing table `_HANDLES` (attention module -> the SparseHandle enabled on its model;
handle.py fills and empties it), and gives each full layer's soft-cap and sinks to the
coordinator at enable (`_set_attention_options`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ...coordinator.core import SparseCoordinator
from ..eager_attention import eager_attention
from ..index_mask import fold_indices
from .compat import NAME, UnsupportedModelError
from .model_info import LayerMap

# attention module -> the SparseHandle (handle.py, which imports this module) enabled on its model
_HANDLES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


@torch.compiler.disable(recursive=True)
def sparse_attention_forward(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention function registered as "sparse_framework": through the coordinator when
    the step is a SparseCache's, transformers' sdpa attention otherwise (the eager formula for
    a call with a soft-cap or attention sinks, which sdpa cannot express)."""
    handle = _HANDLES.get(module)
    cache = handle._active() if handle is not None and handle._active is not None else None
    if cache is not None and cache._claims(module.layer_idx, key):
        return cache._attend(module, query, key, value, attention_mask, scaling, kwargs)
    if handle is not None:
        handle._count_bypass(query.shape[0])
    if kwargs.get("indices") is not None:  # an MLA + DSA model's top-k, which sdpa alone would ignore
        attention_mask = fold_indices(attention_mask, kwargs.pop("indices"), key.shape[2])
    softcap, sinks = _split_options(kwargs)
    if softcap is not None or sinks is not None:  # what the model's own (eager) attention computes
        if dropout:
            raise UnsupportedModelError(
                f"attention dropout ({dropout}) with a soft-cap or sinks is not supported through {NAME}: "
                "call model.eval(), or disable the handle to train"
            )
        return _dense(module, query, key, value, attention_mask, scaling, kwargs, softcap, sinks), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _register() -> None:
    """Register the attention function and the mask function (transformers' own sdpa mask)."""
    AttentionInterface.register(NAME, sparse_attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _set_attention_options(model: Any, cfg: Any, layers: LayerMap, coord: SparseCoordinator) -> None:
    """Give each full-attention layer's soft-cap (Gemma 2's `attn_logit_softcapping`, from the
    attention module or the config) and attention sinks (GPT-OSS's `sinks` parameter) to the
    coordinator under its store layer index, so that its backend applies them at decode. A
    backend that cannot apply one refuses here, at enable (UnsupportedFeatureError naming the
    backend and the option). Sliding-window layers take them per call (`_split_options`).

    The sinks are read once: a float32 model's parameter is used in place (later in-place
    weight updates are seen); another dtype's is copied to float32, so enable again after
    loading new weights."""
    default_cap = getattr(cfg, "attn_logit_softcapping", None)
    found: dict[int, tuple[float | None, torch.Tensor | None]] = {}  # model layer -> (softcap, sinks)
    for module in model.modules():  # modules with a layer_idx: the attention module (and maybe its block)
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or layer not in layers.store:
            continue
        softcap, sinks = found.get(layer, (default_cap, None))
        softcap = getattr(module, "attn_logit_softcapping", None) or softcap
        param = getattr(module, "sinks", None)
        found[layer] = (softcap, param if isinstance(param, torch.Tensor) else sinks)
    for layer, (softcap, sinks) in found.items():
        if softcap is not None or sinks is not None:
            coord.set_attention_options(layers.store[layer], softcap=softcap, sinks=sinks)


def _split_options(kwargs: dict[str, Any]) -> tuple[float | None, torch.Tensor | None]:
    """Take the soft-cap and the sinks out of an attention call's keywords: `softcap` (Gemma
    2, None in Gemma 3) and `s_aux` (GPT-OSS; `sinks` accepted too)."""
    softcap = kwargs.pop("softcap", None)
    s_aux, sinks = kwargs.pop("s_aux", None), kwargs.pop("sinks", None)
    return softcap, s_aux if s_aux is not None else sinks


def _dense(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    scale: float | None, kwargs: dict[str, Any], softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Dense attention over the padded batch with the model's mask -> [B, n, Hq, D]:
    transformers' sdpa attention, or, for a call with a soft-cap or sinks (which sdpa cannot
    express), the eager formula those models use (eager_attention.py)."""
    if softcap is None and sinks is None:
        out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scale, **kwargs)
        return out
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return eager_attention(query, key, value, mask, scale, softcap=softcap, sinks=sinks)
