"""Requests, batches and selections: the data that flows through the coordinator's hooks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .transfer import to_device


@dataclass(eq=False)
class Request:
    """One sequence being decoded.

    `seq_len` counts the tokens whose K/V are in the store (prompt + decoded so far); the
    coordinator advances it. `dense` is decided once, at `on_request_begin`.
    """

    rid: str
    prompt_len: int
    seq_len: int = 0
    dense: bool = False
    slot: int = -1  # row in pooled per-request state; assigned by the coordinator
    cached_len: int = 0  # prompt tokens whose K/V came from a prefix cache (set at on_request_begin)

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"Request {self.rid!r}: prompt_len must be >= 1, got {self.prompt_len}")


@dataclass(eq=False)
class Batch:
    """The requests of one forward pass: all prefill (`is_prefill`) or all decode.

    Prefill tensors are packed along the token dimension in request order (request i
    contributes `requests[i].prompt_len` rows); decode tensors have one row per request.
    `forward_begin` fills in the step's tensors once: `seq_lens` (int32 [batch]: each
    request's length *including* this step's new tokens) and `slot_ids` (int64 [batch]:
    each request's row in pooled state), both on the KV device, and `max_seq_len`.
    """

    requests: list[Request]
    is_prefill: bool = False
    seq_lens: torch.Tensor | None = None
    slot_ids: torch.Tensor | None = None
    max_seq_len: int = 0
    # filled by forward_begin: which rows decode sparsely, as index tensors and sub-batches
    num_sparse: int = 0
    sparse_mask: torch.Tensor | None = None  # bool [batch]
    sparse_rows: torch.Tensor | None = None  # int64 [num_sparse]
    dense_rows: torch.Tensor | None = None  # int64 [batch - num_sparse]
    sparse_batch: Batch | None = None  # the sparse rows as a batch (self when all are sparse)
    dense_batch: Batch | None = None
    composition: tuple = ()  # decode graphs: the batch's shape (size, dense flags), set by forward_begin
    # per-layer scratch the coordinator keeps between attention_begin and attention_end
    pending: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def prepare(self, device: str | torch.device) -> None:
        """Fill the step's tensors from the requests (once per step, in forward_begin): lengths,
        state rows, and the split into sparse and dense rows, with their sub-batches."""
        self.seq_lens = to_device([r.seq_len for r in self.requests], torch.int32, device)
        self.slot_ids = to_device([r.slot for r in self.requests], torch.long, device)
        self.max_seq_len = max(r.seq_len for r in self.requests)
        sparse = [i for i, r in enumerate(self.requests) if not r.dense]
        dense = [i for i, r in enumerate(self.requests) if r.dense]
        self.num_sparse = len(sparse)
        self.sparse_mask = to_device([not r.dense for r in self.requests], torch.bool, device)
        self.sparse_rows = to_device(sparse, torch.long, device)
        self.dense_rows = to_device(dense, torch.long, device)
        self.sparse_batch = self if not dense else self._sub(sparse, device)
        self.dense_batch = self if not sparse else self._sub(dense, device)

    def _sub(self, rows: list[int], device: str | torch.device) -> Batch | None:
        if not rows:
            return None
        sub = Batch([self.requests[i] for i in rows], is_prefill=self.is_prefill)
        sub.prepare(device)
        return sub

    @property
    def query_lens(self) -> list[int]:
        """Query tokens per request in this forward."""
        return [r.prompt_len for r in self.requests] if self.is_prefill else [1] * len(self.requests)


@dataclass
class Selection:
    """Logical token indices to attend to, per request (and per KV head when `per_kv_head`).

    indices: int32 [batch, heads, max_selected], ascending within a row, -1 after `lengths`.
    lengths: int32 [batch, heads]; heads is 1 for per-request selections, else num_kv_heads.
    page_size: the indices come in whole aligned logical pages of this size (the last page of
    a sequence may be partial); 1 for token-granular selections.
    """

    indices: torch.Tensor
    lengths: torch.Tensor
    page_size: int = 1

    @property
    def per_kv_head(self) -> bool:
        return self.indices.shape[1] > 1

    def validate(self, seq_lens: torch.Tensor) -> None:
        """Check the invariants (costs a host sync: for tests and debugging only)."""
        idx, lens = self.indices, self.lengths
        if idx.dtype != torch.int32 or lens.dtype != torch.int32:
            raise ValueError(f"Selection tensors must be int32, got {idx.dtype} and {lens.dtype}")
        pos = torch.arange(idx.shape[-1], device=idx.device)
        valid = pos < lens.unsqueeze(-1)
        if bool((idx[~valid] != -1).any()):
            raise ValueError("Selection: entries after `lengths` must be -1")
        limit = seq_lens.view(-1, 1, 1).to(idx.device)
        if bool(((idx < 0) | (idx >= limit))[valid].any()):
            raise ValueError("Selection: a valid index lies outside [0, seq_len)")
        increasing = idx[..., 1:] > idx[..., :-1]
        if bool((~increasing & valid[..., 1:]).any()):
            raise ValueError("Selection: indices must be strictly ascending within a row")
