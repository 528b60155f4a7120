"""The coordinator's hook order: every misuse is a `HookOrderError` naming the hook, the layer
and the order expected, the refused call changes nothing, `abort_step` abandons a step without
leaking KV; a hypothesis state machine drives random hook sequences, legal and illegal, and
checks every finished step against a twin coordinator that saw only the legal calls (and,
where every token is selected, against float64 dense attention)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sparse_framework import Batch, KVLayout, Request
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.common.errors import CapacityError, HookOrderError, SparseFrameworkError
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

LAYERS, KV_HEADS, Q_HEADS, DIM, MAX_LEN, MAX_REQUESTS = 2, 2, 4, 8, 64, 3
# sparse: 2 pages of 4 selected per step in a 32-token buffer (sink 4 + recent 8 + top_k 8, whole pages: 28), so
# tokens are evicted and swapped in; layer 1 dense; prompts under 12 tokens decode densely
SPARSE = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "backend": "torch_ref", "top_k": 8, "page_size": 4, "sink_tokens": 4,
          "recent_tokens": 8, "device_buffer_tokens": 32, "min_sparse_prompt_len": 12, "dense_layers": [1],
          "extra": {"dense_first_layers": 0}}
# a budget covering every context: the sparse path selects every token, so it equals dense
COVERING = {**SPARSE, "top_k": MAX_LEN, "device_buffer_tokens": 2 * MAX_LEN, "dense_layers": [],
            "min_sparse_prompt_len": 0}


def make(config: dict) -> SparseCoordinator:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32, device="cpu")
    return SparseCoordinator(config, layout, max_requests=MAX_REQUESTS, max_seq_len=MAX_LEN)


class Data:
    """The model's q/k/v of every (request, layer, position), fixed in advance, so that a step
    retried after an abort, or replayed on a twin coordinator, sees the same tensors."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def rows(self, rid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [MAX_LEN, Q_HEADS, DIM], k/v [MAX_LEN, KV_HEADS, DIM] of one request and layer."""
        key = (rid, layer)
        if key not in self._rows:
            g = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{layer}".encode()))
            self._rows[key] = (torch.randn(MAX_LEN, Q_HEADS, DIM, generator=g),
                               torch.randn(MAX_LEN, KV_HEADS, DIM, generator=g),
                               torch.randn(MAX_LEN, KV_HEADS, DIM, generator=g))
        return self._rows[key]

    def step(self, requests: list[Request], layer: int, prefill: bool, begun: bool = False) -> list[torch.Tensor]:
        """q, k, v of one layer of a step: the packed prompts at prefill, one row per request
        at decode (the token at seq_len, or at seq_len - 1 once forward_begin has `begun`)."""
        parts = []
        for r in requests:
            pos = r.seq_len - begun
            rows = slice(0, r.prompt_len) if prefill else slice(pos, pos + 1)
            parts.append([t[rows] for t in self.rows(r.rid, layer)])
        return [torch.cat(ts) for ts in zip(*parts)]

    def dense(self, rid: str, layer: int, pos: int) -> torch.Tensor:
        """float64 attention of the query at `pos` over tokens 0..pos: [Q_HEADS, DIM]."""
        q, k, v = (t.double() for t in self.rows(rid, layer))
        group = Q_HEADS // KV_HEADS
        kk = k[: pos + 1].repeat_interleave(group, dim=1)
        vv = v[: pos + 1].repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[pos], kk) / math.sqrt(DIM)).softmax(-1)
        return torch.einsum("hl,lhd->hd", probs, vv)


def run_step(coord: SparseCoordinator, data: Data, requests: list[Request], prefill: bool) -> list[torch.Tensor]:
    """One legal step; each layer's attention output."""
    inputs = [data.step(requests, layer, prefill) for layer in range(LAYERS)]
    batch = Batch(requests, is_prefill=prefill)
    coord.forward_begin(batch)
    outs = []
    for layer, (q, k, v) in enumerate(inputs):
        meta = coord.attention_begin(layer, q, k, v, batch)
        outs.append(coord.attend(layer, q, meta))
        coord.attention_end(layer, outs[-1], batch)
    coord.forward_end(batch)
    return outs


