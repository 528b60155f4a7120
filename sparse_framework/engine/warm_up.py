"""Warm start (issue 30): every batch bucket's decode step compiled and captured before the first request.

The first decode step of a new batch shape costs seconds on a GPU (2-4 s measured on the H100):
Triton compiles its kernels for the new shapes, and with `cuda_graphs` the step runs eagerly
the first time and is captured the second (step_graphs.py; `decode_graphs` likewise per layer,
decode_graphs.py). `warm_up` pays that at start-up instead of a user:

- buckets: a step graph's key is the batch's composition — its exact size and which rows
  decode densely — and its context width rounded up to `graph_bucket_tokens` (decode graphs
  key their layers alike). There is no padding to a few sizes, so every size from the
  engine's request rows down to 1 is a bucket; largest first, as vLLM captures, so the
  smaller captures reuse the largest one's blocks of the shared pool (step_graphs.py). Each
  size is warmed with every row sparse (forced, as `SamplingParams.sparse=True` does) and,
  when the config decodes short prompts densely (min_sparse_prompt_len > 0), with every row
  dense: `buckets`.
- each bucket runs the decode steps a new key needs: two with graphs (the eager first sight,
  then the capture and its replay), one without (the kernels' compilation). On the CPU there
  are no graphs and nothing to compile: the warm-up is off by default there
  (`EngineConfig.warm_up=None` means on for a CUDA device with cuda_graphs or decode_graphs),
  and `warm_up=True` runs the same steps eagerly (what the tests exercise).
- the steps run over dummy requests admitted straight into the runner (`ModelRunner.admit`,
  a short prompt prefilled in chunks of at most max_num_batched_tokens, its greedy tokens fed
  back), never through the scheduler: no request is queued, no step is logged
  (`Engine.step_log`, `steps`), the prefix cache sees nothing (the runner's hooks are off),
  and the sampler's shared generator draws nothing (greedy rows). Afterwards the dummies are
  freed in the reverse order of their admission, so the coordinator's free rows are as
  before; the coordinator's dense tally and the store's hit, miss and transfer counters and
  LRU clock are restored, and swap-in timing is off meanwhile. Page ids may come back to the
  store's free stacks in another order (they are interchangeable).
- the prefill path first (`_warm_prefill`): one dummy whose prompt spans two chunks of the
  engine's token budget (at most max_model_len - 1 tokens), prefilled sparse and then, where the
  config decodes short prompts densely, dense, so that the first real prompt finds the prefill's
  kernels compiled and chosen (the chunked-prefill attention of a chunk after the first, the
  algorithm's `build` over a whole prompt, the store's hand-over): without it the first
  `generate` after start-up took 8.4 s where the second took 5.6 s (H200, 8 x 32K, dense).
- what is captured is each size at the first width bucket (contexts up to graph_bucket_tokens,
  1024 tokens): the dummies stay within it. A batch at a longer context, or mixing dense and
  sparse rows, is still run eagerly once and captured at its second step, its kernels already
  compiled.

With cuda_graphs, the report gives the device memory the warm-up left reserved
(`torch.cuda.memory_reserved` after less before, the allocator's cache emptied on both sides:
the graphs' pool, the shared logits buffer, the static step tensors), beside the memory
plan's `graph_bytes` estimate, so that a GPU run can compare them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .memory import EngineMemoryPlan
from .models import ModelConfig
from .runner import DecodeRow, ModelRunner, PrefillChunk
from .sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)

WarmUpProgress = Callable[[int, int, str], None]  # (buckets done, buckets in all, what runs now)
PROMPT_TOKENS = 16  # a dummy request's prompt (fewer where max_model_len or the width bucket is short)
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
_STORE_COUNTERS = ("counts", "rows_out", "clock")  # the store's device counters the warm-up leaves as they were


class Settings(Protocol):
    """The EngineConfig fields the warm-up reads."""

    @property
    def warm_up(self) -> bool | None: ...
    @property
    def cuda_graphs(self) -> bool: ...
    @property
    def decode_graphs(self) -> bool: ...
    @property
    def max_num_batched_tokens(self) -> int: ...


class Engine(Protocol):
    """What the warm-up needs of an `Engine` (engine.py imports this module, not the reverse)."""

    config: Settings
    runner: ModelRunner
    sampler: Sampler
    device: torch.device
    num_seqs: int
    max_model_len: int
    model_config: ModelConfig
    memory_plan: EngineMemoryPlan | None

    def has_unfinished(self) -> bool: ...


@dataclass(frozen=True)
class WarmUpReport:
    """What `warm_up` ran: the buckets (batch size, rows dense) in order, those skipped for want
    of room, the decode steps, the graphs captured (whole steps, coordinator layers), the time
    taken, and on CUDA the bytes the warm-up left reserved beside the plan's estimate."""

    buckets: tuple[tuple[int, bool], ...]
    skipped: tuple[tuple[int, bool], ...]
    steps: int
    step_graphs_captured: int
    layer_graphs_captured: int
    seconds: float
    graph_bytes_measured: int | None  # CUDA only: memory_reserved after - before
    graph_bytes_planned: int | None  # the memory plan's `graph_bytes` (None: no plan)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the log."""
        line = (f"warm-up: {len(self.buckets) - len(self.skipped)} batch buckets, {self.steps} decode steps, "
                f"{self.step_graphs_captured} step graphs and {self.layer_graphs_captured} layer graphs captured "
                f"in {self.seconds:.1f} s")
        if self.skipped:
            line += f"; skipped (no room): {', '.join(_name(*b) for b in self.skipped)}"
        if self.graph_bytes_measured is not None:
            planned = "-" if self.graph_bytes_planned is None else f"{self.graph_bytes_planned / 2**30:.2f} GiB"
            line += f"; graphs took {self.graph_bytes_measured / 2**30:.2f} GiB (planned {planned})"
        return line


