"""The engine's models: the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) and Gemma 2/3
over packed tokens, attention left to the runner's `attend` callback (docs/engine.md, "Models")."""

from __future__ import annotations

from .attention import Attend, causal_attention, dense_causal_attend
from .config import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    LinearRopeScaling,
    Llama3RopeScaling,
    ModelConfig,
    UnsupportedModelError,
)
from .gemma import GemmaDecoderModel
from .llama import DecoderModel
from .loader import EngineModel, build_model, default_dtype, load_model, load_reference, random_model, reference_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Attend",
    "CheckpointError",
    "DecoderModel",
    "EngineModel",
    "GemmaDecoderModel",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "ModelConfig",
    "UnsupportedModelError",
    "build_model",
    "causal_attention",
    "default_dtype",
    "dense_causal_attend",
    "load_model",
    "load_reference",
    "random_model",
    "reference_config",
]
