"""The algorithm contract, and a scoring base that does the top-k for an algorithm.

Two levels, as in kvpress: implement `SparseAlgorithm` directly for full control of `select`,
or subclass `ScoringAlgorithm` and write only `score` — the base adds the sink and recent
units, takes the top `top_k // unit` of the rest, expands pages to tokens and pads.

Algorithms own their representations (pooled by `request.slot`) and never touch the store's
slot maps or a backend's metadata.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict

from ..common.batch import Batch, Request, Selection
from ..common.layout import KVLayout, resolve_impl
from ..kernels.reference.scores import reduce_groups

if TYPE_CHECKING:
    from ..common.settings import SparseSettings

Inputs = Mapping[str, torch.Tensor]
"""Extra per-token tensors from the model, by name (e.g. DeepSeek's indexer queries and keys):
the engine passes them to `attention_begin(..., inputs=...)`; rows follow q's rows."""

NO_INPUTS: Inputs = MappingProxyType({})


class NoOptions(BaseModel):
    """Extra-config of an algorithm without options."""

    model_config = ConfigDict(extra="forbid")


class SparseAlgorithm(ABC):
    """Picks, per decode step and layer, the logical tokens each request attends to.

    Class attributes are declarations the framework reads before building anything:
      Config       pydantic model of the extra-config (extra='forbid', paper defaults).
      granularity  "page" (selects whole pages of `config.page_size`) or "token".
      per_kv_head  True: one selection per KV head; False: one per request.
      needs_prefill_queries  True when `build` needs the prompt's queries (SnapKV-like).

    `self.prefill_inputs` / `self.decode_inputs` (set in __init__, may depend on the options)
    name the extra tensors the model must pass to attention_begin at prefill / decode, each
    with its shape after the token dimension; the coordinator checks them and hands them to
    build / append / select as `inputs`, sliced to the rows each call sees.
    """

    Config: ClassVar[type[BaseModel]] = NoOptions
    granularity: ClassVar[Literal["page", "token"]] = "token"
    per_kv_head: ClassVar[bool] = False
    needs_prefill_queries: ClassVar[bool] = False

    def __init__(
        self, config: SparseSettings, layout: KVLayout, max_requests: int, max_seq_len: int
    ) -> None:
        self.config = config
        self.options = config.extra_config
        self.layout = layout
        self.max_requests = max_requests
        self.max_seq_len = max_seq_len
        self.prefill_inputs: dict[str, tuple[int, ...]] = {}
        self.decode_inputs: dict[str, tuple[int, ...]] = {}

    @property
    def prefill_query_rows(self) -> int | None:
        """How many of the prompt's last queries `build` reads: 0 when it reads none, None for
        all of them. An engine that prefills in chunks keeps only these (SnapKV: its window)."""
        return None if self.needs_prefill_queries else 0

    @property
    def unit(self) -> int:
        """Tokens per selection unit: page_size for page-granular algorithms, else 1."""
        return self.config.page_size if self.granularity == "page" else 1

    @classmethod
    def check_config(cls, config: SparseSettings) -> None:
        """Reject, at config time, settings this algorithm cannot serve (raise ValueError)."""
        unit = config.page_size if cls.granularity == "page" else 1
        if config.top_k < unit:
            raise ValueError(
                f"top_k ({config.top_k}) must be >= page_size ({unit}) for the page-granular "
                f"algorithm {config.algorithm!r}: the budget is top_k // page_size pages"
            )
        need = cls.max_selected_tokens(config)
        if config.device_buffer_tokens < need:
            raise ValueError(
                f"device_buffer_tokens ({config.device_buffer_tokens}) is smaller than the "
                f"largest selection ({need} tokens = sink + budget + recent, rounded to whole "
                f"units); raise device_buffer_tokens to at least {need}"
            )

    @classmethod
    def budget_units(cls, config: SparseSettings) -> int:
        """Units the top-k keeps besides the forced ones (sink, recent, newest): top_k // unit."""
        return config.top_k // (config.page_size if cls.granularity == "page" else 1)

    @classmethod
    def own_dense_layers(cls, config: SparseSettings, num_layers: int) -> set[int]:
        """Model layers (< num_layers) the algorithm's recipe keeps dense, on top of
        `config.dense_layers`; a sliding-window hybrid maps them to its store layers
        (`config.dense_layer_set`), so a rule like "the first two layers" means the network's."""
        return set()

    @classmethod
    def representation_bytes_per_token(cls, layout: KVLayout, config: SparseSettings) -> float:
        """Device bytes of representation per token and layer (for capacity planning)."""
        return 0.0

    @classmethod
    def max_selected_tokens(cls, config: SparseSettings) -> int:
        """Upper bound of a selection's length: the static width of `Selection.indices`."""
        unit = config.page_size if cls.granularity == "page" else 1
        return _max_units(config, unit, cls.budget_units(config)) * unit

    @abstractmethod
    def build(
        self,
        layer: int,
        request: Request,
        keys: torch.Tensor,
        queries: torch.Tensor | None = None,
        *,
        inputs: Inputs = NO_INPUTS,
    ) -> None:
        """Make the representation of a prompt at prefill.

        keys: [prompt_len, num_kv_heads, head_dim]; queries: [prompt_len, num_q_heads,
        head_dim] (given when `needs_prefill_queries`), both in the KV dtype; inputs: the
        prompt's rows of each `prefill_inputs` tensor.
        """

    @abstractmethod
    def append(self, layer: int, batch: Batch, keys: torch.Tensor, *, inputs: Inputs = NO_INPUTS) -> None:
        """Update the representations with this decode step's keys: [batch, kv_heads, dim],
        row i at position `batch.seq_lens[i] - 1` of request i (inputs: one row each)."""

    @abstractmethod
    def select(self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS) -> Selection:
        """Choose tokens for this step. queries: [batch, num_q_heads, head_dim]; inputs:
        this step's `decode_inputs`, one row per request. Runs before `append` of the same
        step, so the newest token is not in the representation yet (it is always selected).

        Returns a Selection with 1 (per request) or num_kv_heads (per KV head) rows per
        request, at most `max_selected_tokens` wide (ScoringAlgorithm: min(that, the batch's
        longest sequence rounded up to a unit)). It must contain the sink tokens, the
        recent window and the newest token (the store pins them in the device buffer, and
        the buffer is sized for selections that include them); ScoringAlgorithm does this.
        """

    @abstractmethod
    def release(self, request: Request) -> None:
        """Forget a finished request's representations."""


def key_dtype(layout: KVLayout) -> torch.dtype:
    """dtype of representations made from raw keys (Quest's page bounds, exact top-k keys):
    the layout's, except bfloat16 for fp8 layouts, on which min/max and dots are not defined.
    Keys arrive in whatever dtype the model computed them; they are cast to this."""
    return torch.bfloat16 if layout.is_fp8 else layout.dtype


def _max_units(config: SparseSettings, unit: int, budget_units: int) -> int:
    sink_units = -(-config.sink_tokens // unit)
    recent_units = -(-config.recent_tokens // unit) + 1  # a misaligned window spans one more
    return sink_units + budget_units + recent_units


class ScoringAlgorithm(SparseAlgorithm):
    """Base for algorithms that score units (pages or tokens) and keep the best.

    Subclasses implement `score`; this class forces the sink and recent units in, takes the
    top `top_k // unit` of the remaining units, and turns units into sorted token indices.
    `topk_impl` picks that selection's implementation (see `topk_selection`); algorithms with
    an `impl` option set it to their resolved choice.
    """

    topk_impl: str = "torch"
    newest_forced: bool = True
    """False: the unit holding the newest token takes one of the `budget_units` places unless
    the sink or recent window already holds it (the exact top-k count of DSA's and Quest's
    originals); True: it is kept on top of them. Set from an algorithm's option."""
    newest_scored: bool = False
    """True (with newest_forced False): the newest token is an ordinary candidate ranked by its
    own score, and may be left out, as a model's own indexer does (DSA's `score_newest`); the
    algorithm must then score it (its key is not appended before `select`)."""

    @abstractmethod
    def score(self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS) -> torch.Tensor:
        """float32 [batch, heads, n_units] (heads = num_kv_heads if per_kv_head else 1),
        where n_units covers the longest sequence of the batch. Entries of units at or
        beyond a request's length are ignored (any value)."""

    def select(self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS) -> Selection:
        assert batch.seq_lens is not None, "forward_begin fills seq_lens"
        scores = self.score(layer, queries, batch, inputs=inputs).float()
        return self.top_units(scores, batch)

    def top_units(
        self,
        scores: torch.Tensor,
        batch: Batch,
        first_pass: torch.Tensor | None = None,
        tail_start: torch.Tensor | None = None,
        extra_width_units: int = 0,
    ) -> Selection:
        """`topk_selection` of this algorithm's scores with its config (first_pass: see
        kernels/topk.py; only with topk_impl "triton"; tail_start: a per-request forced
        tail, whose longest length beyond the recent window the width grows by,
        `extra_width_units`)."""
        assert batch.seq_lens is not None, "forward_begin fills seq_lens"
        return topk_selection(
            scores,
            batch.seq_lens,
            unit=self.unit,
            budget_units=self.budget_units(self.config),
            sink_tokens=self.config.sink_tokens,
            recent_tokens=self.config.recent_tokens,
            width_units=_max_units(self.config, self.unit, self.budget_units(self.config)) + extra_width_units,
            impl=self.topk_impl,
            first_pass=first_pass,
            # a recent window holds the newest token: both rules are the same, keep the default's
            newest_forced=self.newest_forced or self.config.recent_tokens >= 1,
            newest_scored=self.newest_scored,
            tail_start=tail_start,
        )


def topk_selection(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    unit: int,
    budget_units: int,
    sink_tokens: int,
    recent_tokens: int,
    width_units: int,
    impl: str = "torch",
    first_pass: torch.Tensor | None = None,
    newest_forced: bool = True,
    tail_start: torch.Tensor | None = None,
    newest_scored: bool = False,
) -> Selection:
    """Turn unit scores into a Selection without a host sync.

    scores: float32 [B, H, n_units]; seq_lens: int [B]. A unit is kept if it holds a sink
    token, a token of the recent window or the newest token, or is among the `budget_units`
    best-scoring remaining valid units. Output width is min(width_units, n_units) * unit.
    newest_forced False: the newest token's unit is forced only if the sink or the recent
    window holds it; otherwise it is eligible and ranked above every score, so it takes the
    first of the `budget_units` places (which must then be >= 1); with `newest_scored` too, it
    is an ordinary eligible unit ranked by its own score (it may be left out: a model's own
    indexer's rule; the Triton kernels do not implement it, so it runs this torch code on any
    device). tail_start: int [B], every
    unit holding a token at or after it is forced too (a per-request recent window).
    impl: "torch" (this code), "triton" (`kernels.topk.topk_selection_triton`: the same
    result in a few kernels instead of ~15 torch ops and a sort; both keep the lowest ids
    among units tied at the threshold) or "auto" (Triton on CUDA). Triton
    is imported only when chosen. first_pass: the Triton path's pass-1 histograms, filled by
    the producer of the scores (`topk_selection_triton`).
    """
    if not newest_forced and budget_units < 1:
        raise ValueError("topk_selection: newest_forced=False needs budget_units >= 1 (the newest unit takes a place)")
    newest_scored = newest_scored and not newest_forced
    if resolve_impl(impl, scores.device) == "triton" and not newest_scored:
        from ..kernels.topk import topk_selection_triton
        return topk_selection_triton(
            scores, seq_lens, unit=unit, budget_units=budget_units, sink_tokens=sink_tokens,
            recent_tokens=recent_tokens, width_units=width_units, first_pass=first_pass,
            newest_forced=newest_forced, tail_start=tail_start,
        )
    if first_pass is not None:
        raise ValueError("topk_selection: first_pass needs impl 'triton'")
    b, h, n_units = scores.shape
    device = scores.device
    lens = seq_lens.to(device=device, dtype=torch.long).view(b, 1, 1)
    ids = torch.arange(n_units, device=device).view(1, 1, n_units)
    valid = ids * unit < lens
    last_unit = (lens - 1) // unit
    # the first unit holding a token of the recent window (none when it is empty: with a
    # partial last unit, (lens - 0) // unit would be that unit) or of the forced tail
    recent_start = (lens - recent_tokens).clamp(min=0) // unit if recent_tokens > 0 else lens // unit + 1
    if tail_start is not None:
        tail = tail_start.to(device=device, dtype=torch.long).clamp(min=0).view(b, 1, 1)
        recent_start = torch.minimum(recent_start, torch.where(tail < lens, tail // unit, lens // unit + 1))
    newest = ids == last_unit
    forced = valid & ((ids * unit < sink_tokens) | (ids >= recent_start) | (newest if newest_forced else False))
    forced, valid = forced.expand(b, h, n_units), valid.expand(b, h, n_units)
    eligible = valid & ~forced
    # a valid unit always competes, whatever its score (NaN ranks last, ±inf at the ends);
    # ineligible ones rank below every eligible one and are never kept
    big = torch.finfo(torch.float32).max
    ranked = scores.float().nan_to_num(nan=-big, posinf=big, neginf=-big).masked_fill(~eligible, float("-inf"))
    if not newest_forced and not newest_scored:  # above every score (each is at most big after nan_to_num)
        ranked = ranked.masked_fill(eligible & newest, float("inf"))
    k = min(budget_units, n_units)
    keep = forced.clone()
    if k > 0:
        # ties at the threshold keep the lowest ids (a stable sort; torch.topk's choice among
        # ties depends on the row's length), as the Triton path does: the selection does not
        # change when the scored width grows past the longest request (decode graphs)
        top_ids = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        keep |= torch.zeros_like(keep).scatter_(-1, top_ids, eligible.gather(-1, top_ids))
    width = min(width_units, n_units)
    # kept unit ids, ascending, compacted by a prefix sum (O(n), no sort of every unit); the
    # rest go to a spill column that is cut off; padding is n_units
    slot = torch.where(keep, keep.cumsum(-1) - 1, width).clamp(max=width)
    units = torch.full((b, h, width + 1), n_units, dtype=torch.long, device=device)
    units.scatter_(-1, slot, ids.expand(b, h, n_units))
    units = units[..., :width]
    offsets = torch.arange(unit, device=device)
    tokens = (units.unsqueeze(-1) * unit + offsets).flatten(-2)  # [B, H, width*unit]
    ok = (units.unsqueeze(-1) < n_units).expand(-1, -1, -1, unit).flatten(-2) & (tokens < lens)
    indices = torch.where(ok, tokens, -1).to(torch.int32)
    return Selection(indices=indices, lengths=ok.sum(-1, dtype=torch.int32), page_size=unit)



def group_probabilities(
    logits: torch.Tensor, seq_lens: torch.Tensor, head_dim: int, how: str, *, first: int = 0, last: int = 1
) -> torch.Tensor:
    """Each query head's softmax of its logits / √head_dim over the candidate tokens, then the
    group's probabilities combined by `how` — the attention mass a GQA group puts on each
    token (PQCache, exact top-k). Candidates: positions in [first, seq_len - last); the
    default is every stored token (the newest, seq_len - 1, is added after select); PQCache's
    original leaves out its sink and recent tokens. Other positions get 0.
    logits [B, Hkv, G, n] -> [B, Hkv, n]."""
    b, hk, g, n = logits.shape
    pos = torch.arange(n, device=logits.device).view(1, -1)
    stored = (pos >= first) & (pos < (seq_lens.long().to(logits.device) - max(last, 1)).view(-1, 1))
    scaled = (logits / math.sqrt(head_dim)).masked_fill(~stored[:, None, None], float("-inf"))
    probs = scaled.softmax(-1).nan_to_num(0.0)
    return reduce_groups(probs.view(b, hk * g, n), hk, how)



def scoring_kernel(name: str, impl: str, device: str | torch.device) -> Callable[..., torch.Tensor]:
    """The scoring function `name` for `impl` ("auto": Triton on CUDA): the Triton kernel
    `kernels.scoring.<name>_triton` or the torch reference `reference.scores.<name>_torch`.
    Triton is imported only when chosen, so the algorithms run where it is not installed."""
    if resolve_impl(impl, device) == "triton":
        from ..kernels import scoring
        return getattr(scoring, f"{name}_triton")
    from ..kernels.reference import scores as reference_scores
    return getattr(reference_scores, f"{name}_torch")
