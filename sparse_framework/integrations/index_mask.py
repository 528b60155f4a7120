"""The top-k indices of a model's own sparse-attention indexer as an attention mask."""

from __future__ import annotations

import torch


def fold_indices(mask: torch.Tensor | None, indices: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """The model's attention mask [B, 1, S, T] with its indexer's top-k `indices` [B, S, k]
    folded in (as the sdpa model does): only the selected keys stay attended. The model hands
    the indices to attention functions other than sdpa/eager instead of masking itself."""
    if indices is None or indices.shape[-1] == 0:
        return mask
    b, s, _ = indices.shape
    dropped = torch.ones(b, s, kv_len, dtype=torch.bool, device=indices.device)
    dropped = dropped.scatter(-1, indices.long(), False).unsqueeze(1)  # [B, 1, S, T], True = masked
    if mask is None:
        return ~dropped
    if mask.dtype == torch.bool:
        return mask & ~dropped
    return mask.masked_fill(dropped, torch.finfo(mask.dtype).min)
