"""What a prompt of token ids may hold: integers of any kind, nothing else."""

from __future__ import annotations

import operator
from typing import Any

import torch


def token_ids(prompt: Any) -> tuple[list[int], str | None]:
    """A prompt's token ids as Python ints, and an error for what is not a token id. Integers
    of any kind pass (Python, numpy, integer tensors and arrays); booleans and floats do not,
    even integral ones (True or 3.0 taken as a token is a caller's mistake that would pass
    silently, and 3.7 would become 3)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype == torch.bool or prompt.dtype.is_floating_point or prompt.dtype.is_complex:
            return [], f"prompt token ids must be integers, got a tensor of {prompt.dtype}"
        prompt = prompt.reshape(-1).tolist()
    elif type(prompt).__module__ == "numpy" and hasattr(prompt, "dtype"):
        if prompt.dtype.kind not in "iu":
            return [], f"prompt token ids must be integers, got an array of {prompt.dtype}"
        prompt = prompt.reshape(-1).tolist()
    ids, bad = [], []
    for t in prompt:
        try:
            if isinstance(t, bool) or type(t).__name__ == "bool_":
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            bad.append(t)
    if bad:
        return ids, f"prompt token ids must be integers, got {bad[:5]!r}"
    return ids, None
