"""The order of the coordinator's hooks within a step, tracked and checked.

One step at a time:

    forward_begin(batch)
      attention_begin(layer, ..., batch) [attend] attention_end(layer, ..., batch)
          once per layer of the layout (dense layers included), layers in any order,
          one layer open at a time; prefetch(layer, ..., batch) any number of times before
          that layer's attention_begin
    forward_end(batch)          or, to abandon the step, abort_step(batch)

Why: every hook changes shared state (lengths, the store's rows and maps, the algorithms'
representations), and a hook called out of order used to corrupt it silently — a second
`forward_begin` advanced the lengths twice and the new request read a finished one's row, a
skipped `attention_end` changed outputs a hundred steps later. Each check here runs before
its hook changes anything, so a refused call (`HookOrderError`) leaves the coordinator as it
was and the caller can go on with the legal call.

A hook that fails *after* changing state (a store or algorithm error, a CUDA error) leaves
the step *broken*: only `abort_step` is accepted then. `abort_step` restores the lengths and
drops the step's scratch; if some layer had already stored this step's K/V, the batch's
requests are *tainted* (their stored KV and representations may hold part of the step) and
must be ended — `on_request_end`, then `on_request_begin` to prefill them again.

Lifecycle hooks during a step: `on_request_begin` is always allowed (a new request is in no
batch); `on_request_end` / `_retract` / `_resume` are refused for a request of the open
step's batch and allowed for the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..common.batch import Batch, Request
from ..common.errors import HookOrderError


@dataclass
class OpenStep:
    """The step between `forward_begin` and `forward_end`."""

    batch: Batch
    seq_lens: list[int]  # each request's seq_len before forward_begin: what abort_step restores
    begun: set[int] = field(default_factory=set)  # layers whose attention_begin ran
    ended: set[int] = field(default_factory=set)  # layers whose attention_end ran
    layer: int | None = None  # the layer begun and not yet ended
    written: int | None = None  # the first layer whose attention_begin changed the store
    broken: str | None = None  # the hook that raised after changing state


def _describe(batch: Batch) -> str:
    kind = "prefill" if batch.is_prefill else "decode"
    return f"{kind} batch of {[r.rid for r in batch.requests]}"


class StepOrder:
    """The coordinator's open step and its checks (the module docstring gives the order).

    `step`: the open step or None; `tainted`: request id -> why it must be ended.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.step: OpenStep | None = None
        self.tainted: dict[str, str] = {}

    @property
    def order(self) -> str:
        return (
            f"the order is forward_begin(batch), then attention_begin(layer) and attention_end(layer) "
            f"once for each of the {self.num_layers} layers, then forward_end(batch)"
        )

    # -- checks (nothing changes when they raise) -------------------------------------------
    def check_forward_begin(self, batch: Batch) -> None:
        step = self.step
        if step is not None:
            left = self._not_run(step)
            again = "forward_begin called twice for the same batch" if batch is step.batch else "forward_begin"
            raise HookOrderError(
                f"{again}: the step of the {_describe(step.batch)} is still open (layers {left} have not run); "
                f"expected forward_end(batch), or abort_step(batch) to abandon it, first; {self.order}",
                "forward_begin",
            )
        for r in batch.requests:
            self._check_tainted("forward_begin", r)

    def check_attention_begin(self, layer: int, batch: Batch) -> None:
        step = self._open("attention_begin", layer, batch)
        if step.layer is not None:
            if step.layer == layer:
                raise HookOrderError(
                    f"attention_begin(layer {layer}) called twice: layer {layer} is already begun in this step; "
                    f"expected attention_end(layer {layer}); {self.order}",
                    "attention_begin", layer,
                )
            raise HookOrderError(
                f"attention_begin(layer {layer}): layer {step.layer} was begun and not ended; expected "
                f"attention_end(layer {step.layer}) before the next layer's attention_begin; {self.order}",
                "attention_begin", layer,
            )
        if layer in step.begun:
            raise HookOrderError(
                f"attention_begin(layer {layer}) called twice in one step: layer {layer} already ran; expected "
                f"{self._next(step)}; {self.order}",
                "attention_begin", layer,
            )

    def check_prefetch(self, layer: int, batch: Batch) -> None:
        """A prefetch for a layer of the open step that has not begun (its selection comes later)."""
        step = self._open("prefetch", layer, batch)
        if layer in step.begun:
            raise HookOrderError(
                f"prefetch(layer {layer}) after the layer's attention_begin in this step: it predicts a selection "
                f"still to come; expected {self._next(step)}; {self.order}",
                "prefetch", layer,
            )

    def check_attention_end(self, layer: int, batch: Batch) -> None:
        step = self._open("attention_end", layer, batch)
        if step.layer == layer:
            return
        if layer in step.ended:
            what = f"attention_end(layer {layer}) called twice in one step"
        else:
            what = f"attention_end(layer {layer}) without attention_begin(layer {layer}) in this step"
        raise HookOrderError(f"{what}; expected {self._next(step)}; {self.order}", "attention_end", layer)

    def check_forward_end(self, batch: Batch) -> None:
        step = self._open("forward_end", None, batch)
        left = self._not_run(step)
        if left:
            raise HookOrderError(
                f"forward_end: layers {left} did not run in this step (every layer, dense ones included, "
                f"needs attention_begin then attention_end); expected {self._next(step)}, or abort_step(batch) "
                f"to abandon the step; {self.order}",
                "forward_end",
            )

    def check_abort(self, batch: Batch) -> OpenStep | None:
        """The step abort_step(batch) abandons (None: no step is open, nothing to do)."""
        step = self.step
        if step is not None and batch is not step.batch:
            raise HookOrderError(
                f"abort_step: this batch is not the open step's ({_describe(step.batch)}); "
                "pass the batch given to forward_begin",
                "abort_step",
            )
        return step

    def check_request(self, hook: str, request: Request) -> None:
        """on_request_end / _retract / _resume: refused for a request of the open batch."""
        step = self.step
        if step is not None and any(r is request for r in step.batch.requests):
            raise HookOrderError(
                f"{hook}(request {request.rid!r}): the request is in the open step's batch; expected "
                "forward_end(batch), or abort_step(batch) to abandon the step, first",
                hook,
            )
        if hook != "on_request_end":
            self._check_tainted(hook, request)

    def check_replay(self, batch: Batch) -> None:
        """step_replayed: the open step is this batch's and no layer has run in it yet."""
        step = self._open("step_replayed", None, batch)
        if step.begun:
            raise HookOrderError(
                f"step_replayed: layers {sorted(step.begun)} already ran in this step; a replayed step "
                "replaces every layer's attention_begin and attention_end", "step_replayed")

    def replayed(self) -> None:
        """Every layer of the open step ran (replayed from an engine's graph)."""
        assert self.step is not None
        self.step.begun.update(range(self.num_layers))
        self.step.ended.update(range(self.num_layers))
        self.step.layer = None
        if self.step.written is None:
            self.step.written = 0  # the replay wrote the store: an abort now taints the requests

    # -- transitions (called once the hook has succeeded) ----------------------------------
    def opened(self, batch: Batch, seq_lens: list[int]) -> None:
        self.step = OpenStep(batch, seq_lens)

    def began(self, layer: int) -> None:
        assert self.step is not None
        self.step.begun.add(layer)
        self.step.layer = layer

    def ended(self, layer: int) -> None:
        assert self.step is not None
        self.step.ended.add(layer)
        self.step.layer = None

    def closed(self) -> None:
        self.step = None

    def abandoned(self, step: OpenStep) -> None:
        """abort_step: close the step; taint its requests if some layer had stored its K/V."""
        if step.written is not None:
            why = (
                f"it was in a {_describe(step.batch)} abandoned with abort_step after layer {step.written} "
                "had stored that step's K/V"
            )
            for r in step.batch.requests:
                self.tainted[r.rid] = why
        self.step = None

    def forget(self, request: Request) -> None:
        """on_request_end: the request (and its taint) is gone."""
        self.tainted.pop(request.rid, None)

    def rewind(self, layer: int) -> None:
        """For benchmarks only, which time one layer's call again and again on one prepared
        step: forget that `layer` ran in the open step. The store is written again at the same
        position by every repeated call; an engine must never do this."""
        step = self.step
        if step is not None:
            step.begun.discard(layer)
            step.ended.discard(layer)
            if step.layer == layer:
                step.layer = None

    @contextmanager
    def work(self, hook: str, layer: int | None, *, writes: bool = False) -> Iterator[None]:
        """Around a hook's state changes: an exception leaves the step broken (abort_step only)."""
        step = self.step
        assert step is not None
        if writes and step.written is None:
            step.written = layer
        try:
            yield
        except BaseException as exc:
            at = hook if layer is None else f"{hook}(layer {layer})"
            step.broken = f"{at} raised {type(exc).__name__} after changing state"
            raise

    # -- helpers ----------------------------------------------------------------------------
    def _open(self, hook: str, layer: int | None, batch: Batch) -> OpenStep:
        at = hook if layer is None else f"{hook}(layer {layer})"
        if layer is not None and not 0 <= layer < self.num_layers:
            raise HookOrderError(f"{at}: layer {layer} out of range 0..{self.num_layers - 1}", hook, layer)
        step = self.step
        if step is None:
            raise HookOrderError(
                f"{at}: no step is open; expected forward_begin(batch) first; {self.order}", hook, layer
            )
        if batch is not step.batch:
            raise HookOrderError(
                f"{at}: this batch is not the open step's ({_describe(step.batch)}); pass the batch given to "
                "forward_begin",
                hook, layer,
            )
        if step.broken is not None:
            raise HookOrderError(
                f"{at}: the open step is broken ({step.broken}); expected abort_step(batch)", hook, layer
            )
        return step

    def _not_run(self, step: OpenStep) -> list[int]:
        return [layer for layer in range(self.num_layers) if layer not in step.ended]

    def _next(self, step: OpenStep) -> str:
        if step.layer is not None:
            return f"attention_end(layer {step.layer})"
        left = self._not_run(step)
        return f"attention_begin for one of layers {left}" if left else "forward_end(batch)"

    def _check_tainted(self, hook: str, request: Request) -> None:
        why = self.tainted.get(request.rid)
        if why is not None:
            raise HookOrderError(
                f"{hook}(request {request.rid!r}): {why}, so its stored KV and the algorithm's state may hold "
                "part of that step; expected on_request_end(request) (then on_request_begin to prefill it again)",
                hook,
            )
