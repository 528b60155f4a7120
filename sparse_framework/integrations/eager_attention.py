"""Dense attention with logit soft-capping and attention sinks, as the models' own eager code.

The integration runs prefill (and forwards that bypass a sparse cache) densely over the padded
batch with the mask transformers built. `torch.nn.functional.scaled_dot_product_attention`
cannot express two terms some models add, so for a call that has them the integration uses
this explicit formula instead, which is what transformers runs for those models by default
(their `_attn_implementation` is "eager": sdpa refuses a softcap):

  Gemma 2   softcap  logits s = scale * q.k become softcap * tanh(s / softcap), then the mask,
                     then a softmax in float32 (`modeling_gemma2.eager_attention_forward`).
  GPT-OSS   sinks    one learned logit per query head (the attention module's `sinks`, passed
                     as `s_aux`) is appended to each row's masked logits; the row's maximum is
                     subtracted, the softmax runs in the logits' dtype and the sink's
                     probability is dropped: it has no value (`modeling_gpt_oss.eager_attention_forward`).

Both may be combined (the cap applies to the q.k logits only, never to the sink), and each
branch keeps its model's softmax dtype so that the result equals that model's eager attention
bit for bit in float32 and up to its own rounding in half precision.

Masks: transformers' sdpa mask function (the one the integration registers) gives a bool
mask [B, 1, n, L], True = attend, or None for a plain causal prefill. A masked logit becomes
the dtype's minimum, as the eager models' additive masks make it, so a fully masked row (a
left-padding query) is uniform over its keys (finite), not NaN. A float mask is added as is.
"""

from __future__ import annotations

import torch


def eager_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
    *, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, n, D], key/value [B, Hk, L, D] (Hq a multiple of Hk: GQA), the last n of
    the L keys being the queries' own positions -> [B, n, Hq, D] (transformers' attention-function
    output layout) in value's dtype. sinks: [Hq] logits or None."""
    b, hq, n, _ = query.shape
    groups = hq // key.shape[1]
    k = key.repeat_interleave(groups, 1)
    v = value.repeat_interleave(groups, 1)
    logits = torch.matmul(query, k.transpose(2, 3)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    length = k.shape[2]
    if mask is None:  # causal: query i sits at position length - n + i
        mask = torch.ones(n, length, dtype=torch.bool, device=query.device).tril(length - n)
    mask = mask[..., :length]
    if mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    else:
        logits = logits + mask
    if sinks is None:
        probs = torch.softmax(logits, -1, dtype=torch.float32).to(value.dtype)
    else:
        sink = sinks.reshape(1, hq, 1, 1).to(logits.dtype).expand(b, hq, n, 1)
        combined = torch.cat([logits, sink], -1)
        combined = combined - combined.amax(-1, keepdim=True)
        probs = torch.softmax(combined, -1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()
