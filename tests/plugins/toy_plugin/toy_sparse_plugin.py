"""A third-party plugin distribution: one algorithm and one attention backend.

`toy_recent`: a token-granular, per-request algorithm that prefers the latest tokens.

Its score of a token is its position (plus `bias`), so the top-k keeps the newest tokens
outside the sink and recent windows. It keeps one small record — tokens seen per layer and
request slot — so that tests can check the coordinator calls build / append / release.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from sparse_framework.algorithms.base import ScoringAlgorithm
from sparse_framework.backends.base import AttentionBackend


class ToyOptions(BaseModel):
    """ToyRecent's extra-config."""

    model_config = ConfigDict(extra="forbid")

    bias: float = Field(0.0, description="added to every score (does not change the order)")


class ToyRecent(ScoringAlgorithm):
    """Scores tokens by position; records tokens seen as int64 [num_layers, max_requests]."""

    Config = ToyOptions
    granularity = "token"
    per_kv_head = False

    def __init__(self, config, layout, max_requests, max_seq_len) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, layout, max_requests, max_seq_len)
        self.tokens_seen = torch.zeros(
            (layout.num_layers, max_requests), dtype=torch.long, device=layout.device
        )

    def build(self, layer, request, keys, queries=None, *, inputs=None) -> None:  # type: ignore[no-untyped-def]
        self.tokens_seen[layer, request.slot] = keys.shape[0]

    def append(self, layer, batch, keys, *, inputs=None) -> None:  # type: ignore[no-untyped-def]
        assert batch.slot_ids is not None
        self.tokens_seen[layer, batch.slot_ids] += 1

    def score(self, layer, queries, batch, *, inputs=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        n = batch.max_seq_len
        pos = torch.arange(n, dtype=torch.float32, device=queries.device) + self.options.bias
        return pos.view(1, 1, n).expand(len(batch), 1, n)

    def release(self, request) -> None:  # type: ignore[no-untyped-def]
        self.tokens_seen[:, request.slot] = 0


class ToySDPABackend(AttentionBackend):
    """`toy_sdpa`: reads the FlashAttention page table one sequence at a time and calls
    torch's scaled_dot_product_attention on the gathered rows (slow, obviously right). Counts
    its calls so that tests can see it ran."""

    metadata_formats = ("flash_attention",)

    def __init__(self) -> None:
        self.calls = 0

    def run(self, q, k_cache, v_cache, metadata, *, scale=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        b, hq, d = q.shape
        n, page = metadata.page_table.shape[0], k_cache.shape[1]
        qs = q.reshape(n, hq * b // n, d)
        out = []
        for i in range(n):
            length = int(metadata.cache_seqlens[i])
            pages = metadata.page_table[i, : -(-length // page)].long()
            k = k_cache[pages].flatten(0, 1)[:length].transpose(0, 1)  # [Hk, length, D]
            v = v_cache[pages].flatten(0, 1)[:length].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs[i].unsqueeze(1), k, v, scale=scale, enable_gqa=True)
            out.append(o.squeeze(1))
        return torch.stack(out).reshape(b, hq, v_cache.shape[-1])
