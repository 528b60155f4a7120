"""`ModelConfig`: the few facts of a Hugging Face `config.json` the engine's models need.

Reading the JSON ourselves (not through `transformers.AutoConfig`) keeps the engine free of
transformers at run time and lets every unsupported feature be refused here, by name, before a
single weight is read: a model that would silently compute something else (a sliding window,
a RoPE variant we do not implement, another activation) is an error, not a wrong answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...common.errors import ConfigError
from ...common.layout import KVLayout
from .errors import CheckpointError, UnsupportedModelError
from .mla_config import DEFAULT_ROPE_THETA, MLAConfig, read_mla_config

# architecture (config.json "architectures") -> family; every one is a pre-norm Llama decoder
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # MLA + DSA's lightning indexer + MoE (engine/models/deepseek_v32.py; fields in mla_config.py)
    "DeepseekV32ForCausalLM": "deepseek_v32",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency rescaling (`rope_type: "llama3"`): wavelengths longer than
    `original_max_position_embeddings / low_freq_factor` are stretched by `factor`, shorter than
    `... / high_freq_factor` kept, and the band between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """One Llama-family decoder: every layer attention (MHA/GQA, RoPE) + SiLU-gated MLP, each
    behind an RMSNorm with a residual. Families differ only in the flags below."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # the output projection has one too (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # Llama's mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # DeepSeek-V3.2 only (mla_config.MLAConfig): MLA, indexer and MoE shapes. With it,
    # num_kv_heads is 1 and head_dim the latent row (kv_lora_rank + qk_rope_head_dim): the KV
    # cache the model writes; rope_scaling may be a YarnRopeScaling.
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(_unsupported_message(self.architecture))

    @property
    def family(self) -> str:
        """'llama', 'mistral', 'qwen2' or 'qwen3'."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def kv_layout(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> KVLayout:
        """The KV cache this model writes: one K and one V row of num_kv_heads x head_dim per
        layer and token (MLA: one latent row, its first kv_lora_rank values the V)."""
        if self.mla is not None:
            return KVLayout.mla(self.num_layers, latent_dim=self.head_dim, v_head_dim=self.mla.kv_lora_rank,
                                dtype=dtype, device=device)
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, dtype=dtype, device=device)

    def num_parameters(self) -> int:
        """Parameters the model holds (a tied LM head counted once): weights bytes = this x
        the element size, the first term of a decode step's byte floor."""
        if self.mla is not None:
            return self.mla.num_parameters(self)
        d, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * (q + 2 * kv) + q * d
        attn += (q + 2 * kv) * self.attention_bias + d * self.o_proj_bias + 2 * self.head_dim * self.qk_norm
        mlp = 3 * d * self.intermediate_size + (2 * self.intermediate_size + d) * self.mlp_bias
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face config: a checkpoint directory, its config.json, or the parsed
        dict. Old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) RoPE spellings
        are both read. Raises CheckpointError (no file) or UnsupportedModelError."""
        raw = source if isinstance(source, Mapping) else read_config_json(Path(source))
        return _from_dict(raw)


def read_config_json(path: Path) -> dict[str, Any]:
    """config.json of a checkpoint directory (or the file itself), parsed."""
    if not path.exists():
        raise CheckpointError(f"model directory not found: {path}")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(
            f"no config.json in {path}: a Hugging Face checkpoint directory holds config.json "
            "and *.safetensors"
        )
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _unsupported_message(what: str) -> str:
    return (
        f"architecture {what!r} is not supported by the engine's models; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures")
    if not archs:
        raise UnsupportedModelError(
            f"config has no 'architectures' entry (model_type {raw.get('model_type')!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    names = [archs] if isinstance(archs, str) else list(archs)
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise UnsupportedModelError(_unsupported_message(", ".join(map(str, names))))


def _required(raw: Mapping[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ConfigError(f"config.json has no {key!r}, which every Llama-family config must give")
    return raw[key]


def _rope(raw: Mapping[str, Any], max_pos: int) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, llama3 scaling or None) from either spelling of the RoPE settings."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json rope_parameters/rope_scaling must be an object, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError(
            f"per-layer-type RoPE settings ({sorted(params)}) are not supported; one global "
            f"rope_type of {SUPPORTED_ROPE_TYPES} is"
        )
    theta = float(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported; only 1.0 (RoPE on all dims)")
    if rope_type == "default":
        return theta, None
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", max_pos))
            ),
        )
    except KeyError as exc:
        raise ConfigError(f"rope_type 'llama3' needs {exc.args[0]!r} in the config's rope settings") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(
            f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
            f"{scaling.high_freq_factor} <= {scaling.low_freq_factor}"
        )
    return theta, scaling


def _check_no_window(raw: Mapping[str, Any], family: str, num_layers: int, max_pos: int) -> None:
    """Refuse a sliding window that would bind (sliding-window attention comes in step 8)."""
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window", False):
            return  # transformers ignores sliding_window unless use_sliding_window is set
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
        if "sliding_attention" not in types:
            return
    elif family != "mistral":
        return
    if window is not None and int(window) < max_pos:
        raise UnsupportedModelError(
            f"sliding_window {window} is shorter than max_position_embeddings {max_pos}: "
            "sliding-window attention is not supported yet (windows come in step 8); use a "
            "checkpoint without a window (sliding_window null)"
        )


def _from_dict(raw: Mapping[str, Any]) -> ModelConfig:
    architecture = _architecture(raw)
    family = SUPPORTED_ARCHITECTURES[architecture]
    if family == "deepseek_v32":
        return _from_deepseek_v32(raw, architecture)
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; the Llama family's MLP uses 'silu'")
    hidden = int(_required(raw, "hidden_size"))
    num_heads = int(_required(raw, "num_attention_heads"))
    num_layers = int(_required(raw, "num_hidden_layers"))
    max_pos = int(_required(raw, "max_position_embeddings"))
    head_dim = raw.get("head_dim") or hidden // num_heads
    theta, scaling = _rope(raw, max_pos)
    _check_no_window(raw, family, num_layers, max_pos)
    attn_bias = bool(raw.get("attention_bias", False))
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(_required(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_required(raw, "intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and none on o_proj; the others follow attention_bias
        attention_bias={"qwen2": True, "mistral": False}.get(family, attn_bias),
        o_proj_bias=False if family in ("qwen2", "mistral") else attn_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family == "qwen3",
        bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
        eos_token_ids=eos_ids,
    )


def _from_deepseek_v32(raw: Mapping[str, Any], architecture: str) -> ModelConfig:
    """A DeepseekV32ForCausalLM config: the MLA part from mla_config, the cache one latent row
    (num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim)."""
    mla, theta = read_mla_config(raw)
    num_heads = int(_required(raw, "num_attention_heads"))
    eos = raw.get("eos_token_id")
    attn_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(_required(raw, "vocab_size")),
        hidden_size=int(_required(raw, "hidden_size")),
        intermediate_size=int(_required(raw, "intermediate_size")),
        num_layers=len(mla.mlp_layer_types),
        num_heads=num_heads,
        num_kv_heads=1,  # one latent row per token
        head_dim=mla.latent_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=None,  # YaRN, if any, is mla.yarn
        max_position_embeddings=int(_required(raw, "max_position_embeddings")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attn_bias,
        o_proj_bias=attn_bias,
        bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
        eos_token_ids=() if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])),
        mla=mla,
    )
