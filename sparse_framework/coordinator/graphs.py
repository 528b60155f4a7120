"""CUDA-graph replay of decode layers inside the coordinator (`decode_graphs=True`).

Why: one decode layer is ~15 kernel launches and ~40 torch ops issued from Python — 0.6–1.7 ms
of host time at batch 8 on the H100 machines' hosts, several times the 0.1–0.2 ms the GPU needs
for it (docs/performance.md). An engine that runs its layers eagerly (transformers, a research loop)
then waits on Python. With `decode_graphs` the coordinator captures each layer's decode work —
store write, select, make resident, adapt, attend, append — once per batch composition and
replays it: per layer the host copies the inputs into the graph's buffers and launches one graph.

What a captured graph depends on is held fixed or in device memory:
- the step's tensors (lengths, state rows, the sparse / dense split) live in static tensors
  per batch composition, refreshed in place by `bind` at `forward_begin` (once per step, one
  kernel per dtype: `Staging`);
- the context width the algorithms score (`batch.max_seq_len`) is rounded up to `bucket`
  tokens — score entries past a request's length are ignored by the algorithms' contract —
  so one graph serves `bucket` consecutive steps;
- the inputs are copied into the graph's buffers with one kernel per dtype (`Staging`);
- the store's device→host writes, which it queues in Python while the layer is captured, are
  queued again after every replay (`HierarchicalKVStore.take_pending` / `queue_pending`);
- swap-in time is not measured (no timing events inside a graph); hits, misses and rows moved
  are counted on the device as before.

A (layer, composition, width, input signature) seen for the first time runs eagerly, which
compiles the kernels and makes lazily allocated buffers outside any capture; the second time
it is captured and replayed. If a capture fails (a backend that synchronises with the host,
say) that key runs eagerly from then on, with one warning.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..common.batch import Batch

# the step tensors of a Batch (and of its sparse / dense sub-batches) that graphs read
STEP_TENSORS = ("seq_lens", "slot_ids", "sparse_mask", "sparse_rows", "dense_rows")

Body = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", dict[str, torch.Tensor]], tuple[Any, torch.Tensor]]


def bucket_width(max_len: int, bucket: int, cap: int) -> int:
    """`max_len` rounded up to a multiple of `bucket`, at most `cap` (and at least max_len)."""
    return max(max_len, min(-(-max_len // bucket) * bucket, cap))


class Staging:
    """A graph's input buffers, laid out back to back in one flat buffer per dtype, so that
    refilling them is one `torch.cat` kernel per dtype. Measured on an H100 (MHA DSA 128K
    B=8, six bf16 inputs, 32 layers in a row, benchmarks/graph_overhead_parts.py): refilling
    with `torch._foreach_copy_` added 18.7 µs per layer to the replay, one `cat` 6.3 µs."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.groups: list[tuple[torch.Tensor, list[int]]] = []
        self.views: list[torch.Tensor] = [tensors[0]] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=dtype, device=tensors[0].device)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                self.views[i] = flat[offset : offset + n].view(tensors[i].shape)
                offset += n
            self.groups.append((flat, idx))
        self.fill(tensors)

    def fill(self, tensors: list[torch.Tensor]) -> None:
        """Copy `tensors` (the shapes and dtypes staged) into the buffers."""
        for flat, idx in self.groups:
            torch.cat([tensors[i].reshape(-1) for i in idx], out=flat)


@dataclass
class _Entry:
    """One captured layer: its graph (None once a capture failed), its staged inputs, the
    metadata and output it writes, and the store writes it queues."""

    graph: torch.cuda.CUDAGraph | None
    inputs: Staging | None
    meta: Any = None
    output: torch.Tensor | None = None
    pending: list | None = None