def started(config: dict = SPARSE, lens: tuple[int, ...] = (20, 30)) -> tuple[SparseCoordinator, Data, list[Request]]:
    """A coordinator whose requests of `lens` are prefilled and decoded one step."""
    coord, data = make(config), Data()
    reqs = [Request(f"r{i}", n) for i, n in enumerate(lens)]
    for r in reqs:
        coord.on_request_begin(r)
    run_step(coord, data, reqs, True)
    run_step(coord, data, reqs, False)
    return coord, data, reqs


def twin(lens: tuple[int, ...] = (20, 30), config: dict = SPARSE) -> tuple[SparseCoordinator, list[Request]]:
    """The reference: the same requests and steps, through legal calls only."""
    coord, _, reqs = started(config, lens)
    return coord, reqs


def assert_same_steps(coord, data, reqs, ref, ref_reqs, steps: int = 3) -> None:
    """The coordinator and its reference decode `steps` more steps to bit-identical outputs."""
    for _ in range(steps):
        for mine, want in zip(run_step(coord, data, reqs, False), run_step(ref, data, ref_reqs, False)):
            assert torch.equal(mine, want)


def test_forward_begin_twice_is_refused_and_changes_nothing() -> None:
    coord, data, reqs = started()
    batch = Batch(reqs)
    coord.forward_begin(batch)
    with pytest.raises(HookOrderError, match=r"forward_begin called twice for the same batch.*layers \[0, 1\] have not run"
                       r".*expected forward_end\(batch\), or abort_step\(batch\)") as err:
        coord.forward_begin(batch)
    assert err.value.hook == "forward_begin" and isinstance(err.value, ValueError)
    assert [r.seq_len for r in reqs] == [r.prompt_len + 2 for r in reqs]  # the prefill, one step, this one
    coord.abort_step(batch)
    ref, ref_reqs = twin()
    assert_same_steps(coord, data, reqs, ref, ref_reqs)


def test_forward_begin_twice_cannot_hand_a_new_request_a_finished_ones_row() -> None:
    """The issue's case: a request ends, a new one takes its state row, and a doubled
    forward_begin would skip a position still holding the finished request's K row."""
    coord, data, reqs = started(COVERING)
    coord.on_request_end(reqs[0])
    new = Request("new", 16)
    coord.on_request_begin(new)
    run_step(coord, data, [new], True)
    batch = Batch([new])
    coord.forward_begin(batch)
    with pytest.raises(HookOrderError, match="called twice"):
        coord.forward_begin(batch)
    q, k, v = data.step([new], 0, False, begun=True)
    meta = coord.attention_begin(0, q, k, v, batch)
    out = coord.attend(0, q, meta)
    torch.testing.assert_close(out[0].double(), data.dense("new", 0, 16), atol=1e-5, rtol=1e-5)


def test_a_skipped_attention_end_is_refused_at_the_next_layer_and_at_forward_end() -> None:
    coord, data, reqs = started()
    inputs = [data.step(reqs, layer, False) for layer in range(LAYERS)]
    batch = Batch(reqs)
    coord.forward_begin(batch)
    q, k, v = inputs[0]
    out0 = coord.attend(0, q, coord.attention_begin(0, q, k, v, batch))
    q1, k1, v1 = inputs[1]
    with pytest.raises(HookOrderError, match=r"attention_begin\(layer 1\): layer 0 was begun and not ended; "
                       r"expected attention_end\(layer 0\)") as err:
        coord.attention_begin(1, q1, k1, v1, batch)
    assert (err.value.hook, err.value.layer) == ("attention_begin", 1)
    with pytest.raises(HookOrderError, match=r"forward_end: layers \[0, 1\] did not run.*expected attention_end\(layer 0\)"):
        coord.forward_end(batch)
    coord.attention_end(0, out0, batch)  # the refused calls changed nothing: the step goes on
    with pytest.raises(HookOrderError, match=r"forward_end: layers \[1\] did not run.*dense ones included"):
        coord.forward_end(batch)  # layer 1 (a dense layer) skipped altogether
    out1 = coord.attend(1, q1, coord.attention_begin(1, q1, k1, v1, batch))
    coord.attention_end(1, out1, batch)
    coord.forward_end(batch)
    ref, ref_reqs = twin()
    want = run_step(ref, data, ref_reqs, False)
    assert torch.equal(out0, want[0]) and torch.equal(out1, want[1])
    assert_same_steps(coord, data, reqs, ref, ref_reqs)


