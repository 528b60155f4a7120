"""Shared test constants and helpers."""

import torch

from sparse_framework import Batch, Request


# A Quest config small enough for CPU tests: 8 pages of 4 tokens per selection, plus one sink
# page and the recent window, in a 256-token device buffer; every prompt and layer decodes sparsely.
SMALL_QUEST = {
    "algorithm": "quest",
    "top_k": 32,
    "page_size": 4,
    "sink_tokens": 4,
    "recent_tokens": 8,
    "min_sparse_prompt_len": 0,
    "device_buffer_tokens": 256,
    "extra": {"dense_first_layers": 0},
}


def batch_of(reqs: list[Request]) -> Batch:
    """The step tensors forward_begin would fill in, for algorithm tests without a coordinator."""
    b = Batch(reqs)
    b.seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
    b.slot_ids = torch.tensor([r.slot for r in reqs], dtype=torch.int64)
    b.max_seq_len = max(r.seq_len for r in reqs)
    return b
