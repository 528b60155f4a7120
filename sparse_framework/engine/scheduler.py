"""The engine's scheduler: which sequences run in the next step, and with how many tokens.

Pure Python over `Sequence` objects; it never allocates memory. It asks a `MemoryBudget`
(the runner's view of the store's pools) whether a sequence can start, grow or come back, and
tells it what to reserve and release. `schedule()` returns a `StepPlan`; the caller runs it
and reports the sampled tokens to `on_step_done`.

Policy (first come, first served; a sequence's arrival index is its priority):

1. Every running sequence that has finished its prompt gets one decode token, oldest first.
   It must first grow by the token the step writes (`budget.grow`). When it cannot, the
   newest running sequence is preempted and the check repeats; when the one that cannot grow
   is itself the newest, it is preempted. Preempting is `budget.retract`: the device room is
   released and the KV stays on the host, so a decoding sequence resumes later without
   recomputation. A sequence whose K/V has no host room to go to (the resident store without
   a host pool) cannot be preempted: it alone is ended with `FinishReason.ERROR` and the
   reason, its memory freed, and the others go on. A sequence preempted while still
   prefilling loses its staged chunks (they lived in device staging) and restarts its prefill
   from token 0 when it comes back; it has produced no output yet, so its output is unchanged.
2. The rest of `max_num_batched_tokens` goes to prefill chunks: first the running sequences
   still prefilling (oldest first), then the queue - preempted sequences (oldest first,
   `budget.resume`; a decoding one takes a decode row) before any waiting one
   (`budget.admit`). The queue is strict: it stops at the first sequence that cannot start
   (no memory, no token left, `max_num_seqs` running), so a large old request is never
   overtaken by small new ones. Nothing is resumed or admitted in a step that preempted (or
   ended a sequence to make room).
   A prompt longer than what is left of the budget (or than `max_prefill_chunk`) is split
   over steps, so a 128K prompt never needs 128K tokens of activations at once.
3. A request that could never run, even alone (prompt + max_tokens beyond `max_model_len`,
   or beyond what the pools hold per `budget.never_fits`), is finished at `add` with
   `FinishReason.ERROR` and a message, rather than waiting forever.

These rules keep, at all times, running < preempted < waiting in arrival order; the oldest
running sequence is never preempted (unless it cannot grow alone, which only a budget that
broke its contract allows: that sequence is finished with an error), so it advances by at
least one token per step: with no new arrivals, every request finishes within
sum(prompt + max_tokens) + number of requests steps (the property test checks that bound).

`abort(rid)` frees whatever the request holds, in any state.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..common.errors import ConfigError


class HasMaxTokens(Protocol):
    """What the scheduler reads of a request's sampling parameters."""

    @property
    def max_tokens(self) -> int: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet; holds nothing
    RUNNING = "running"  # admitted: prefilling (num_computed_tokens < prompt) or decoding
    PREEMPTED = "preempted"  # retracted: host room (and host KV) kept, no device room
    FINISHED = "finished"  # holds nothing; finish_reason says why


class FinishReason(enum.StrEnum):
    STOP = "stop"  # the caller decided (a stop token, end of sequence)
    LENGTH = "length"  # max_tokens outputs
    ABORT = "abort"
    ERROR = "error"  # could never run; `Sequence.error` says why


@dataclass(eq=False)
class Sequence:
    """One request's tokens and place in the schedule.

    `num_computed_tokens` counts the tokens whose K/V exist (staged or in the store); the
    newest output token's K/V are written by the next decode step, at position
    `num_computed_tokens`.
    """

    rid: str
    prompt_ids: list[int]
    params: HasMaxTokens
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival: int = -1  # set by Scheduler.add: the FCFS order
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most outputs it may produce."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        """The token a decode step feeds (the newest output)."""
        return self.output_ids[-1]


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start + length) of `seq`; `is_last` when it ends the prompt (the
    step then samples the sequence's first output token)."""

    seq: Sequence
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.num_prompt_tokens