def test_attention_begin_twice_for_one_layer_is_refused() -> None:
    coord, data, reqs = started()
    batch = Batch(reqs)
    coord.forward_begin(batch)
    q, k, v = data.step(reqs, 0, False)
    meta = coord.attention_begin(0, q, k, v, batch)
    with pytest.raises(HookOrderError, match=r"attention_begin\(layer 0\) called twice: layer 0 is already begun"):
        coord.attention_begin(0, q, k, v, batch)
    coord.attention_end(0, coord.attend(0, q, meta), batch)
    with pytest.raises(HookOrderError, match=r"attention_begin\(layer 0\) called twice in one step.*"
                       r"expected attention_begin for one of layers \[1\]"):
        coord.attention_begin(0, q, k, v, batch)
    with pytest.raises(HookOrderError, match=r"attention_end\(layer 0\) called twice in one step"):
        coord.attention_end(0, None, batch)
    coord.abort_step(batch)


def test_hooks_between_steps_and_an_unfinished_step_are_refused() -> None:
    coord, data, reqs = started()
    q, k, v = data.step(reqs, 0, False)
    batch = Batch(reqs)
    for call, name in ((lambda: coord.attention_begin(0, q, k, v, batch), r"attention_begin\(layer 0\)"),
                       (lambda: coord.attention_end(0, None, batch), r"attention_end\(layer 0\)"),
                       (lambda: coord.forward_end(batch), "forward_end")):
        with pytest.raises(HookOrderError, match=name + ": no step is open; expected forward_begin"):
            call()
    coord.forward_begin(batch)
    for layer in range(LAYERS):  # a whole step but forward_end
        ql, kl, vl = data.step(reqs, layer, False, begun=True)
        coord.attention_end(layer, coord.attend(layer, ql, coord.attention_begin(layer, ql, kl, vl, batch)), batch)
    with pytest.raises(HookOrderError, match=r"forward_begin: the step of the decode batch of \['r0', 'r1'\] is still "
                       r"open \(layers \[\] have not run\); expected forward_end"):
        coord.forward_begin(Batch(reqs))
    with pytest.raises(HookOrderError, match="this batch is not the open step's"):
        coord.forward_end(Batch(reqs))
    assert [r.seq_len for r in reqs] == [r.prompt_len + 2 for r in reqs]
    coord.forward_end(batch)
    ref, ref_reqs = twin()
    run_step(ref, data, ref_reqs, False)
    assert_same_steps(coord, data, reqs, ref, ref_reqs)


def test_attention_end_without_attention_begin_is_a_clear_error() -> None:
    coord, data, reqs = started()
    batch = Batch(reqs)
    coord.forward_begin(batch)
    with pytest.raises(HookOrderError, match=r"attention_end\(layer 0\) without attention_begin\(layer 0\) in this step; "
                       r"expected attention_begin for one of layers \[0, 1\]"):
        coord.attention_end(0, None, batch)
    with pytest.raises(HookOrderError, match=r"attention_end\(layer 7\): layer 7 out of range 0..1"):
        coord.attention_end(7, None, batch)
    coord.abort_step(batch)


