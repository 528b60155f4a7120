"""A small decode loop that drives the coordinator exactly as an engine would, and measures
every step against dense attention."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..common.batch import Batch, Request
from ..config import SparseConfig
from ..coordinator.core import SparseCoordinator
from ..common.errors import CapacityError
from ..common.layout import KVLayout
from ..coordinator.dense_tally import SHORT_PROMPT, DenseTally
from .metrics import attention_recall, dense_attention, needle_hits, relative_error, selected_mask
from .workload import SyntheticWorkload, WorkloadConfig


@dataclass
class RequestResult:
    """Means over decode steps and layers for one request of one experiment."""

    algorithm: str
    backend: str
    context: int
    mode: str  # "sparse" or "dense" (prompt below min_sparse_prompt_len)
    top_k: int
    selected_tokens: float
    rel_error: float
    recall: float
    needle_hit_rate: float | None
    kv_read_fraction: float  # tokens attended / tokens in context
    device_kv_fraction: float  # device bytes held / dense device bytes
    ms_per_step: float  # whole batch, coordinator + attention, reference and first (warm-up) step excluded
    hit_rate: float | None  # device-buffer hits / selected tokens of the batch's buffered rows (None: dense)
    swap_in_kib_per_step: float  # host -> device KiB per decode step (whole batch, all layers)
    config: dict = field(default_factory=dict)
    dense_reason: str | None = None  # why the whole request decoded densely ("short prompt"), or None
    layer_steps: int = 0  # this request's decode layer-steps (layers x steps)
    dense_layer_steps: dict[str, int] = field(default_factory=dict)  # the dense ones, by reason
    num_layers: int = 0
    dense_layers: list[int] = field(default_factory=list)  # layers that always attend densely

    @property
    def sparse_fraction(self) -> float:
        """Share of this request's decode layer-steps that attended sparsely."""
        return 1.0 - sum(self.dense_layer_steps.values()) / self.layer_steps if self.layer_steps else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "sparse_fraction": self.sparse_fraction}


@dataclass
class _Tally:
    n: int = 0
    err: float = 0.0
    recall: float = 0.0
    selected: float = 0.0
    read: float = 0.0
    hits: int = 0
    needles: int = 0


