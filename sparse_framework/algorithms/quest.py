"""Quest (Tang et al., ICML 2024): query-aware page selection from per-page key bounds.

Per page of `page_size` keys and per KV head the representation is the element-wise min and
max of the keys. A page's score for a query q is Σ_d max(q_d·min_d, q_d·max_d), an upper
bound of q·k over the page. The paper's evaluation code scores per *query* head after
repeating KV; serving that would duplicate KV, so here each KV head gets one selection and its
group's per-query-head bounds are combined by `gqa_reduce` — "sum" by default: measured on
the needle workload it keeps 0.05 more attention mass than "max" (docs/algorithms.md), although
"max" is the choice that keeps every head's bound an upper bound.

Facts from the original code kept here: pages start at position 0 (the last one may be
partial and is always kept, as its decode kernel does); prefill runs dense; the first
`dense_first_layers` layers (2 in the original) attend densely; the top-k keeps
max(`min_pages`, top_k // page_size) pages (its evaluation code's `max(3, budget // 16)`),
with page size 16 in every published run; the original kernel counts the last page inside
the budget, as `newest_in_top_k` (default) does here (false: the last page on top of it).
Differences: the original keeps no sink or recent pages (set sink_tokens / recent_tokens to 0
to match); its evaluation path (not its kernel) does not force the last page either.

`range_weight` (default 0, the page midpoint; 1 = the paper's bound): per channel max(q_d·m_d, q_d·M_d) = q_d·mid_d + |q_d|·r_d
(midpoint, half-range), so the bound is the page midpoint's q·k plus a spread term that a page
earns for how far its keys swing per channel, whatever q·k is. On a real model (SmolLM2-135M,
whose largest key channels, RoPE's slowest pairs, swing through half their prompt-wide range
inside any page of 16) that term misranks the pages of the upper layers, and weighting it less
(0: the midpoint) keeps the needle (docs/algorithms.md, "Quest and PQCache on a real model"): hence the
default. It needs nothing more
than the min/max pages, so build, append, the prefix cache and chunked prefill (which hand the
whole staged prompt to `build`) are unchanged. Centering the keys, often suggested, is no fix:
subtracting a mean key μ lowers every page's bound of a query head by the same q·μ, so with
`sum`/`mean` the ranking does not move; per-channel scaling (k_d·s, q_d/s) leaves each term.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..common.batch import Batch, Request
from ..common.layout import resolve_impl
from .base import NO_INPUTS, Inputs, ScoringAlgorithm, key_dtype, scoring_kernel


class QuestOptions(BaseModel):
    """Quest's extra-config."""

    model_config = ConfigDict(extra="forbid")

    gqa_reduce: Literal["max", "sum", "mean"] = Field(
        "sum", description="how a GQA group's per-query-head page bounds combine per KV head"
    )
    min_pages: int = Field(3, ge=0, description="pages the top-k keeps at least (the original: 3)")
    dense_first_layers: int = Field(
        2, ge=0, description="the model's first layers attend densely (the original: 2; a per-layer list goes in "
        "dense_layers); on a sliding-window hybrid only the full-attention layers among them (Gemma 3: none)"
    )
    newest_in_top_k: bool = Field(
        True,
        description="the page of the newest token takes one of the top-k places unless the sink or recent window "
        "holds it (the original kernel's count: exactly max(min_pages, top_k // page_size) pages with "
        "sink_tokens = recent_tokens = 0); false: it is kept on top of them",
    )
    range_weight: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="a page scores q·(min+max)/2 + range_weight·Σ_d |q_d|·(max_d − min_d)/2: 0 (default) = the "
        "page midpoint's q·k, which keeps a real model's accuracy; 1 = the paper's upper "
        "bound Σ_d max(q_d·min_d, q_d·max_d); between, the per-channel spread, which every page has in a model's "
        "large outlier key channels, counts less (docs/algorithms.md, SmolLM2 section)",
    )
    impl: Literal["auto", "torch", "triton"] = Field("auto", description="scoring kernel: auto = triton on CUDA")