def test_request_hooks_during_a_step() -> None:
    """on_request_begin is allowed mid-step; end / retract / resume are refused for a request
    of the open batch and allowed for the others."""
    coord, data, reqs = started(lens=(20, 30, 25))
    coord.on_request_retract(reqs[2])
    batch = Batch(reqs[:2])
    coord.forward_begin(batch)
    for hook in (coord.on_request_end, coord.on_request_retract):
        with pytest.raises(HookOrderError, match=rf"{hook.__name__}\(request 'r0'\): the request is in the open step's batch"):
            hook(reqs[0])
    coord.on_request_resume(reqs[2])  # not in the batch
    coord.on_request_end(reqs[2])
    late = Request("late", 14)
    coord.on_request_begin(late)
    for layer in range(LAYERS):
        q, k, v = data.step(reqs[:2], layer, False, begun=True)
        coord.attention_end(layer, coord.attend(layer, q, coord.attention_begin(layer, q, k, v, batch)), batch)
    coord.forward_end(batch)
    coord.on_request_retract(reqs[0])  # between steps: allowed
    coord.on_request_resume(reqs[0])
    ref, ref_reqs = twin()
    run_step(ref, data, ref_reqs, False)
    assert_same_steps(coord, data, reqs[:2], ref, ref_reqs)


@pytest.mark.parametrize("prefill", [False, True])
def test_abort_before_any_layer_restores_the_step(prefill: bool) -> None:
    coord, data, reqs = started()
    if prefill:
        reqs = [Request("p", 24)]
        coord.on_request_begin(reqs[0])
    batch = Batch(reqs, is_prefill=prefill)
    before = [r.seq_len for r in reqs]
    coord.forward_begin(batch)
    q, k, v = data.step(reqs, 0, prefill)
    with pytest.raises(ValueError, match="k and v must be"):  # refused by the input checks: nothing stored
        coord.attention_begin(0, q, k[:, :1], v, batch)
    coord.abort_step(batch)
    coord.abort_step(batch)  # no step open: nothing to do
    assert [r.seq_len for r in reqs] == before and coord.steps.step is None
    if prefill:
        run_step(coord, data, reqs, True)
        ref = make(SPARSE)
        ref_reqs = [Request("p", 24)]
        ref.on_request_begin(ref_reqs[0])
        run_step(ref, data, ref_reqs, True)
    else:
        ref, ref_reqs = twin()
    assert_same_steps(coord, data, reqs, ref, ref_reqs)


def test_abort_after_a_layer_stored_kv_requires_ending_the_requests() -> None:
    coord, data, reqs = started()
    other = Request("other", 16)
    coord.on_request_begin(other)
    run_step(coord, data, [other], True)
    batch = Batch(reqs)
    coord.forward_begin(batch)
    q, k, v = data.step(reqs, 0, False, begun=True)
    coord.attention_begin(0, q, k, v, batch)
    with pytest.raises(HookOrderError, match="abort_step: this batch is not the open step's"):
        coord.abort_step(Batch(reqs))
    coord.abort_step(batch)
    assert [r.seq_len for r in reqs] == [r.prompt_len + 1 for r in reqs]  # back to before the step
    for call, hook in ((lambda: coord.forward_begin(Batch(reqs)), "forward_begin"),
                       (lambda: coord.on_request_retract(reqs[0]), "on_request_retract")):
        with pytest.raises(HookOrderError, match=rf"{hook}\(request 'r0'\): it was in a decode batch of \['r0', 'r1'\] "
                           r"abandoned with abort_step after layer 0 had stored that step's K/V.*expected on_request_end"):
            call()
    run_step(coord, data, [other], False)  # the other requests go on
    for r in reqs:
        coord.on_request_end(r)
    coord.on_request_end(other)
    assert coord.store.used_tokens() == 0 and coord.requests == {}
    again = [Request("r0", 20), Request("r1", 30)]  # begun anew: prefilled and decoded as before
    for r in again:
        coord.on_request_begin(r)
    run_step(coord, data, again, True)
    ref, ref_reqs = make(SPARSE), [Request("r0", 20), Request("r1", 30)]
    for r in ref_reqs:
        ref.on_request_begin(r)
    run_step(ref, data, ref_reqs, True)
    # a store that held other requests (other slots, other pages) holds the same tokens: the same outputs
    assert_same_steps(coord, data, again, ref, ref_reqs)