@dataclass
class StepPlan:
    """One step. Before running it the runner applies, in order: `preempted` (already
    retracted in the budget: move or drop their device state; a sequence with
    `num_computed_tokens == 0` among them was prefilling and drops its staging), `resumed`
    (restore device state; one with `num_computed_tokens == 0` restarts its prefill and has a
    chunk from 0), `admitted` (new requests; their first chunk is in `prefill`). Then one
    forward over `decode` rows (one token each) and `prefill` chunks. `finished` lists
    sequences the planning itself ended (only when the budget broke its contract; see
    `MemoryBudget`). A plan with no rows needs no `on_step_done`."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended while planning (ERROR)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)

    @property
    def sampled(self) -> list[Sequence]:
        """Sequences that get a new token from this step: decode rows, then the prefills it
        completes; `on_step_done` wants a token for each."""
        return self.decode + [c.seq for c in self.prefill if c.is_last]

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


class MemoryBudget(Protocol):
    """The runner's reservations in the store's pools, as the scheduler sees them.

    Calls are reservations made while planning; the runner may move data inside them or when
    it applies the plan. Contract the scheduler's liveness relies on:

    - `admit` reserves everything the prefill needs: the request's device buffers for every
      layer, prefill staging for the whole prompt, and host room for its whole life
      (prompt + max_tokens), so that growing never needs room a retraction cannot release.
    - `grow` reserves room for the one K/V token the coming step writes (KV length
      `num_computed_tokens + 1`): one more host token if host was not reserved ahead, one
      more token of any layer kept whole on the device.
    - `retract` releases all device room (buffers, staging, device KV) and keeps the host
      room; for a prefilling sequence the staged chunks are lost (the scheduler resets its
      `num_computed_tokens` to 0). It returns None, or, when the sequence's K/V has nowhere
      to go (a store without host room for it: the resident store's default), why, having
      changed nothing: the scheduler then ends that sequence alone with `FinishReason.ERROR`
      (`plan.finished`) and frees it, so the others go on. `resume` re-reserves what the sequence needs to take its
      next step: device buffers plus the coming token (decoding) or plus staging (prefilling).
    - `end_prefill` releases the staging once the prompt is fully prefilled.
    - `free` releases everything the sequence holds, whatever its state.
    - When no other sequence holds device room (others retracted or finished), a sequence for
      which `never_fits` returned None can be admitted or resumed and grown to
      prompt + max_tokens - 1 K/V tokens.
    """

    def never_fits(self, seq: Sequence) -> str | None:
        """None when `seq` fits with the pools to itself; else why it never can (name the pool
        and the setting that would change it)."""
        ...

    def can_admit(self, seq: Sequence) -> bool: ...
    def admit(self, seq: Sequence) -> None: ...
    def end_prefill(self, seq: Sequence) -> None: ...
    def can_grow(self, seq: Sequence) -> bool: ...
    def grow(self, seq: Sequence) -> None: ...
    def retract(self, seq: Sequence) -> str | None: ...
    def can_resume(self, seq: Sequence) -> bool: ...
    def resume(self, seq: Sequence) -> None: ...
    def free(self, seq: Sequence) -> None: ...


class Scheduler:
    """Continuous batching over a `MemoryBudget`; the policy is in the module docstring.

    `max_num_batched_tokens`: tokens per step (decode rows + prefill chunk tokens), at least
    `max_num_seqs` so every running sequence can decode in one step. `max_num_seqs`: running
    sequences at most. `max_prefill_chunk`: the longest chunk of one prompt in one step (None:
    the token budget only). `max_model_len`: the longest prompt + max_tokens accepted.
    """

    def __init__(
        self,
        budget: MemoryBudget,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_prefill_chunk: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so that every running sequence can decode in one step"
            )
        if max_prefill_chunk is not None and max_prefill_chunk < 1:
            raise ConfigError(f"max_prefill_chunk must be None or >= 1, got {max_prefill_chunk}")
        if max_model_len is not None and max_model_len < 2:
            raise ConfigError(f"max_model_len must be None or >= 2, got {max_model_len}")
        self.budget = budget
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_prefill_chunk = max_prefill_chunk
        self.max_model_len = max_model_len
        # arrival order within each: running < preempted < waiting (see the module docstring)
        self._running: list[Sequence] = []
        self._preempted: deque[Sequence] = deque()
        self._waiting: deque[Sequence] = deque()
        self._live: dict[str, Sequence] = {}  # every unfinished sequence, by rid
        self._arrivals = 0
        self._plan: StepPlan | None = None  # the plan awaiting on_step_done
        self.num_preemptions = 0

    # -- requests --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> bool:
        """Queue `seq`. False when it can never run: it is then finished at once with
        `FinishReason.ERROR` and `seq.error` saying why (the others are unaffected)."""
        if seq.rid in self._live:
            raise ValueError(f"request {seq.rid!r} is already queued or running")
        if seq.status is not SequenceStatus.WAITING or seq.output_ids or seq.num_computed_tokens:
            raise ValueError(f"request {seq.rid!r}: add a fresh sequence (status WAITING, no outputs)")
        seq.arrival = self._arrivals
        self._arrivals += 1
        reason = self._rejection(seq)
        if reason is not None:
            self._finish(seq, FinishReason.ERROR, error=reason)
            return False
        self._live[seq.rid] = seq
        self._waiting.append(seq)
        return True

    def _rejection(self, seq: Sequence) -> str | None:
        if not seq.prompt_ids:
            return f"request {seq.rid!r}: the prompt is empty; give at least one token"
        if seq.max_tokens < 1:
            return f"request {seq.rid!r}: max_tokens must be >= 1, got {seq.max_tokens}"
        if self.max_model_len is not None and seq.max_total_tokens > self.max_model_len:
            return (
                f"request {seq.rid!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.max_tokens}) "
                f"= {seq.max_total_tokens} exceeds max_model_len {self.max_model_len}; shorten the prompt or "
                "lower max_tokens"
            )
        why = self.budget.never_fits(seq)
        return None if why is None else f"request {seq.rid!r} can never be served: {why}"

    def drop_plan(self) -> StepPlan | None:
        """Forget the plan awaiting `on_step_done` (its step failed: the engine ends the
        requests it touched) so that `schedule` may run again; the plan, or None."""
        plan, self._plan = self._plan, None
        return plan

    def abort(self, rid: str) -> Sequence | None:
        """Finish `rid` with `FinishReason.ABORT`, freeing all it holds; None when it is not
        queued or running. Allowed between `schedule` and `on_step_done` (its result is then
        ignored)."""
        return self.finish(rid, FinishReason.ABORT)

    def finish(self, rid: str, reason: FinishReason) -> Sequence | None:
        """Finish `rid` now with `reason`, freeing all it holds (abort; or a stop token the
        engine read a step late, async scheduling); None when it is not queued or running.
        If `budget.free` raises, the sequence is still finished and forgotten (never left
        half-removed) and the exception goes on to the caller."""
        seq = self._live.get(rid)
        if seq is None:
            return None
        try:
            if seq.status is SequenceStatus.WAITING:
                self._waiting.remove(seq)
            else:
                (self._running if seq.status is SequenceStatus.RUNNING else self._preempted).remove(seq)
                self.budget.free(seq)
        finally:  # a budget that raised while freeing: the sequence is forgotten all the same
            self._finish(seq, reason)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def preempted(self) -> tuple[Sequence, ...]:
        return tuple(self._preempted)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    # -- steps -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan the next step (see the policy above). Empty only when nothing is unfinished."""
        if self._plan is not None:
            raise RuntimeError("schedule() called again before on_step_done() of the previous plan")
        plan = StepPlan()
        self._schedule_decodes(plan)
        tokens_left = self.max_num_batched_tokens - len(plan.decode)
        for seq in self._running:  # prefills under way, oldest first
            if seq.is_prefilling and tokens_left > 0:
                tokens_left -= self._add_chunk(plan, seq, tokens_left)
        if not plan.preempted and not plan.finished:  # room made for growth is not handed out
            self._start_queued(plan, tokens_left)
        if not plan.is_empty:
            self._plan = plan
        return plan

    def _schedule_decodes(self, plan: StepPlan) -> None:
        """Step 1 of the policy: grow each decoding sequence, oldest first, preempting the
        newest running ones when it cannot."""
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            if seq.is_prefilling:
                i += 1
                continue
            while not self.budget.can_grow(seq) and self._running[-1] is not seq:
                self._preempt(plan, self._running[-1])
            if self.budget.can_grow(seq):
                self.budget.grow(seq)
                plan.decode.append(seq)
                i += 1
            elif len(self._running) == 1:  # alone and cannot grow: the budget broke its contract
                self._running.remove(seq)
                self.budget.free(seq)
                why = f"request {seq.rid!r}: no room to grow to {seq.num_computed_tokens + 1} tokens even alone"
                self._finish(seq, FinishReason.ERROR, error=why)
                plan.finished.append(seq)
            else:  # the newest cannot grow: it steps aside itself
                self._preempt(plan, seq)

    def _preempt(self, plan: StepPlan, seq: Sequence) -> None:
        why = self.budget.retract(seq)
        self._running.remove(seq)
        if why is not None:  # nowhere to keep it (no host room): it alone ends, the others go on
            self.budget.free(seq)
            error = f"request {seq.rid!r} had to be preempted and cannot be kept: {why}"
            self._finish(seq, FinishReason.ERROR, error=error)
            plan.finished.append(seq)
            return
        if seq.is_prefilling:
            seq.num_computed_tokens = 0  # its staged chunks are gone
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted.appendleft(seq)  # the newest running is older than every preempted one
        plan.preempted.append(seq)

    def _start_queued(self, plan: StepPlan, tokens_left: int) -> None:
        """Step 2's queue: preempted sequences, then waiting ones, oldest first, stopping at
        the first that cannot start."""
        while tokens_left > 0 and len(self._running) < self.max_num_seqs:
            queue = self._preempted or self._waiting
            if not queue:
                return
            seq = queue[0]
            resuming = seq.status is SequenceStatus.PREEMPTED
            if not (self.budget.can_resume(seq) if resuming else self.budget.can_admit(seq)):
                if self._running:
                    return  # wait for running sequences to release room
                queue.popleft()  # nothing else holds device room: it never will fit
                if resuming:
                    self.budget.free(seq)
                why = f"request {seq.rid!r}: no room to {'resume' if resuming else 'start'} even alone"
                self._finish(seq, FinishReason.ERROR, error=why)
                plan.finished.append(seq)
                continue
            queue.popleft()
            if resuming:
                self.budget.resume(seq)
                plan.resumed.append(seq)
            else:
                self.budget.admit(seq)
                plan.admitted.append(seq)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            if seq.is_prefilling:
                tokens_left -= self._add_chunk(plan, seq, tokens_left)
            else:
                plan.decode.append(seq)
                tokens_left -= 1

    def _add_chunk(self, plan: StepPlan, seq: Sequence, tokens_left: int) -> int:
        n = min(seq.num_prompt_tokens - seq.num_computed_tokens, tokens_left)
        if self.max_prefill_chunk is not None:
            n = min(n, self.max_prefill_chunk)
        plan.prefill.append(PrefillChunk(seq, seq.num_computed_tokens, n))
        return n

    def on_step_done(
        self,
        plan: StepPlan,
        new_tokens: Mapping[str, int],
        finished: Mapping[str, FinishReason | str] | None = None,
    ) -> list[Sequence]:
        """Record a step's results: advance computed tokens, append `new_tokens[rid]` to each
        sequence of `plan.sampled`, and finish those in `finished` (with that reason, after
        appending their token) or at max_tokens. Returns the sequences finished now.
        Sequences aborted since `schedule` are skipped."""
        if plan.is_empty:
            return []
        if plan is not self._plan:
            raise RuntimeError("on_step_done() takes the plan of the latest schedule() call, once")
        finished = dict(finished or {})
        sampled = plan.sampled
        expected = {s.rid for s in sampled}
        live = {s.rid for s in sampled if s.status is SequenceStatus.RUNNING}
        missing = live - new_tokens.keys()
        if missing:
            raise ValueError(f"on_step_done: no new token for {sorted(missing)}")
        extra = (new_tokens.keys() | finished.keys()) - expected
        if extra:
            raise ValueError(f"on_step_done: {sorted(extra)} got no token in this plan (sampled: {sorted(expected)})")
        reasons = {rid: FinishReason(r) for rid, r in finished.items()}  # ValueError names a bad one
        self._plan = None

        for chunk in plan.prefill:
            seq = chunk.seq
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens = chunk.end
                if chunk.is_last:
                    self.budget.end_prefill(seq)
        for seq in plan.decode:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += 1
        done = []
        for seq in sampled:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.output_ids.append(int(new_tokens[seq.rid]))
            reason = reasons.get(seq.rid)
            if reason is None and len(seq.output_ids) >= seq.max_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                self._running.remove(seq)
                self.budget.free(seq)
                self._finish(seq, reason)
                done.append(seq)
        return done

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self._live.pop(seq.rid, None)


