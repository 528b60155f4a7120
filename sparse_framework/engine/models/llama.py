"""`DecoderModel`: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 as one pre-norm decoder (Gemma 2/3:
gemma.py, built from the pieces here). Sliding-window layers (Mistral's window, Qwen2's
`use_sliding_window`) need nothing here: which keys a layer sees is the runner's business.

Parameters carry Hugging Face's names (`model.layers.3.self_attn.q_proj.weight`, ...) so a
checkpoint loads by name. The forward takes one step's tokens of every request packed in one
tensor with their positions (no padding, no batch dimension) and leaves attention to the
runner's `attend` callback; everything else (projections, norms, RoPE, MLP) is here.

Two ways to run a layer, the same arithmetic:
  plain torch ops (the default; the CPU path the tests compare with transformers), and
  fused (`use_fused_ops()`, what the engine takes on CUDA): the q/k/v and gate/up projections
  as one matmul each (their weights packed in one tensor per layer, the Hugging Face
  parameters kept as views of it, so loading, counting and tying see the same names and
  bytes), and the residual add + RMSNorm, RoPE and SiLU-times-up as one Triton kernel each
  (kernels/layer_ops.py). A decode layer then issues 8 kernels besides attention instead of
  ~45: at a batch of 8 those small kernels, not bytes, were a quarter of the step's GPU time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

from .attention import Attend, Prefetch, check_packed
from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rotary
from .tensor_parallel import TPShard, local_config

Reduce = Callable[[torch.Tensor], torch.Tensor]


@cache
def _layer_ops():  # noqa: ANN202 - the module
    """kernels/layer_ops (Triton), imported on the fused path only: the package runs without Triton.
    Cached: the fused forward asks for it five times per layer."""
    from ...kernels import layer_ops

    return layer_ops


def _pack(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the linears' rows back to back; each linear's own
    parameters become views into it (no second copy of the weights)."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


class RMSNorm(nn.Module):
    """x / rms(x) x weight over the last dim; the statistic in float32, the product in the
    input's dtype (as the checkpoints were trained)."""

    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """q/k/v projections (+ q/k norm), RoPE, the `attend` callback, the output projection."""

    def __init__(
        self, c: ModelConfig, norm: type[nn.Module] = RMSNorm, reduce: Reduce | None = None, **factory: Any
    ) -> None:
        """`norm`: the q/k norm's class where the config has one (Gemma's differs). `reduce`:
        tensor parallelism's all-reduce of o_proj's partial output (`c` is then the rank's
        local config: its heads only; tensor_parallel.py)."""
        super().__init__()
        self.reduce = reduce
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q_dim, bias=c.attention_bias, **factory)
        self.k_proj = nn.Linear(c.hidden_size, kv_dim, bias=c.attention_bias, **factory)
        self.v_proj = nn.Linear(c.hidden_size, kv_dim, bias=c.attention_bias, **factory)
        self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=c.o_proj_bias, **factory)
        if c.qk_norm:
            self.q_norm = norm(c.head_dim, c.rms_norm_eps, **factory)
            self.k_norm = norm(c.head_dim, c.rms_norm_eps, **factory)
        self.qk_norm = c.qk_norm

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, layer: int
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(layer, q, k, v)
        return self._reduced(self.o_proj(out.reshape(t, self.num_heads * self.head_dim)))

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.reduce is None else self.reduce(x)

    def pack(self) -> None:
        """q/k/v weights (and biases) as one tensor for `forward_fused`."""
        self.qkv_weight, self.qkv_bias = _pack([self.q_proj, self.k_proj, self.v_proj])

    def forward_fused(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, layer: int
    ) -> torch.Tensor:
        t = x.shape[0]
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = nn.functional.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]
        if self.qk_norm:
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, q_dim)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, kv_dim)
        q, k, v = _layer_ops().rope_qkv(q, k, v, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        out = attend(layer, q, k, v)
        return self._reduced(self.o_proj(out.reshape(t, q_dim)))


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, c: ModelConfig, reduce: Reduce | None = None, **factory: Any) -> None:
        """`reduce`: tensor parallelism's all-reduce of down_proj's partial output."""
        super().__init__()
        self.reduce = reduce
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, **factory)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, **factory)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduced(self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)))

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.reduce is None else self.reduce(x)

    def pack(self) -> None:
        """gate/up weights (and biases) as one tensor for `forward_fused`."""
        self.gate_up_weight, self.gate_up_bias = _pack([self.gate_proj, self.up_proj])

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduced(self.down_proj(_layer_ops().silu_mul(nn.functional.linear(x, self.gate_up_weight, self.gate_up_bias))))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then + mlp(norm(.))."""

    def __init__(self, c: ModelConfig, reduce: Reduce | None = None, **factory: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.self_attn = Attention(c, reduce=reduce, **factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.mlp = MLP(c, reduce=reduce, **factory)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, layer: int
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attend, layer)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        attend: Attend, layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (this layer's MLP output, the residual stream before adding it):
        each residual add happens inside the next RMSNorm's kernel."""
        norm = self.input_layernorm
        x, residual = _layer_ops().add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.self_attn.forward_fused(x, cos, sin, attend, layer)
        norm = self.post_attention_layernorm
        x, residual = _layer_ops().add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(x), residual


