"""The step in flight under async scheduling: its sampled tokens still on the device.

`AsyncSteps` owns that step (`InFlightStep`: its sampled requests, where each one's token sits
in its output ids, the device tokens and their host copy, the requests ended meanwhile) and
the time of the last read. It hands the next step its decode rows' tokens on the device
(`feed`: the runner's `TokenFeed`), starts a step's non-blocking copy to the host and advances
the scheduler with `PENDING` tokens (`launch`), and reads the values one step later (`read`:
stop tokens and stop strings applied, the tokens sampled after a stop dropped, the outputs of
the requests that ended). engine.py's docstring says what async scheduling guarantees.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .request_output import LiveRequest, RequestOutput, output_of
from .runner import TokenFeed
from .sampling import finished
from .scheduler import FinishReason, Scheduler, Sequence, StepPlan
from .step_log import StepLog, step_stats

PENDING = -1  # an output token sampled on the device that the host has not read yet


@dataclass
class InFlightStep:
    """A step whose sampled tokens the host has not read yet (async scheduling)."""

    lives: list[LiveRequest]  # the step's sampled requests, in row order
    at: list[int]  # where each one's token sits in its output_ids (PENDING until read)
    tokens: torch.Tensor  # [R] int64 on the device: the next step's decode rows read these
    host: torch.Tensor  # [R] int64 on the host, filled by a non-blocking copy
    ready: torch.cuda.Event | None  # recorded after that copy (None off CUDA)
    started: float
    stats: tuple[int, int, int]  # decode rows, prefill tokens, context (step_log)
    finished: list[Sequence]  # finished at max_tokens in this step: output once the token is read
    # ended by the scheduler while the next step was planned (no room to keep them), their
    # newest token still in this step: rid -> (live, error); output once the token is read
    ended: dict[str, tuple[LiveRequest, str | None]] = field(default_factory=dict)


class AsyncSteps:
    """At most one step in flight (`step`), over the engine's scheduler and live requests."""

    def __init__(self, scheduler: Scheduler, live: dict[str, LiveRequest], eos: tuple[int, ...],
                 step_log: StepLog, device: torch.device) -> None:
        self.scheduler = scheduler
        self.live = live  # the engine's: a request leaves it when its output is made
        self.eos = eos
        self.step_log = step_log
        self.device = device
        self.step: InFlightStep | None = None
        self._last_read = 0.0

    def holds_ended(self, rid: str) -> bool:
        """Whether `rid` ended while the step in flight was planned, its output not made yet."""
        return self.step is not None and rid in self.step.ended

    def end_later(self, seq: Sequence, live: LiveRequest) -> bool:
        """A sequence the scheduler ended while planning: True when its newest token is still on
        the device, so its output is made once the step in flight is read."""
        if self.step is None or PENDING not in seq.output_ids:
            return False
        self.step.ended[seq.rid] = (live, seq.error)
        return True

    def feed(self, plan: StepPlan) -> TokenFeed | None:
        """The decode rows whose last token is still on the device: the step in flight's."""
        rows = [i for i, s in enumerate(plan.decode) if s.output_ids[-1] == PENDING]
        if not rows:
            return None
        inflight = self.step
        assert inflight is not None, "a PENDING token with no step in flight"
        source = {live.seq.rid: i for i, live in enumerate(inflight.lives)}
        return TokenFeed(inflight.tokens, rows, [source[plan.decode[i].rid] for i in rows])

    def launch(self, plan: StepPlan, lives: list[LiveRequest], tokens: torch.Tensor | None, started: float,
               context: int) -> list[RequestOutput]:
        """The step just run becomes the one in flight (`_record`); the previous one is read:
        the outputs of the requests that ended in it."""
        record = self._record(plan, lives, tokens, started, context)
        previous, self.step = self.step, record
        return self.read(previous) if previous is not None else []

    def _record(self, plan: StepPlan, lives: list[LiveRequest], tokens: torch.Tensor | None, started: float,
                context: int) -> InFlightStep:
        """Start copying the step's tokens to the host and advance the scheduler with PENDING
        tokens (max_tokens finishes happen now; stop tokens when the values are read)."""
        if tokens is None:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        cuda = tokens.is_cuda
        host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        at = [len(live.seq.output_ids) for live in lives]
        done = self.scheduler.on_step_done(plan, {live.seq.rid: PENDING for live in lives})
        return InFlightStep(lives, at, tokens, host, ready, started, step_stats(plan, context), done)

    def read_now(self) -> list[RequestOutput]:
        """Read the step in flight now (nothing else to overlap it with)."""
        inflight, self.step = self.step, None
        return self.read(inflight) if inflight is not None else []

    def read(self, step: InFlightStep) -> list[RequestOutput]:
        """A step's token values: into the output ids, stop tokens applied (a request that
        stopped drops the tokens of the steps after; it finishes now if it still runs), and
        the outputs of the requests that finished in it."""
        if step.ready is not None:
            step.ready.synchronize()
        values = step.host.tolist()
        now = time.perf_counter()
        self.step_log.add((*step.stats, now - max(step.started, self._last_read)))
        self._last_read = now
        outputs = []
        for live, at, token in zip(step.lives, step.at, values):
            seq = live.seq
            ended = seq.rid in step.ended
            if (not ended and self.live.get(seq.rid) is not live) or at >= len(seq.output_ids):
                continue  # its output is out (aborted, or stopped at an earlier step)
            seq.output_ids[at] = token
            if live.first_token is None:
                live.first_token = now
            stop_string = live.take(token)
            if finished(live.params, token, at + 1, self.eos or None) == "stop" or stop_string:
                del seq.output_ids[at + 1 :]  # sampled after the stop, in steps already run
                if ended:  # it stopped before it had to be ended: a stop, not an error
                    step.ended[seq.rid] = (live, None)
                    continue
                if seq.is_finished:  # at max_tokens in a later step: the stop token came first
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(seq.rid, FinishReason.STOP)
                self.live.pop(seq.rid)
                outputs.append(output_of(live, FinishReason.STOP.value))
        for seq in step.finished:
            live = self.live.pop(seq.rid, None)
            if live is not None:
                outputs.append(output_of(live, str(seq.finish_reason.value), seq.error))
        for live, error in step.ended.values():
            reason = FinishReason.STOP if error is None else FinishReason.ERROR
            outputs.append(output_of(live, reason.value, error))
        return outputs
