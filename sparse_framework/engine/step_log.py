"""The engine's record of the steps it ran, and its counters in one object (`EngineStats`).

`StepLog` owns, per step run, its decode rows, prefill tokens, the decode rows' context tokens
and its seconds (the last `STEP_LOG_LIMIT` only, so a server's engine does not grow it
forever), and the count of every step run; `engine_stats` reads the scheduler's, the
coordinator's and the prefix cache's counters into an `EngineStats`. Benchmarks and servers
read these; the step loop (engine.py) and the async reads (async_steps.py) only append.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ..config import SparseConfig
from ..coordinator.core import SparseCoordinator
from .prefix_cache import PrefixCache
from .scheduler import Scheduler, StepPlan

STEP_LOG_LIMIT = 1 << 16  # steps kept in Engine.step_log (benchmarks read whole runs; far shorter)


class StepLog:
    """Per step run: (decode rows, prefill tokens, context tokens of the decode rows, seconds).

    A step ends with its sampled tokens on the host (async scheduling: when they are read, its
    time counted from its start or the previous read, whichever is later)."""

    def __init__(self) -> None:
        self.entries: deque[tuple[int, int, int, float]] = deque(maxlen=STEP_LOG_LIMIT)
        self.steps = 0  # every step run, also past the limit

    def add(self, entry: tuple[int, int, int, float]) -> None:
        self.entries.append(entry)
        self.steps += 1


def step_stats(plan: StepPlan, context: int) -> tuple[int, int, int]:
    """A step's entry but its seconds: decode rows, prefill tokens, context tokens of the decode rows."""
    return len(plan.decode), plan.num_tokens - len(plan.decode), context


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters in one object (`Engine.stats`), for servers and reports: they read
    this rather than the scheduler, the runner or the coordinator."""

    running: int
    waiting: int
    preempted: int
    preemptions: int
    steps: int
    config: SparseConfig  # as resolved for the device (backend "auto" named)
    dense_tally: Any  # the coordinator's DenseTally: requests and layer-steps dense, by reason
    pools: list[dict[str, Any]] | None = None  # with store=True: Coordinator.memory_stats()
    buffer_hits: int | None = None  # with store=True, hierarchical store only
    buffer_misses: int | None = None
    prefix_hit_tokens: int | None = None  # prefix caching on only
    prefix_prompt_tokens: int | None = None


def engine_stats(scheduler: Scheduler, coord: SparseCoordinator, prefix_cache: PrefixCache | None, steps: int,
                 store: bool) -> EngineStats:
    """The counters as of the last step; `store`: also the pools and the device buffer's hits
    (reading them may synchronise the device)."""
    extra: dict[str, Any] = {}
    if store:
        extra["pools"] = coord.memory_stats()
        if coord.config.store != "resident" and hasattr(coord.store, "stats"):
            counts = coord.store.stats()
            extra["buffer_hits"] = sum(int(c["hits"]) for c in counts)
            extra["buffer_misses"] = sum(int(c["misses"]) for c in counts)
    if prefix_cache is not None:
        extra["prefix_hit_tokens"] = prefix_cache.stats.hit_tokens
        extra["prefix_prompt_tokens"] = prefix_cache.stats.prompt_tokens
    return EngineStats(running=len(scheduler.running), waiting=len(scheduler.waiting),
                       preempted=len(scheduler.preempted), preemptions=scheduler.num_preemptions, steps=steps,
                       config=coord.config, dense_tally=coord.dense_tally, **extra)
