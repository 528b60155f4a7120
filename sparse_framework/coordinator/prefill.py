"""Dense causal attention over packed prompts, float32 accumulation: the coordinator's
prefill when no faster kernel is asked for, and the plain reference the prefill kernels are
checked against. Queries go in chunks so that memory stays at [q_heads, chunk, prompt_len]
however long the prompt."""

from __future__ import annotations

import math

import torch

from .options import DEFAULT, AttentionOptions
from ..common.softmax import softcap_and_sink_softmax


def causal_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], chunk: int = 256,
    options: AttentionOptions = DEFAULT,
) -> torch.Tensor:
    """Dense causal attention per request over packed rows, float32 accumulation; queries in
    chunks so that memory stays at [q_heads, chunk, prompt_len]. `options`: the layer's
    scale (None: 1/sqrt(D)) and softcap / sinks, as `common.softmax.softcap_and_sink_softmax`
    applies them."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if options.scale is None else options.scale
    offset = 0
    for n in lens:
        ks = k[offset : offset + n].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
        vs = v[offset : offset + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            qs = q[offset + start : offset + stop].float().transpose(0, 1)  # [Hq, c, D]
            scores = (qs @ ks[:, :stop].transpose(1, 2)) * scale
            rows = torch.arange(start, stop, device=q.device).unsqueeze(1)
            future = torch.arange(stop, device=q.device).unsqueeze(0) > rows
            if options.softcap is None and options.sinks is None:
                probs = scores.masked_fill(future, float("-inf")).softmax(-1)
            else:
                sinks = None if options.sinks is None else options.sinks.view(-1, 1).expand(-1, stop - start)
                probs = softcap_and_sink_softmax(scores, future, options.softcap, sinks)
            out[offset + start : offset + stop] = (probs @ vs[:, :stop]).transpose(0, 1).to(q.dtype)
        offset += n
    return out