def test_a_hook_failing_midway_leaves_a_broken_step_that_only_abort_closes(monkeypatch) -> None:
    coord, data, reqs = started()
    batch = Batch(reqs)
    coord.forward_begin(batch)
    q, k, v = data.step(reqs, 0, False, begun=True)

    def fail(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(coord.algorithm, "select", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        coord.attention_begin(0, q, k, v, batch)
    monkeypatch.undo()
    with pytest.raises(HookOrderError, match=r"attention_begin\(layer 0\): the open step is broken \(attention_begin\(layer 0\) "
                       r"raised RuntimeError after changing state\); expected abort_step\(batch\)"):
        coord.attention_begin(0, q, k, v, batch)
    with pytest.raises(HookOrderError, match="broken"):
        coord.forward_end(batch)
    coord.abort_step(batch)
    for r in reqs:
        coord.on_request_end(r)
    assert coord.store.used_tokens() == 0


def test_benchmarks_rewind_a_layer_to_time_it_again() -> None:
    """benchmarks/decode_layer.py and eager_overhead.py call one layer again and again on one
    prepared step: `steps.rewind(layer)` lets them (the repeated calls give the same output)."""
    coord, data, reqs = started(COVERING)
    batch = Batch(reqs)
    coord.forward_begin(batch)
    q, k, v = data.step(reqs, 0, False, begun=True)
    outs = []
    for end in (False, True, True):
        coord.steps.rewind(0)
        outs.append(coord.attend(0, q, coord.attention_begin(0, q, k, v, batch)))
        if end:
            coord.attention_end(0, outs[-1], batch)
    assert all(torch.equal(o, outs[0]) for o in outs)
    with pytest.raises(HookOrderError, match="called twice"):
        coord.attention_begin(0, q, k, v, batch)


def test_a_replayed_step_counts_every_layer_and_queues_its_host_writes() -> None:
    """An engine that replays a whole decode step from its own CUDA graph reports it with
    step_replayed: accepted only on the open step with no layer run; forward_end then closes
    it, and an abort after it taints the requests (the replay wrote the store)."""
    coord, data, reqs = started(COVERING)
    batch = Batch(reqs)
    with pytest.raises(HookOrderError, match="step_replayed: no step is open"):
        coord.step_replayed(batch, [])
    coord.forward_begin(batch)
    mark = coord.store.pending_mark()
    coord.step_replayed(batch, [])
    assert coord.store.pending_mark() == mark  # nothing recorded: nothing queued
    with pytest.raises(HookOrderError, match=r"layers \[0, 1\] already ran"):
        coord.step_replayed(batch, [])
    coord.forward_end(batch)  # every layer counts as run
    batch = Batch(reqs)
    coord.forward_begin(batch)
    q, k, v = data.step(reqs, 0, False, begun=True)
    coord.attention_end(0, coord.attend(0, q, coord.attention_begin(0, q, k, v, batch)), batch)
    with pytest.raises(HookOrderError, match=r"layers \[0\] already ran"):
        coord.step_replayed(batch, [])

    coord, data, reqs = started(COVERING)
    batch = Batch(reqs)
    coord.forward_begin(batch)
    coord.step_replayed(batch, [])
    coord.abort_step(batch)
    with pytest.raises(HookOrderError, match="abandoned with abort_step"):
        coord.forward_begin(Batch(reqs))


def test_errors_are_sparse_framework_value_errors() -> None:
    assert issubclass(HookOrderError, SparseFrameworkError) and issubclass(HookOrderError, ValueError)


# -- random hook sequences --------------------------------------------------------------------

class HookMachine(RuleBasedStateMachine):
    """Drives coordinator `a` with random hook calls, legal and illegal, over several requests.
    An illegal call must raise HookOrderError and change nothing (lengths, the open step); the
    legal calls are replayed on twin `b` step by step, and every finished step's outputs must
    be bit-identical (and equal float64 dense attention where every token is attended)."""

    CONFIG: dict = SPARSE

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.data = make(self.CONFIG), make(self.CONFIG), Data()
        self.ra: dict[str, Request] = {}
        self.rb: dict[str, Request] = {}
        self.seq: dict[str, int] = {}  # what each request's seq_len must be
        self.tainted: set[str] = set()
        self.retracted: set[str] = set()
        self.step: dict | None = None  # batch, rids, prefill, done, open, written, inputs, outs
        self.count = 0

    # -- helpers ----------------------------------------------------------------------------
    def refused(self, call, hook: str) -> None:
        """`call` must raise HookOrderError naming `hook` and change nothing."""
        def snapshot() -> tuple:
            open_step = self.a.steps.step
            inside = None if open_step is None else (
                open_step.batch, set(open_step.begun), set(open_step.ended), open_step.layer, open_step.broken)
            return ({rid: r.seq_len for rid, r in self.ra.items()}, dict(self.a.steps.tainted), inside,
                    set(self.a.requests), self.a.store.used_tokens())

        before = snapshot()
        with pytest.raises(HookOrderError, match=hook) as err:
            call()
        event(f"refused {err.value.hook}")
        assert snapshot() == before

    def in_step(self, rid: str) -> bool:
        return self.step is not None and rid in self.step["rids"]

    def dense_everywhere(self, layer: int, rid: str) -> bool:
        cfg = self.CONFIG
        return (cfg["top_k"] >= MAX_LEN or layer in cfg["dense_layers"]
                or self.ra[rid].prompt_len < cfg["min_sparse_prompt_len"])

    @initialize(lens=st.lists(st.integers(4, 40), min_size=1, max_size=MAX_REQUESTS))
    def prefilled(self, lens: list[int]) -> None:
        """Start with live requests, so that examples reach decode steps."""
        for n in lens:
            self.begin_request(n)
        self.forward_begin(True, set(range(11)))
        for layer in range(LAYERS):
            self.attention_begin(layer, False)
            self.attention_end(layer)
        self.forward_end()

    # -- requests ---------------------------------------------------------------------------
    @rule(prompt_len=st.integers(4, 40))
    def begin_request(self, prompt_len: int) -> None:
        if len(self.ra) == MAX_REQUESTS:
            return
        rid = f"q{self.count}"
        self.count += 1
        self.ra[rid], self.rb[rid] = Request(rid, prompt_len), Request(rid, prompt_len)
        self.a.on_request_begin(self.ra[rid])  # allowed during a step too
        self.b.on_request_begin(self.rb[rid])
        self.seq[rid] = 0

    @rule(i=st.integers(0, 10))
    def end_request(self, i: int) -> None:
        if not self.ra:
            return
        rid = sorted(self.ra)[i % len(self.ra)]
        if self.in_step(rid):
            return self.refused(lambda: self.a.on_request_end(self.ra[rid]), "on_request_end")
        self.a.on_request_end(self.ra.pop(rid))
        self.b.on_request_end(self.rb.pop(rid))
        self.tainted.discard(rid)
        self.retracted.discard(rid)
        del self.seq[rid]

    @rule(i=st.integers(0, 10))
    def retract_or_resume(self, i: int) -> None:
        live = sorted(rid for rid in self.ra if self.seq[rid] > 0)
        if not live:
            return
        rid = live[i % len(live)]
        hook = "on_request_resume" if rid in self.retracted else "on_request_retract"
        if self.in_step(rid) or rid in self.tainted:
            return self.refused(lambda: getattr(self.a, hook)(self.ra[rid]), hook)
        getattr(self.a, hook)(self.ra[rid])
        getattr(self.b, hook)(self.rb[rid])
        self.retracted ^= {rid}

    # -- steps ------------------------------------------------------------------------------
    @rule(prefill=st.booleans(), picks=st.sets(st.integers(0, 10), min_size=1, max_size=3))
    def forward_begin(self, prefill: bool, picks: set[int]) -> None:
        ready = sorted(rid for rid in self.ra if rid not in self.retracted
                       and (self.seq[rid] == 0 if prefill else 0 < self.seq[rid] < MAX_LEN - 1))
        if not ready:
            return
        rids = sorted({ready[p % len(ready)] for p in picks})
        reqs = [self.ra[rid] for rid in rids]
        if self.step is not None or any(rid in self.tainted for rid in rids):
            return self.refused(lambda: self.a.forward_begin(Batch(reqs, is_prefill=prefill)), "forward_begin")
        inputs = [self.data.step(reqs, layer, prefill) for layer in range(LAYERS)]
        batch = Batch(reqs, is_prefill=prefill)
        if not prefill and not self.a.can_grow(reqs):
            # a full device pool (requests decoding densely outgrow the sparse layers' pool) is a
            # documented outcome, not a hook error: forward_begin raises CapacityError and
            # changes nothing; an engine preempts instead (here: the newest request ends)
            lengths = {rid: r.seq_len for rid, r in self.ra.items()}
            with pytest.raises(CapacityError):
                self.a.forward_begin(batch)
            assert {rid: r.seq_len for rid, r in self.ra.items()} == lengths and self.a.steps.step is None
            event("pool full: a request ended")
            return self.end_request(sorted(self.ra).index(rids[-1]))
        self.a.forward_begin(batch)
        self.step = dict(batch=batch, rids=rids, prefill=prefill, done=set(), open=None, written=False,
                         inputs=inputs, outs={}, before={rid: self.seq[rid] for rid in rids})
        for r in reqs:
            self.seq[r.rid] = r.prompt_len if prefill else self.seq[r.rid] + 1

    @rule()
    def forward_begin_again(self) -> None:
        if self.step is not None:
            self.refused(lambda: self.a.forward_begin(self.step["batch"]), "forward_begin called twice")

    @rule(layer=st.integers(0, LAYERS - 1), other_batch=st.booleans())
    def attention_begin(self, layer: int, other_batch: bool) -> None:
        step = self.step
        if step is None:
            if self.ra:
                reqs = list(self.ra.values())[:1]
                q, k, v = (t[:1] for t in self.data.rows(reqs[0].rid, layer))
                self.refused(lambda: self.a.attention_begin(layer, q, k, v, Batch(reqs)), "no step is open")
            return
        q, k, v = step["inputs"][layer]
        batch = Batch(step["batch"].requests, is_prefill=step["prefill"]) if other_batch else step["batch"]
        if other_batch or step["open"] is not None or layer in step["done"]:
            return self.refused(lambda: self.a.attention_begin(layer, q, k, v, batch), rf"attention_begin\(layer {layer}\)")
        meta = self.a.attention_begin(layer, q, k, v, batch)
        step["outs"][layer] = self.a.attend(layer, q, meta)
        step["open"], step["written"] = layer, True

    @rule(layer=st.integers(0, LAYERS - 1))
    def attention_end(self, layer: int) -> None:
        step = self.step
        batch = step["batch"] if step is not None else Batch(list(self.ra.values())[:1])
        if step is None or step["open"] != layer:
            if batch.requests:
                self.refused(lambda: self.a.attention_end(layer, None, batch), rf"attention_end\(layer {layer}\)")
            return
        self.a.attention_end(layer, step["outs"][layer], batch)
        step["done"].add(layer)
        step["open"] = None

    @rule()
    def forward_end(self) -> None:
        step = self.step
        if step is None or step["open"] is not None or len(step["done"]) < LAYERS:
            if step is not None or self.ra:
                batch = step["batch"] if step is not None else Batch(list(self.ra.values())[:1])
                self.refused(lambda: self.a.forward_end(batch), "forward_end")
            return
        self.a.forward_end(step["batch"])
        self.step = None
        event("prefill step checked" if step["prefill"] else f"decode step of {len(step['rids'])} checked")
        reqs_b = [self.rb[rid] for rid in step["rids"]]
        want = run_step(self.b, self.data, reqs_b, step["prefill"])
        for layer in range(LAYERS):
            assert torch.equal(step["outs"][layer], want[layer])
            if step["prefill"]:
                continue
            for i, rid in enumerate(step["rids"]):
                if self.dense_everywhere(layer, rid):
                    ref = self.data.dense(rid, layer, self.seq[rid] - 1)
                    torch.testing.assert_close(want[layer][i].double(), ref, atol=1e-5, rtol=1e-5)

    @rule(often=st.integers(0, 3))
    def abort_step(self, often: int) -> None:
        step = self.step
        if step is not None and often:  # an open step is abandoned a quarter of the times drawn
            return
        if step is None:
            if self.ra:
                self.a.abort_step(Batch(list(self.ra.values())[:1]))  # nothing open: nothing to do
            return
        self.a.abort_step(step["batch"])
        self.seq.update(step["before"])
        if step["written"]:  # the requests hold part of the step: refused until ended
            self.tainted |= set(step["rids"])
            again = Batch(list(step["batch"].requests), is_prefill=step["prefill"])
            self.refused(lambda: self.a.forward_begin(again), "abandoned with abort_step")
        event("abort after a layer stored" if step["written"] else "abort before any layer")
        self.step = None

    @rule(moves=st.integers(1, 30), data=st.data())
    def advance(self, moves: int, data: st.DataObject) -> None:
        """The next legal calls of the protocol (random calls alone rarely finish a step)."""
        for _ in range(moves):
            step = self.step
            if step is None:
                ready = [rid for rid in self.ra if rid not in self.retracted and rid not in self.tainted]
                if self.tainted:
                    self.end_request(sorted(self.ra).index(sorted(self.tainted)[0]))
                elif any(self.seq[rid] == 0 for rid in ready):
                    self.forward_begin(True, set(range(11)))
                elif any(0 < self.seq[rid] < MAX_LEN - 1 for rid in ready):
                    self.forward_begin(False, data.draw(st.sets(st.integers(0, 10), min_size=1, max_size=3)))
                elif len(self.ra) < MAX_REQUESTS:
                    self.begin_request(data.draw(st.integers(4, 40)))
                else:
                    self.end_request(data.draw(st.integers(0, 10)))
            elif step["open"] is not None:
                self.attention_end(step["open"])
            elif len(step["done"]) < LAYERS:
                left = sorted(set(range(LAYERS)) - step["done"])
                self.attention_begin(data.draw(st.sampled_from(left)), False)  # layers in any order
            else:
                self.forward_end()

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def lengths_and_step_agree(self) -> None:
        assert {rid: r.seq_len for rid, r in self.ra.items()} == self.seq
        assert (self.a.steps.step is None) == (self.step is None)

    def teardown(self) -> None:
        """Whatever happened, abort + end leaves nothing allocated."""
        if self.step is not None:
            self.a.abort_step(self.step["batch"])
        for r in list(self.ra.values()):
            self.a.on_request_end(r)
        assert self.a.store.used_tokens() == 0 and self.a.store.host_alloc.used == 0


class CoveringHookMachine(HookMachine):
    CONFIG = COVERING


RUNS = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestHookSequencesSparse = pytest.mark.slow(HookMachine.TestCase)  # the Covering machine runs by default
TestHookSequencesSparse.settings = RUNS
TestHookSequencesCovering = CoveringHookMachine.TestCase
TestHookSequencesCovering.settings = RUNS
