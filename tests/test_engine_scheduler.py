"""The engine's scheduler against a fake paged store and a fake model.

`FakeEngine` is both the `MemoryBudget` and the runner, as the real runner is: it accounts
pages of a hierarchical store (device: per-request buffers, prefill staging, layers kept whole
on the device; host: every request's whole life) and asserts on every call that the pools are
never over-committed and that the scheduler keeps its side of the contract. It also "runs"
plans: each request's simulated K/V is a rolling hash of the tokens written so far, checked
for contiguity, and the sampled token is a hash of (rid, K/V). A request's output therefore
depends on exactly which tokens reached its K/V, in order; `reference_output` computes it for
the request alone, one token at a time, which is what every scheduled run must reproduce.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sparse_framework.common.arith import cdiv
from sparse_framework.common.errors import ConfigError
from sparse_framework.engine.scheduler import (
    FinishReason,
    Scheduler,
    Sequence,
    SequenceStatus,
    StepPlan,
)

VOCAB = 1000
MOD = (1 << 61) - 1


@dataclass(frozen=True)
class Params:
    max_tokens: int


def roll(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) % MOD


def sample(rid: str, h: int) -> int:
    return (h ^ zlib.crc32(rid.encode())) % VOCAB


def stop_on_multiple_of_11(token: int) -> bool:
    return token % 11 == 0


def reference_output(rid: str, prompt: list[int], max_tokens: int, stop=None) -> list[int]:
    """The request alone, one token at a time: what any schedule must produce."""
    h = 0
    for t in prompt:
        h = roll(h, t)
    out: list[int] = []
    while True:
        t = sample(rid, h)
        out.append(t)
        if len(out) == max_tokens or (stop is not None and stop(t)):
            return out
        h = roll(h, t)


@dataclass
class Held:
    buffer: int  # device pages of the request's buffers (every layer)
    staging: int  # device pages of prefill staging
    dense_tokens: int  # tokens reserved in the layers kept whole on the device
    host: int  # host pages (the whole life)
    staged: bool = True  # prefilling: staging reserved (even when it is 0 pages)
    retracted: bool = False


class FakeEngine:
    """MemoryBudget with page accounting, and a fake runner (see the module docstring)."""

    def __init__(self, device_pages: int, host_pages: int, page: int = 4, buffer_pages: int = 1,
                 dense_factor: int = 1, staging_factor: int = 1) -> None:
        self.device_pages, self.host_pages, self.page = device_pages, host_pages, page
        self.buffer_pages, self.dense_factor, self.staging_factor = buffer_pages, dense_factor, staging_factor
        self.held: dict[str, Held] = {}
        self.kv: dict[str, tuple[int, int]] = {}  # rid -> (tokens written, rolling hash)
        self.peak_device = self.peak_host = 0

    # -- accounting ----------------------------------------------------------------------
    def dense_pages(self, tokens: int) -> int:
        return cdiv(tokens, self.page) * self.dense_factor

    def staging_pages(self, seq: Sequence) -> int:
        return cdiv(seq.num_prompt_tokens, self.page) * self.staging_factor

    def device_used(self) -> int:
        return sum(h.buffer + h.staging + self.dense_pages(h.dense_tokens) for h in self.held.values())

    def host_used(self) -> int:
        return sum(h.host for h in self.held.values())

    def check_pools(self) -> None:
        dev, host = self.device_used(), self.host_used()
        assert dev <= self.device_pages, f"device pool over-committed: {dev} > {self.device_pages}"
        assert host <= self.host_pages, f"host pool over-committed: {host} > {self.host_pages}"
        self.peak_device, self.peak_host = max(self.peak_device, dev), max(self.peak_host, host)

    def prefill_need(self, seq: Sequence) -> int:
        return self.buffer_pages + self.staging_pages(seq) + self.dense_pages(seq.num_prompt_tokens)

    def host_need(self, seq: Sequence) -> int:
        return cdiv(seq.max_total_tokens, self.page)

    # -- MemoryBudget ----------------------------------------------------------------------
    def never_fits(self, seq: Sequence) -> str | None:
        device = max(self.prefill_need(seq), self.buffer_pages + self.dense_pages(seq.max_total_tokens - 1))
        if device > self.device_pages:
            return f"needs {device} device pages, the device pool has {self.device_pages} (device_pages)"
        if self.host_need(seq) > self.host_pages:
            return f"needs {self.host_need(seq)} host pages, the host pool has {self.host_pages} (host_pages)"
        return None

    def can_admit(self, seq: Sequence) -> bool:
        assert seq.rid not in self.held and seq.num_computed_tokens == 0
        return (self.device_used() + self.prefill_need(seq) <= self.device_pages
                and self.host_used() + self.host_need(seq) <= self.host_pages)

    def admit(self, seq: Sequence) -> None:
        assert self.can_admit(seq)
        self.held[seq.rid] = Held(self.buffer_pages, self.staging_pages(seq), seq.num_prompt_tokens,
                                  self.host_need(seq))
        self.check_pools()

    def end_prefill(self, seq: Sequence) -> None:
        h = self.held[seq.rid]
        assert not h.retracted and h.staged and seq.num_computed_tokens == seq.num_prompt_tokens
        h.staging, h.staged = 0, False

    def _grow_need(self, seq: Sequence) -> int:
        h = self.held[seq.rid]
        assert not h.retracted and not h.staged and not seq.is_prefilling, "grow of a sequence not decoding"
        return self.dense_pages(seq.num_computed_tokens + 1) - self.dense_pages(h.dense_tokens)

    def can_grow(self, seq: Sequence) -> bool:
        return self.device_used() + self._grow_need(seq) <= self.device_pages

    def grow(self, seq: Sequence) -> None:
        assert self.can_grow(seq)
        self.held[seq.rid].dense_tokens = seq.num_computed_tokens + 1
        self.check_pools()

    def retract(self, seq: Sequence) -> None:
        h = self.held[seq.rid]
        assert not h.retracted
        h.buffer = h.staging = h.dense_tokens = 0
        h.retracted, h.staged = True, False
        if seq.is_prefilling:  # staged chunks are lost; decoding ones keep their K/V on the host
            self.kv.pop(seq.rid, None)

    def _resume_need(self, seq: Sequence) -> int:
        assert self.held[seq.rid].retracted
        if seq.num_computed_tokens == 0:
            return self.prefill_need(seq)
        return self.buffer_pages + self.dense_pages(seq.num_computed_tokens + 1)

    def can_resume(self, seq: Sequence) -> bool:
        return self.device_used() + self._resume_need(seq) <= self.device_pages

    def resume(self, seq: Sequence) -> None:
        assert self.can_resume(seq)
        h = self.held[seq.rid]
        h.retracted, h.buffer = False, self.buffer_pages
        if seq.num_computed_tokens == 0:
            h.staging, h.staged, h.dense_tokens = self.staging_pages(seq), True, seq.num_prompt_tokens
        else:
            h.dense_tokens = seq.num_computed_tokens + 1
        self.check_pools()

    def free(self, seq: Sequence) -> None:
        assert seq.rid in self.held, f"free of {seq.rid!r}, which holds nothing"
        del self.held[seq.rid]
        self.kv.pop(seq.rid, None)

    # -- the fake runner -------------------------------------------------------------------
    def execute(self, plan: StepPlan, sched: Scheduler) -> dict[str, int]:
        """Run the plan on the simulated K/V; return the sampled tokens."""
        assert 0 < plan.num_tokens <= sched.max_num_batched_tokens
        rids = [s.rid for s in plan.decode] + [c.seq.rid for c in plan.prefill]
        assert len(rids) == len(set(rids)), "a sequence twice in one step"
        assert len(sched.running) <= sched.max_num_seqs
        for seq in plan.resumed:
            if seq.num_computed_tokens:
                assert self.kv[seq.rid][0] == seq.num_computed_tokens, "resumed K/V lost"
        for seq in plan.admitted:
            assert seq.rid not in self.kv
        for chunk in plan.prefill:
            seq = chunk.seq
            h = self.held[seq.rid]
            assert not h.retracted and h.staged, "prefill without staging"
            assert chunk.length >= 1
            if sched.max_prefill_chunk is not None:
                assert chunk.length <= sched.max_prefill_chunk
            n, hsh = self.kv.get(seq.rid, (0, 0))
            assert n == chunk.start == seq.num_computed_tokens, "prefill chunk not contiguous"
            for t in seq.prompt_ids[chunk.start:chunk.end]:
                hsh = roll(hsh, t)
            self.kv[seq.rid] = (chunk.end, hsh)
        for seq in plan.decode:
            h = self.held[seq.rid]
            assert not h.retracted and not h.staged and h.dense_tokens >= seq.num_computed_tokens + 1
            n, hsh = self.kv[seq.rid]
            assert n == seq.num_computed_tokens
            self.kv[seq.rid] = (n + 1, roll(hsh, seq.last_token_id))
        return {seq.rid: sample(seq.rid, self.kv[seq.rid][1]) for seq in plan.sampled}


def step(sched: Scheduler, eng: FakeEngine, stop=None) -> tuple[StepPlan, list[Sequence]]:
    """One engine step: schedule, run, report. Returns the plan and the sequences it finished."""
    plan = sched.schedule()
    assert not plan.finished, f"the scheduler gave up on {[s.error for s in plan.finished]}"
    assert not (plan.preempted and (plan.resumed or plan.admitted)), "a step that preempts starts nothing"
    if plan.is_empty:
        return plan, []
    tokens = eng.execute(plan, sched)
    finished = {rid: "stop" for rid, t in tokens.items() if stop is not None and stop(t)}
    return plan, sched.on_step_done(plan, tokens, finished)


def make_seq(rid: str, prompt_len: int, max_tokens: int, base: int = 0) -> Sequence:
    return Sequence(rid, [(base + 7 * i) % VOCAB for i in range(prompt_len)], Params(max_tokens))


def drain(sched: Scheduler, eng: FakeEngine, limit: int = 10_000, stop=None) -> list[StepPlan]:
    plans = []
    while sched.has_unfinished():
        assert len(plans) < limit, "requests did not finish"
        plans.append(step(sched, eng, stop)[0])
    return plans


def assert_reference(seq: Sequence, stop=None) -> None:
    assert seq.output_ids == reference_output(seq.rid, seq.prompt_ids, seq.max_tokens, stop)


# -- policy rules --------------------------------------------------------------------------
def test_every_decode_gets_its_token_first_and_prefill_takes_the_rest() -> None:
    eng = FakeEngine(device_pages=1000, host_pages=1000)
    sched = Scheduler(eng, max_num_batched_tokens=8, max_num_seqs=4)
    for i in range(3):
        sched.add(make_seq(f"d{i}", 2, 10))
    step(sched, eng)  # all three prompts in one step
    assert [s.num_computed_tokens for s in sched.running] == [2, 2, 2]
    late = make_seq("late", 20, 4)
    sched.add(late)
    plan, _ = step(sched, eng)
    assert [s.rid for s in plan.decode] == ["d0", "d1", "d2"]
    assert [(c.seq.rid, c.start, c.length) for c in plan.prefill] == [("late", 0, 5)]
    plan, _ = step(sched, eng)
    assert len(plan.decode) == 3 and [(c.start, c.length) for c in plan.prefill] == [(5, 5)]


def test_a_128k_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    page, budget = 16, 8192
    prompt = 128 * 1024
    eng = FakeEngine(device_pages=4 * cdiv(prompt, page), host_pages=2 * cdiv(prompt, page), page=page)
    sched = Scheduler(eng, max_num_batched_tokens=budget, max_num_seqs=4, max_prefill_chunk=6000)
    long = make_seq("long", prompt, 3)
    short = make_seq("short", 10, 40)
    sched.add(short)
    step(sched, eng)  # short's prompt: it decodes from now on
    sched.add(long)
    chunks = []
    while long.is_prefilling:
        plan, _ = step(sched, eng)
        assert plan.num_tokens <= budget
        assert [s.rid for s in plan.decode] == ["short"]  # the decode never waits for the prefill
        chunks += [(c.start, c.length) for c in plan.prefill if c.seq is long]
    assert all(n <= 6000 for _, n in chunks)
    assert [s for s, _ in chunks] == [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    assert sum(n for _, n in chunks) == prompt and len(chunks) == cdiv(prompt, 6000)
    assert not eng.held["long"].staged and eng.held["long"].staging == 0  # released with the last chunk
    drain(sched, eng)
    assert_reference(long)
    assert_reference(short)


def test_admission_waits_for_memory_and_fcfs_holds_the_line() -> None:
    # each request: 1 buffer + 2 staging + 2 dense pages to prefill, at most 1 + 3 dense to decode
    eng = FakeEngine(device_pages=8, host_pages=100, page=4)
    sched = Scheduler(eng, max_num_batched_tokens=64, max_num_seqs=8)
    a, b, small = make_seq("a", 8, 4), make_seq("b", 8, 4), make_seq("small", 1, 1)
    for s in (a, b, small):
        assert sched.add(s)
    plan, _ = step(sched, eng)
    assert plan.admitted == [a]  # b needs 5 more pages with 3 free; small would fit but is behind b
    assert b.status is SequenceStatus.WAITING and small.status is SequenceStatus.WAITING
    while a.status is not SequenceStatus.FINISHED:
        plan, _ = step(sched, eng)
        assert b not in plan.admitted or a.is_finished
    drain(sched, eng)
    for s in (a, b, small):
        assert s.finish_reason is FinishReason.LENGTH
        assert_reference(s)
    assert eng.held == {} and eng.peak_device <= 8


def three_that_outgrow_the_device() -> tuple[FakeEngine, Scheduler, list[Sequence]]:
    """3 requests of prompt 4 decoding 12 tokens each: 1 buffer + dense pages growing 1 -> 4
    each; 10 device pages hold all three only until they pass 8 tokens."""
    eng = FakeEngine(device_pages=10, host_pages=100, page=4, staging_factor=0)
    sched = Scheduler(eng, max_num_batched_tokens=16, max_num_seqs=4)
    seqs = [make_seq(f"r{i}", 4, 12, base=i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    return eng, sched, seqs

def test_the_newest_running_sequence_is_preempted_and_resumes_without_recomputation() -> None:
    # 3 requests of prompt 4 decode 12 tokens: 1 buffer + dense pages growing 1 -> 4 each;
    # 10 device pages hold all three only until they pass 8 tokens
    eng, sched, seqs = three_that_outgrow_the_device()
    preempted_plan = None
    while preempted_plan is None:
        plan, _ = step(sched, eng)
        if plan.preempted:
            preempted_plan = plan
    assert preempted_plan.preempted == [seqs[2]]  # the newest
    assert seqs[2].status is SequenceStatus.PREEMPTED and seqs[2].num_computed_tokens == 8
    assert eng.held["r2"].retracted and eng.kv["r2"][0] == 8  # its K/V stay on the host
    assert preempted_plan.decode == seqs[:2]
    plans = drain(sched, eng)
    resumed = [p for p in plans if p.resumed]
    assert resumed and resumed[0].resumed == [seqs[2]]
    for s in seqs:
        assert_reference(s)
    assert seqs[2].num_preemptions >= 1 and sched.num_preemptions >= 1


def test_a_prefilling_victim_restarts_its_prefill_with_the_same_output() -> None:
    # a decodes and grows; b prefills one token a step and holds 4 staging + 4 dense pages;
    # when a needs its 4th page (11 device pages), b (the newest) is preempted: its staged
    # chunks are dropped and its prefill restarts
    eng = FakeEngine(device_pages=11, host_pages=100, page=4, buffer_pages=0)
    sched = Scheduler(eng, max_num_batched_tokens=2, max_num_seqs=2, max_prefill_chunk=1)
    a, b = make_seq("a", 4, 20), make_seq("b", 16, 2)
    sched.add(a)
    step(sched, eng)
    sched.add(b)
    victim_plan = None
    for _ in range(20):
        plan, _ = step(sched, eng)
        if plan.preempted:
            victim_plan = plan
            break
    assert victim_plan is not None and victim_plan.preempted == [b]
    assert b.num_computed_tokens == 0 and b.status is SequenceStatus.PREEMPTED
    assert eng.held["b"].retracted and not eng.held["b"].staged and "b" not in eng.kv
    assert victim_plan.decode == [a]
    plans = drain(sched, eng)
    back = next(p for p in plans if p.resumed)
    assert back.resumed == [b] and back.prefill[0].start == 0
    assert_reference(a)
    assert_reference(b)


def test_preempted_sequences_resume_before_any_new_admission() -> None:
    eng, sched, seqs = three_that_outgrow_the_device()
    while not sched.preempted:
        step(sched, eng)
    newcomer = make_seq("new", 1, 1)  # fits in the free room at once, but must wait
    sched.add(newcomer)
    order = []
    while sched.has_unfinished():
        plan, _ = step(sched, eng)
        order += [s.rid for s in plan.resumed + plan.admitted]
        if newcomer.status is not SequenceStatus.WAITING:
            assert not sched.preempted
    assert order.index("r2") < order.index("new")
    assert_reference(newcomer)


def test_max_num_seqs_bounds_the_running_set() -> None:
    eng = FakeEngine(device_pages=1000, host_pages=1000)
    sched = Scheduler(eng, max_num_batched_tokens=64, max_num_seqs=2)
    seqs = [make_seq(f"r{i}", 3, 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    for plan in drain(sched, eng):
        assert len(plan.decode) + sum(c.start == 0 for c in plan.prefill) <= 2
    for s in seqs:
        assert_reference(s)


def test_stop_decided_by_the_caller() -> None:
    eng = FakeEngine(device_pages=1000, host_pages=1000)
    sched = Scheduler(eng, max_num_batched_tokens=64, max_num_seqs=8)
    seqs = [make_seq(f"r{i}", 5, 40, base=3 * i) for i in range(8)]
    for s in seqs:
        sched.add(s)
    drain(sched, eng, stop=stop_on_multiple_of_11)
    reasons = set()
    for s in seqs:
        assert_reference(s, stop_on_multiple_of_11)
        reasons.add(s.finish_reason)
        expect = FinishReason.STOP if stop_on_multiple_of_11(s.output_ids[-1]) else FinishReason.LENGTH
        assert s.finish_reason is expect
    assert FinishReason.STOP in reasons  # the test exercises the path


# -- abort -----------------------------------------------------------------------------------
def _pressured() -> tuple[Scheduler, FakeEngine, list[Sequence]]:
    eng, sched, seqs = three_that_outgrow_the_device()
    while not sched.preempted:
        step(sched, eng)
    return sched, eng, seqs


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted", "mid-step"])
def test_abort_frees_everything_in_each_state(state: str) -> None:
    sched, eng, seqs = _pressured()
    if state == "waiting":
        victim = make_seq("w", 4, 4)
        sched.add(victim)
    elif state == "prefilling":
        eng = FakeEngine(device_pages=100, host_pages=100, page=4)
        sched = Scheduler(eng, max_num_batched_tokens=8, max_num_seqs=4)
        seqs = [make_seq("a", 2, 12)]
        victim = make_seq("p", 40, 4)
        sched.add(seqs[0])
        sched.add(victim)
        step(sched, eng)
        assert victim.is_prefilling and eng.held["p"].staged and eng.kv["p"][0] == 6
    elif state == "decoding":
        victim = seqs[0]
    elif state == "preempted":
        victim = sched.preempted[0]
    else:
        victim = seqs[0]  # aborted while its step runs: the step's token for it is dropped
        plan = sched.schedule()
        assert victim in plan.decode
        tokens = eng.execute(plan, sched)
        outputs_before = list(victim.output_ids)
    assert sched.abort(victim.rid) is victim
    assert victim.finish_reason is FinishReason.ABORT and victim.status is SequenceStatus.FINISHED
    assert victim.rid not in eng.held and victim.rid not in eng.kv
    assert victim not in sched.running + sched.preempted + sched.waiting
    assert sched.abort(victim.rid) is None  # twice: nothing left to free
    if state == "mid-step":
        done = sched.on_step_done(plan, tokens)
        assert victim not in done and victim.output_ids == outputs_before
    drain(sched, eng)
    assert eng.held == {} and eng.kv == {}
    for s in seqs:
        if s is not victim and s.finish_reason is FinishReason.LENGTH:
            assert_reference(s)
    expected = reference_output(victim.rid, victim.prompt_ids, victim.max_tokens)
    assert victim.output_ids == expected[: len(victim.output_ids)]


def test_abort_of_an_unknown_or_finished_request_is_none() -> None:
    eng = FakeEngine(device_pages=100, host_pages=100)
    sched = Scheduler(eng, max_num_batched_tokens=8, max_num_seqs=2)
    s = make_seq("a", 2, 1)
    sched.add(s)
    drain(sched, eng)
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert s.finish_reason is FinishReason.LENGTH


# -- bad requests and misuse --------------------------------------------------------------------
def test_requests_that_can_never_run_are_rejected_with_a_reason_and_the_rest_run() -> None:
    eng = FakeEngine(device_pages=20, host_pages=10, page=4)
    sched = Scheduler(eng, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    too_long = make_seq("too-long", 60, 8)
    no_room = make_seq("no-room", 30, 30)  # fits max_model_len, not the host pool
    empty = Sequence("empty", [], Params(4))
    zero = make_seq("zero", 3, 0)
    ok = make_seq("ok", 5, 5)
    for s in (too_long, no_room, empty, zero):
        assert sched.add(s) is False
        assert s.status is SequenceStatus.FINISHED and s.finish_reason is FinishReason.ERROR
    assert "max_model_len 64" in too_long.error and "68" in too_long.error
    assert "host_pages" in no_room.error
    assert "empty" in empty.error and "max_tokens" in zero.error
    assert sched.add(ok)
    drain(sched, eng)
    assert_reference(ok)
    assert eng.held == {}


def test_bad_settings_and_misuse_raise_clear_errors() -> None:
    eng = FakeEngine(device_pages=100, host_pages=100)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        Scheduler(eng, max_num_batched_tokens=2, max_num_seqs=4)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        Scheduler(eng, max_num_batched_tokens=2, max_num_seqs=0)
    with pytest.raises(ConfigError, match="max_prefill_chunk"):
        Scheduler(eng, max_num_batched_tokens=8, max_num_seqs=2, max_prefill_chunk=0)
    sched = Scheduler(eng, max_num_batched_tokens=8, max_num_seqs=2)
    sched.add(make_seq("a", 2, 3))
    with pytest.raises(ValueError, match="already queued"):
        sched.add(make_seq("a", 2, 3))
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="before on_step_done"):
        sched.schedule()
    with pytest.raises(ValueError, match="no new token"):
        sched.on_step_done(plan, {})
    with pytest.raises(ValueError, match="got no token"):
        sched.on_step_done(plan, {"a": 1, "b": 2})
    with pytest.raises(ValueError, match="FinishReason"):
        sched.on_step_done(plan, {"a": 1}, {"a": "bored"})
    sched.on_step_done(plan, eng.execute(plan, sched))
    with pytest.raises(RuntimeError, match="latest schedule"):
        sched.on_step_done(plan, {"a": 1})


class _NeverGrows(FakeEngine):
    def can_grow(self, seq: Sequence) -> bool:
        return False


def test_a_budget_that_breaks_its_contract_ends_the_request_with_an_error() -> None:
    eng = _NeverGrows(device_pages=100, host_pages=100)
    sched = Scheduler(eng, max_num_batched_tokens=8, max_num_seqs=2)
    s = make_seq("a", 2, 3)
    sched.add(s)
    step(sched, eng)  # prefill
    plan = sched.schedule()
    assert plan.finished == [s] and plan.is_empty and s.finish_reason is FinishReason.ERROR
    assert "even alone" in s.error and eng.held == {} and not sched.has_unfinished()


class _NoHostRoom(FakeEngine):
    """A store with nowhere to keep a decoding sequence's K/V (the resident store without a
    host pool): retract says why and changes nothing."""

    def retract(self, seq: Sequence) -> str | None:
        if not seq.is_prefilling:
            return "no host room for its K/V"
        return super().retract(seq)


def test_a_sequence_that_cannot_be_retracted_ends_alone_with_the_reason() -> None:
    """The newest running sequence must be preempted, but its budget has nowhere to keep it:
    it is ended with FinishReason.ERROR and why (in plan.finished), its memory freed, nothing
    starts in that step (a waiting one starts the step after), and the oldest finish with
    their reference outputs."""
    eng = _NoHostRoom(device_pages=10, host_pages=100, page=4, staging_factor=0)
    sched = Scheduler(eng, max_num_batched_tokens=16, max_num_seqs=3)
    seqs = [make_seq(f"r{i}", 4, 12, base=i) for i in range(4)]  # r3 waits for a row
    for seq in seqs:
        sched.add(seq)
    plans = []
    while sched.has_unfinished():
        assert len(plans) < 1000
        plan = sched.schedule()
        plans.append(plan)
        if not plan.is_empty:
            sched.on_step_done(plan, eng.execute(plan, sched))
    first = next(i for i, p in enumerate(plans) if p.finished)
    assert plans[first].finished == [seqs[2]] and not plans[first].preempted and not plans[first].admitted
    assert plans[first + 1].admitted == [seqs[3]]
    assert seqs[2].finish_reason is FinishReason.ERROR and "cannot be kept: no host room for its K/V" in seqs[2].error
    for seq in seqs[:2]:
        assert_reference(seq)
    assert eng.held == {} and sched.num_preemptions == 0


class _FreeRaises(FakeEngine):
    def free(self, seq: Sequence) -> None:
        super().free(seq)
        raise RuntimeError("injected free failure")


def test_a_sequence_is_forgotten_even_when_its_budget_raises_while_freeing_it() -> None:
    eng = _FreeRaises(device_pages=100, host_pages=100)
    sched = Scheduler(eng, max_num_batched_tokens=8, max_num_seqs=2)
    a, b = make_seq("a", 2, 3), make_seq("b", 2, 3, base=1)
    sched.add(a)
    sched.add(b)
    step(sched, eng)
    with pytest.raises(RuntimeError, match="injected free failure"):
        sched.abort("a")
    assert a.finish_reason is FinishReason.ABORT and a not in sched.running and sched.abort("a") is None
    assert sched.running == (b,)


# -- random arrivals, aborts and steps ----------------------------------------------------------
class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2, 4]),
        device_tokens=st.integers(12, 120),
        host_tokens=st.integers(24, 240),
        buffer=st.integers(0, 2),
        dense=st.sampled_from([0, 1, 1, 2]),
        staging=st.integers(0, 1),
        max_seqs=st.integers(1, 5),
        extra_tokens=st.integers(0, 12),
        chunk=st.none() | st.integers(1, 8),
        max_model_len=st.none() | st.integers(8, 48),
        stop=st.booleans(),
    )
    def setup(self, page, device_tokens, host_tokens, buffer, dense, staging, max_seqs, extra_tokens,
              chunk, max_model_len, stop) -> None:
        self.eng = FakeEngine(device_tokens // page, host_tokens // page, page, buffer, dense, staging)
        self.sched = Scheduler(self.eng, max_seqs + extra_tokens, max_seqs, chunk, max_model_len)
        self.stop = stop_on_multiple_of_11 if stop else None
        self.seqs: list[Sequence] = []
        self.done: list[Sequence] = []  # finished, as reported (at add, by on_step_done or abort)

    @rule(requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 24), st.integers(0, VOCAB)),
                            min_size=1, max_size=5))
    def add(self, requests) -> None:
        for prompt_len, max_tokens, base in requests:
            seq = make_seq(f"r{len(self.seqs)}", prompt_len, max_tokens, base)
            self.seqs.append(seq)
            limit = self.sched.max_model_len
            fits = (limit is None or prompt_len + max_tokens <= limit) and self.eng.never_fits(seq) is None
            assert self.sched.add(seq) is fits
            if not fits:
                assert seq.finish_reason is FinishReason.ERROR and seq.error
                self.done.append(seq)

    @rule(index=st.integers(0, 1000))
    def abort(self, index) -> None:
        if not self.seqs:
            return
        seq = self.seqs[index % len(self.seqs)]
        was_live = not seq.is_finished
        got = self.sched.abort(seq.rid)
        assert (got is seq) is was_live
        if was_live:
            self.done.append(seq)
            event("abort")

    @rule(n=st.integers(1, 6))
    def steps(self, n) -> None:
        for _ in range(n):
            plan, finished = step(self.sched, self.eng, self.stop)
            self.done += finished
            if plan.preempted:
                event("preemption")

    @invariant()
    def pools_and_queues_agree(self) -> None:
        if not hasattr(self, "sched"):
            return
        self.eng.check_pools()
        running, preempted, waiting = self.sched.running, self.sched.preempted, self.sched.waiting
        arrivals = [s.arrival for s in running + preempted + waiting]
        assert arrivals == sorted(set(arrivals)), "queues out of arrival order, or a sequence twice"
        assert all(s.status is SequenceStatus.RUNNING for s in running)
        assert all(s.status is SequenceStatus.PREEMPTED for s in preempted)
        assert all(s.status is SequenceStatus.WAITING for s in waiting)
        assert set(self.eng.held) == {s.rid for s in running + preempted}
        assert {r for r, h in self.eng.held.items() if h.retracted} == {s.rid for s in preempted}
        assert {r for r, h in self.eng.held.items() if h.staged} == {s.rid for s in running if s.is_prefilling}
        # nothing lost, nothing duplicated: each request is either live once or reported done once
        live = {s.rid for s in running + preempted + waiting}
        done = [s.rid for s in self.done]
        assert len(done) == len(set(done)) and live.isdisjoint(done)
        assert live | set(done) == {s.rid for s in self.seqs}

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        live = [s for s in self.seqs if not s.is_finished]
        bound = sum(s.max_total_tokens for s in live) + len(live) + 1  # the module's liveness bound
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            self.done += step(self.sched, self.eng, self.stop)[1]
            self.pools_and_queues_agree()
        assert not self.sched.has_unfinished(), f"not finished within {bound} steps"
        self.pools_and_queues_agree()
        assert self.eng.held == {} and self.eng.kv == {}
        served = sum(s.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for s in self.seqs)
        event(f"requests served: {min(served, 10)}{'+' if served >= 10 else ''}")
        event(f"preemptions: {min(self.sched.num_preemptions, 5)}{'+' if self.sched.num_preemptions >= 5 else ''}")
        for s in self.seqs:
            expected = reference_output(s.rid, s.prompt_ids, s.max_tokens, self.stop)
            if s.finish_reason is FinishReason.ABORT:
                assert s.output_ids == expected[: len(s.output_ids)]
            elif s.finish_reason is FinishReason.ERROR:
                assert s.output_ids == []
            else:
                assert s.output_ids == expected, f"{s.rid}: preempted {s.num_preemptions} times"
                if s.num_preemptions:
                    event("a preempted request finished")


TestSchedulerMachine = pytest.mark.slow(SchedulerMachine.TestCase)  # 300 runs of 40 steps
TestSchedulerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
