"""`SparseCoordinator`'s request lifecycle (split out of coordinator.py): admission
(`on_request_begin`, and `decodes_densely`, which an engine's budget asks before it), the room
check of a decode step (`can_grow`), preemption (`on_request_retract` / `on_request_resume`)
and release (`on_request_end`).

These are the hooks called around requests rather than around forward passes: they reserve and
free a request's state row, its KV in the store and its representations, and decide dense or
sparse once, at admission. The step hooks (`forward_begin` .. `forward_end`) stay in
coordinator.py, which builds one `RequestLifecycle` and delegates its request hooks to it.

`RequestLifecycle` owns the table of requests: the active ones by id (`requests`), the
retracted ids (`retracted`) and the free state rows (`free_slots`). The coordinator's step hooks
read the first two (the coordinator's `requests` / `retracted` properties); only this class
changes them. The store, the algorithm, the sparse policy, the step order and the dense tally
are the coordinator's, passed in: this class calls them, it does not own them.
"""

from __future__ import annotations

import torch

from typing import TYPE_CHECKING

from ..common.batch import Request
from ..common.errors import CapacityError, LimitError

if TYPE_CHECKING:
    from ..algorithms.base import SparseAlgorithm
    from ..kv_store.hierarchical import HierarchicalKVStore
    from .dense_tally import DenseTally
    from .policy import SparsePolicy
    from .step_order import StepOrder


