"""Whole decode steps replayed from CUDA graphs (`EngineConfig(cuda_graphs=True)`).

An eager decode step issues every layer's projections, norms, RoPE and MLP, and the
coordinator's sparse decode, from Python: at 8 × 16K on the H100 that host work, not the
bytes, sets the step time (docs/engine.md). Here a decode-only step — every row one token,
no prefill chunk — is captured once per batch composition and context width and replayed:
the host copies the step's token ids and positions in and launches one graph.

What the graph depends on is held fixed: the coordinator runs with `decode_graphs=True`, whose
`bind` (at `forward_begin`) points the batch's step tensors at static per-composition tensors
and rounds the scored width up to `graph_bucket_tokens`; the coordinator's own per-layer
graphs are switched off while capturing (`graphs.inline`), so each layer's store write,
selection, swap-in, attention and append are recorded in this graph; the store's
device→host writes, queued in Python during the capture, are queued again after each replay
(`SparseCoordinator.step_replayed`). A key seen for the first time runs eagerly (warm-up:
compilation and lazily allocated buffers stay outside any capture), the second time it is
captured. A failed capture is an error naming the switch (the step cannot be completed).
`Engine.warm_up` (engine/warm_up.py) runs those two sightings for every batch size before the
first request, largest first.

Memory: every capture draws from one pool (`torch.cuda.graph(..., pool=...)`, as vLLM's do), so
the graphs together take about the largest capture's peak instead of one peak each; capturing
the largest batch first lets the smaller captures reuse its blocks. Sharing is safe because
nothing a graph leaves in the pool is read after another graph's replay: the logits are
written into one buffer outside the pool (`_output`; copied out right after the replay), and
the store's host-write offsets are consumed by `forward_end` of the same step, in stream
order, before any later replay. The memory plan reserves the pool (memory.py `graph_bytes`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..common.batch import Batch


@dataclass
class _Step:
    graph: torch.cuda.CUDAGraph | None
    token_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # every input the graph reads must outlive it
    logits: torch.Tensor | None = None  # a view of the logits buffer every graph shares (`_output`)
    host_writes: list | None = None


EXTRA_GRAPHS = 16  # graphs kept beyond one per batch size (other context widths, dense rows)


class StepGraphs:
    """Captured decode steps of one runner, least recently used dropped past `max_graphs`
    (None: one per batch size of the coordinator's rows, twice — all-sparse and all-dense
    rows, which the warm-up captures — plus EXTRA_GRAPHS for later context widths)."""

    def __init__(self, coordinator: Any, max_graphs: int | None = None) -> None:
        if coordinator.graphs is None:
            raise ValueError("whole-step graphs need the coordinator's decode_graphs=True (static step tensors)")
        self.coord = coordinator
        self.rows = int(getattr(coordinator.store, "max_requests", 1))
        self.max_graphs = max_graphs if max_graphs is not None else 2 * self.rows + EXTRA_GRAPHS
        self._steps: OrderedDict[tuple, _Step] = OrderedDict()
        self._seen: set[tuple] = set()
        self._pool: Any = None  # the captures' shared memory pool (made at the first capture)
        self._logits: torch.Tensor | None = None  # [rows, vocab] float32: every graph's output
        self.eager = self.captures = self.replays = 0

    def run(
        self, batch: Batch, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
        forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The step's logits [B, vocab]: replayed, captured now, or run eagerly. `forward(ids,
        positions, rows)` runs the model over the coordinator's hooks for this open step; rows
        are the logits rows (every decode row, in order)."""
        key = (batch.composition, batch.max_seq_len)
        step = self._steps.get(key)
        if step is None and key not in self._seen:
            self._seen.add(key)
            return self._eager(forward, token_ids, positions, rows)
        if step is None:
            return self._capture(key, forward, token_ids, positions, rows)
        self._steps.move_to_end(key)
        if step.graph is None:
            return self._eager(forward, token_ids, positions, rows)
        assert step.token_ids is not None and step.positions is not None and step.logits is not None
        step.token_ids.copy_(token_ids)
        step.positions.copy_(positions)
        step.graph.replay()
        self.replays += 1
        self.coord.step_replayed(batch, step.host_writes)
        return step.logits.clone()  # before any other graph's replay (module docstring)

    def _eager(self, forward: Callable[..., torch.Tensor], token_ids: torch.Tensor, positions: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
        self.eager += 1
        logits = forward(token_ids, positions, rows)
        buffer = self._logits
        if buffer is None or buffer.shape[0] < logits.shape[0] or buffer.shape[1:] != logits.shape[1:] \
                or buffer.dtype != logits.dtype:  # (graphs captured before keep a view of the old one)
            self._logits = logits.new_empty((max(self.rows, logits.shape[0]), *logits.shape[1:]))
        return logits

    def _capture(self, key: tuple, forward: Callable[..., torch.Tensor], token_ids: torch.Tensor,
                 positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Record the step (its hooks run, its kernels do not), then replay it once. The graph
        reads its own copies of the inputs, kept with it."""
        ids, pos, rows = token_ids.clone(), positions.clone(), rows.clone()
        store, graphs = self.coord.store, self.coord.graphs
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        mark = store.pending_mark()
        graph = torch.cuda.CUDAGraph()
        graphs.inline = True
        out: torch.Tensor | None = None
        try:
            # one pool for every capture: what a graph leaves there is consumed before any
            # other graph replays (module docstring), so the order of replays does not matter
            with torch.cuda.graph(graph, pool=self._pool):
                logits = forward(ids, pos, rows)
                out = self._output(logits)
                out.copy_(logits)
            del logits  # its blocks go back to the pool for the next capture
        except Exception as exc:  # a kernel that synchronises with the host, say
            # the capture's hooks ran but no kernel did: this step cannot be completed (the
            # runner abandons it); the shape stays eager from then on
            store.take_pending(mark)
            self._steps[key] = _Step(None)
            raise RuntimeError(
                f"cuda_graphs: capturing a decode step failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); run with cuda_graphs=False"
            ) from exc
        finally:
            graphs.inline = False
        host_writes = store.take_pending(mark)
        assert out is not None
        self.captures += 1
        self._steps[key] = _Step(graph, ids, pos, rows, out, host_writes)
        while len(self._steps) > self.max_graphs:
            self._steps.popitem(last=False)
        graph.replay()  # this step's work: the capture only recorded it
        self.replays += 1
        store.queue_pending(host_writes)
        return out.clone()

    def _output(self, logits: torch.Tensor) -> torch.Tensor:
        """Where a graph writes its logits: the first rows of the buffer `_eager` made (one
        float32 [rows, vocab] for every graph, outside the pool, so that no graph keeps logits
        of its own in the pool; under capture an allocation would land in the pool)."""
        buffer = self._logits
        if buffer is None or buffer.shape[0] < logits.shape[0] or buffer.shape[1:] != logits.shape[1:] \
                or buffer.dtype != logits.dtype:
            raise RuntimeError("cuda_graphs: no logits buffer for this step (a key is captured only after an "
                               "eager run of it, which makes the buffer)")
        return buffer[: logits.shape[0]]
