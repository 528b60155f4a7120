"""Sparse only when it pays: a cost model of one decode step's attention, and the policy the
coordinator asks at admission and at each decode step (config `sparse_policy`).

Why: a sparse layer-step reads far fewer bytes than a dense one, but it also pays a fixed
cost of its own: the scoring and top-k launches, residency, the adaptor and the small
kernels around them. At a short context or a small batch that cost exceeds the bytes it saves
(SGLang measured 0.92x of dense at batch 1-2), so a static prompt-length threshold
(`min_sparse_prompt_len`) either gives that away or leaves long contexts dense.

The model, per request and sparse layer of one decode step, at HBM bandwidth BW:

    dense(c)  = c · P / BW                    P: the K+V (or latent) bytes a token stores per layer
    sparse(c) = (min(c, S) · P + c · r) / BW  S: the algorithm's largest selection (sink + top_k +
                                              recent); r: its representation bytes per token
                                              (Quest: page min/max keys, 2·K row / page_size;
                                              DSA: an indexer key) — what its scoring reads
    o(b)      = o1 + g · (b − 1)              µs per sparse layer-step of b requests that select

A step's selecting requests go sparse when Σ dense(c_i) > Σ sparse(c_i) + o(b); one request in
a batch of b like it when dense(c) > sparse(c) + o(b) / b. Since P > r the saving
dense(c) − sparse(c) never falls as c grows, so the decision is monotone in the context: dense
below a break-even context, sparse above it, and the break-even falls as the batch grows.

The constants default to the GPU's figures (common/hardware.py): its measured HBM ceiling and
the fit of benchmarks/sparse_policy_fit.py over its measurements (docs/engine.md says which, and
what was not measured); the config's policy_* fields override them.

The policy (`SparsePolicy`):
- "cost" (default): below.
- "always": the rule before the cost model — a prompt shorter than min_sparse_prompt_len decodes
  densely, every other one sparsely; `SamplingParams.sparse` overrides.
- "cost": min_sparse_prompt_len is not consulted; `SamplingParams.sparse` still overrides.
  * hierarchical store: decided once, at admission, from the prompt length and the batch the
    request joins (the coordinator's active requests + 1): a dense request stays whole on the
    device, a sparse one goes to the host tier. (The engine's budget sends a request whose
    whole life could not be kept dense to the host tier.)
  * resident store: every token is on the device, so each decode step can attend either way.
    A request is admitted dense only if sparse could never pay within the coordinator's
    limits (max_seq_len at max_requests); else it keeps the algorithm's representations up
    to date and each decode step decides, for all its selecting requests together (the
    overhead is paid once per layer-step by whoever selects): dense until their contexts
    cross the break-even, sparse after. A request that asked for sparse (sparse=True) makes
    the step sparse: its selection runs anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..common.hardware import DEFAULT, GpuFigures, gpu_figures
from ..config import SparseConfig
from .dense_tally import COST_POLICY, REQUESTED_DENSE, SHORT_PROMPT

if TYPE_CHECKING:
    from ..common.batch import Batch, Request
    from ..common.layout import KVLayout

__all__ = ["CostModel", "SparsePolicy"]
REPORTED_BATCHES = (1, 8, 32)  # break-evens shown by `describe`


@dataclass(frozen=True)
class CostModel:
    """One decode step's attention cost per request and sparse layer (module docstring)."""

    kv_bytes_per_token: float  # P
    representation_bytes_per_token: float  # r
    selected_tokens: int  # S
    hbm_tb_s: float = DEFAULT.hbm_tb_s
    overhead_us: float = DEFAULT.policy_overhead_us  # o1
    overhead_growth_us: float = DEFAULT.policy_overhead_growth_us  # g

    @classmethod
    def for_config(cls, config: SparseConfig, layout: KVLayout, figures: GpuFigures | None = None) -> CostModel:
        """The model of this config's algorithm over this layout: the config's policy_*
        constants where set, else those of the layout's GPU (`figures`; default: looked up;
        on the CPU the default GPU's, so that a CPU run decides as that GPU would)."""
        algo = config.algorithm_class
        gpu = figures or gpu_figures(layout.device) or DEFAULT
        return cls(
            kv_bytes_per_token=float(layout.bytes_per_token_per_layer),
            representation_bytes_per_token=float(algo.representation_bytes_per_token(layout, config)),
            selected_tokens=int(algo.max_selected_tokens(config)),
            hbm_tb_s=config.policy_hbm_tb_s or gpu.hbm_tb_s,
            overhead_us=gpu.policy_overhead_us if config.policy_overhead_us is None else config.policy_overhead_us,
            overhead_growth_us=(gpu.policy_overhead_growth_us if config.policy_overhead_growth_us is None
                                else config.policy_overhead_growth_us),
        )

    def _us(self, nbytes: float) -> float:
        return nbytes / (self.hbm_tb_s * 1e6)  # TB/s = 1e6 bytes per µs

    def dense_us(self, context: int) -> float:
        """Reading every K/V row of the context."""
        return self._us(context * self.kv_bytes_per_token)

    def sparse_us(self, context: int) -> float:
        """Reading the selected rows and the representation of the whole context (the
        overhead apart)."""
        return self._us(min(context, self.selected_tokens) * self.kv_bytes_per_token
                        + context * self.representation_bytes_per_token)

    def overhead(self, batch: int) -> float:
        """Fixed µs of one sparse layer-step of `batch` selecting requests."""
        return self.overhead_us + self.overhead_growth_us * (max(batch, 1) - 1)

    def step_saving_us(self, contexts: Sequence[int]) -> float:
        """µs per sparse layer that these requests, selecting together, save over attending
        densely (negative: sparse costs more)."""
        return sum(self.dense_us(c) - self.sparse_us(c) for c in contexts) - self.overhead(len(contexts))

    def step_pays(self, contexts: Sequence[int]) -> bool:
        """Whether these requests should attend sparsely in this step."""
        return bool(contexts) and self.step_saving_us(contexts) > 0

    def sparse_pays(self, context: int, batch: int = 1) -> bool:
        """Whether one request of this context, in a batch of `batch` like it, pays sparse."""
        b = max(batch, 1)
        return b * (self.dense_us(context) - self.sparse_us(context)) > self.overhead(b)

    def break_even(self, batch: int = 1, limit: int = 2**31 - 1) -> int | None:
        """The shortest context at which sparse pays at this batch (None: none up to `limit`).
        Closed form for c >= S: c > (S·P + o(b)/b · BW) / (P − r); below S sparse reads
        every row and the representation besides, so it never pays."""
        b = max(batch, 1)
        gain = self.kv_bytes_per_token - self.representation_bytes_per_token
        if gain <= 0:
            return None
        x = (self.selected_tokens * self.kv_bytes_per_token + self.overhead(b) / b * self.hbm_tb_s * 1e6) / gain
        c = max(self.selected_tokens, math.floor(x))
        while c > 1 and self.sparse_pays(c - 1, b):  # float rounding either way
            c -= 1
        while c <= limit and not self.sparse_pays(c, b):
            c += 1
        return c if c <= limit else None