class Quest(ScoringAlgorithm):
    """Page min/max keys, pooled as [layers, max_requests, kv_heads, max_pages, head_dim]."""

    Config = QuestOptions
    granularity = "page"
    per_kv_head = True

    @classmethod
    def budget_units(cls, config) -> int:  # type: ignore[no-untyped-def]
        return max(config.extra_config.min_pages, config.top_k // config.page_size)

    @classmethod
    def own_dense_layers(cls, config, num_layers: int) -> set[int]:  # type: ignore[no-untyped-def]
        return set(range(min(config.extra_config.dense_first_layers, num_layers)))

    @classmethod
    def representation_bytes_per_token(cls, layout, config) -> float:  # type: ignore[no-untyped-def]
        """Min and max keys of every page: 2 / page_size of a K row."""
        return 2 * layout.row_bytes / config.page_size

    def __init__(self, config, layout, max_requests, max_seq_len) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, layout, max_requests, max_seq_len)
        self.topk_impl = resolve_impl(self.options.impl, layout.device)
        self.newest_forced = not self.options.newest_in_top_k
        p = config.page_size
        self.max_pages = -(-max_seq_len // p)
        shape = (layout.num_layers, max_requests, layout.num_kv_heads, self.max_pages, layout.head_dim)
        self.page_min = torch.empty(shape, dtype=key_dtype(layout), device=layout.device)
        self.page_max = torch.empty(shape, dtype=key_dtype(layout), device=layout.device)
        self.page_scores = scoring_kernel("quest_scores", self.options.impl, layout.device)

    def build(
        self, layer: int, request: Request, keys: torch.Tensor, queries: torch.Tensor | None = None, *, inputs: Inputs = NO_INPUTS
    ) -> None:
        p = self.config.page_size
        n = keys.shape[0]
        n_pages = -(-n // p)
        pad = n_pages * p - n
        k = keys.to(self.page_min.dtype).transpose(0, 1)  # [kv_heads, n, dim]
        lo = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("inf"))
        hi = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("-inf"))
        shape = (k.shape[0], n_pages, p, k.shape[-1])
        self.page_min[layer, request.slot, :, :n_pages] = lo.view(shape).amin(dim=2)
        self.page_max[layer, request.slot, :, :n_pages] = hi.view(shape).amax(dim=2)

    def append(self, layer: int, batch: Batch, keys: torch.Tensor, *, inputs: Inputs = NO_INPUTS) -> None:
        assert batch.seq_lens is not None and batch.slot_ids is not None
        if self.topk_impl == "triton":  # one launch instead of 12 ops (kernels/page_bounds.py)
            from ..kernels.page_bounds import append_page_bounds_triton as append_bounds
        else:
            append_bounds = append_page_bounds
        append_bounds(self.page_min[layer], self.page_max[layer], batch.slot_ids, batch.seq_lens, keys,
                      self.config.page_size)

    def score(
        self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS
    ) -> torch.Tensor:
        assert batch.seq_lens is not None and batch.slot_ids is not None
        n_pages = -(-batch.max_seq_len // self.config.page_size)
        return self.page_scores(queries, self.page_min[layer], self.page_max[layer], batch.slot_ids, n_pages,
                                self.options.gqa_reduce, self.options.range_weight)

    def release(self, request: Request) -> None:
        """Nothing to free: the pooled rows of `request.slot` are overwritten on reuse."""


def append_page_bounds(
    page_min: torch.Tensor, page_max: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
    keys: torch.Tensor, page_size: int,
) -> None:
    """Each row's new key (keys [batch, kv_heads, dim], at position seq_lens - 1 of state
    `rows`) into its page's bounds (page_min/page_max [requests, kv_heads, pages, dim], one
    layer): the key itself on a page's first token, else the element-wise min/max with it.
    The reference of kernels/page_bounds.py (the torch form, used off CUDA)."""
    pos = seq_lens.long() - 1
    page = pos // page_size
    fresh = (pos % page_size == 0).view(-1, 1, 1)  # first token of a new page
    keys = keys.to(page_min.dtype)
    cur_min = page_min[rows, :, page]  # [B, kv_heads, dim]
    cur_max = page_max[rows, :, page]
    page_min[rows, :, page] = torch.where(fresh, keys, torch.minimum(cur_min, keys))
    page_max[rows, :, page] = torch.where(fresh, keys, torch.maximum(cur_max, keys))
