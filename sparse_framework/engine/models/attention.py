"""The model's one hook into the engine: the `attend` callback, and a plain reference of it.

The model computes q, k, v and hands them to `attend`; who attends to what (the staged prefix
of a prefill chunk, the coordinator's sparse selection, the dense store) is the runner's
business. That keeps the model a plain forward that the runner can also capture in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ...common.errors import ConfigError
from .config import ModelConfig


class Attend(Protocol):
    """`attend(layer, q, k, v) -> out` for one layer of a packed step.

    q [T, Hq, D], k and v [T, Hkv, D]: the step's T tokens of every sequence, packed in the
    order of the forward's token_ids; q and k after RoPE (and the q/k norm), q not scaled.
    Returns [T, Hq, D] in q's dtype: softmax(cap(q k^T x scale)) v over whatever keys each
    token may see (its sequence's cached ones and this step's up to itself; in a sliding
    layer only the last `sliding_window` of them). The per-layer terms are the model
    config's, which the `attend` reads rather than being passed them each call:
    scale = `ModelConfig.attention_scale` (1/sqrt(D) unless query_pre_attn_scalar is set),
    cap(s) = c tanh(s / c) with c = `attn_logit_softcapping` (none when None), the window
    where `layer_type(layer)` is "sliding_attention".
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Prefetch:
    """The engine's prefetch for one decode step (`SparseConfig.prefetch`), handed to a model's
    forward beside `attend`: before layer i runs, for i in `layers`, the model calls
    `predict(i, q)` with an early query of layer i (computed from the hidden state entering
    layer i - 1), so that the store can start copying what layer i will likely select."""

    layers: frozenset[int]
    predict: Callable[[int, torch.Tensor], None]


def check_packed(token_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """A model's forward takes one step's tokens packed in one [T] tensor with their [T]
    positions: anything else (a batch dimension, mismatched shapes) is a ValueError."""
    if token_ids.ndim != 1 or positions.shape != token_ids.shape:
        raise ValueError(
            f"token_ids and positions must both be [T] (packed, no batch dim); got "
            f"{tuple(token_ids.shape)} and {tuple(positions.shape)}"
        )


def dense_causal_attend(
    seq_lens: Sequence[int], compute_dtype: torch.dtype = torch.float32, config: ModelConfig | None = None
) -> Attend:
    """A reference `attend` for whole prompts packed back to back (`seq_lens` tokens each, no
    cache): exact causal GQA attention per sequence in `compute_dtype`, with `config`'s
    scale, soft-cap and sliding windows (None: 1/sqrt(D), neither).

    For tests and CPU checks only: it builds each sequence's L x L score matrix, which the
    engine's prefill never does.
    """
    lens = [int(n) for n in seq_lens]
    if any(n < 1 for n in lens):
        raise ConfigError(f"dense_causal_attend: every sequence length must be >= 1, got {lens}")

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != sum(lens):
            raise ConfigError(
                f"dense_causal_attend: the step has {q.shape[0]} tokens but seq_lens {lens} sum to {sum(lens)}"
            )
        out = torch.empty_like(q)
        terms: dict = {}
        if config is not None:
            window = config.sliding_window if config.layer_type(layer) == "sliding_attention" else None
            terms = {"scale": config.attention_scale, "softcap": config.attn_logit_softcapping, "window": window}
        start = 0
        for n in lens:
            rows = slice(start, start + n)
            out[rows] = causal_attention(q[rows], k[rows], v[rows], compute_dtype, **terms).to(q.dtype)
            start += n
        return out

    return attend


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compute_dtype: torch.dtype = torch.float32, offset: int = 0,
    *, scale: float | None = None, softcap: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """One sequence: q [Lq, Hq, D] at positions offset..offset+Lq-1 attending to k, v
    [Lk, Hkv, D] at positions 0..Lk-1 (causal; offset = Lk - Lq for a suffix of the keys),
    logits scaled by `scale` (None: 1/sqrt(D)), capped by `softcap`, and with a `window`
    only the keys at positions (t - window, t]. Returns [Lq, Hq, D] in `compute_dtype`."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = (t.to(compute_dtype).transpose(0, 1) for t in (q, k, v))  # [H, L, D]
    kf, vf = kf.repeat_interleave(group, dim=0), vf.repeat_interleave(group, dim=0)
    scores = qf @ kf.transpose(1, 2) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [Hq, Lq, Lk]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + offset
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(dim=-1) @ vf).transpose(0, 1)
