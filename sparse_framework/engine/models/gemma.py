"""`GemmaDecoderModel`: Gemma 2 and Gemma 3 (text) over packed tokens.

The same forward protocol as llama.py's `DecoderModel` (token ids and positions packed, the
runner's `attend` callback, logits of the requested rows) and its attention module; what
differs is Gemma's (numerically as transformers computes it):

- RMSNorm scales by (1 + weight), the product taken in float32 and then cast (Llama casts
  first): `GemmaRMSNorm`, also Gemma 3's q/k norm over head_dim;
- the embedding is multiplied by sqrt(hidden_size), that factor cast to the activations' dtype;
- sandwich norms: each block's output is normed before the residual add (post_attention_ /
  post_feedforward_layernorm) besides its input (input_ / pre_feedforward_layernorm);
- the MLP is a GeGLU: down(gelu_tanh(gate(x)) * up(x));
- Gemma 2 caps the LM head's logits: cap * tanh(logits / cap) (`final_logit_softcapping`);
- Gemma 3's sliding layers rotate with their own RoPE base (`local_rope_theta`).

Attention scale (query_pre_attn_scalar^-1/2), logit soft-capping and the sliding window are
not applied here: the runner reads them from the config (`ModelConfig.attention_scale`,
`attn_logit_softcapping`, `layer_types`), as the `Attend` protocol says. The LM head is tied
to the embedding (Gemma checkpoints store no lm_head).

No fused path (`supports_fused_ops` is False): llama.py's Triton kernels fuse Llama's norm
(cast, then weight) and SiLU; Gemma's (1 + weight) norm in float32, its sandwich norms and
GELU would need kernels of their own, so the engine runs Gemma with plain torch ops on every
device (engine.py checks `supports_fused_ops`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...common.layer_map import SLIDING
from .attention import Attend, Prefetch, check_packed
from .config import ModelConfig
from .llama import Attention
from .rope import RotaryEmbedding

FUSED_OPS_UNSUPPORTED = (
    "Gemma's (1 + weight) RMSNorm, sandwich norms and GELU have no fused kernels (kernels/layer_ops.py "
    "fuses the Llama family's); leave EngineConfig.fused_ops unset or False"
)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) x (1 + weight), all in float32, cast back to x's dtype at the end."""

    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    """h + post_norm(attn(norm(h))), then + post_ff_norm(mlp(pre_ff_norm(.)))."""

    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        norm = lambda: GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, **factory)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(c, norm=GemmaRMSNorm, **factory)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(c, **factory)
        self.post_feedforward_layernorm = norm()

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, layer: int
    ) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, attend, layer))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaBackbone(nn.Module):
    """What Hugging Face calls `model`: embeddings, layers, final norm."""

    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(GemmaDecoderLayer(c, **factory) for _ in range(c.num_layers))
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, **factory)


class GemmaDecoderModel(nn.Module):
    """A Gemma 2 / Gemma 3 causal LM over packed tokens (module docstring). Built like
    `DecoderModel`: `dtype`/`device`, `device="meta"` for `load_model`."""

    supports_fused_ops = False
    fused_ops_unsupported = FUSED_OPS_UNSUPPORTED

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        if not config.is_gemma:
            raise ValueError(f"GemmaDecoderModel builds Gemma 2/3, got {config.architecture} (use DecoderModel)")
        self.config = config
        factory = {"dtype": dtype, "device": device}
        self.model = GemmaBackbone(config, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.local_rotary = self.rotary
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(config.head_dim, config.local_rope_theta, config.local_rope_scaling)
        self.fused_ops = False
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tie_word_embeddings (Gemma's default) the LM head is the embedding matrix."""
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
        """As `DecoderModel.forward`: token_ids, positions [T] -> logits [R, vocab] float32
        of the rows `logits_rows` (None: all), soft-capped when the config says so. `prefetch`
        is ignored: the early-query prefetch is implemented for DecoderModel only (as before)."""
        check_packed(token_ids, positions)
        c = self.config
        h = self.model.embed_tokens(token_ids)
        h = h * torch.tensor(c.hidden_size**0.5, dtype=torch.float32).to(h.dtype)
        angles = self.rotary.cos_sin(positions, h.dtype)
        local = angles if self.local_rotary is self.rotary else self.local_rotary.cos_sin(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            cos, sin = local if c.layer_type(i) == SLIDING else angles
            h = layer(h, cos, sin, attend, i)
        if logits_rows is not None:
            h = h[logits_rows]
        logits = self.lm_head(self.model.norm(h)).float()
        cap = c.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)
