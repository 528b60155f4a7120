"""`DeepseekV32Model`: DeepSeek-V3.2 (MLA + DSA's lightning indexer + MoE) over packed tokens.

Parameters carry Hugging Face's names (transformers' `DeepseekV32ForCausalLM` as
`save_pretrained` writes it, experts one module each: `model.layers.3.mlp.experts.7.up_proj.weight`)
so a checkpoint loads by name. The forward mirrors the model's arithmetic (transformers 5.24's
modeling_deepseek_v32.py) and hands attention to the runner through an `MLAAttend` (mla.py):

  attention  q_resid = q_a_layernorm(q_a_proj(x)); q = q_b_proj(q_resid) split into nope and
             rope parts per head; [c, k_rot] = kv_a_proj_with_mqa(x), c through
             kv_a_layernorm; q_rot and k_rot rotated by the interleaved RoPE (pairs of
             adjacent dims, output de-interleaved, as the model's); YaRN if configured
             (cos/sin × attention_factor, softmax scale × mscale^2).
  indexer    queries wq_b(q_resid) per index head, key LayerNorm(wk(x)), both RoPE'd on their
             first qk_rope dims with the half-split rotation; head weights
             weights_proj(x) in float32 × Hi^-1/2 × Di^-1/2.
  MoE        sigmoid router (float32) + e_score_correction_bias for the choice only, the top
             topk_group groups by their two best experts, the top num_experts_per_tok experts
             among them, weights = the sigmoid scores (normalised if norm_topk_prob) ×
             routed_scaling_factor; plus the shared experts. The first layers (mlp_layer_types
             "dense") have a plain SiLU MLP.

The router's weight and bias and the indexer's weights_proj stay float32 in a bf16 model, as
transformers keeps them. No fused kernels: `use_fused_ops` is a no-op for this model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .attention import Prefetch, check_packed
from .config import ModelConfig
from .llama import RMSNorm
from .mla import MLAAttend, MLAInputs
from .mla_config import MLAConfig, YarnRopeScaling


def mla_inverse_frequencies(rope_dim: int, theta: float, yarn: YarnRopeScaling | None) -> torch.Tensor:
    """[rope_dim / 2] float32: theta^(-2i / rope_dim), blended by YaRN if given (transformers'
    `_compute_yarn_parameters`)."""
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.int64).to(torch.float32) / rope_dim)
    extrapolated = 1.0 / pos_freqs
    if yarn is None:
        return extrapolated
    interpolated = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (fast dims), 0: interpolate (slow dims)
    return interpolated * (1 - keep) + extrapolated * keep


class MLARotary:
    """cos/sin [T, rope] (cat(freqs, freqs) × YaRN's attention factor, cast to the model's
    dtype) for a step's positions; not a module, so the float32 frequencies are never cast."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnRopeScaling | None) -> None:
        self.inv_freq = mla_inverse_frequencies(rope_dim, theta, yarn)
        self.factor = 1.0 if yarn is None else yarn.attention_factor
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on_device.get(positions.device)
        if inv is None:
            inv = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.factor).to(dtype), (angles.sin() * self.factor).to(dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, R]: adjacent pairs (x0, x1), (x2, x3)... rotated, output [evens', odds']
    (the model's `apply_rotary_pos_emb_interleave`)."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, R]: the two halves are the coordinates of R/2 rotating pairs (the indexer's)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Indexer(nn.Module):
    """DSA's lightning indexer: its own query/key projections and key norm, per-head weights."""

    def __init__(self, c: ModelConfig, m: MLAConfig, **factory: Any) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = m.index_n_heads, m.index_head_dim, m.qk_rope_head_dim
        self.wq_b = nn.Linear(m.q_lora_rank, m.index_n_heads * m.index_head_dim, bias=False, **factory)
        self.wk = nn.Linear(c.hidden_size, m.index_head_dim, bias=False, **factory)
        self.k_norm = nn.LayerNorm(m.index_head_dim, eps=1e-6, **factory)
        fp32 = {**factory, "dtype": torch.float32}  # kept float32 in a bf16 model, as transformers does
        self.weights_proj = nn.Linear(c.hidden_size, m.index_n_heads, bias=False, **fp32)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(queries [T, Hi, Di], weights [T, Hi] float32 with both scales, keys [T, Di])."""
        t, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        q = torch.cat([rope_half(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([rope_half(k[..., :r], cos, sin), k[..., r:]], dim=-1).squeeze(1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        return q, w * (self.n_heads**-0.5 * self.head_dim**-0.5), k


class MLAttention(nn.Module):
    """Multi-head latent attention with the indexer; attention itself is the runner's."""

    def __init__(self, c: ModelConfig, m: MLAConfig, **factory: Any) -> None:
        super().__init__()
        self.m, self.num_heads = m, c.num_heads
        bias = c.attention_bias
        self.q_a_proj = nn.Linear(c.hidden_size, m.q_lora_rank, bias=bias, **factory)
        self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6, **factory)  # the model's default eps
        self.q_b_proj = nn.Linear(m.q_lora_rank, c.num_heads * m.qk_head_dim, bias=False, **factory)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, m.latent_dim, bias=bias, **factory)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6, **factory)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, c.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False,
                                   **factory)
        self.o_proj = nn.Linear(c.num_heads * m.v_head_dim, c.hidden_size, bias=bias, **factory)
        self.indexer = Indexer(c, m, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: MLAAttend, layer: int
                ) -> torch.Tensor:
        m, t, h = self.m, x.shape[0], self.num_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(t, h, m.qk_head_dim)
        kv_pass, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(kv_pass), rope_interleaved(k_rot[:, None], cos, sin)[:, 0]], dim=-1)
        index_q, index_w, index_k = self.indexer(x, q_resid, cos, sin)
        inputs = MLAInputs(
            q_nope=q[..., : m.qk_nope_head_dim], q_rot=rope_interleaved(q[..., m.qk_nope_head_dim :], cos, sin),
            latent=latent, kv_b=self.kv_b_proj.weight.view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank),
            scale=m.softmax_scale, index_q=index_q, index_weights=index_w, index_k=index_k, index_topk=m.index_topk,
        )
        out = attend(layer, inputs)  # [T, H, v_head_dim]
        return self.o_proj(out.reshape(t, h * m.v_head_dim).to(x.dtype))


