"""`RunnerBudget`: the scheduler's `MemoryBudget` over the runner's coordinator and staging.

The scheduler plans with reservations (engine/scheduler.py states the contract); the store
reserves as it goes (host pages at admission for the prompt, then a page when a request's
length crosses a page boundary, in `forward_begin`). This module bridges the two:

- host room for a request's whole life (prompt + max_tokens) is *promised* at admission: a
  request is admitted only when the free host pages, less what earlier requests were promised
  and do not hold yet, cover it; so growth never needs host room a preemption cannot free;
- `can_admit` / `can_resume` reserve for real (the coordinator's all-or-nothing admission
  and resumption, the staging span) and the following `admit` / `resume` keep it: the
  scheduler always calls them right after a True;
- growth of a plan's decode rows is checked together (`coordinator.can_grow` over every row
  granted so far in this plan), since the rows share the pools' free pages, and an admission
  or resumption later in the plan is refused if it would take the room they were granted;
- a store without a host pool (the resident store's default) promises nothing: its device
  pool holds every request whole, so nothing needs preempting unless it is sized smaller
  (device_capacity_tokens below max_num_seqs x max_model_len); then a decoding request that
  must be preempted has nowhere to keep its K/V: `retract` says so and the scheduler ends that
  request alone with finish_reason "error" (the engine logs a warning for such a
  configuration when it is built; give host_capacity_tokens to preempt instead);
- a request's mode, dense or sparse, is the coordinator's rule (`decodes_densely`) with the
  request's own `SamplingParams.sparse` (None: the config's rule), asked before admission since
  it decides whether the request keeps its K/V on the host and what it needs on the device;
  under the cost policy of a hierarchical store (sparse_policy.py) a request whose whole life
  would not fit the device pools if kept dense goes to the host tier (`_sparse`), so that the
  policy never makes a request that `never_fits` let in unservable;
- a sequence preempted while still prefilling has no K/V in the store yet: its coordinator
  request and staging are dropped (its host promise stays) and it is admitted again, from
  token 0, when it resumes.

With a prefix cache (engine/prefix_cache.py) an admission (and the re-admission of a
sequence preempted while prefilling) first looks its prompt up and locks the cached prefix;
a sequence that keeps its K/V on the host maps those pages as its own and needs host pages
for the rest of its life only (one that does not — dense mode, the resident store — copies
the prefix into its staging, drops the lock at once, and is still promised its whole life: if
preempted it copies its whole context out; when its own lock is what keeps that room from
being freed by eviction, it is admitted without the cache). A hybrid model's cached window
is written into its ring row once the runner admitted it (`on_admitted`). The sequence starts
its prefill at `num_computed_tokens = cached tokens`, and the cache's unlocked pages count as
free: when
the free pages less the promises do not cover an admission, a resumption or a decode row's
growth, the least recently used cached pages are evicted first (before the scheduler
preempts anyone). A finished prompt's pages are inserted at `end_prefill`, and a finishing
sequence's prompt and outputs at `free`, before its memory is released.
"""

from __future__ import annotations

import logging

from ..common.arith import cdiv
from ..kv_store.device_pools import DENSE_LAYERS, RESIDENT
from .prefix_cache import PrefixCache
from .runner import ModelRunner
from .scheduler import Sequence

log = logging.getLogger(__name__)


