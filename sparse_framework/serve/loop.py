"""`EngineLoop`: the one thread that drives an `Engine`; HTTP handlers only talk to it.

The engine is not thread-safe (two threads stepping it corrupt the scheduler), so exactly one
thread owns it: it takes the handlers' commands (add, abort) from a queue between steps, runs
`step()`, and hands each request's new tokens and its end to that request's `sink` (a callable
the handler gave; the app's sinks post into an asyncio queue with `call_soon_threadsafe`).
Handlers never touch the engine, so the offline API (`LLM.generate`) and the server run the
same code and apply the same admission rules and errors.

Tokens are streamed as they exist on the host: after a step, every running or preempted
sequence's output past what its sink has seen (`Engine.partial_outputs`; a token of async
scheduling still on the device waits for the next step). Where the engine has a tokenizer, the
loop adds its requests with `detokenize=True`: the engine keeps their text and stop strings
(engine/stop.py), and each event carries the text every token made visible (`Event.texts`:
never text that a stop string may still cut); the end's `output.text` is the whole text.

A failed step does not stop the loop: the engine itself ends the requests the step touched
with finish_reason "error" and the reason (Engine._fail_step; the server answers them 500),
frees their pages and serves on; requests the step did not touch (waiting, preempted) go on.
Only an exception out of `Engine.step()` itself (tensor parallelism, or a bug) marks the server
broken: every request is aborted and it answers 503 until restarted.

Start-up runs on the loop thread before `ready` is set (so /health answers 503 until then):
the engine's warm-up where its config asks for it and it has not run yet (`Engine.warm_up`:
every batch bucket's decode step compiled and captured; its progress is in `warm_up_progress`
for /health, in the log, and in a progress bar with `warm_up_bar`), then one short request
through the whole path.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import STEP_FAILED, Engine
from ..engine.request_output import RequestOutput
from ..engine.sampling import SamplingParams
from ..engine.stop import RequestText
from ..engine.warm_up import bar_text, progress_bar

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0  # the store's hit counters are read at most this often (they may synchronise)
IDLE_WAIT_S = 0.05  # an idle loop wakes this often at the latest (a submit or abort wakes it at once)


@dataclass
class Event:
    """What a request's sink receives: new token ids (with `texts`, the text each made visible,
    when the engine keeps the request's text), or its end (`output` set, `output.text` the
    whole text; `server_error` when the engine failed rather than refused the request)."""

    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    output: RequestOutput | None = None
    server_error: bool = False


Sink = Callable[[Event], None]


@dataclass
class _Stream:
    sink: Sink
    text: RequestText | None = None  # the engine's text of the request (Engine.output_text)
    delivered: int = 0

    def event(self, ids: list[int], start: int) -> Event:
        """The event of tokens ids[start:] (with their texts)."""
        new = list(ids[start:])
        texts = self.text.deltas(start, start + len(new)) if self.text is not None else []
        return Event(tokens=new, texts=texts)


@dataclass
class Snapshot:
    """The engine's counters as of the loop's latest step (read by /metrics and admission)."""

    running: int = 0
    waiting: int = 0  # in the engine's waiting queue plus handed to the loop, not yet added
    preempted: int = 0
    preemptions: int = 0
    steps: int = 0
    step_errors: int = 0
    pools: list[dict[str, Any]] = field(default_factory=list)  # Coordinator.memory_stats()
    buffer_hits: int | None = None  # hierarchical store only
    buffer_misses: int | None = None
    prefix_hit_tokens: int | None = None  # prefix caching on only
    prefix_prompt_tokens: int | None = None


class EngineLoop:
    """One background thread stepping `engine`; thread-safe `submit`, `abort` and `snapshot`.

    on_finished(output): called on the loop thread for each request's engine output (the
    app's Prometheus counters), the warm-up request excepted. warm_up_bar: draw the engine
    warm-up's progress bar on stderr (the `serve` command)."""

    def __init__(self, engine: Engine, on_finished: Callable[[RequestOutput], None] | None = None, *,
                 warm_up_bar: bool = False) -> None:
        self.engine = engine
        self._on_finished = on_finished
        self._warm_up_bar = warm_up_bar
        # (done, total, label) of the engine warm-up while it runs (read by /health)
        self.warm_up_progress: tuple[int, int, str] | None = None
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _snapshot, _queued and _closed
        self._queued = 0  # submitted, not yet added to the engine
        self._closed: str | None = None  # why the loop stops (close()); submits after it are aborted
        self._snapshot = Snapshot()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._stats_read = 0.0
        self.ready = threading.Event()
        self.broken: str | None = None  # why the engine can no longer step (None: serving)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- the handlers' side (any thread) --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Queue a request; its tokens and its end go to `sink` (from the loop thread). After
        `close()` the request ends at once with finish_reason "abort" and the reason."""
        with self._lock:
            closed = self._closed
            if closed is None:
                self._queued += 1
                self._commands.put(("add", (rid, prompt_ids, params, sink)))
        if closed is not None:
            sink(Event(output=RequestOutput(rid, prompt_ids, [], "abort", closed), server_error=True))
            return
        self._wake.set()

    def abort(self, rid: str) -> None:
        """Stop a request (its client has gone); its pages are freed by the engine."""
        self._commands.put(("abort", rid))
        self._wake.set()

    def snapshot(self) -> Snapshot:
        with self._lock:
            snap = Snapshot(**vars(self._snapshot))
            snap.waiting += self._queued
            return snap

    @property
    def stopping(self) -> bool:
        return self._closed is not None

    def close(self, reason: str = "the server is shutting down") -> None:
        """Without waiting: end every request in flight with finish_reason "abort" and `reason`
        (at the next step boundary), refuse later submits the same way, and let the thread end."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
            self._commands.put(("stop", reason))  # behind every add already queued
        self._stop.set()
        self._wake.set()

    def stop(self, reason: str = "the server is shutting down", timeout: float = 30.0) -> None:
        """`close(reason)`, then join the thread."""
        self.close(reason)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the loop thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._warm_up()
        except Exception as exc:  # noqa: BLE001 - reported through /health, never raised into uvicorn
            self.broken = f"warm-up failed: {type(exc).__name__}: {exc}"
            log.error("engine warm-up failed\n%s", traceback.format_exc())
        self._publish(force_stats=True)
        self.ready.set()
        while True:
            # sleep only when idle: waiting between the steps of a running batch would add up to
            # IDLE_WAIT_S to every token (the H100 sweep's first run: ITL p50 ~55 ms at any load)
            if not self._has_work():
                self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()
            if self._drain():
                return
            if self._has_work():
                self._step()
            elif time.monotonic() - self._stats_read > STATS_INTERVAL_S:
                self._publish(force_stats=True)

    def _has_work(self) -> bool:
        return self.broken is None and self.engine.has_unfinished()

    def _warm_up(self) -> None:
        """The engine's warm-up (module docstring), then one short greedy request through the
        whole path (prefill, decode, sampling), so that /health says ready only once a step has
        run; it counts in no metric."""
        engine = self.engine
        if engine.wants_warm_up and engine.warm_up_report is None:
            with progress_bar(self._warm_up_bar) as bar:
                def progress(done: int, total: int, label: str) -> None:
                    self.warm_up_progress = (done, total, label)
                    log.info("%s", bar_text(done, total, label))
                    bar(done, total, label)

                engine.warm_up(progress)
        rid = "warm-up"
        self.engine.add_request(rid, [0, 1], SamplingParams(max_tokens=2, temperature=0.0))
        for _ in range(64):  # bounded: a 2-token prompt and 2 tokens take a few steps
            outputs = self.engine.step()
            if any(o.request_id == rid for o in outputs):
                break
        else:
            raise RuntimeError("the warm-up request did not finish in 64 steps")

    def _drain(self) -> bool:
        """Apply the queued commands; True when the loop must end."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return False
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                out = self.engine.abort(arg) if self.broken is None else None
                stream = self._streams.pop(arg, None)
                if out is not None:
                    self._finished(out)
                if stream is not None and out is not None:
                    stream.sink(Event(output=out))
                self._publish()
            elif kind == "stop":
                self._abort_all(arg)
                return True

    def _add(self, rid: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Add a submitted request; it leaves `_queued` in the same snapshot that shows it in the
        engine's queue, so that admission never sees it in neither (or both)."""
        if self.broken is not None:
            self._unqueue()
            sink(Event(output=RequestOutput(rid, prompt_ids, [], "error", self.broken), server_error=True))
            return
        try:
            self.engine.add_request(rid, prompt_ids, params, detokenize=self.engine.tokenizer is not None)
        except Exception as exc:  # noqa: BLE001 - this request only (a duplicate id, a bad value)
            self._unqueue()
            sink(Event(output=RequestOutput(rid, prompt_ids, [], "error", f"{type(exc).__name__}: {exc}")))
            return
        self._streams[rid] = _Stream(sink, self.engine.output_text(rid))
        self._publish(unqueued=1)

    def _unqueue(self) -> None:
        with self._lock:
            self._queued -= 1

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
            log.error("engine step failed\n%s", traceback.format_exc())
            self._fail_step(exc)
            self._publish(force_stats=True)
            return
        failed = False
        for out in outputs:
            self._finished(out)
            server_error = out.finish_reason == "error" and (out.error or "").startswith(STEP_FAILED)
            failed |= server_error
            stream = self._streams.pop(out.request_id, None)
            if stream is None:
                continue
            if len(out.token_ids) > stream.delivered:
                stream.sink(stream.event(out.token_ids, stream.delivered))
            stream.sink(Event(output=out, server_error=server_error))
        if failed:  # the engine ended that step's requests itself and serves on
            with self._lock:
                self._snapshot.step_errors += 1
        for rid, ids in self.engine.partial_outputs().items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if len(ids) > stream.delivered:
                event = stream.event(ids, stream.delivered)
                stream.delivered = len(ids)
                stream.sink(event)
        self._publish()

    def _fail_step(self, exc: Exception) -> None:
        """`engine.step()` itself raised: the engine ends a failed step's requests and serves on
        (Engine._fail_step), so this is a fault it could not recover from (tensor parallelism,
        where the other ranks wait in a collective, or a bug): every request is aborted with
        the reason and the server answers 503 until restarted."""
        with self._lock:
            self._snapshot.step_errors += 1
        self.broken = f"{STEP_FAILED}: {type(exc).__name__}: {exc}; the engine cannot go on: restart the server"
        self._abort_all(self.broken, server_error=True)

    def _abort_all(self, reason: str, server_error: bool = False) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                out = self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                out = None
            if out is not None:
                self._finished(out)
            stream.sink(Event(output=RequestOutput(rid, [], out.token_ids if out else [], "abort", reason),
                              server_error=server_error))
        self._streams.clear()
        while True:  # adds queued behind the stop
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._unqueue()
                arg[3](Event(output=RequestOutput(arg[0], arg[1], [], "abort", reason), server_error=True))

    def _finished(self, out: RequestOutput) -> None:
        if self._on_finished is not None:
            try:
                self._on_finished(out)
            except Exception:  # noqa: BLE001 - metrics never stop the loop
                log.error("on_finished failed\n%s", traceback.format_exc())

    def _publish(self, force_stats: bool = False, unqueued: int = 0) -> None:
        """Copy the engine's counters for the other threads (the store's hit counters at most
        once a second: reading them may synchronise the device); `unqueued` requests just added
        leave `_queued` in the same step."""
        now = time.monotonic()
        read_store = force_stats or now - self._stats_read > STATS_INTERVAL_S
        if read_store:
            self._stats_read = now
        stats = self.engine.stats(store=read_store)
        old = self._snapshot
        snap = Snapshot(running=stats.running, waiting=stats.waiting, preempted=stats.preempted,
                        preemptions=stats.preemptions, steps=stats.steps, step_errors=old.step_errors,
                        pools=stats.pools if read_store else old.pools,
                        buffer_hits=stats.buffer_hits if read_store else old.buffer_hits,
                        buffer_misses=stats.buffer_misses if read_store else old.buffer_misses,
                        prefix_hit_tokens=stats.prefix_hit_tokens, prefix_prompt_tokens=stats.prefix_prompt_tokens)
        with self._lock:
            self._snapshot = snap
            self._queued -= unqueued