class Backbone(nn.Module):
    """What Hugging Face calls `model`: embeddings, layers, final norm."""

    def __init__(self, c: ModelConfig, reduce: Reduce | None = None, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(c, reduce=reduce, **factory) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)


class DecoderModel(nn.Module):
    """A Llama-family causal LM over packed tokens.

    Built with `dtype`/`device` (default float32 on the CPU); `device="meta"` builds it without
    memory, for `load_model` to materialise (`to_empty` then `tie_weights`).

    `tp`: this rank's place in a tensor-parallel group (tensor_parallel.py): the layers are
    built from `local_config` (the rank's heads, KV heads and MLP columns) and all-reduce after
    o_proj and down_proj; `config` stays the whole model's. Fill it with `load_model` /
    `random_model` given the same `tp` (they slice the full tensors).
    """

    supports_fused_ops = True  # the engine may call use_fused_ops (engine.py)

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
        tp: TPShard | None = None,
    ) -> None:
        super().__init__()
        if config.is_gemma:
            raise ValueError(f"DecoderModel builds the Llama family, got {config.architecture} (use GemmaDecoderModel)")
        self.config = config
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.local_config = local_config(config, tp.world_size) if self.tp is not None else config
        factory = {"dtype": dtype, "device": device}
        self.model = Backbone(self.local_config, reduce=tp.reduce if self.tp is not None else None, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.fused_ops = False
        self.tie_weights()

    def use_fused_ops(self) -> None:
        """Run layers through the fused projections and Triton kernels (module docstring):
        for CUDA (or the Triton interpreter). Call once the weights are loaded: it packs them."""
        if self.fused_ops:
            return
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        self.fused_ops = True

    def early_query(self, layer: int, stream: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s query computed from an earlier point of the residual stream (`stream`
        [T, hidden], e.g. the input of the layer before): its input norm, q projection, q norm
        and RoPE, as its attention would compute them. A prediction for prefetching that layer's
        selection: from one layer early it finds ~88% of SmolLM2's Quest pages and ~72% of
        those a buffer of the last selection lacks (benchmarks/selection_prediction.py)."""
        block = self.model.layers[layer]
        attn = block.self_attn
        q = attn.q_proj(block.input_layernorm(stream)).view(stream.shape[0], attn.num_heads, attn.head_dim)
        if attn.qk_norm:
            q = attn.q_norm(q)
        return apply_rotary(q, cos, sin)

    def tie_weights(self) -> None:
        """With tie_word_embeddings the LM head is the embedding matrix itself (one tensor)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        logits_rows: torch.Tensor | None = None,
        prefetch: Prefetch | None = None,
    ) -> torch.Tensor:
        """token_ids [T] and positions [T] (int64; each token's position in its own sequence)
        -> logits [R, vocab] float32 for the rows `logits_rows` [R] (typically each sequence's
        last token of the step; None = all T rows). Only those rows go through the final norm
        and the LM head. `prefetch`: the engine's early queries for a decode step (None: none)."""
        check_packed(token_ids, positions)
        h = self.model.embed_tokens(token_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        if self.fused_ops:
            residual: torch.Tensor | None = None
            for i, layer in enumerate(self.model.layers):
                if prefetch is not None and i + 1 in prefetch.layers:
                    early = h if residual is None else h + residual
                    prefetch.predict(i + 1, self.early_query(i + 1, early, cos, sin))
                h, residual = layer.forward_fused(h, residual, cos, sin, attend, i)
            if logits_rows is not None:
                h, residual = h[logits_rows], residual[logits_rows]
            norm = self.model.norm
            return self.lm_head(_layer_ops().add_rms_norm(h, residual, norm.weight, norm.eps)[0]).float()
        for i, layer in enumerate(self.model.layers):
            if prefetch is not None and i + 1 in prefetch.layers:
                prefetch.predict(i + 1, self.early_query(i + 1, h, cos, sin))
            h = layer(h, cos, sin, attend, i)
        if logits_rows is not None:
            h = h[logits_rows]
        return self.lm_head(self.model.norm(h)).float()