class RunnerBudget:
    """`MemoryBudget` of a `ModelRunner` (see the module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # the engine attaches its prefix cache after building it (the cache takes `headroom`)
        self.cache: PrefixCache | None = None
        self.store = runner.coord.store
        self.page = self.store.page_size
        self._promised: dict[str, int] = {}  # rid -> host pages promised for its whole life
        self._granted: list[str] = []  # decode rows of the plan being made that start a page, grown together
        self._trial: str | None = None  # reserved by the last can_admit / can_resume
        self._dropped: set[str] = set()  # preempted while prefilling: admitted again on resume
        self._warn_if_preemption_ends_requests()

    def _warn_if_preemption_ends_requests(self) -> None:
        """The resident store keeps no host copy unless host_capacity_tokens is given: when its
        device pool cannot hold every request row to max_model_len, a request that must be
        preempted has nowhere to go and is ended with an error (`retract`); say so once, when
        the engine is built, with the settings that avoid it."""
        store, rows = self.store, self.store.max_requests
        if not store.all_resident or store.host_alloc.num_pages or rows < 2:
            return
        need = rows * cdiv(self.runner.max_model_len, self.page) * self.page
        have = min(pool.slots for pool in store.pools)
        if have < need:
            log.warning("the resident store's device pool (%d tokens per layer) holds fewer than max_num_seqs %d x "
                        "max_model_len %d tokens and it has no host pool: a request that must be preempted is ended "
                        "with finish_reason 'error' instead; give host_capacity_tokens (room to preempt into), or "
                        "more device_capacity_tokens, or fewer max_num_seqs", have, rows, self.runner.max_model_len)

    def begin_plan(self) -> None:
        """Before each `Scheduler.schedule()`: no decode row is granted yet."""
        self._granted = []

    # -- reading the pools ---------------------------------------------------------------------
    def _life_pages(self, seq: Sequence) -> int:
        """Host pages of every K/V token the sequence will store (its last token is never fed)."""
        return cdiv(seq.max_total_tokens - 1, self.page)

    def _owed_pages(self) -> int:
        """Host pages promised to admitted sequences and not yet held by them."""
        owed = 0
        for rid, pages in self._promised.items():
            request = self.runner.requests.get(rid)
            held = cdiv(self.store.host_tokens(request), self.page) if request is not None else 0
            owed += max(0, pages - held)
        return owed

    def headroom(self) -> int:
        """Free host pages beyond what admitted sequences were promised (a prefix cache may
        take these)."""
        return self.store.host_alloc.free - self._owed_pages()

    def never_fits(self, seq: Sequence) -> str | None:
        prompt, life = seq.num_prompt_tokens, seq.max_total_tokens - 1
        staging = self.runner.staging.capacity
        if prompt > staging:
            return (f"its prompt of {prompt} tokens exceeds the prefill staging ({staging} tokens); "
                    "raise staging_tokens")
        host_pages = self.store.host_alloc.num_pages
        if host_pages and self._life_pages(seq) > host_pages:
            return (f"its {life} tokens of K/V exceed the host pool ({host_pages * self.page} tokens); "
                    "raise host_capacity_tokens or lower max_tokens")
        dense_mode = self.runner.coord.decodes_densely(prompt, self._sparse(seq))
        for pool in self.store.pools:
            whole = pool.kind in (DENSE_LAYERS, RESIDENT) or dense_mode
            need = life if whole else self.store.buffer_tokens
            if cdiv(need, self.page) * self.page > pool.slots:
                why = "every token of its context" if whole else f"a buffer of {need} tokens"
                return (f"it needs {why} in the {pool.kind} device pool, which holds {pool.slots} tokens per "
                        "layer; raise device_capacity_tokens or lower max_tokens")
        return None

    # -- reservations ------------------------------------------------------------------------
    def _host_room(self, pages: int) -> bool:
        """Whether `pages` free host pages beyond the promises exist, evicting cached pages
        (least recently used first) to make them."""
        short = pages - self.headroom()
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
            short = pages - self.headroom()
        return short <= 0

    def can_admit(self, seq: Sequence) -> bool:
        cached, pages = self.cache.match(seq.rid, seq.prompt_ids) if self.cache is not None else (0, None)
        # a request that keeps its K/V on the host maps the cached pages as its own (held
        # already); one that does not (dense mode, the resident store) only copies them into its
        # staging and, if preempted, copies its whole context to new host pages: promised it all
        adopts = self.store.keeps_host_for(seq.num_prompt_tokens, self.runner.coord.decodes_densely(
            seq.num_prompt_tokens, self._sparse(seq)))
        need = self._life_pages(seq) - (cached // self.page if adopts else 0)
        if self.store.host_alloc.num_pages and not self._host_room(need):
            self._drop_match(seq)
            if adopts or not cached:
                return False
            # its own lock kept the matched pages from eviction, and it would not hold them:
            # admitted without the cache if evicting them makes the room
            cached, pages = 0, None
            if not self._host_room(need):
                return False
        if not self._admit_keeping_grants(seq, cached, pages):
            return False
        self._promised[seq.rid] = self._life_pages(seq)
        self._trial = seq.rid
        return True

    def _drop_match(self, seq: Sequence) -> None:
        if self.cache is not None:
            self.cache.release(seq.rid)

    def _admit_keeping_grants(self, seq: Sequence, cached: int = 0, pages=None) -> bool:
        """Admit `seq` in the runner (with its cached prefix) unless that takes room the
        plan's decode rows were granted (their growth is checked before admissions are made);
        the prefix lock is dropped when it fails."""
        if not self.runner.admit(seq.rid, seq.num_prompt_tokens, pages, self._sparse(seq)):
            self._drop_match(seq)
            return False
        if not self.runner.can_grow(self._granted):
            self.runner.free(seq.rid)
            self._drop_match(seq)
            return False
        if self.cache is not None:
            self.cache.on_admitted(seq.rid, self.runner.requests[seq.rid])  # a hybrid's window into its ring row
            self.cache.count(seq.num_prompt_tokens, cached)
        seq.num_computed_tokens = cached  # the prefill starts after the cached prefix
        return True

    def admit(self, seq: Sequence) -> None:
        self._take_trial(seq)

    def end_prefill(self, seq: Sequence) -> None:
        """The runner released the staging when it handed the prompt over; the prompt's whole
        pages go into the prefix cache."""
        if seq.rid in self.runner.staging.spans:
            raise RuntimeError(f"request {seq.rid!r} still holds prefill staging after its last chunk")
        if self.cache is not None:
            self.cache.on_prefilled(seq.rid, self.runner.requests[seq.rid], seq.prompt_ids)

    def can_grow(self, seq: Sequence) -> bool:
        # only rows starting a page take room: checking them alone keeps a plan's checks linear
        # in its rows (all granted rows at every check cost milliseconds at 64 requests)
        if not self.store.needs_page(self.runner.requests[seq.rid]):
            return True
        rows = [*self._granted, seq.rid]
        if self.runner.can_grow(rows):
            return True
        if self.cache is not None and self.cache.evictable_pages():  # cached pages before preemption
            self.cache.evict(len(rows))
            return self.runner.can_grow(rows)
        return False

    def grow(self, seq: Sequence) -> None:
        if self.store.needs_page(self.runner.requests[seq.rid]):
            self._granted.append(seq.rid)

    def retract(self, seq: Sequence) -> str | None:
        """None once retracted; why not (nothing changed) when its K/V has no host room to go
        to — the resident store keeps none unless host_capacity_tokens is given."""
        request = self.runner.requests[seq.rid]
        if request.seq_len == 0:  # still prefilling: nothing in the store to keep
            self.runner.free(seq.rid)
            self._drop_match(seq)  # looked up again when it resumes
            self._dropped.add(seq.rid)
            return None
        return self.runner.retract(seq.rid)

    def can_resume(self, seq: Sequence) -> bool:
        if seq.rid in self._dropped:  # its host room is promised: only device room and staging
            cached, pages = self.cache.match(seq.rid, seq.prompt_ids) if self.cache is not None else (0, None)
            ok = self._admit_keeping_grants(seq, cached, pages)
        else:
            ok = self.runner.resume(seq.rid)
            if ok and not self.runner.can_grow([*self._granted, seq.rid]):
                why = self.runner.retract(seq.rid)  # back in, but its next token would not fit
                if why is not None:  # the host room its resumption just released is gone
                    raise RuntimeError(f"request {seq.rid!r}: cannot retract it again after resuming it: {why}")
                ok = False
        if ok:
            self._trial = seq.rid
        return ok

    def resume(self, seq: Sequence) -> None:
        self._take_trial(seq)
        if seq.rid in self._dropped:
            self._dropped.discard(seq.rid)
        else:
            self._granted.append(seq.rid)  # it decodes in this step

    def free(self, seq: Sequence) -> None:
        """Release everything `seq` holds. When the prefix cache's insertion or a hook of the
        coordinator raises, the rest is still released before the exception goes on (a
        request the scheduler forgets must not keep pages)."""
        try:
            if self.cache is not None:
                request = self.runner.requests.get(seq.rid)
                retracted = seq.rid in self.runner.coord.retracted
                self.cache.on_finished(seq.rid, request, [*seq.prompt_ids, *seq.output_ids], retracted)
        finally:
            try:
                self.runner.free(seq.rid)
            finally:
                self._promised.pop(seq.rid, None)
                self._dropped.discard(seq.rid)
                if self._trial == seq.rid:
                    self._trial = None

    def _sparse(self, seq: Sequence) -> bool | None:
        """The request's own choice (`_sparse`), else None (the coordinator's rule) — but True
        (the host tier) under the cost policy of a hierarchical store when, kept dense, its
        whole life (prompt + max_tokens) would not fit a sparse layers' pool even alone: the
        policy keeps a request dense only where it can be served so."""
        own = _sparse(seq)
        if own is not None or not self.runner.coord.policy.decides_at_admission:
            return own
        life = cdiv(seq.max_total_tokens - 1, self.page) * self.page
        if any(life > pool.slots for pool in self.store.pools if pool.kind not in (DENSE_LAYERS, RESIDENT)):
            return True
        return None

    def _take_trial(self, seq: Sequence) -> None:
        if self._trial != seq.rid:
            raise RuntimeError(f"request {seq.rid!r}: admit/resume without a successful can_admit/can_resume just before")
        self._trial = None


def _sparse(seq: Sequence) -> bool | None:
    """The request's own choice of sparse or dense decoding (SamplingParams.sparse; None: the
    config's rule, also for parameters without the field)."""
    return getattr(seq.params, "sparse", None)
