"""PQCache (Zhang et al., SIGMOD 2025): product-quantised keys score the tokens.

Per layer, request and KV head the prompt's keys are split into `subvectors` sub-vectors and
each sub-space is clustered by Euclidean k-means into 2**`bits` centroids (random initial
points from the data, `iterations` Lloyd steps; the original runs scikit-learn on the CPU
while prefill runs, with 2 sub-vectors and 6 bits). Every prompt token keeps its codes; decode
keys are encoded against the prefill codebooks as they arrive. At decode a query head's
approximate logit of token t is Σ_m q_m · centroid_m[code_m(t)] (a q·centroid table per
sub-space); as in the original, each query head turns its logits into probabilities
(softmax of logit / √head_dim over the stored tokens — the original's candidates leave out
its sink and recent tokens) and the group's probabilities are summed per KV head
(`gqa_reduce`). The original's k-means iteration count is picked at run time (3-300) by a
timing model of its hardware; here it is fixed by `iterations` (default 20). Sink and
recent tokens come from the framework config (the original keeps 32 sink tokens and half the
budget as recent: set `sink_tokens` / `recent_tokens` to match).

`candidates` "middle" (default, the original): the k-means runs on the keys after the sink
tokens (the sink keys get their nearest centroids' codes, unused: they are always selected),
and each head's softmax is normalised over the tokens between the sink and the recent window
only. "all": both take every token, sink and recent included: a head's probabilities then
depend on how much of its mass the always-selected tokens take.

Reproducibility: each clustering's initial points come from `seed`, the layer, the (KV head,
sub-space) group and the number of keys clustered (`PQCache.generators`), so a prompt gets the
same codebooks whatever was built before, whether it is alone or in a batch, and in any process.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..common.batch import Batch, Request
from ..common.errors import ConfigError
from ..common.layout import resolve_impl
from .base import NO_INPUTS, Inputs, ScoringAlgorithm, group_probabilities, scoring_kernel


class PQCacheOptions(BaseModel):
    """PQCache's extra-config (defaults from the original code)."""

    model_config = ConfigDict(extra="forbid")

    subvectors: int = Field(2, ge=1, description="sub-vectors per head (must divide head_dim)")
    bits: int = Field(6, ge=1, le=8, description="bits per code: 2**bits centroids per sub-space")
    iterations: int = Field(20, ge=1, le=300, description="k-means (Lloyd) iterations")
    seed: int = Field(
        0,
        description="seed of the k-means initial points; each clustering's start depends only on it, the layer, "
        "the KV head, the sub-space and the number of keys clustered (not on the request, its slot or "
        "what was built before), so a prompt gets the same codebooks alone, in a batch, again, or in "
        "another process",
    )
    gqa_reduce: Literal["max", "sum", "mean"] = Field(
        "sum", description="how a GQA group's per-head probabilities combine (the original sums)"
    )
    candidates: Literal["middle", "all"] = Field(
        "middle",
        description="middle (the original): k-means over the keys after the sink, softmax over the tokens between "
        "the sink and the recent window; all: both over every token, sink and recent included",
    )
    impl: Literal["auto", "torch", "triton"] = Field("auto", description="scoring kernel: auto = triton on CUDA")