class RequestLifecycle:
    """Begin, retract, resume and end requests; the table of active requests (module docstring).

    store, algorithm, policy, steps, dense_tally: the coordinator's (shared, owned there);
    max_requests: the state rows (0 .. max_requests - 1); max_seq_len: the coordinator's limit
    on a prompt; store_kind: `SparseConfig.store` ("hierarchical" or "resident"), for the
    advice of a refused retract.
    """

    def __init__(
        self,
        *,
        store: HierarchicalKVStore,
        algorithm: SparseAlgorithm,
        policy: SparsePolicy,
        steps: StepOrder,
        dense_tally: DenseTally,
        max_requests: int,
        max_seq_len: int,
        store_kind: str,
    ) -> None:
        self.store = store
        self.algorithm = algorithm
        self.policy = policy
        self.steps = steps
        self.dense_tally = dense_tally
        self.max_seq_len = max_seq_len
        self.store_kind = store_kind
        self.free_slots = list(range(max_requests - 1, -1, -1))  # state rows not in use, next last
        self.requests: dict[str, Request] = {}  # the active requests by id (retracted ones included)
        self.retracted: set[str] = set()  # ids of the active requests retracted (on_request_retract)

    # -- request lifecycle ------------------------------------------------------------------
    def decodes_densely(self, prompt_len: int, sparse: bool | None = None, batch: int | None = None) -> bool:
        """Whether a request decodes densely (every token, every layer): `sparse` when the
        request says (False: dense; True: sparse even for a short prompt — every algorithm
        selects within whatever context there is), else the config's rule (sparse_policy.py:
        prompt < min_sparse_prompt_len, or the cost model for a request joining a batch of
        `batch`, default the active requests + 1). An engine's budget asks it before admission."""
        return self.policy.decodes_densely(prompt_len, sparse, batch, active=len(self.requests))[0]

    def on_request_begin(
        self, request: Request, cached_pages: torch.Tensor | None = None, *, sparse: bool | None = None
    ) -> None:
        """Admit a request: decide dense or sparse (`decodes_densely(prompt_len, sparse)`),
        reserve its KV and a state row. Allowed during a step (the new request is in no batch).

        `cached_pages`: host page ids (the store's pages, owned by a prefix cache) that hold
        the K/V of the prompt's first len(cached_pages) x page_size tokens. The store maps
        them read-only instead of reserving and writing those tokens' host pages
        (`HierarchicalKVStore.admit`); the prefill step still passes the whole prompt's K/V
        (the engine stages the prefix from these pages), from which the device buffer and the
        algorithm's representations are built as for any prompt."""
        if request.rid in self.requests:
            raise ValueError(f"request {request.rid!r} is already active")
        if request.prompt_len >= self.max_seq_len:
            raise LimitError(
                f"request {request.rid!r}: prompt_len {request.prompt_len} leaves no room to decode "
                f"within max_seq_len {self.max_seq_len}; build the coordinator with a larger max_seq_len"
            )
        if not self.free_slots:
            raise LimitError(
                f"request {request.rid!r}: all {len(self.requests)} request rows are in use (max_requests="
                f"{len(self.requests)}); end a request first, or build the coordinator with a larger max_requests"
            )
        request.slot = self.free_slots.pop()
        request.seq_len = 0
        request.dense, why = self.policy.decodes_densely(request.prompt_len, sparse, active=len(self.requests))
        cached = 0 if cached_pages is None else cached_pages.numel() * self.store.page_size
        if cached >= request.prompt_len:
            self.free_slots.append(request.slot)
            request.slot = -1
            raise ValueError(f"request {request.rid!r}: a cached prefix of {cached} tokens leaves nothing of its "
                             f"{request.prompt_len}-token prompt to prefill; cache at most prompt_len - 1 tokens")
        request.cached_len = cached
        try:
            self.store.admit(request, cached_pages) if cached else self.store.admit(request)
        except Exception:
            self.free_slots.append(request.slot)
            request.slot = -1
            raise
        self.requests[request.rid] = request
        self.policy.admitted(request, sparse, why)
        self.dense_tally.admit(request.dense, why)

    def can_grow(self, requests: list[Request]) -> bool:
        """Whether a decode step of these active requests would find room for its new tokens
        (`forward_begin` raises CapacityError where it would not); changes nothing."""
        for r in requests:
            self._active(r)
        return self.store.can_grow(requests)

    def on_request_retract(self, request: Request) -> None:
        """Preempt a request between steps: its device KV is released, its host KV and the
        algorithm's representations are kept; `on_request_resume` brings it back."""
        self._active(request)
        self.steps.check_request("on_request_retract", request)
        if request.rid in self.retracted:
            raise ValueError(f"request {request.rid!r} is already retracted")
        if request.seq_len == 0:
            raise ValueError(f"request {request.rid!r} must be prefilled before it is retracted")
        try:
            self.store.retract(request)
        except CapacityError as exc:
            raise CapacityError(_retract_advice(request, exc, self.store.host_slots, self.store_kind)) from None
        self.retracted.add(request.rid)

    def on_request_resume(self, request: Request) -> None:
        """Resume a retracted request (CapacityError, with nothing changed, if it does not fit)."""
        self._active(request)
        self.steps.check_request("on_request_resume", request)
        if request.rid not in self.retracted:
            raise ValueError(f"request {request.rid!r} is not retracted")
        self.store.resume(request)
        self.retracted.discard(request.rid)

    def _active(self, request: Request) -> None:
        if self.requests.get(request.rid) is not request:
            raise ValueError(f"request {request.rid!r} is not active (call on_request_begin first)")

    def on_request_end(self, request: Request) -> None:
        """Finish a request: free its KV, its representations and its state row. Refused for
        a request of the open step's batch (forward_end or abort_step first). When the
        algorithm's `release` raises, the store's pages and the row are freed before the
        exception goes on: an ended request never keeps KV."""
        if self.requests.get(request.rid) is None:
            raise ValueError(f"request {request.rid!r} is not active")
        self.steps.check_request("on_request_end", request)
        self.requests.pop(request.rid)
        self.steps.forget(request)
        self.retracted.discard(request.rid)
        try:
            self.algorithm.release(request)  # a plugin's hook: if it raises, the KV is freed all the same
        finally:
            try:
                self.store.release(request)
            finally:
                self.free_slots.append(request.slot)
                request.slot = -1
                self.policy.release(request)


def _retract_advice(request: Request, exc: CapacityError, host_slots: int, store: str) -> str:
    """Why a retract found no host room, and the setting that gives it some: a request whose
    K/V is all on the device (resident store, dense requests) is copied to the host pool,
    which the resident store leaves empty unless host_capacity_tokens is given."""
    why = (
        "the resident store keeps no host copy, so its host pool is empty by default"
        if host_slots == 0 and store == "resident"
        else f"the host pool ({host_slots} tokens) is full"
    )
    return (
        f"cannot retract request {request.rid!r} ({request.seq_len} tokens): its K/V is copied to the host "
        f"pool and {why}; build the coordinator with host_capacity_tokens >= the tokens of the requests "
        f"you retract at once (e.g. max_requests x max_seq_len). ({exc})"
    )
