"""What the integration reads of a model and its config: the decoder config (after checking
that the model can use transformers' attention registry), whether it is an MLA model, which
layers are full and which slide (`LayerMap`), and the module behind `torch.compile`. Owns no
state."""

from __future__ import annotations

from typing import Any

import torch

from ...common.layer_map import FULL, SLIDING
from ...common.layer_map import LayerMap as CommonLayerMap
from .compat import UnsupportedModelError, transformers


def _text_config(model: Any) -> Any:
    """The model's decoder config, after checking that the model can use the registry."""
    if not isinstance(model, transformers.PreTrainedModel):
        raise UnsupportedModelError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not use transformers' attention-function registry (AttentionInterface), "
            "so its attention cannot be replaced; decoders such as Llama, Qwen2/3, Mistral and Gemma do"
        )
    cfg = model.config
    if cfg.get_text_config(decoder=True) is not cfg:
        raise UnsupportedModelError(f"{name}: multimodal and encoder-decoder models are not supported yet")
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: encoder-decoder models are not supported")
    return cfg


def is_mla(cfg: Any) -> bool:
    """An MLA model (a latent KV cache): handled by mla.py."""
    return getattr(cfg, "kv_lora_rank", None) is not None


class LayerMap(CommonLayerMap):
    """common/layer_map.py's map (which layers go through the coordinator, which through the
    `SlidingWindowKV`), read from a transformers config."""

    @classmethod
    def of(cls, cfg: Any, max_seq_len: int) -> LayerMap:
        """From the decoder config: `layer_types` where the config has them (Gemma 2/3,
        Qwen2 from `use_sliding_window` and `max_window_layers`, GPT-OSS, Mistral on
        transformers 5), else every layer slides when `sliding_window` is set (Mistral on
        4.x). A sliding layer whose window is >= max_seq_len never binds: it is a full layer
        (through the coordinator, as before hybrid support)."""
        n = cfg.num_hidden_layers
        types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        if types is None:
            types = [SLIDING if window is not None else FULL] * n
        other = sorted(set(types) - {FULL, SLIDING})
        if other:
            raise UnsupportedModelError(f"layer types {other} are not supported (full and sliding attention are)")
        if len(types) != n:
            raise UnsupportedModelError(f"the config has {len(types)} layer_types for {n} layers")
        if SLIDING in types and (not isinstance(window, int) or window < 1):
            raise UnsupportedModelError(f"the config has sliding-window layers but sliding_window = {window!r}")
        return cls.from_types(types, window, max_seq_len)  # type: ignore[return-value]


def _uncompiled(model: Any) -> Any:
    """The module `torch.compile(model)` wraps: the integration patches the model itself,
    which the compiled wrapper calls (its attention and cache steps run eagerly)."""
    orig = getattr(model, "_orig_mod", None)
    return orig if isinstance(model, torch.nn.Module) and isinstance(orig, torch.nn.Module) else model

