"""The DeepSeek-V3.2 part of `ModelConfig`: MLA, the lightning indexer, the MoE and YaRN.

Read from a Hugging Face `config.json` of `DeepseekV32ForCausalLM` (transformers >= 5.24 writes
it; DeepSeek's own release has the same keys, RoPE under `rope_scaling`). What the engine's
model does not compute is refused by name: a quantized checkpoint (FP8 weights with their
scales: convert to bf16 first), a model without the query LoRA (the indexer reads its
output), an activation other than SiLU, a RoPE type other than default / YaRN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...common.errors import ConfigError
from .errors import UnsupportedModelError

DEFAULT_ROPE_THETA = 10_000.0  # transformers' default when a config names no theta
MLA_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (transformers' `_compute_yarn_parameters`, the DeepSeek-V3 spelling): frequencies
    blended between interpolated (/ factor) and original over a ramp of dimensions set by
    beta_fast / beta_slow rotations at original_max_position_embeddings; cos/sin times
    `attention_factor`; the attention's softmax scale times mscale(factor, mscale_all_dim)^2."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None  # the config's attention_factor, if given
    truncate: bool = True

    @staticmethod
    def _mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim)
        return self._mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What the attention's (qk_nope + qk_rope)^-1/2 is multiplied by (DeepSeek's mscale^2)."""
        if not self.mscale_all_dim:
            return 1.0
        m = self._mscale(self.factor, self.mscale_all_dim)
        return m * m