_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, the same in every process and Python (SplitMix64 steps;
    Python's `hash` is salted per process, so it cannot be used here)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (part & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def kmeans(
    x: torch.Tensor, k: int, iterations: int, gen: torch.Generator | list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched Lloyd k-means. x: float32 [G, N, d] -> (centroids [G, k, d], codes int64 [G, N]).

    Initial centroids are k distinct random points of each group (repeated when N < k), drawn
    from `gen` (one generator for all groups, or one per group); an empty cluster keeps its
    centroid. Codes are the nearest centroids after the last update."""
    g, n, d = x.shape
    gens = gen if isinstance(gen, list) else [gen] * g
    if len(gens) != g:
        raise ValueError(f"kmeans: {len(gens)} generators for {g} groups")
    pick = torch.stack([torch.randperm(n, generator=gi)[: min(k, n)] for gi in gens])
    if n < k:
        pick = pick.repeat(1, -(-k // n))[:, :k]
    centroids = x.gather(1, pick.to(x.device).unsqueeze(-1).expand(-1, -1, d)).clone()
    for _ in range(iterations):
        codes = torch.cdist(x, centroids).argmin(-1)  # [G, N]
        sums = torch.zeros_like(centroids).scatter_add_(1, codes.unsqueeze(-1).expand(-1, -1, d), x)
        counts = torch.zeros(g, k, device=x.device).scatter_add_(1, codes, torch.ones_like(codes, dtype=x.dtype))
        centroids = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp(min=1).unsqueeze(-1), centroids)
    return centroids, torch.cdist(x, centroids).argmin(-1)


class PQCache(ScoringAlgorithm):
    """Token-granular, per KV head. Codebooks [layers, R, Hkv, M, K, d] and codes
    [layers, R, Hkv, max_seq_len, M] (uint8) on the KV device."""

    Config = PQCacheOptions
    granularity = "token"
    per_kv_head = True

    @classmethod
    def representation_bytes_per_token(cls, layout, config) -> float:  # type: ignore[no-untyped-def]
        """One byte per sub-vector code and KV head (the codebooks are per request)."""
        return float(layout.num_kv_heads * config.extra_config.subvectors)

    def __init__(self, config, layout, max_requests, max_seq_len) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, layout, max_requests, max_seq_len)
        self.topk_impl = resolve_impl(self.options.impl, layout.device)
        m = self.options.subvectors
        if layout.head_dim % m:
            raise ConfigError(
                f"`extra.subvectors` = {m} must divide head_dim ({layout.head_dim}) for algorithm 'pqcache'"
            )
        self.k = 2**self.options.bits
        self.sub = layout.head_dim // m
        hk = layout.num_kv_heads
        self.codebooks = torch.zeros(
            (layout.num_layers, max_requests, hk, m, self.k, self.sub), dtype=torch.float32, device=layout.device
        )
        self.codes = torch.zeros(
            (layout.num_layers, max_requests, hk, max_seq_len, m), dtype=torch.uint8, device=layout.device
        )
        self.token_logits = scoring_kernel("pqcache_scores", self.options.impl, layout.device)

    def _split(self, keys: torch.Tensor) -> torch.Tensor:
        """[N, Hkv, D] -> [Hkv * M, N, d]."""
        n, hk, _ = keys.shape
        return keys.float().view(n, hk, self.options.subvectors, self.sub).permute(1, 2, 0, 3).reshape(-1, n, self.sub)

    def build(
        self, layer: int, request: Request, keys: torch.Tensor, queries: torch.Tensor | None = None, *, inputs: Inputs = NO_INPUTS
    ) -> None:
        n, hk, _ = keys.shape
        m = self.options.subvectors
        # "middle": the keys after the sink (all of them when nothing follows the sink)
        skip = self.config.sink_tokens if self.options.candidates == "middle" and n > self.config.sink_tokens else 0
        x = self._split(keys)  # [Hkv * M, n, d]
        centroids, codes = kmeans(x[:, skip:], self.k, self.options.iterations, self.generators(layer, n - skip))
        if skip:  # the sink keys' nearest centroids
            codes = torch.cat([torch.cdist(x[:, :skip], centroids).argmin(-1), codes], dim=1)
        self.codebooks[layer, request.slot] = centroids.view(hk, m, self.k, self.sub)
        self.codes[layer, request.slot, :, :n] = codes.view(hk, m, n).transpose(1, 2).to(torch.uint8)

    def generators(self, layer: int, n: int) -> list[torch.Generator]:
        """The k-means start of each (KV head, sub-space) group of `layer` clustering n keys:
        seeded from `seed`, the layer, the group and n only. Not from the request (its slot,
        id or a counter): a prompt must get the same codebooks alone, in a batch or again.
        Not from a checksum of the keys either: a prompt's keys computed in a batch differ
        from those computed alone in their last bits, and a checksum would turn that into
        different starts (different prompts of one length share the start *indices*, drawn
        from different keys)."""
        groups = self.layout.num_kv_heads * self.options.subvectors
        return [torch.Generator().manual_seed(mix_seed(self.options.seed, layer, j, n)) for j in range(groups)]

    def encode(self, layer: int, slot_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Nearest-centroid codes of keys [B, Hkv, D] against each request's codebooks ->
        uint8 [B, Hkv, M]."""
        b, hk, _ = keys.shape
        m = self.options.subvectors
        x = keys.float().view(b, hk, m, 1, self.sub)
        books = self.codebooks[layer, slot_ids]  # [B, Hkv, M, K, d]
        return (x - books).square().sum(-1).argmin(-1).to(torch.uint8)

    def append(self, layer: int, batch: Batch, keys: torch.Tensor, *, inputs: Inputs = NO_INPUTS) -> None:
        assert batch.seq_lens is not None and batch.slot_ids is not None
        pos = batch.seq_lens.long() - 1
        heads = torch.arange(self.layout.num_kv_heads, device=keys.device)
        codes = self.encode(layer, batch.slot_ids, keys)
        self.codes[layer, batch.slot_ids.view(-1, 1), heads.view(1, -1), pos.view(-1, 1)] = codes

    def score(
        self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS
    ) -> torch.Tensor:
        assert batch.slot_ids is not None and batch.seq_lens is not None
        n = batch.max_seq_len
        approx = self.token_logits(queries, self.codebooks[layer], self.codes[layer], batch.slot_ids, n, "none")  # [B, Hkv, G, n]
        if self.options.candidates == "all":
            return group_probabilities(approx, batch.seq_lens, self.layout.head_dim, self.options.gqa_reduce)
        return group_probabilities(approx, batch.seq_lens, self.layout.head_dim, self.options.gqa_reduce,
                                   first=self.config.sink_tokens, last=self.config.recent_tokens)

    def release(self, request: Request) -> None:
        """Nothing to free: the pooled rows of `request.slot` are overwritten on reuse."""
