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
from ...common.layer_map import FULL, SLIDING, LayerMap
from ...common.layout import KVLayout
from .errors import CheckpointError, UnsupportedModelError
from .mla_config import DEFAULT_ROPE_THETA, MLAConfig, read_mla_config

# architecture (config.json "architectures") -> family: the Llama family's pre-norm decoders
# (engine/models/llama.py) and Gemma 2/3's sandwich-norm decoders (engine/models/gemma.py)
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # MLA + DSA's lightning indexer + MoE (engine/models/deepseek_v32.py; fields in mla_config.py)
    "DeepseekV32ForCausalLM": "deepseek_v32",
}
GEMMA_FAMILIES = ("gemma2", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


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
class LinearRopeScaling:
    """Position interpolation (`rope_type: "linear"`, Gemma 3's global layers): every
    frequency divided by `factor`."""

    factor: float


RopeScaling = Llama3RopeScaling | LinearRopeScaling


@dataclass(frozen=True)
class ModelConfig:
    """One decoder: every layer attention (MHA/GQA, RoPE) + a gated MLP, each behind an
    RMSNorm with a residual. The Llama family (pre-norm, SiLU) and Gemma 2/3 (sandwich norms,
    (1 + weight) RMSNorm, GELU-tanh, scaled embeddings: `family` in GEMMA_FAMILIES) differ in
    the flags below.

    Hybrid models: `layer_types` gives each layer "full_attention" or "sliding_attention"
    (empty: every layer full); a sliding layer's token at position t attends to (t -
    sliding_window, t]. Attention scales q·k by `attention_scale`, then caps the logits with
    `attn_logit_softcapping` (Gemma 2) if set; the LM head's logits are capped by
    `final_logit_softcapping`. Sliding layers use `local_rope_theta` / `local_rope_scaling`
    where given (Gemma 3's `rope_local_base_freq`), else the global RoPE."""

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
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # the output projection has one too (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # Llama's mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # "silu" (Llama family) or "gelu_pytorch_tanh" (Gemma)
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" / "sliding_attention"; () = all full
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None  # Gemma: q·k scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None  # sliding layers' RoPE base (Gemma 3); None: rope_theta
    local_rope_scaling: RopeScaling | None = None
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
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {FULL, SLIDING})
        if bad:
            raise UnsupportedModelError(f"layer types {bad} are not supported; supported: {FULL!r}, {SLIDING!r}")
        if SLIDING in self.layer_types and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ConfigError(f"ModelConfig.sliding_window must be a positive int when a layer slides, "
                              f"got {self.sliding_window!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"ModelConfig.{name} must be None or > 0, got {value!r}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported; supported: 'silu', "
                                        "'gelu_pytorch_tanh'")

    @property
    def family(self) -> str:
        """'llama', 'mistral', 'qwen2', 'qwen3', 'gemma2' or 'gemma3'."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def is_gemma(self) -> bool:
        return self.family in GEMMA_FAMILIES

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q·k by: query_pre_attn_scalar^-1/2 (Gemma), else head_dim^-1/2."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_type(self, layer: int) -> str:
        """'full_attention' or 'sliding_attention'."""
        return self.layer_types[layer] if self.layer_types else FULL

    def layer_map(self, max_model_len: int | None = None) -> LayerMap:
        """Which layers go to the store (full attention, or a window that never binds at
        max_model_len, default max_position_embeddings) and which to the sliding-window ring."""
        types = self.layer_types or (FULL,) * self.num_layers
        return LayerMap.from_types(types, self.sliding_window, max_model_len or self.max_position_embeddings)

    def kv_layout(
        self, dtype: torch.dtype, device: str | torch.device = "cpu", max_model_len: int | None = None
    ) -> KVLayout:
        """The KV the store holds: one K and one V row of num_kv_heads x head_dim per token and
        full-attention layer (`layer_map(max_model_len).full`; sliding layers keep a ring of
        their own, `sliding_ring_bytes`). A model whose layers all slide has 0 store layers."""
        layers = self.layer_map(max_model_len)
        full = len(layers.full)
        if self.mla is not None:  # one latent row per token, its first kv_lora_rank values the V
            return KVLayout.mla(full, latent_dim=self.head_dim, v_head_dim=self.mla.kv_lora_rank, dtype=dtype,
                                device=device)
        return KVLayout(full, self.num_kv_heads, self.head_dim, dtype=dtype, device=device,
                        model_layers=tuple(layers.full) if layers.sliding else None)

    def sliding_ring_bytes(self, dtype: torch.dtype, max_model_len: int | None = None, extra_slots: int = 0) -> int:
        """Device bytes one request row of the sliding-window ring takes (every sliding layer's
        `window` slots of K and V, plus `extra_slots`: a prefix cache's page of slack): the
        ring's term of a request's device bytes."""
        layers = self.layer_map(max_model_len)
        if not layers.sliding:
            return 0
        assert layers.window is not None
        return 2 * len(layers.sliding) * (layers.window + extra_slots) * self.num_kv_heads * self.head_dim * dtype.itemsize

    def num_parameters(self) -> int:
        """Parameters the model holds (a tied LM head counted once): weights bytes = this x
        the element size, the first term of a decode step's byte floor."""
        if self.mla is not None:
            return self.mla.num_parameters(self)
        d, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * (q + 2 * kv) + q * d
        attn += (q + 2 * kv) * self.attention_bias + d * self.o_proj_bias + 2 * self.head_dim * self.qk_norm
        mlp = 3 * d * self.intermediate_size + (2 * self.intermediate_size + d) * self.mlp_bias
        per_layer = attn + mlp + (4 if self.is_gemma else 2) * d  # Gemma: pre/post norms of both blocks
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


def _rope(raw: Mapping[str, Any], max_pos: int, family: str) -> tuple[float, RopeScaling | None, float | None, RopeScaling | None]:
    """(theta, scaling, local theta, local scaling) from either spelling of the RoPE settings.
    Per-layer-type settings (transformers 5's Gemma 3: rope_parameters keyed by layer type) and
    Gemma 3's older `rope_local_base_freq` give the sliding layers' own; other families have
    one RoPE (local None)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json rope_parameters/rope_scaling must be an object, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        if family != "gemma3" or not set(params) <= {FULL, SLIDING}:
            raise UnsupportedModelError(
                f"per-layer-type RoPE settings ({sorted(params)}) are supported for Gemma 3 only (keys "
                f"{FULL!r}, {SLIDING!r}); one global rope_type of {SUPPORTED_ROPE_TYPES} is for the others"
            )
        theta, scaling = _one_rope(params.get(FULL) or {}, raw, max_pos)
        local = params.get(SLIDING)
        if not local:
            return theta, scaling, None, None
        return (theta, scaling, *_one_rope(local, {}, max_pos))
    theta, scaling = _one_rope(params, raw, max_pos)
    local = raw.get("rope_local_base_freq") if family == "gemma3" else None
    return theta, scaling, None if local is None else float(local), None


def _one_rope(params: Mapping[str, Any], raw: Mapping[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
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
    if rope_type == "linear":
        if "factor" not in params:
            raise ConfigError("rope_type 'linear' needs 'factor' in the config's rope settings")
        return theta, LinearRopeScaling(float(params["factor"]))
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


def _layer_types(raw: Mapping[str, Any], family: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer types, window) as transformers reads them: `layer_types` where given; else
    Qwen2/3 slide from `max_window_layers` on when `use_sliding_window` is set (and ignore
    the window otherwise), Mistral slides every layer when `sliding_window` is set, Gemma 2
    alternates (sliding first), Gemma 3 has one full layer every `sliding_window_pattern`.
    () means every layer full."""
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return (), None
    if family == "llama" or window is None:
        return (), None
    types = raw.get("layer_types")
    if types is None:
        if family in ("qwen2", "qwen3"):
            first = raw.get("max_window_layers", 28)
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        elif family == "gemma2":
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        elif family == "gemma3":
            pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        else:  # mistral
            types = [SLIDING] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"config.json layer_types must be a list of {num_layers} entries, got {types!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"config.json sliding_window must be a positive int, got {window!r}")
    return tuple(str(t) for t in types), window


def _from_dict(raw: Mapping[str, Any]) -> ModelConfig:
    architecture = _architecture(raw)
    family = SUPPORTED_ARCHITECTURES[architecture]
    if family == "deepseek_v32":
        return _from_deepseek_v32(raw, architecture)
    gemma = family in GEMMA_FAMILIES
    act = raw.get("hidden_activation") or raw.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    act = "silu" if act == "swish" else act
    want = "gelu_pytorch_tanh" if gemma else "silu"
    if act != want:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported for {family}; its MLP uses {want!r}")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention is not supported; the engine's models are causal")
    hidden = int(_required(raw, "hidden_size"))
    num_heads = int(_required(raw, "num_attention_heads"))
    num_layers = int(_required(raw, "num_hidden_layers"))
    max_pos = int(_required(raw, "max_position_embeddings"))
    head_dim = raw.get("head_dim") or hidden // num_heads
    theta, scaling, local_theta, local_scaling = _rope(raw, max_pos, family)
    types, window = _layer_types(raw, family, num_layers)
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
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        # Qwen2 always has q/k/v biases and none on o_proj; the others follow attention_bias
        attention_bias={"qwen2": True, "mistral": False}.get(family, attn_bias),
        o_proj_bias=False if family in ("qwen2", "mistral") else attn_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family in ("qwen3", "gemma3"),
        bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
        eos_token_ids=eos_ids,
        hidden_act=act,
        layer_types=types,
        sliding_window=window if types else None,
        query_pre_attn_scalar=_positive(raw, "query_pre_attn_scalar", family) if gemma else None,
        attn_logit_softcapping=_positive(raw, "attn_logit_softcapping", family) if gemma else None,
        final_logit_softcapping=_positive(raw, "final_logit_softcapping", family) if gemma else None,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


# transformers' config-class defaults, which apply when config.json leaves a key out (null is None)
_GEMMA_DEFAULTS: dict[str, dict[str, float | None]] = {
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None},
}


def _positive(raw: Mapping[str, Any], key: str, family: str) -> float | None:
    value = raw.get(key, _GEMMA_DEFAULTS[family][key])
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"config.json {key} must be a number > 0 or null, got {value!r}")
    return float(value)


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
