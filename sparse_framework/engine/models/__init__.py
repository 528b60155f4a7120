"""The engine's models: the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over packed
tokens, attention left to the runner's `attend` callback (docs/engine.md, "Models")."""

from __future__ import annotations

from .attention import Attend, causal_attention, dense_causal_attend
from .config import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    Llama3RopeScaling,
    ModelConfig,
    UnsupportedModelError,
)
from .llama import DecoderModel
from .loader import default_dtype, load_model, load_reference, random_model, reference_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Attend",
    "CheckpointError",
    "DecoderModel",
    "Llama3RopeScaling",
    "ModelConfig",
    "UnsupportedModelError",
    "causal_attention",
    "default_dtype",
    "dense_causal_attend",
    "load_model",
    "load_reference",
    "random_model",
    "reference_config",
]
