"""Accuracy metrics of one decode step against dense attention (float64 reference)."""

from __future__ import annotations

import math

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact decode attention of one request in float64.

    q: [q_heads, dim]; k, v: [seq_len, kv_heads, dim]. Returns (output [q_heads, dim],
    probabilities [q_heads, seq_len])."""
    group = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), kk) / math.sqrt(q.shape[-1])
    probs = scores.softmax(-1)
    return torch.einsum("hl,lhd->hd", probs, vv), probs


def selected_mask(indices: torch.Tensor, seq_len: int, num_q_heads: int) -> torch.Tensor:
    """bool [q_heads, seq_len] from one request's selection rows [rows, width] (-1 padded);
    rows is 1 (shared by all heads) or num_kv_heads (each row shared by its group)."""
    rows = indices.shape[0]
    mask = torch.zeros(rows, seq_len + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(1, torch.where(indices >= 0, indices.long(), seq_len), True)
    return mask[:, :seq_len].repeat_interleave(num_q_heads // rows, dim=0)


def attention_recall(probs: torch.Tensor, mask: torch.Tensor) -> float:
    """Attention mass on the selected tokens over the mass of the oracle top-k of the same
    size, averaged over heads (1.0: the selection is as good as the exact top-k)."""
    counts = mask.sum(-1)
    ranked = probs.sort(dim=-1, descending=True).values.cumsum(-1)
    oracle = ranked.gather(1, (counts - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    got = (probs * mask).sum(-1)
    ratio = torch.where(counts > 0, got / oracle.clamp(min=1e-300), torch.zeros_like(got))
    return float(ratio.mean())


def needle_hits(needles: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(selected, total) needle tokens over all heads."""
    if needles.numel() == 0:
        return 0, 0
    return int(mask[:, needles].sum()), mask.shape[0] * needles.numel()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius)."""
    return float((out.double() - ref).norm() / ref.norm().clamp(min=1e-300))