class DecodeGraphs:
    """The coordinator's captured decode layers, least recently used dropped past `max_graphs`.

    store: the coordinator's store (its queued host writes are replayed); bucket: tokens of
    context width one graph serves; cap: the longest width (the coordinator's max_seq_len).
    Counters: `eager` (calls run eagerly: first sightings and failed captures), `captures`,
    `replays`.
    """

    def __init__(self, store: Any, bucket: int, cap: int, max_graphs: int) -> None:
        self.store, self.bucket, self.cap, self.max_graphs = store, bucket, cap, max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self._stream: torch.cuda.Stream | None = None
        self._batches: dict[tuple, Staging] = {}
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._seen: set[tuple] = set()
        self._warned = False
        self.eager = self.captures = self.replays = 0
        # True while an engine captures a whole decode step around the coordinator's hooks:
        # each layer's body then runs as it is, inside the engine's graph (no graph of its own)
        self.inline = False

    # -- per step -------------------------------------------------------------------------
    def bind(self, batch: Batch) -> tuple:
        """Point a prepared decode batch's step tensors at this composition's static tensors
        (values copied in) and round its width up to the bucket. Returns the composition."""
        parts = [batch] + [b for b in (batch.sparse_batch, batch.dense_batch) if b is not None and b is not batch]
        comp = (len(batch), tuple(r.dense for r in batch.requests))
        fresh = [getattr(p, name) for p in parts for name in STEP_TENSORS]
        static = self._batches.get(comp)
        if static is None:
            static = self._batches[comp] = Staging(fresh)
        else:
            static.fill(fresh)
        it = iter(static.views)
        width = bucket_width(batch.max_seq_len, self.bucket, self.cap)
        for p in parts:
            for name in STEP_TENSORS:
                setattr(p, name, next(it))
            p.max_seq_len = width
        return comp

    # -- per layer ------------------------------------------------------------------------
    def captured_entries(self) -> list[_Entry]:
        """The layers captured so far (for benchmarks that replay a graph bare)."""
        return [e for e in self._entries.values() if e.graph is not None]

    def captured(self, key: tuple) -> bool:
        """Whether `key` has a graph (its inputs passed the coordinator's checks before)."""
        entry = self._entries.get(key)
        return entry is not None and entry.graph is not None

    def run(self, key: tuple, body: Body, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
            inputs: dict[str, torch.Tensor]) -> Any:
        """`body(q, k, v, inputs) -> (metadata, output)` for this call: replayed from the graph
        captured for `key`, captured now (second sighting) or run eagerly (first sighting, or a
        key whose capture failed). Returns the metadata with `output` set to a fresh tensor;
        a replayed layer's metadata object and tensors are the graph's and are overwritten
        when this layer is replayed again."""
        if self.inline:
            return self._eager(body, q, k, v, inputs)
        entry = self._entries.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return self._eager(body, q, k, v, inputs)
            entry = self._capture(key, body, q, k, v, inputs)
        else:
            self._entries.move_to_end(key)
            if entry.inputs is not None:
                entry.inputs.fill(_flat(q, k, v, inputs))
        if entry.graph is None:
            return self._eager(body, q, k, v, inputs)
        entry.graph.replay()
        self.replays += 1
        self.store.queue_pending(entry.pending)
        assert entry.output is not None
        entry.meta.output = entry.output.clone()
        return entry.meta

    def _eager(self, body: Body, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               inputs: dict[str, torch.Tensor]) -> Any:
        self.eager += 1
        meta, out = body(q, k, v, inputs)
        meta.output = out
        return meta

    def _capture(self, key: tuple, body: Body, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 inputs: dict[str, torch.Tensor]) -> _Entry:
        staging = Staging(_flat(q, k, v, inputs))
        static = staging.views
        sq, sk = static[0], static[1]
        sv = static[2] if v is not None else None
        sin = dict(zip(inputs, static[3 if v is not None else 2:]))
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=q.device)
        current = torch.cuda.current_stream(q.device)
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        mark = self.store.pending_mark()
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self.pool)
                try:
                    meta, out = body(sq, sk, sv, sin)
                finally:
                    graph.capture_end()
        except Exception as exc:  # e.g. a backend that synchronises with the host
            self.store.take_pending(mark)
            if not self._warned:
                self._warned = True
                warnings.warn(f"decode_graphs: capturing a decode layer failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); that layer runs eagerly",
                              RuntimeWarning, stacklevel=3)
            entry = _Entry(None, None)
        else:
            current.wait_stream(self._stream)
            self.captures += 1
            entry = _Entry(graph, staging, meta, out, self.store.take_pending(mark))
        self._entries[key] = entry
        while len(self._entries) > self.max_graphs:
            self._entries.popitem(last=False)
        return entry


def signature(*tensors: torch.Tensor | None) -> tuple:
    """What a captured graph is specialised on per input: shape, dtype and device (None:
    absent). Strides are not: inputs are copied into the graph's own buffers."""
    return tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors)


def _flat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [q, k, *([] if v is None else [v]), *inputs.values()]
