"""Counting the decoding that fell back to dense attention, and why.

A request whose prompt is shorter than `min_sparse_prompt_len`, a layer in the config's
`dense_layers` or among the algorithm's own dense layers (Quest's first two), and a
transformers forward that does not go through a sparse cache (`use_cache=False`) all attend to
every token. Their outputs are exact, so nothing else shows it: a run that never went sparse
reads like a sparse run at full budget. `DenseTally` counts them so that `stats()`, the CLI
tables and the evaluation can say how much of a run was sparse.

Units: a *request* is counted once, when admitted; a *layer-step* is one request in one layer
of one decode step (a batch of 4 requests through 32 layers for 10 steps is 1280 layer-steps).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# why a request or a layer-step attended densely
SHORT_PROMPT = "short prompt"  # prompt_len < min_sparse_prompt_len: the whole request is dense
DENSE_LAYER = "dense layer"  # config.dense_layers or the algorithm's own (e.g. Quest's first layers)
DENSE_REQUEST = "dense request"  # a sparse layer, but the request is dense (short prompt)
REQUESTED_DENSE = "requested dense (sparse=False)"  # the request asked (SamplingParams.sparse)
# sparse_policy "cost": a request admitted dense, or a (resident) decode step attended densely,
# because the cost model found dense cheaper there
COST_POLICY = "cost policy"
NO_CACHE = "no cache (use_cache=False)"  # transformers: a forward without a SparseCache


@dataclass
class DenseTally:
    """Requests and decode layer-steps, with the dense ones by reason."""

    requests: int = 0
    dense_requests: Counter[str] = field(default_factory=Counter)
    layer_steps: int = 0
    dense_layer_steps: Counter[str] = field(default_factory=Counter)

    def admit(self, dense: bool, reason: str = SHORT_PROMPT) -> None:
        """One request admitted (dense or not)."""
        self.requests += 1
        if dense:
            self.dense_requests[reason] += 1

    def decode_step(
        self, num_requests: int, num_dense_requests: int, num_layers: int, num_dense_layers: int, cost_policy: int = 0
    ) -> None:
        """One decode step of a batch: every request through every layer. A dense layer counts
        as "dense layer" for every request; a dense request's other layers as "dense request";
        `cost_policy` requests (not among `num_dense_requests`) that attended densely because of
        the cost policy, in this step or since admission, count their other layers as "cost
        policy" (so that its share is visible apart from the static rule's)."""
        self.layer_steps += num_requests * num_layers
        if num_dense_layers:
            self.dense_layer_steps[DENSE_LAYER] += num_requests * num_dense_layers
        if num_dense_requests and num_layers > num_dense_layers:
            self.dense_layer_steps[DENSE_REQUEST] += num_dense_requests * (num_layers - num_dense_layers)
        if cost_policy and num_layers > num_dense_layers:
            self.dense_layer_steps[COST_POLICY] += cost_policy * (num_layers - num_dense_layers)

    def dense_steps(self, reason: str, layer_steps: int) -> None:
        """Layer-steps that ran densely outside the coordinator (e.g. transformers' sdpa)."""
        self.layer_steps += layer_steps
        self.dense_layer_steps[reason] += layer_steps

    @property
    def sparse_layer_steps(self) -> int:
        return self.layer_steps - sum(self.dense_layer_steps.values())

    @property
    def sparse_fraction(self) -> float | None:
        """Share of the decode layer-steps that attended sparsely (None before any)."""
        return self.sparse_layer_steps / self.layer_steps if self.layer_steps else None

    def __add__(self, other: DenseTally) -> DenseTally:
        return DenseTally(
            self.requests + other.requests, self.dense_requests + other.dense_requests,
            self.layer_steps + other.layer_steps, self.dense_layer_steps + other.dense_layer_steps,
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able counts (reasons with a zero count left out)."""
        return {
            "requests": self.requests,
            "dense_requests": {k: v for k, v in sorted(self.dense_requests.items()) if v},
            "layer_steps": self.layer_steps,
            "sparse_layer_steps": self.sparse_layer_steps,
            "dense_layer_steps": {k: v for k, v in sorted(self.dense_layer_steps.items()) if v},
        }

    def summary(self) -> str:
        """One line for a person, e.g. "2 of 3 requests dense (short prompt: 2); 40 of 96
        decode layer-steps dense (dense layer: 24, dense request: 16)"."""
        parts = []
        dense_requests = sum(self.dense_requests.values())
        parts.append(f"{dense_requests} of {self.requests} requests dense" + _reasons(self.dense_requests))
        dense_steps = sum(self.dense_layer_steps.values())
        parts.append(f"{dense_steps} of {self.layer_steps} decode layer-steps dense" + _reasons(self.dense_layer_steps))
        return "; ".join(parts)


def _reasons(counts: Counter[str]) -> str:
    shown = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if v)
    return f" ({shown})" if shown else ""