class MLP(nn.Module):
    """SiLU-gated MLP (a dense layer's, an expert's, the shared experts')."""

    def __init__(self, hidden: int, intermediate: int, **factory: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, **factory)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """DeepSeek-V3's router (module docstring); weight and correction bias in float32."""

    def __init__(self, c: ModelConfig, m: MLAConfig, device: Any = None, **_: Any) -> None:
        super().__init__()
        self.m = m
        self.weight = nn.Parameter(torch.empty(m.n_routed_experts, c.hidden_size, dtype=torch.float32, device=device))
        # a Parameter (not a buffer) so the loader fills it by name like every other tensor
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(m.n_routed_experts, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k] float32, expert indices [T, k])."""
        m = self.m
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, m.n_group, m.n_routed_experts // m.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(m.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        allowed = group_mask[:, :, None].expand_as(grouped).reshape(-1, m.n_routed_experts)
        chosen = choice.masked_fill(~allowed, float("-inf")).topk(m.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, chosen


class MoE(nn.Module):
    """Routed experts + shared experts over packed tokens.

    Two dispatches of the same sum. Gathered (eager): each expert some token chose runs on
    those tokens only; which experts were chosen is read on the host (a synchronisation), and
    `experts_hit` keeps how many (bench.py's decode floor reads it). Dense (while a CUDA graph
    is being captured, or `dense_dispatch`): every expert runs on every token and its output is
    weighted by the token's routing weight, 0 where the token did not choose it, so nothing
    leaves the device and the step can be captured; a non-chosen expert adds an exact 0. It
    computes E / num_experts_per_tok times the routed FLOPs: meant for decode steps (a few
    rows, memory-bound, every expert's weights read anyway once the batch hits them all)."""

    def __init__(self, c: ModelConfig, m: MLAConfig, **factory: Any) -> None:
        super().__init__()
        self.gate = Router(c, m, **factory)
        self.experts = nn.ModuleList(MLP(c.hidden_size, m.moe_intermediate_size, **factory)
                                     for _ in range(m.n_routed_experts))
        self.shared_experts = MLP(c.hidden_size, m.moe_intermediate_size * m.n_shared_experts, **factory)
        self.dense_dispatch = False
        self.experts_hit: int | None = None  # distinct experts of the last gathered dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.dense_dispatch or capturing:
            self.experts_hit = None
            return self._dense(x, weights, chosen) + self.shared_experts(x)
        out = torch.zeros_like(x)
        hit = chosen.unique().tolist()  # only the experts some token chose
        for e in hit:
            token, slot = torch.where(chosen == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        self.experts_hit = len(hit)
        return out + self.shared_experts(x)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, weighted by [T, E] routing weights (0: not chosen),
        summed in ascending expert order as the gathered dispatch does."""
        dense = torch.zeros((x.shape[0], len(self.experts)), dtype=weights.dtype, device=x.device)
        dense.scatter_(1, chosen, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += (expert(x) * dense[:, e, None]).to(out.dtype)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, m: MLAConfig, layer: int, **factory: Any) -> None:
        super().__init__()
        self.self_attn = MLAttention(c, m, **factory)
        sparse = m.mlp_layer_types[layer] == "sparse"
        self.mlp = MoE(c, m, **factory) if sparse else MLP(c.hidden_size, c.intermediate_size, **factory)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: MLAAttend, layer: int
                ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attend, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig, m: MLAConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(c, m, i, **factory) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)


class DeepseekV32Model(nn.Module):
    """A DeepSeek-V3.2 causal LM over packed tokens: forward(token_ids, positions, attend,
    logits_rows) like DecoderModel's, with `attend` an MLAAttend (mla.py)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if config.mla is None:
            raise ValueError(f"DeepseekV32Model needs an MLA config; {config.architecture} has none")
        self.config = config
        factory = {"dtype": dtype, "device": device}
        self.model = Backbone(config, config.mla, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.rotary = MLARotary(config.mla.qk_rope_head_dim, config.rope_theta, config.mla.yarn)
        self.fused_ops = False
        self.tie_weights()

    def use_fused_ops(self) -> None:
        """No fused path for this model yet: plain torch ops on every device."""

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: MLAAttend,
                logits_rows: torch.Tensor | None = None, prefetch: Prefetch | None = None) -> torch.Tensor:
        """token_ids [T], positions [T] -> logits [R, vocab] float32 of `logits_rows` (None: all).
        `prefetch` is ignored: the early-query prefetch is implemented for DecoderModel only."""
        check_packed(token_ids, positions)
        h = self.model.embed_tokens(token_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, attend, i)
        if logits_rows is not None:
            h = h[logits_rows]
        return self.lm_head(self.model.norm(h)).float()
