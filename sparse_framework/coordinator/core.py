"""`SparseCoordinator`: the lifecycle hooks an engine calls around its forward passes.

    on_request_begin(request)                 admit: choose dense/sparse, reserve KV
    forward_begin(batch)                      prepare the step once (lengths, rows, room)
      attention_begin(layer, q, k, v, batch)  store K/V; select -> make resident -> adapt
      attend(layer, q, metadata)              run the configured backend (or your kernel)
      attention_end(layer, output, batch)     build / append the algorithm's representations
    forward_end(batch)                        (or abort_step(batch) to abandon the step)
    on_request_end(request)                   free everything

The order is checked (step_order.py): a hook called out of order raises `HookOrderError`
naming the hook, the layer and what was expected, and changes nothing. Every layer of the
layout, dense ones included, runs attention_begin then attention_end once per step, one layer
open at a time. After an exception mid-step an engine calls `abort_step(batch)`: it restores
the lengths; if some layer had already stored the step's K/V, the batch's requests must then
be ended (and begun again to re-prefill) — the coordinator refuses to batch them otherwise.

The step's metadata is passed explicitly (no globals): `attention_begin` returns an
`AttentionMetadata` holding the logical selection, its physical slots, the adaptor's plan and
the paged K/V views, which is all a kernel needs.

With `decode_graphs=True` (CUDA) a decode layer's whole work — store write, select, make
resident, adapt, attend and the append of `attention_end` — is captured in a CUDA graph per
batch composition and replayed by `attention_begin` (decode_graphs.py says how and why);
`attend` then returns the output already computed and `attention_end` has nothing left to do.

The request hooks (on_request_begin, retract / resume, on_request_end, with `decodes_densely`
and `can_grow`) are carried out by `requests.RequestLifecycle` (`self.lifecycle`), which owns the
table of active and retracted requests and the free state rows; the coordinator's methods of
those names delegate to it. Construction and the step hooks are here.

Why this module is long: the step hooks stay one object's because they share one open step (the
batch's lengths, the layer open, its metadata, the step's dense rows) over the store, algorithm,
adaptor and backend they drive; what owns other state lives apart (requests.py, step_order.py,
dense_tally.py, graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from typing import Any

import torch

from ..algorithms.base import Inputs
from .options import DEFAULT, AttentionOptions
from ..common.batch import Batch, Request, Selection
from ..config import SparseConfig, dense_layer_set, load_config
from .graphs import DecodeGraphs, signature
from ..common.errors import ConfigError, LimitError
from .dense_tally import REQUESTED_DENSE as REQUESTED_DENSE, DenseTally  # the name stays importable here
from .footprint import check_footprint, reraise_allocation_error
from .step_order import StepOrder
from ..kv_store.hierarchical import HierarchicalKVStore
from .prefill import causal_prefill
from ..common.layout import KVLayout
from .inputs import check_model_inputs, check_qkv, input_dtypes, query_tail_rows
from .requests import RequestLifecycle
from .policy import SparsePolicy


@dataclass
class AttentionMetadata:
    """Everything one layer's attention needs for one step.

    For prefill (dense and causal) `plan` is the list of prompt lengths and `k_cache` /
    `v_cache` are this forward's packed K/V.
    For decode: `selection` (logical, one row per request or per (request, KV head)),
    `slots` (physical, same shape), `plan` (the adaptor's kernel metadata) and `k_cache` /
    `v_cache` (the device buffer viewed as the plan's pages).
    """

    layer: int
    is_prefill: bool
    selection: Selection | None = None
    slots: torch.Tensor | None = None
    plan: Any = None
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    output: torch.Tensor | None = None  # decode graphs: the layer's attention, already computed


class SparseCoordinator:
    """Drives one algorithm, one store, one adaptor and one backend for an engine.

    max_requests / max_seq_len size the pooled per-request state (algorithm
    representations, page tables, slot maps) and, by default, the store's pools, one per
    layer kind (kv_store/device_pools.py): dense layers max_requests x max_seq_len (they keep
    every token); sparse layers max_requests x the larger of device_buffer_tokens and
    min_sparse_prompt_len (a sparse request's buffer, or a short prompt that decodes densely);
    the resident store max_requests x max_seq_len. device_capacity_tokens replaces the sparse
    layers' (the resident store's) tokens per layer; host_capacity_tokens the host pool's
    (default: every token of max_requests sequences of max_seq_len). `memory_stats()` and the
    INFO log say how each pool was sized; `plan_capacity` counts the same bytes.

    decode_graphs: replay each decode layer from a CUDA graph (CUDA layouts only; see
    decode_graphs.py): the host's work per layer drops to copying the inputs in and one graph
    launch. graph_bucket_tokens: the context width one graph serves (the scored width is
    rounded up to it); max_graphs: graphs kept (least recently used dropped), default 4 per
    layer. The metadata of a replayed layer is the graph's and is overwritten when the layer
    is replayed again; the output is the caller's.
    """

    def __init__(
        self,
        config: SparseConfig | dict[str, Any] | str | PathLike[str],
        layout: KVLayout,
        *,
        max_requests: int = 8,
        max_seq_len: int = 32768,
        device_capacity_tokens: int | None = None,
        host_capacity_tokens: int | None = None,
        decode_graphs: bool = False,
        graph_bucket_tokens: int = 1024,
        max_graphs: int | None = None,
    ) -> None:
        self.config = load_config(config).resolved(layout)  # backend "auto" -> the one it picks here
        self.layout = layout
        self._device_type = torch.device(layout.device).type
        if decode_graphs and self._device_type != "cuda":
            raise ConfigError(f"decode_graphs=True needs a CUDA layout device (CUDA graphs), got {layout.device!r}")
        if graph_bucket_tokens < 1 or (max_graphs is not None and max_graphs < 1):
            raise ConfigError(f"graph_bucket_tokens and max_graphs must be >= 1, got {graph_bucket_tokens}, {max_graphs}")
        bad = [layer for layer in self.config.dense_layers if layer >= layout.num_layers]
        if bad:
            raise ConfigError(
                f"`dense_layers` = {self.config.dense_layers}: layers {bad} do not exist; "
                f"the layout has layers 0..{layout.num_layers - 1}"
            )
        if max_requests < 1 or max_seq_len < 1:
            raise ConfigError(f"max_requests and max_seq_len must be >= 1, got {max_requests}, {max_seq_len}")
        backend_cls = self.config.backend_class
        try:
            backend_cls.check_layout(layout)
        except ConfigError as exc:
            raise ConfigError(f"backend {self.config.backend!r} {exc}") from None
        self.config.adaptor_class.check_layout(layout, self.config)
        algorithm_cls = self.config.algorithm_class
        self.dense_layers = dense_layer_set(self.config, layout)
        check_footprint(self.config, layout, max_requests=max_requests, max_seq_len=max_seq_len,
                        device_capacity_tokens=device_capacity_tokens, host_capacity_tokens=host_capacity_tokens)
        with reraise_allocation_error(f"algorithm {self.config.algorithm!r} representations", "max_requests / max_seq_len"):
            self.algorithm = algorithm_cls(self.config, layout, max_requests, max_seq_len)
        self.adaptor = self.config.adaptor_class()
        self.backend = backend_cls()
        cfg = self.config
        self.store = HierarchicalKVStore(
            layout,
            page_size=cfg.page_size,
            device_buffer_tokens=cfg.device_buffer_tokens,
            sink_tokens=cfg.sink_tokens,
            recent_tokens=cfg.recent_tokens,
            dense_layers=self.dense_layers,
            unit=self.algorithm.unit,
            per_kv_head=self.algorithm.per_kv_head,
            max_requests=max_requests,
            max_seq_len=max_seq_len,
            device_capacity_tokens=device_capacity_tokens,
            host_capacity_tokens=host_capacity_tokens,
            min_sparse_prompt_len=cfg.min_sparse_prompt_len,
            resident_only=cfg.store == "resident",
            hybrid=cfg.store == "hybrid",
            host_kv_dtype=cfg.host_kv_dtype,
        )
        self.max_seq_len = max_seq_len
        self._heads = layout.num_kv_heads if self.algorithm.per_kv_head else 1
        self.steps = StepOrder(layout.num_layers)  # the open step, checked hook by hook
        # q/k/v dtypes attention_begin takes (`_check_inputs`; None: any, an fp8 store quantises)
        self._input_dtypes = input_dtypes(layout)
        # requests and decode layer-steps that attended densely, and why (`dense_report`)
        self.dense_tally = DenseTally()
        self.policy = SparsePolicy(self.config, layout, max_requests=max_requests, max_seq_len=max_seq_len)
        # the request hooks and the table of requests (requests.py)
        self.lifecycle = RequestLifecycle(
            store=self.store, algorithm=self.algorithm, policy=self.policy, steps=self.steps,
            dense_tally=self.dense_tally, max_requests=max_requests, max_seq_len=max_seq_len,
            store_kind=cfg.store,
        )
        self._step_dense = False  # forward_begin: the policy made this step's selecting requests dense
        self._options: dict[int, AttentionOptions] = {}  # layers with scale / softcap / sinks (set_attention_options)
        self.graphs: DecodeGraphs | None = None
        if decode_graphs:
            self.store.timing = False  # no timing events inside a graph
            cap = max_graphs if max_graphs is not None else 4 * layout.num_layers
            self.graphs = DecodeGraphs(self.store, graph_bucket_tokens, max_seq_len, cap)

    # -- requests (requests.py `RequestLifecycle`) --------------------------------------------
    @property
    def requests(self) -> dict[str, Request]:
        """The active requests by id (retracted ones included); owned by `self.lifecycle`."""
        return self.lifecycle.requests

    @property
    def retracted(self) -> set[str]:
        """Ids of the active requests that are retracted; owned by `self.lifecycle`."""
        return self.lifecycle.retracted

    def decodes_densely(self, prompt_len: int, sparse: bool | None = None, batch: int | None = None) -> bool:
        """`RequestLifecycle.decodes_densely`: whether a request would decode densely."""
        return self.lifecycle.decodes_densely(prompt_len, sparse, batch)

    def on_request_begin(
        self, request: Request, cached_pages: torch.Tensor | None = None, *, sparse: bool | None = None
    ) -> None:
        """`RequestLifecycle.on_request_begin`: admit a request."""
        self.lifecycle.on_request_begin(request, cached_pages, sparse=sparse)

    def can_grow(self, requests: list[Request]) -> bool:
        """`RequestLifecycle.can_grow`: whether a decode step of these requests finds room."""
        return self.lifecycle.can_grow(requests)

    def on_request_retract(self, request: Request) -> None:
        """`RequestLifecycle.on_request_retract`: preempt a request between steps."""
        self.lifecycle.on_request_retract(request)

    def on_request_resume(self, request: Request) -> None:
        """`RequestLifecycle.on_request_resume`: resume a retracted request."""
        self.lifecycle.on_request_resume(request)

    def on_request_end(self, request: Request) -> None:
        """`RequestLifecycle.on_request_end`: free a request's KV, representations and row."""
        self.lifecycle.on_request_end(request)

    def set_attention_options(
        self, layer: int, *, softcap: float | None = None, sinks: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> None:
        """Set a layer's q·k scale, logit soft-capping and attention-sink logits (options.py):
        scale, a float > 0 (logits are scale · q·k; None, or 1/sqrt(head_dim), is the
        default 1/sqrt(head_dim): a host whose model scales otherwise, e.g. Gemma's
        query_pre_attn_scalar, sets it here instead of multiplying q); softcap, a float > 0
        (Gemma 2's `attn_logit_softcapping`), applied to the scaled logits; sinks, a floating
        tensor [num_q_heads] on the layout's device (GPT-OSS's `sinks`). All None restores
        the default; each call replaces all three. They apply from the next call of the layer
        on, at prefill (`attend`) and decode (the backend's run; a decode graph captured
        before is not reused: the options are part of its key). The algorithm keeps seeing
        q x (scale · sqrt(head_dim)) (`AttentionOptions.query_factor`), so that its q·k/sqrt(D)
        is the model's logit as before. Refused with ConfigError naming the field for a bad
        value, and with UnsupportedFeatureError (a ConfigError) when the configured backend
        cannot apply an option."""
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ConfigError(f"layer must be in 0..{self.layout.num_layers - 1}, got {layer!r}")
        options = AttentionOptions.make(softcap, sinks, self.layout.device, scale, self.layout.head_dim)
        if options.is_default:
            self._options.pop(layer, None)
            return
        try:
            self.config.backend_class.check_attention_options(options.softcap, options.sinks)
        except ConfigError as exc:
            raise type(exc)(f"backend {self.config.backend!r} {exc}") from None
        self._options[layer] = options

    def attention_options(self, layer: int) -> AttentionOptions:
        """The layer's options (the default, all None, unless set)."""
        return self._options.get(layer, DEFAULT)

    def _algorithm_queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q as the algorithm takes it: x (scale · sqrt(D)) for a layer with a scale, so that
        its q·k/sqrt(D) is the model's logit (an algorithm's softmax sees what it saw when
        hosts multiplied q themselves); q itself otherwise."""
        factor = self.attention_options(layer).query_factor(q.shape[-1])
        return q if factor is None else q * factor

    def memory_stats(self) -> list[dict[str, Any]]:
        """Per pool (device pools by layer kind, then the host pool): kind, layers, tokens per
        layer, bytes, tokens and bytes held now, and the rule that sized it."""
        return self.store.pool_stats()

    # -- step -----------------------------------------------------------------------------
    def forward_begin(self, batch: Batch) -> None:
        """Prepare the step once: advance lengths, make room, build the step's tensors.
        Refused while another step is open; on any error nothing changes."""
        if not batch.requests:
            raise ValueError("empty batch")
        self.steps.check_forward_begin(batch)
        for r in batch.requests:
            if self.requests.get(r.rid) is not r:
                raise ValueError(f"request {r.rid!r} was not begun with on_request_begin")
            if r.rid in self.retracted:
                raise ValueError(f"request {r.rid!r} is retracted; resume it before batching it")
            if batch.is_prefill and r.seq_len != 0:
                raise ValueError(f"request {r.rid!r} was already prefilled")
            if not batch.is_prefill and r.seq_len == 0:
                raise ValueError(f"request {r.rid!r} must be prefilled before decoding")
            if not batch.is_prefill and r.seq_len >= self.max_seq_len:
                raise LimitError(f"request {r.rid!r} reached max_seq_len {self.max_seq_len}; end it, or build the coordinator with a larger max_seq_len")
        if len({r.rid for r in batch.requests}) != len(batch):
            raise ValueError("a request appears twice in the batch")
        before = [r.seq_len for r in batch.requests]
        for r in batch.requests:
            r.seq_len = r.prompt_len if batch.is_prefill else r.seq_len + 1
        try:
            if not batch.is_prefill:
                self.store.grow(batch)  # all or nothing; pages kept on a later error are reused
            batch.prepare(self.layout.device)
            # (a dense step reads every token on the device: not with a spilled row)
            self._step_dense = self.policy.step_dense(batch) and not self.store.buffers_rows_of(batch)
            if self.graphs is not None and not batch.is_prefill:
                batch.composition = self.graphs.bind(batch) + self.store.decode_key(batch)
                if self.policy.per_step:  # a graph of the step's choice: the selection is in it or not
                    batch.composition += (self._step_dense,)
            self.store.begin_step(batch)
        except BaseException:
            for r, n in zip(batch.requests, before):
                r.seq_len = n
            raise
        batch.pending.clear()
        self.steps.opened(batch, before)

    def dense_report(self) -> dict[str, Any]:
        """How much of the decoding so far fell back to dense attention, and why (counts since
        the coordinator was built; see dense_fallback.py): requests, dense requests by
        reason, decode layer-steps (request x layer x step), the dense ones by reason, the
        dense layers, min_sparse_prompt_len and the sparse policy (`SparsePolicy.describe`)."""
        return {
            **self.dense_tally.as_dict(),
            "dense_layers": sorted(self.dense_layers),
            "min_sparse_prompt_len": self.config.min_sparse_prompt_len,
            "sparse_policy": self.policy.describe(),
        }

    def forward_end(self, batch: Batch) -> None:
        """End of the step: start the store's asynchronous host writes, drop the scratch.
        Refused unless every layer ran attention_begin then attention_end in this step."""
        self.steps.check_forward_end(batch)
        with self.steps.work("forward_end", None):
            self.store.end_step(batch)
        batch.pending.clear()
        self.steps.closed()
        if not batch.is_prefill:  # counted once the step is complete (an aborted one is not)
            other, by_policy = self.policy.dense_in_step(batch, self._step_dense)
            self.dense_tally.decode_step(len(batch), other, self.layout.num_layers, len(self.dense_layers), by_policy)

    def step_replayed(self, batch: Batch, host_writes: list) -> None:
        """An engine replayed this decode step's layers from a CUDA graph it captured around
        this coordinator's hooks (decode_graphs=True with `graphs.inline` set while capturing,
        so that each layer's work was recorded in the engine's graph): every layer counts as
        run, and the store's host writes recorded at capture (`store.take_pending`) are queued
        again for `forward_end`. Refused unless the open step is `batch`'s with no layer run."""
        self.steps.check_replay(batch)
        self.steps.replayed()
        self.store.queue_pending(host_writes)

    def abort_step(self, batch: Batch) -> None:
        """Abandon the open step, e.g. after an exception between forward_begin and
        forward_end: each request's seq_len goes back to its value before forward_begin, the
        step's queued host writes and scratch are dropped, and the step is closed (a later
        forward_begin is accepted). Pages reserved for the step stay with the requests.

        If no layer's attention_begin had stored K/V, nothing else changed and the requests
        can be batched again. Otherwise their stored KV and the algorithm's representations
        may hold part of the step: they are marked, and every hook but `on_request_end`
        refuses them (end them, then begin them again to prefill anew). No step open: does
        nothing, so an engine can call it from any error handler."""
        step = self.steps.check_abort(batch)
        if step is None:
            return
        for r, n in zip(step.batch.requests, step.seq_lens):
            r.seq_len = n
        self.store.take_pending(0)  # the step's host writes: end_step cleared the last step's
        batch.pending.clear()
        self.steps.abandoned(step)

    @property
    def prefetching(self) -> bool:
        """Whether `prefetch` does anything: SparseConfig.prefetch on, a hierarchical store, an
        algorithm that selects without decode inputs, and no per-layer decode graph: eager
        layers, or a whole step being captured (`graphs.inline`: the prefetch is recorded with
        the step and replayed with it). A layer graph of its own would wait on a copy recorded
        outside it."""
        return (self.config.prefetch != "off" and not self.store.all_resident and not self.algorithm.decode_inputs
                and (self.graphs is None or self.graphs.inline))

    def prefetch(self, layer: int, q: torch.Tensor, batch: Batch) -> None:
        """A predicted query of a layer still to run this decode step (q [batch, q_heads, dim],
        e.g. from the residual stream one layer early: SparseConfig.prefetch "early_query"):
        select with it and have the store swap the selection's missing rows in ahead of the
        layer (on a side stream on CUDA). The layer's own `attention_begin` selects with its real
        query as always; the prefetch changes which rows are already resident, never what is
        selected or attended. Does nothing unless `prefetching`, for dense layers, steps
        without sparse rows or steps the cost policy made dense. Refused (HookOrderError)
        outside a step or for a layer that already began."""
        self.steps.check_prefetch(layer, batch)
        sub = batch.sparse_batch
        if not self.prefetching or layer in self.dense_layers or sub is None or self._step_dense:
            return
        with self.steps.work("prefetch", layer):
            queries = self._algorithm_queries(layer, q).to(self.layout.dtype)
            predicted = self.algorithm.select(layer, _rows(batch, queries), sub)
            self.store.prefetch(layer, sub, predicted)

    def attention_begin(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        batch: Batch,
        inputs: Inputs | None = None,
    ) -> AttentionMetadata:
        """Store this step's K/V; for decode select, make resident and plan.

        Decode: q [batch, q_heads, dim], k/v [batch, kv_heads, dim]. Prefill: packed
        q [Σ prompt_len, q_heads, dim], k/v [Σ prompt_len, kv_heads, dim]. MLA: k is the
        latent [tokens, 1, 576] and v is None. inputs: the extra tensors the algorithm
        declares in `algorithm.prefill_inputs` / `decode_inputs` (e.g. DSA's indexer queries, weights and
        keys), rows aligned with q's. q, k and v are in the layout's dtype or float32 (cast
        down as stored; an fp8 layout takes any); ValueError naming the dtypes otherwise.

        Refused (HookOrderError, nothing changed) outside a step, while another layer is
        open, or for a layer that already ran in this step.
        """
        self.steps.check_attention_begin(layer, batch)
        if self.graphs is not None and not batch.is_prefill:
            meta = self._graphed_decode(layer, q, k, v, batch, inputs)
        else:
            self._check_inputs(layer, q, k, v, batch)
            inputs = self._check_model_inputs(q.shape[0], inputs, batch.is_prefill)
            with self.steps.work("attention_begin", layer, writes=True):
                meta = self._eager_begin(layer, q, k, v, batch, inputs)
        self.steps.began(layer)
        return meta

    def store_prompt(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor | None,
        batch: Batch,
        queries: torch.Tensor | None = None,
        inputs: Inputs | None = None,
    ) -> None:
        """A prefill layer whose attention the host computed itself (an engine that attends its
        prompt chunks from its own staging): store the prompts' K/V and build the algorithm's
        representations, in place of attention_begin + attention_end with nothing to attend.

        k, v as attention_begin's at prefill. `queries`: what the algorithm's build reads (q's
        tail form: each prompt's last `algorithm.prefill_query_rows` queries, or every query),
        None when it reads none; `inputs` its declared prefill inputs. Counts as the layer's
        attention_begin and attention_end in the step order."""
        if not batch.is_prefill:
            raise ValueError(f"store_prompt(layer {layer}) takes a prefill batch; a decode step goes through "
                             "attention_begin / attend / attention_end")
        if queries is None and self.algorithm.needs_prefill_queries and not all(r.dense for r in batch.requests):
            raise ValueError(
                f"algorithm {self.config.algorithm!r} builds from the prompt's queries: pass store_prompt(..., "
                f"queries=...) with each prompt's last {self.algorithm.prefill_query_rows} queries (or all of them)")
        self.steps.check_attention_begin(layer, batch)
        self._check_inputs(layer, queries, k, v, batch)
        inputs = self._check_model_inputs(sum(batch.query_lens), inputs, True)
        with self.steps.work("attention_begin", layer, writes=True):
            self._eager_begin(layer, queries, k, v, batch, inputs)
        self.steps.began(layer)
        self.attention_end(layer, None, batch)

    def _eager_begin(
        self, layer: int, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None, batch: Batch, inputs: Inputs
    ) -> AttentionMetadata:
        batch.pending[layer] = {"q": q, "k": k, "v": v, "inputs": inputs}
        if batch.is_prefill:
            offset = 0
            for r in batch.requests:
                rows = slice(offset, offset + r.prompt_len)
                self.store.write_prefill(layer, r, k[rows], None if v is None else v[rows])
                offset += r.prompt_len
            v_rows = k[..., : self.layout.v_head_dim] if v is None else v
            return AttentionMetadata(layer, True, plan=batch.query_lens, k_cache=k, v_cache=v_rows)
        return self._decode_metadata(layer, q, k, v, batch, inputs)

    def _graphed_decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, batch: Batch, inputs: Inputs | None
    ) -> AttentionMetadata:
        """A decode layer through the decode graphs: the whole layer (the append of
        `attention_end` included) replayed, captured or run eagerly (decode_graphs.py)."""
        assert self.graphs is not None
        given = inputs or {}
        options = self.attention_options(layer)
        key = (layer, batch.composition, batch.max_seq_len, self.backend, self.adaptor,
               tuple(given), signature(q, k, v, *given.values()), options.key())
        if not self.graphs.captured(key):  # a captured key's inputs were checked when first seen
            self._check_inputs(layer, q, k, v, batch)
            given = self._check_model_inputs(q.shape[0], inputs, False)

        def body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, inputs: Inputs) -> tuple[AttentionMetadata, torch.Tensor]:
            meta = self._decode_metadata(layer, q, k, v, batch, inputs)
            out = self._run_backend(q, meta, options)
            self._append(layer, batch, k, inputs)
            return meta, out

        with self.steps.work("attention_begin", layer, writes=True):
            batch.pending[layer] = {"q": q, "k": k, "v": v, "inputs": given, "appended": True}
            return self.graphs.run(key, body, q, k, v, given)

    def _decode_metadata(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, batch: Batch, inputs: Inputs
    ) -> AttentionMetadata:
        """A decode layer's store write, selection, residency and plan."""
        self.store.write_decode(layer, batch, k, v)
        selection, slots = self._select_and_place(layer, q, batch, inputs)
        plan = self.adaptor.plan(slots, selection.lengths, page_size=selection.page_size, num_slots=self.store.layer_slots(layer))
        k_cache, v_cache = self.store.paged_view(layer, selection.page_size)
        return AttentionMetadata(layer, False, selection, slots, plan, k_cache, v_cache)

    def attend(self, layer: int, q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Run attention for the layer: the configured backend at decode; dense causal
        attention (float32) at prefill; both with the layer's options (scale, softcap, sinks).
        Returns q's shape and dtype. A layer replayed from a decode graph already holds its
        output (`metadata.output`), which is returned."""
        if metadata.is_prefill:
            if q.shape[0] != sum(metadata.plan):
                raise ValueError(f"attend at prefill needs every prompt query ({sum(metadata.plan)} rows), got "
                                 f"{q.shape[0]}: the tail form of q is for attention_begin only")
            options = self.attention_options(layer)
            options.check_heads(q.shape[1])
            return causal_prefill(q, metadata.k_cache, metadata.v_cache, metadata.plan, options=options)
        if metadata.output is not None:
            return metadata.output
        return self._run_backend(q, metadata, self.attention_options(layer))

    def _run_backend(self, q: torch.Tensor, meta: AttentionMetadata, options: AttentionOptions) -> torch.Tensor:
        """The backend's decode attention; the layer's options (scale, softcap, sinks) passed
        only when set, so that the default call (and backends without them) stay as they are."""
        if options.is_default:
            return self.backend.run(q, meta.k_cache, meta.v_cache, meta.plan)
        options.check_heads(q.shape[-2])
        return self.backend.run(q, meta.k_cache, meta.v_cache, meta.plan, **options.kwargs())

    def attention_end(self, layer: int, output: torch.Tensor | None, batch: Batch) -> None:
        """Build (prefill) or extend (decode) the algorithm's representations. `output` is
        the layer's attention output (None when the engine did not compute it); built-in
        algorithms do not read it. Refused (HookOrderError, nothing changed) unless `layer`
        is the layer begun last in this step; with decode graphs it has nothing left to do but
        must still be called."""
        self.steps.check_attention_end(layer, batch)
        with self.steps.work("attention_end", layer):
            self._end(layer, batch)
        self.steps.ended(layer)

    def _end(self, layer: int, batch: Batch) -> None:
        pending = batch.pending.pop(layer)
        if layer in self.dense_layers or pending.get("appended"):
            return
        if batch.is_prefill:
            q = pending["q"]  # None from store_prompt for an algorithm that reads no queries
            tail = self._query_tail_rows(batch)
            q_lens = tail if tail is not None and q is not None and q.shape[0] == sum(tail) else batch.query_lens
            offset = q_offset = 0
            for r, q_len in zip(batch.requests, q_lens):
                if not r.dense:
                    rows = slice(offset, offset + r.prompt_len)
                    queries = (self._algorithm_queries(layer, q[q_offset : q_offset + q_len])
                               if self.algorithm.needs_prefill_queries else None)
                    inputs = {name: t[rows] for name, t in pending["inputs"].items()}
                    self.algorithm.build(layer, r, pending["k"][rows], queries, inputs=inputs)
                offset += r.prompt_len
                q_offset += q_len
            return
        self._append(layer, batch, pending["k"], pending["inputs"])

    def _append(self, layer: int, batch: Batch, k: torch.Tensor, inputs: Inputs) -> None:
        """A decode step's new keys into the algorithm's representations (sparse rows only)."""
        sub = batch.sparse_batch
        if sub is not None and layer not in self.dense_layers:
            self.algorithm.append(layer, sub, _rows(batch, k), inputs={n: _rows(batch, t) for n, t in inputs.items()})

    # -- helpers --------------------------------------------------------------------------
    def _select_and_place(
        self, layer: int, q: torch.Tensor, batch: Batch, inputs: Inputs
    ) -> tuple[Selection, torch.Tensor]:
        """Selection and device slots for every row: the algorithm's choice, made resident,
        for sparse requests in sparse layers; every token for the others (and for all in a
        step the cost policy made dense: the representations are still appended)."""
        sub = batch.sparse_batch
        if layer in self.dense_layers or sub is None or self._step_dense:
            everything = _dense_selection(batch, self._heads, self.store.page_size)
            return everything, self.store.resident_slots(layer, batch, everything)
        step_inputs = {name: _rows(batch, t) for name, t in inputs.items()}
        chosen = self.algorithm.select(layer, self._algorithm_queries(layer, _rows(batch, q)), sub, inputs=step_inputs)
        slots = self.store.ensure_resident(layer, sub, chosen)
        if sub is batch:
            return chosen, slots
        dense = batch.dense_batch
        assert dense is not None and batch.dense_rows is not None and batch.sparse_rows is not None
        everything = _dense_selection(dense, self._heads, chosen.page_size)
        dense_slots = self.store.resident_slots(layer, dense, everything)
        width = max(everything.indices.shape[-1], chosen.indices.shape[-1])
        shape = (len(batch), self._heads, width)
        indices = torch.full(shape, -1, dtype=torch.int32, device=q.device)
        all_slots = torch.full(shape, -1, dtype=torch.int32, device=q.device)
        lengths = torch.zeros(shape[:2], dtype=torch.int32, device=q.device)
        for rows, sel, sl in ((batch.sparse_rows, chosen, slots), (batch.dense_rows, everything, dense_slots)):
            w = sel.indices.shape[-1]
            indices[rows, :, :w] = sel.indices
            all_slots[rows, :, :w] = sl
            lengths[rows] = sel.lengths
        return Selection(indices, lengths, chosen.page_size), all_slots

    def _check_model_inputs(self, tokens: int, inputs: Inputs | None, prefill: bool) -> Inputs:
        return check_model_inputs(self.algorithm, self.config.algorithm, tokens, inputs, prefill, self.layout)

    def _check_inputs(self, layer: int, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None,
                      batch: Batch) -> None:
        check_qkv(self.layout, layer, q, k, v, batch, self._input_dtypes, self.algorithm.prefill_query_rows)

    def _query_tail_rows(self, batch: Batch) -> list[int] | None:
        return query_tail_rows(batch, self.algorithm.prefill_query_rows)


def _rows(batch: Batch, t: torch.Tensor) -> torch.Tensor:
    """The sparse requests' rows of a decode-step tensor (all of it when all are sparse)."""
    return t if batch.sparse_batch is batch else t[batch.sparse_rows]


def _dense_selection(batch: Batch, heads: int, page_size: int) -> Selection:
    """Every token of every request: arange(seq_len) per row."""
    assert batch.seq_lens is not None
    pos = torch.arange(batch.max_seq_len, device=batch.seq_lens.device, dtype=torch.int32)
    lens = batch.seq_lens.view(-1, 1)
    indices = torch.where(pos < lens, pos, -1).unsqueeze(1).expand(-1, heads, -1).contiguous()
    return Selection(indices, lens.expand(-1, heads).contiguous(), page_size)
