"""The engine's models: the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3), Gemma 2/3 and
DeepSeek-V3.2 (MLA + lightning indexer + MoE) over packed tokens, attention left to the runner's
`attend` callback (an `MLAAttend` for MLA; docs/engine.md, "Models")."""

from __future__ import annotations

from .attention import Attend, Prefetch, causal_attention, dense_causal_attend
from .config import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    LinearRopeScaling,
    Llama3RopeScaling,
    ModelConfig,
    UnsupportedModelError,
)
from .deepseek_v32 import DeepseekV32Model
from .gemma import GemmaDecoderModel
from .llama import DecoderModel
from .loader import (EngineModel, build_model, default_dtype, load_model, load_reference, model_class, random_model,
                     reference_config)
from .mla import MLAAttend, MLAInputs, dense_mla_attend, index_scores, indexer_keep
from .mla_config import MLAConfig, YarnRopeScaling

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Attend",
    "CheckpointError",
    "DecoderModel",
    "DeepseekV32Model",
    "EngineModel",
    "GemmaDecoderModel",
    "LinearRopeScaling",
    "MLAAttend",
    "MLAConfig",
    "MLAInputs",
    "YarnRopeScaling",
    "Llama3RopeScaling",
    "ModelConfig",
    "Prefetch",
    "UnsupportedModelError",
    "build_model",
    "causal_attention",
    "default_dtype",
    "dense_causal_attend",
    "dense_mla_attend",
    "index_scores",
    "indexer_keep",
    "model_class",
    "load_model",
    "load_reference",
    "random_model",
    "reference_config",
]