@dataclass(frozen=True)
class MLAConfig:
    """MLA (query LoRA, latent KV), DSA's indexer and the MoE of a DeepSeek-V3.2 model."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" (a SiLU MLP) or "sparse" (the MoE)
    yarn: YarnRopeScaling | None = None
    num_nextn_predict_layers: int = 0  # MTP layers stored after the last layer: not loaded

    def __post_init__(self) -> None:
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "index_n_heads", "index_head_dim", "index_topk", "moe_intermediate_size", "n_routed_experts",
                     "num_experts_per_tok", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"DeepseekV32 config: {name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"DeepseekV32 config: qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and at "
                              f"most index_head_dim ({self.index_head_dim})")
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ConfigError(f"DeepseekV32 config: n_routed_experts ({self.n_routed_experts}) must split into n_group "
                              f"({self.n_group}) groups of at least 2 (the router ranks a group by its top 2)")
        if not self.topk_group <= self.n_group or self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"DeepseekV32 config: needs topk_group <= n_group and num_experts_per_tok <= "
                              f"n_routed_experts, got {self.topk_group}, {self.n_group}, {self.num_experts_per_tok}, "
                              f"{self.n_routed_experts}")
        bad = sorted(set(self.mlp_layer_types) - {"dense", "sparse"})
        if bad:
            raise ConfigError(f"DeepseekV32 config: mlp_layer_types entries must be 'dense' or 'sparse', got {bad}")

    @property
    def latent_dim(self) -> int:
        """One cached row: the normalised latent c (kv_lora_rank) then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The model's attention scale: qk_head_dim^-1/2, times YaRN's mscale^2."""
        return self.qk_head_dim**-0.5 * (self.yarn.softmax_factor if self.yarn is not None else 1.0)

    def with_experts(self, n_routed_experts: int, n_group: int | None = None, topk_group: int | None = None,
                     num_experts_per_tok: int | None = None) -> MLAConfig:
        """A copy with a shrunk MoE (random-weight benchmarks only: never for a checkpoint)."""
        from dataclasses import replace

        return replace(self, n_routed_experts=n_routed_experts, n_group=n_group or self.n_group,
                       topk_group=topk_group or self.topk_group,
                       num_experts_per_tok=num_experts_per_tok or self.num_experts_per_tok)

    def num_parameters(self, c: Any) -> int:
        """Parameters of the whole model (c: the ModelConfig holding this)."""
        d, h = c.hidden_size, c.num_heads
        attn = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
                + d * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
                + h * self.v_head_dim * d)
        if c.attention_bias:
            attn += self.q_lora_rank + self.latent_dim + d
        indexer = (self.q_lora_rank * self.index_n_heads * self.index_head_dim + d * self.index_head_dim
                   + 2 * self.index_head_dim + d * self.index_n_heads)
        dense = 3 * d * c.intermediate_size
        moe = (self.n_routed_experts * 3 * d * self.moe_intermediate_size
               + 3 * d * self.moe_intermediate_size * self.n_shared_experts + self.n_routed_experts * (d + 1))
        mlps = sum(dense if t == "dense" else moe for t in self.mlp_layer_types)
        head = 0 if c.tie_word_embeddings else c.vocab_size * d
        return c.vocab_size * d + c.num_layers * (attn + indexer + 2 * d) + mlps + d + head


def _int(raw: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ConfigError(f"config.json has no {key!r}, which a DeepseekV32ForCausalLM config must give")
    return int(value)


def _yarn(raw: Mapping[str, Any], max_pos: int) -> tuple[float, YarnRopeScaling | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json rope_parameters/rope_scaling must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in MLA_ROPE_TYPES:
        raise UnsupportedModelError(f"DeepseekV32: rope_type {rope_type!r} is not supported; supported: "
                                    f"{', '.join(MLA_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise UnsupportedModelError("DeepseekV32: partial_rotary_factor is not supported (RoPE is on qk_rope_head_dim)")
    if rope_type == "default":
        return theta, None
    orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if orig is None:
        raise ConfigError("rope_type 'yarn' needs original_max_position_embeddings in the config's rope settings")
    factor = params.get("factor")
    factor = max_pos / int(orig) if factor is None else float(factor)  # transformers' DeepSeek fallback
    return theta, YarnRopeScaling(
        factor=factor, original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor_override=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


def read_mla_config(raw: Mapping[str, Any]) -> tuple[MLAConfig, float]:
    """(MLAConfig, rope theta) of a DeepseekV32ForCausalLM config.json; refuses what the
    engine's model does not compute (module docstring)."""
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?") if isinstance(raw["quantization_config"], Mapping) else "?"
        raise UnsupportedModelError(
            f"DeepseekV32: quantized checkpoints (quantization_config, quant_method {method!r}) are not supported; "
            "convert the weights to bfloat16 first"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"DeepseekV32: hidden_act {act!r} is not supported; only 'silu'")
    if raw.get("q_lora_rank") is None:
        raise UnsupportedModelError("DeepseekV32: q_lora_rank null (no query LoRA) is not supported: the indexer "
                                    "reads the query latent; give q_lora_rank")
    types = raw.get("indexer_types")
    if types and any(t != "full" for t in types):
        raise UnsupportedModelError(f"DeepseekV32: indexer_types {types} (layers reusing another's top-k) are "
                                    "not supported; every layer needs its own indexer")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("DeepseekV32: mlp_bias true is not supported")
    num_layers = _int(raw, "num_hidden_layers")
    max_pos = _int(raw, "max_position_embeddings")
    layer_types = raw.get("mlp_layer_types")
    if layer_types is None:
        dense = min(_int(raw, "first_k_dense_replace", 3), num_layers)
        layer_types = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    if len(layer_types) != num_layers:
        raise ConfigError(f"DeepseekV32: mlp_layer_types has {len(layer_types)} entries for {num_layers} layers")
    theta, yarn = _yarn(raw, max_pos)
    mla = MLAConfig(
        q_lora_rank=_int(raw, "q_lora_rank"), kv_lora_rank=_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=_int(raw, "qk_nope_head_dim"), qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
        v_head_dim=_int(raw, "v_head_dim"), index_n_heads=_int(raw, "index_n_heads", 64),
        index_head_dim=_int(raw, "index_head_dim", 128), index_topk=_int(raw, "index_topk", 2048),
        moe_intermediate_size=_int(raw, "moe_intermediate_size"),
        n_routed_experts=_int(raw, "n_routed_experts", raw.get("num_local_experts")),
        n_shared_experts=_int(raw, "n_shared_experts", 1), num_experts_per_tok=_int(raw, "num_experts_per_tok"),
        n_group=_int(raw, "n_group", 1), topk_group=_int(raw, "topk_group", 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        mlp_layer_types=tuple(layer_types), yarn=yarn,
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )
    if raw.get("topk_method", "noaux_tc") != "noaux_tc" or raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(
            f"DeepseekV32: router topk_method {raw.get('topk_method')!r} / scoring_func {raw.get('scoring_func')!r} "
            "not supported; only 'noaux_tc' with 'sigmoid' (DeepSeek-V3's)"
        )
    return mla, theta