def warm_up_enabled(config: Settings, device: torch.device) -> bool:
    """Whether an engine's owner (LLM, the server) warms it up: EngineConfig.warm_up, where None
    means on for a CUDA device with cuda_graphs or decode_graphs (a CPU has no graphs to
    capture and no kernels to compile)."""
    if config.warm_up is not None:
        return config.warm_up
    return device.type == "cuda" and (config.cuda_graphs or config.decode_graphs)


def buckets(engine: Engine) -> list[tuple[int, bool]]:
    """(batch size, rows dense) of every bucket the warm-up runs, in order (module docstring)."""
    kinds = [False] + ([True] if engine.runner.coord.config.min_sparse_prompt_len > 0 else [])
    return [(size, dense) for dense in kinds for size in range(engine.num_seqs, 0, -1)]


def warm_up(engine: Engine, progress: WarmUpProgress | None = None) -> WarmUpReport:
    """Run every bucket's decode steps over dummy requests and leave the engine as it was
    (module docstring). `progress(done, total, label)` is called before each bucket (done =
    buckets finished) and once at the end (done == total, "done"). Refused (RuntimeError) on an
    engine with requests: it is meant for start-up."""
    runner = engine.runner
    if engine.has_unfinished() or runner.requests:
        raise RuntimeError("Engine.warm_up runs before the first request: this engine has requests queued or "
                           "running")
    coord = runner.coord
    graphs = runner.step_graphs is not None or coord.graphs is not None
    steps_per_bucket = 2 if graphs else 1
    limit = engine.max_model_len if coord.graphs is None else min(engine.max_model_len, coord.graphs.bucket)
    prompt = min(PROMPT_TOKENS, limit - steps_per_bucket)
    todo = buckets(engine) if prompt >= 1 else []
    verb = "capturing" if graphs else ("compiling" if engine.device.type == "cuda" else "running")
    captured = (_captures(runner.step_graphs), _captures(coord.graphs))
    before = _reserved(engine.device)
    started = time.perf_counter()
    restore = _keep_state(engine)
    skipped: list[tuple[int, bool]] = []
    steps = 0
    dummies: _Dummies | None = None
    try:
        if todo:  # (inside the first bucket's progress: the bar counts buckets)
            log.debug("warming up: the prefill path")
            _warm_prefill(engine, dense_too=any(dense for _, dense in todo))
        for done, (size, dense) in enumerate(todo):
            if dummies is None or dummies.dense != dense:  # the dense rows after every sparse bucket
                if dummies is not None:
                    dummies.free()
                dummies = _Dummies(engine, dense, prompt, limit)
            _call(progress, done, len(todo), f"{verb} {_name(size, dense)}")
            if not dummies.ready(size, steps_per_bucket):
                skipped.append((size, dense))
                continue
            for _ in range(steps_per_bucket):
                dummies.decode(size)
                steps += 1
        _call(progress, len(todo), len(todo), "done")
    finally:
        try:
            if dummies is not None:
                dummies.free()
        finally:
            restore()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    after = _reserved(engine.device)
    plan = engine.memory_plan
    report = WarmUpReport(
        buckets=tuple(todo), skipped=tuple(skipped), steps=steps,
        step_graphs_captured=_captures(runner.step_graphs) - captured[0],
        layer_graphs_captured=_captures(coord.graphs) - captured[1], seconds=time.perf_counter() - started,
        graph_bytes_measured=None if before is None or after is None else after - before,
        graph_bytes_planned=None if plan is None else plan.graph_bytes,
    )
    log.info("%s", report.describe())
    return report


