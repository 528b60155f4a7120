"""The attention softmax with a logit soft-cap and attention sinks: one definition for every
float32 path that applies them (backends/torch_ref, the coordinator's prefill, the
sliding-window ring, the engine's soft-capped prefill chunks)."""

from __future__ import annotations

import torch


def softcap_and_sink_softmax(
    scores: torch.Tensor, hidden: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Attention probabilities from scaled scores [..., T] (float32), with `hidden` (broadcast
    to scores) masking tokens out:

      softcap  Gemma 2's logit soft-capping: s -> softcap * tanh(s / softcap), after the scale
               and before the softmax (bounds every logit to (-softcap, softcap)).
      sinks    [...] (scores' shape without T): GPT-OSS's learned sink logit, one per query
               head: it joins the softmax denominator, exp(sink - m), but has no value, so the
               probabilities sum to less than one. It is not soft-capped (GPT-OSS has none).

    Rows with no visible token give zeros (their sink takes all the weight)."""
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)
    with_sink = torch.cat([scores, sinks.float().unsqueeze(-1)], dim=-1)
    return torch.softmax(with_sink, dim=-1)[..., :-1].nan_to_num(0.0)  # a sink of -inf and no token
