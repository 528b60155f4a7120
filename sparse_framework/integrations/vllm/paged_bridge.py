"""The rebuild bridge: any scoring algorithm inside vLLM, unchanged, without a twin of its own.

A twin (`paged.PagedAlgorithm`) keeps an algorithm's representation per physical KV block, which
needs the algorithm rewritten for vLLM's paged cache. The bridge needs nothing of the algorithm
but the framework's contract: it keeps every K row per physical slot (`paged_keys.BlockKeys`,
as DSA over the keys does) and, at each decode step and layer, gathers each request's keys
through its block table and hands them to the unchanged algorithm's `build`, then asks its
`score` for the step's queries, exactly as the engine would at a prefill of the same tokens
followed by one decode step. A selection inside vLLM is whole blocks, so token scores are pooled
to blocks by their max (a block is as good as its best token); a page-granular algorithm's
pages are the blocks (page_size = block size, checked by `load_vllm_config`). The framework's
top-k then keeps the best blocks beside the sink, recent and newest ones, as every twin does.

Exact for the algorithm over the same tokens, rebuilt every step: the newest token is not
given to `build` (the contract: `select` runs before that step's `append`) and is always
selected. Where an algorithm's representation depends on when a token arrived, this differs
from the engine after the first decode step: PQCache trains its codebooks on the prompt there
and encodes later keys against them, here it re-runs its k-means over every token so far at
every step (its k-means starts are seeded as the engine's layer 0, whatever the layer).

Cost: a copy of the K cache (as `PagedKeyMass`), every key of the context read per layer and
step, the representation rebuilt from scratch each time (PQCache: k-means per request, layer
and step), a host read of the lengths and a Python loop over the requests. It is for running an
algorithm inside vLLM unchanged and measuring its accuracy there, not for speed; and it cannot
be captured in a CUDA graph (`graph_safe` False: vLLM runs PIECEWISE, attention eager).

Refused (`PagedBridge.refuses`): algorithms that are not `ScoringAlgorithm`s (their `select` is
their own, with nothing to pool), those that need the prompt's queries (SnapKV: vLLM's prefill
does not keep them), and, at the first K write when the instance says so, those that need
model tensors beside K (`prefill_inputs` / `decode_inputs`: DeepSeek's indexer keys). Those
need a twin of their own. A `ScoringAlgorithm`'s own `select` override is not called: the
bridge scores and takes the framework's top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from ...algorithms.base import ScoringAlgorithm
from ...common.batch import Batch, Request, Selection
from ...common.errors import ConfigError
from ...common.layout import KVLayout
from ...config import SparseConfig
from .paged_base import CONFIG_ENV
from .paged_keys import BlockKeys, PerSlotKeys


class PagedBridge(PerSlotKeys):
    """The config's algorithm itself over the keys kept per physical slot (module docstring).
    One instance per layer (as every twin), holding one instance of the framework algorithm,
    made on the first K write and re-made when a step brings more requests or longer contexts
    than it was sized for."""

    graph_safe = False

    def __init__(self, config: SparseConfig) -> None:
        super().__init__(config)
        self.algorithm: ScoringAlgorithm | None = None
        self._sized: tuple[Any, ...] = ()  # (Hkv, D, dtype, device, rows, tokens) of `algorithm`

    @classmethod
    def refuses(cls, config: SparseConfig) -> str | None:
        """Why the bridge cannot run this algorithm (naming the field), or None. That an
        algorithm needs model inputs (DSA's indexer) is known from an instance only: the first
        K write raises it (`_instance`)."""
        algo = config.algorithm_class
        if not issubclass(algo, ScoringAlgorithm):
            return (f"{algo.__name__} is not a ScoringAlgorithm and needs a `PagedAlgorithm` twin: its `select` is "
                    "its own, and the bridge pools an algorithm's `score`")
        if algo.needs_prefill_queries:
            return (f"{algo.__name__} declares `needs_prefill_queries`: it builds from the prompt's queries, which "
                    "vLLM's prefill does not keep; it needs a `PagedAlgorithm` twin")
        return None

    @classmethod
    def blocks_of_budget(cls, config: SparseConfig) -> int:
        """A page-granular algorithm's own budget (its pages are the blocks: Quest's
        `min_pages`), else top_k // block."""
        algo = config.algorithm_class
        return algo.budget_units(config) if algo.granularity == "page" else config.top_k // config.page_size

    def new_state(
        self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> BlockKeys:
        """The per-slot keys, and a first instance of the algorithm: a config it cannot serve
        here (model inputs, a head_dim its options do not divide) fails now, at the first K
        write (a prefill), rather than at the first decode."""
        state = super().new_state(num_blocks, num_kv_heads, head_dim, dtype, device)
        self._instance(state, 1, self.unit)
        return state

    def _instance(self, state: BlockKeys, rows: int, tokens: int) -> ScoringAlgorithm:
        """The algorithm, sized for at least `rows` requests of `tokens` tokens (grown to powers
        of two, so that it is re-made a few times, not every step)."""
        hk, d = state.keys.shape[1], state.keys.shape[-1]
        kind = (hk, d, state.keys.dtype, state.keys.device)
        if self.algorithm is None or self._sized[:4] != kind or rows > self._sized[4] or tokens > self._sized[5]:
            old_rows, old_tokens = self._sized[4:] if self._sized[:4] == kind else (0, 0)
            rows, tokens = max(rows, old_rows), max(1 << (tokens - 1).bit_length(), old_tokens)
            layout = KVLayout(num_layers=1, num_kv_heads=hk, head_dim=d, dtype=state.keys.dtype,
                              device=state.keys.device)
            algo = self.config.algorithm_class(self.config, layout, rows, tokens)  # as the coordinator makes it
            assert isinstance(algo, ScoringAlgorithm)  # refuses() checked the class
            if algo.prefill_inputs or algo.decode_inputs:
                needs = ", ".join(sorted({**algo.prefill_inputs, **algo.decode_inputs}))
                raise ConfigError(
                    f"{CONFIG_ENV}: `algorithm` = {self.config.algorithm!r} with these options needs the model's "
                    f"own tensors beside K ({needs}: `prefill_inputs` / `decode_inputs`), which vLLM's attention "
                    "layer does not pass; it needs a `PagedAlgorithm` twin (docs/vllm.md)"
                )
            self.algorithm, self._sized = algo, (*kind, rows, tokens)
            # the algorithm's own rule for the newest token's unit (`ScoringAlgorithm.top_units`)
            self.newest_forced = algo.newest_forced or self.config.recent_tokens >= 1
        assert self.algorithm is not None
        return self.algorithm

    def score(
        self, state: BlockKeys, q: torch.Tensor, block_table: torch.Tensor, n_blocks: int, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """float32 [B, Hkv or 1, n_blocks]: the algorithm's scores of each logical block, its
        representation built afresh from each request's first seq_len - 1 keys (the newest is
        selected anyway). Token scores are pooled to blocks by their max over the tokens the
        algorithm saw (the rest count as -inf); page scores are the blocks' own. Entries of
        blocks past a request's length are any value. Reads seq_lens on the host (eager only)."""
        lens = [int(n) for n in seq_lens.tolist()]
        algo = self._instance(state, len(lens), max(lens))
        requests = []
        for i, n in enumerate(lens):
            request = Request(rid=f"bridge-{i}", prompt_len=max(n - 1, 1), seq_len=max(n - 1, 0), slot=i)
            if n > 1:  # a request with only its newest token has nothing to build
                algo.build(0, request, state.logical(block_table[i], n - 1))
            request.seq_len = n  # the decode step's length, as forward_begin advances it
            requests.append(request)
        batch = Batch(requests)
        batch.prepare(q.device)
        try:
            scores = algo.score(0, q, batch).float()
        finally:
            for request in requests:
                algo.release(request)
        b, h = scores.shape[:2]
        if algo.unit > 1:  # pages = blocks
            return _fit(scores, n_blocks)
        width = n_blocks * self.unit
        tokens = _fit(scores, width)
        seen = (seq_lens.to(tokens.device, torch.long) - 1).view(-1, 1, 1)
        tokens = tokens.masked_fill(torch.arange(width, device=tokens.device) >= seen, float("-inf"))
        return tokens.view(b, h, n_blocks, self.unit).amax(-1)

    def select_static(
        self, state: Any, q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, min_len: int
    ) -> Selection:
        raise RuntimeError(
            "sparse_framework's rebuild bridge (paged_bridge.PagedBridge) was asked for the static, full-CUDA-graph "
            "selection: it reads the lengths on the host and loops over the requests, which a graph cannot "
            "capture. Its backend declares no full-graph support (graph_safe False); run vLLM with cudagraph_mode "
            "PIECEWISE or enforce_eager=True"
        )


def _fit(scores: torch.Tensor, width: int) -> torch.Tensor:
    """scores [B, H, n] cut or padded (-inf) to [B, H, width]."""
    n = scores.shape[-1]
    if n >= width:
        return scores[..., :width]
    return torch.nn.functional.pad(scores, (0, width - n), value=float("-inf"))