def run_experiment(
    config: SparseConfig,
    workload: WorkloadConfig,
    on_step: Callable[[], None] | None = None,
    decode_graphs: bool = False,
) -> list[RequestResult]:
    """Prefill one request per context, decode them together for `decode_steps` steps, and
    compare each step's attention with dense attention. Returns one result per request.
    decode_graphs: the coordinator replays each decode layer from a CUDA graph (CUDA only)."""
    gen = SyntheticWorkload(workload)
    layout = KVLayout(
        workload.num_layers, workload.num_kv_heads, workload.head_dim, workload.torch_dtype, workload.device
    )
    max_len = max(workload.contexts) + workload.decode_steps + 1
    try:
        coord = SparseCoordinator(config, layout, max_requests=len(workload.contexts), max_seq_len=max_len,
                                  decode_graphs=decode_graphs)
    except CapacityError as exc:
        raise CapacityError(
            f"the workload does not fit: its contexts {workload.contexts} (--contexts) with {workload.decode_steps} "
            f"decode steps (--steps) set max_seq_len and max_requests: {exc}"
        ) from None
    data = [gen.request(c) for c in workload.contexts]
    requests = [Request(f"req{i}-{d.context}", d.context) for i, d in enumerate(data)]
    # the engine keeps its own full-precision K/V as the dense reference
    ref_k = [[k.clone() for k in d.keys] for d in data]
    ref_v = [[v.clone() for v in d.values] for d in data]
    dtype = layout.dtype

    for request, d in zip(requests, data):
        coord.on_request_begin(request)
        batch = Batch([request], is_prefill=True)
        coord.forward_begin(batch)
        for layer in range(layout.num_layers):
            q, k, v = (t.to(dtype) for t in (d.prompt_queries[layer], d.keys[layer], d.values[layer]))
            extra = gen.model_inputs(config.algorithm, coord.algorithm.prefill_inputs, d.keys[layer], d.prompt_queries[layer])
            coord.attention_begin(layer, q, k, v, batch, extra)
            # a synthetic prompt feeds no next layer, so its prefill output is not computed
            coord.attention_end(layer, None, batch)
        coord.forward_end(batch)

    tallies = [_Tally() for _ in requests]
    dense_tallies = [DenseTally() for _ in requests]
    dense_layers = sorted(coord.dense_layers)
    step_seconds = 0.0
    timed_steps = max(1, workload.decode_steps - 1)  # the first step warms up (kernel compilation)
    for step in range(workload.decode_steps):
        batch = Batch(requests)
        inputs = [gen.decode_inputs(data, layer) for layer in range(layout.num_layers)]
        extras = [gen.model_inputs(config.algorithm, coord.algorithm.decode_inputs, k, q) for q, k, _ in inputs]
        for layer, (_, k, v) in enumerate(inputs):
            for i in range(len(requests)):
                ref_k[i][layer] = torch.cat([ref_k[i][layer], k[i : i + 1].to(dtype).float()])
                ref_v[i][layer] = torch.cat([ref_v[i][layer], v[i : i + 1].to(dtype).float()])
        outputs, selections = [], []
        start = time.perf_counter()
        coord.forward_begin(batch)
        for layer, (q, k, v) in enumerate(inputs):
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            meta = coord.attention_begin(layer, q, k, v, batch, extras[layer])
            out = coord.attend(layer, q, meta)
            coord.attention_end(layer, out, batch)
            outputs.append(out)
            selections.append(meta.selection)
        coord.forward_end(batch)
        if torch.device(layout.device).type == "cuda":
            torch.cuda.synchronize()
        if step > 0 or workload.decode_steps == 1:
            step_seconds += time.perf_counter() - start
        for layer, (q, _, _) in enumerate(inputs):
            sel = selections[layer]
            for i, r in enumerate(requests):
                ref_out, probs = dense_attention(q[i].to(dtype).float(), ref_k[i][layer], ref_v[i][layer])
                mask = selected_mask(sel.indices[i], r.seq_len, q.shape[1])
                t = tallies[i]
                t.n += 1
                t.err += relative_error(outputs[layer][i], ref_out)
                t.recall += attention_recall(probs, mask)
                t.selected += float(sel.lengths[i].float().mean())
                t.read += float(mask.sum()) / (mask.shape[0] * r.seq_len)
                hit, total = needle_hits(data[i].needles[layer], mask)
                t.hits += hit
                t.needles += total
        for r, dt in zip(requests, dense_tallies):
            dt.decode_step(1, int(r.dense), layout.num_layers, len(dense_layers))
        if on_step is not None:
            on_step()

    stats = coord.store.stats()
    hits, misses = sum(x["hits"] for x in stats), sum(x["misses"] for x in stats)
    swapped = sum(x["bytes_in"] for x in stats) / 1024 / workload.decode_steps
    results = []
    for r, t, dt in zip(requests, tallies, dense_tallies):
        device_tokens = coord.store.device_tokens(r)
        results.append(
            RequestResult(
                algorithm=config.algorithm,
                backend=coord.config.backend,  # "auto" resolved: the backend that ran
                context=r.prompt_len,
                mode="dense" if r.dense else "sparse",
                top_k=config.top_k,
                selected_tokens=t.selected / t.n,
                rel_error=t.err / t.n,
                recall=t.recall / t.n,
                needle_hit_rate=t.hits / t.needles if t.needles else None,
                kv_read_fraction=t.read / t.n,
                device_kv_fraction=device_tokens / r.seq_len,
                ms_per_step=1000 * step_seconds / timed_steps,
                hit_rate=hits / (hits + misses) if hits + misses and not r.dense else None,
                swap_in_kib_per_step=swapped,
                config=config.model_dump(),
                dense_reason=SHORT_PROMPT if r.dense else None,
                layer_steps=dt.layer_steps,
                dense_layer_steps=dt.as_dict()["dense_layer_steps"],
                num_layers=layout.num_layers,
                dense_layers=dense_layers,
            )
        )
    for r in requests:
        coord.on_request_end(r)
    if coord.store.used_tokens() != 0:
        raise RuntimeError(f"KV store leaked {coord.store.used_tokens()} tokens after all requests ended")
    return results