class SparsePolicy:
    """Dense or sparse, for the coordinator (module docstring): at admission
    (`decodes_densely`, then `admitted` once the store took the request) and, for the resident
    store under "cost", per decode step (`step_dense`). It remembers which requests it made
    dense at admission and which asked for sparse, to count and to decide, until `release`."""

    def __init__(self, config: SparseConfig, layout: KVLayout, *, max_requests: int, max_seq_len: int) -> None:
        self.mode = config.sparse_policy
        self.min_sparse_prompt_len = config.min_sparse_prompt_len
        # the hybrid store's requests are whole on the device until spilled: decided as the
        # resident store's (a step with a spilled row stays sparse: the coordinator asks the store)
        self.resident = config.store in ("resident", "hybrid")
        self.max_requests, self.max_seq_len = max_requests, max_seq_len
        self.model = CostModel.for_config(config, layout)
        self.cost = self.mode == "cost"
        self.per_step = self.cost and self.resident  # decided per decode step (resident store only)
        # resident store: a request whose context could never pay sparse is admitted dense
        self._never_pays = self.per_step and not self.model.sparse_pays(max_seq_len, max_requests)
        self.admitted_dense: set[str] = set()  # rids the cost policy made dense at admission
        self._pinned: set[str] = set()  # rids that asked for sparse (sparse=True)

    def joining(self, active: int) -> int:
        """The decode batch a request admitted beside `active` others joins: what the cost
        policy spreads the overhead over at admission (at most max_requests)."""
        return min(active + 1, self.max_requests)

    @property
    def decides_at_admission(self) -> bool:
        """Whether the cost policy may keep a request dense for its whole life (hierarchical)."""
        return self.cost and not self.resident

    def decodes_densely(
        self, prompt_len: int, sparse: bool | None, batch: int | None = None, *, active: int = 0
    ) -> tuple[bool, str]:
        """(dense, why) for a request about to be admitted into a batch of `batch` requests
        (None: the one it joins beside `active` others, `joining`)."""
        if sparse is not None:
            return not sparse, REQUESTED_DENSE
        if not self.cost:
            return prompt_len < self.min_sparse_prompt_len, SHORT_PROMPT
        if self.resident:
            return self._never_pays, COST_POLICY
        return not self.model.sparse_pays(prompt_len, batch or self.joining(active)), COST_POLICY

    def admitted(self, request: Request, sparse: bool | None, why: str) -> None:
        """Remember an admitted request's mode (`decodes_densely`'s answer, `why` its reason)
        until `release`: to count the policy's dense requests and to keep a step sparse for a
        request that asked for it."""
        if request.dense and why == COST_POLICY:
            self.admitted_dense.add(request.rid)
        if sparse:
            self._pinned.add(request.rid)

    def release(self, request: Request) -> None:
        """Forget an ended request (its id may be used again)."""
        self.admitted_dense.discard(request.rid)
        self._pinned.discard(request.rid)

    def step_dense(self, batch: Batch) -> bool:
        """Whether this decode step's selecting requests attend densely instead (resident store
        under "cost" only; False otherwise). From their lengths on the host: no sync."""
        if not self.per_step or batch.is_prefill or batch.num_sparse == 0:
            return False
        selecting = [r for r in batch.requests if not r.dense]
        if any(r.rid in self._pinned for r in selecting):
            return False
        return not self.model.step_pays([r.seq_len for r in selecting])

    def dense_in_step(self, batch: Batch, step_dense: bool) -> tuple[int, int]:
        """(requests dense for another reason, requests dense because of the cost policy) in a
        prepared decode step: what `DenseTally.decode_step` counts."""
        admitted = sum(r.rid in self.admitted_dense for r in batch.requests) if self.admitted_dense else 0
        return len(batch) - batch.num_sparse - admitted, admitted + (batch.num_sparse if step_dense else 0)

    def describe(self) -> dict[str, Any]:
        """The policy for reports: its mode and, under "cost", the constants and the
        break-even contexts of this config and layout at a few batch sizes."""
        if not self.cost:
            return {"mode": self.mode}
        m = self.model
        return {
            "mode": self.mode,
            "decided": "per decode step" if self.per_step else "at admission",
            "hbm_tb_s": m.hbm_tb_s, "overhead_us": m.overhead_us, "overhead_growth_us": m.overhead_growth_us,
            "break_even_context": {str(b): m.break_even(b) for b in REPORTED_BATCHES},
        }