def _warm_prefill(engine: Engine, dense_too: bool) -> None:
    """Prefill one dummy prompt in two chunks (the second attends to the first: the chunked
    path), sparse and then dense, and free it; skipped where the pools have no room for it."""
    budget = engine.config.max_num_batched_tokens
    length = min(engine.max_model_len - 1, budget + max(1, budget // 2))
    if length < 2:
        return
    first = min(budget, length - 1)
    vocab = engine.model_config.vocab_size
    prompt = tuple(t % vocab for t in range(1, length + 1))
    runner = engine.runner
    for dense in (False, True) if dense_too else (False,):
        rid = f"warm-up/prefill/{'dense' if dense else 'sparse'}"
        if not runner.admit(rid, length, sparse=not dense):
            log.info("warm-up: no room for a %d-token prefill; the first prompt compiles the prefill", length)
            return
        try:
            runner.execute([], [PrefillChunk(rid, prompt[:first], 0, False)])
            runner.execute([], [PrefillChunk(rid, prompt[first:], first, True)])
        finally:
            runner.free(rid)


class _Dummies:
    """The dummy requests of one kind (dense or sparse rows), in admission order."""

    def __init__(self, engine: Engine, dense: bool, prompt_len: int, limit: int) -> None:
        self.engine, self.runner = engine, engine.runner
        self.dense, self.prompt_len, self.limit = dense, prompt_len, limit
        vocab = engine.model_config.vocab_size
        self.prompt = tuple(t % vocab for t in range(1, prompt_len + 1))
        self.live: list[tuple[str, int]] = []  # (rid, its last token)
        self._next = 0

    def ready(self, size: int, steps: int) -> bool:
        """Whether `size` dummies are prefilled with room for `steps` more tokens each within
        the limit (the dummies that would pass it are replaced by fresh ones first); False when
        the pools have no room for that many."""
        if any(self.runner.seq_len(rid) + steps > self.limit for rid, _ in self.live[:size]):
            self.free()
        while len(self.live) < size:
            if not self._admit(size - len(self.live)):
                return False
        return True

    def _admit(self, want: int) -> bool:
        """Admit up to `want` dummies, as many as one prefill step takes, and prefill them."""
        budget = max(self.engine.config.max_num_batched_tokens, self.prompt_len)
        group: list[str] = []
        while len(group) < want and (len(group) + 1) * self.prompt_len <= budget:
            rid = f"warm-up/{'dense' if self.dense else 'sparse'}/{self._next}"
            if not self.runner.admit(rid, self.prompt_len, sparse=not self.dense):
                break
            self._next += 1
            group.append(rid)
            self.live.append((rid, -1))
        if not group:
            return False
        logits = self.runner.execute([], [PrefillChunk(rid, self.prompt, 0, True) for rid in group])
        self._feed(len(self.live) - len(group), logits)
        return True

    def decode(self, size: int) -> None:
        """One decode step of the first `size` dummies, their sampled tokens fed back."""
        logits = self.runner.execute([DecodeRow(rid, token) for rid, token in self.live[:size]], [])
        self._feed(0, logits)

    def _feed(self, first: int, logits: torch.Tensor) -> None:
        tokens = self.engine.sampler.sample(logits, [_GREEDY] * logits.shape[0]).tolist()
        for i, token in enumerate(tokens):
            self.live[first + i] = (self.live[first + i][0], token)

    def free(self) -> None:
        """Free every dummy, the last admitted first: the coordinator's free rows come back in
        their order."""
        while self.live:
            rid, _ = self.live.pop()
            self.runner.free(rid)


def _keep_state(engine: Engine) -> Callable[[], None]:
    """Switch off what must not see the dummies and save the counters they move; the function
    returned puts everything back."""
    runner = engine.runner
    coord, store = runner.coord, runner.coord.store
    hooks = runner.chunk_hook, runner.commit_hook
    runner.chunk_hook = runner.commit_hook = None  # the prefix cache's: no dummy window or key kept
    timing = getattr(store, "timing", None)
    if timing is not None:
        store.timing = False  # no swap-in time counted
    tally = dataclasses.replace(coord.dense_tally, dense_requests=coord.dense_tally.dense_requests.copy(),
                                dense_layer_steps=coord.dense_tally.dense_layer_steps.copy())
    counters = [(t, t.clone()) for t in (getattr(store, name, None) for name in _STORE_COUNTERS)
                if isinstance(t, torch.Tensor)]

    def restore() -> None:
        runner.chunk_hook, runner.commit_hook = hooks
        if timing is not None:
            store.timing = timing
        vars(coord.dense_tally).update(vars(tally))
        for live, saved in counters:  # in place: captured graphs add to these very tensors
            live.copy_(saved)

    return restore


def _captures(graphs: Any) -> int:
    return 0 if graphs is None else graphs.captures


def _reserved(device: torch.device) -> int | None:
    """CUDA: the bytes torch's allocator holds once its cache of unused blocks is returned
    (graph pools stay: their graphs hold them). None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def _name(size: int, dense: bool) -> str:
    return f"batch {size}" + (", dense rows" if dense else "")


def _call(progress: WarmUpProgress | None, done: int, total: int, label: str) -> None:
    log.debug("warming up: %s (%d/%d)", label, min(done + 1, total), total)
    if progress is not None:
        progress(done, total, label)


def bar_text(done: int, total: int, label: str) -> str:
    """The progress line: "warming up: capturing batch 8 (3/12)"."""
    return f"warming up: {label} ({min(done + 1, total)}/{total})"


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[WarmUpProgress]:
    """A rich progress bar on stderr for the warm-up (transient; nothing is drawn where stderr
    is not a terminal); yields the `progress` callback."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, disable=not enabled) as bar:
        task = bar.add_task("warming up", total=None)

        def update(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=bar_text(done, total, label))

        yield update
