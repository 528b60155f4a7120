"""What `enable` returns: the `SparseHandle` of one model. Owns the per-model state: the
decode counters behind `stats()`, the last selections, the observer, the forwards that
bypassed the coordinator, the model's own attention implementation and generate to put back
at `disable()`, and the table `_ENABLED` (model -> its handle). At enable it registers the
attention function, routes the model's attention modules to itself (attention.py's
`_HANDLES`) and wraps `model.generate` (generate.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...common.batch import Batch, Selection
from ...coordinator.core import SparseCoordinator
from ...coordinator.dense_tally import NO_CACHE, DenseTally
from ...kv_store.sliding_window import SlidingWindowKV
from .attention import _HANDLES, _register
from .cache import AttentionEvent, SparseCache, _Requests
from .compat import NAME, UnsupportedModelError, cache_kwarg
from .generate import _wrap_generate
from .model_info import LayerMap

# a forward through the integration's attention function without a SparseCache, other than
# generate(use_cache=False): e.g. model(ids) or a DynamicCache
NOT_SPARSE_CACHE = "not a sparse cache (a forward without handle.new_cache())"

_ENABLED: weakref.WeakKeyDictionary[Any, SparseHandle] = weakref.WeakKeyDictionary()  # model -> handle


class SparseHandle:
    """What `enable` returns: the coordinator (`handle.coordinator`), statistics of the
    decode selections (`stats()`, `last_selections`), new caches for manual forwards
    (`new_cache()`), and `disable()`. A context manager that disables on exit."""

    def __init__(
        self, model: Any, coordinator: SparseCoordinator, layers: LayerMap | None = None,
        sliding: SlidingWindowKV | None = None,
    ) -> None:
        self.model = model
        self.coordinator = coordinator
        # model layer -> store layer (full attention) or ring layer (sliding window)
        self.layers = layers if layers is not None else LayerMap.all_full(coordinator.layout.num_layers)
        self.sliding = sliding  # the sliding-window layers' device rings, None without such layers
        self._sliding_steps = 0  # decode layer-steps of sliding-window layers (row x layer x step)
        self.original_attn_implementation = model.config._attn_implementation
        self.enabled = False
        # the last decode step's selection per layer (logical token indices, see Selection)
        self.last_selections: dict[int, Selection] = {}
        self._active: weakref.ref[SparseCache] | None = None  # the cache whose update() ran last
        self._live: weakref.WeakSet[_Requests] = weakref.WeakSet()
        dev = coordinator.layout.device
        self._counts = torch.zeros(2, dtype=torch.int64, device=dev)  # selected, context tokens
        # called once per layer and forward with what the coordinator saw (`AttentionEvent`);
        # the evaluation harness measures recall and errors against dense attention with it
        self.observer: Callable[[AttentionEvent], None] | None = None
        self._decode_steps = self._layer_steps = 0
        # layer-steps that bypassed the coordinator (dense sdpa), by reason; `_uncached` is set
        # while a generate(use_cache=False) runs
        self._outside = DenseTally()
        self._uncached = False
        self.cache_kwarg = cache_kwarg(model)
        _register()
        model.set_attn_implementation(NAME)
        if model.config._attn_implementation != NAME:
            raise UnsupportedModelError(
                f"{type(model).__name__} did not switch to the {NAME!r} attention implementation "
                "(it does not use transformers' attention-function registry)"
            )
        for module in model.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                _HANDLES[module] = self
        self._own_generate = vars(model).get("generate")  # an instance attribute to put back, if any
        model.generate = _wrap_generate(self, model.generate)
        _ENABLED[model] = self
        self.enabled = True

    def new_cache(self) -> SparseCache:
        """A cache for manual forwards: `model(ids, attention_mask=..., cache=cache)`
        (`past_key_values=cache` before transformers 5.24; `handle.cache_kwarg` names it) prefills, then one token per row per call decodes; `cache.close()` ends its requests."""
        if not self.enabled:
            raise RuntimeError("this sparse_framework handle is disabled")
        return SparseCache(self)

    def stats(self) -> dict[str, Any]:
        """Over the decode steps so far: steps, (step, layer) pairs, tokens selected (summed
        over requests and selection heads), tokens in context (same sum, every token), and
        their ratio: the fraction of the KV the decode attention read. Syncs the device.

        A dense fallback reads every token, so `read_fraction` alone cannot tell a dense run
        from a sparse one at full budget: "dense" says how much fell back and why: requests
        (dense ones by reason: "short prompt", below min_sparse_prompt_len) and layer-steps
        (one request in one layer of one step; dense ones by reason: "dense layer", "dense
        request", "no cache (use_cache=False)", or a forward without a SparseCache), with
        `sparse_fraction` the share that attended sparsely (None before any step).

        `pools`: the store's device pools (per layer kind) and host pool, how each was sized
        and what it holds (`SparseCoordinator.memory_stats`), then, for a hybrid model, the
        sliding-window layers' rings (kind "sliding_window": device only, nothing on the host).

        Layer counts (`layer_steps`, the selected and context tokens, "dense") are the
        full-attention layers', the ones that go through the coordinator; `sliding_window`
        says which model layers slide instead, their window and their decode layer-steps
        (each attends to its whole window: min(seq_len, window) tokens). `full_layers`: the
        model layers the store holds, in store order (store layer i is model layer
        full_layers[i]; the config's `dense_layers` count in store layers, Quest's
        `dense_first_layers` in model layers)."""
        selected, context = (int(x) for x in self._counts.tolist())
        dense = self.dense_tally()
        pools = self.coordinator.memory_stats()
        if self.sliding is not None:
            pools.append(self._sliding_pool())
        return {
            "decode_steps": self._decode_steps,
            "layer_steps": self._layer_steps,
            "selected_tokens": selected,
            "context_tokens": context,
            "read_fraction": selected / context if context else 0.0,
            "sparse_fraction": dense.sparse_fraction,
            "dense": {**self.coordinator.dense_report(), **dense.as_dict()},
            "pools": pools,
            "full_layers": list(self.layers.full),
            "sliding_window": {
                "layers": list(self.layers.sliding),
                "window": self.layers.window if self.layers.sliding else None,
                "layer_steps": self._sliding_steps,
            },
        }

    def _sliding_pool(self) -> dict[str, Any]:
        """The rings' entry in `stats()["pools"]`, in the store pools' format."""
        ring = self.sliding
        assert ring is not None
        held = sum(min(r.seq_len, ring.window) for r in self.coordinator.requests.values())
        per_token = ring.bytes_per_token() * ring.num_layers
        return {
            "kind": "sliding_window",
            "layers": ring.num_layers,
            "tokens_per_layer": ring.max_rows * ring.window,
            "bytes": ring.nbytes,
            "used_tokens": held * ring.num_layers,
            "used_bytes": held * per_token,
            "rule": f"max_requests {ring.max_rows} x window {ring.window}: the last window tokens of every request",
        }

    def dense_tally(self) -> DenseTally:
        """The coordinator's dense counts plus the forwards that bypassed it."""
        return self.coordinator.dense_tally + self._outside

    def dense_summary(self) -> str:
        """`stats()["dense"]` as one line for a person."""
        return self.dense_tally().summary()

    def _count_bypass(self, rows: int) -> None:
        """One layer of a forward that did not go through a SparseCache: dense for every row."""
        self._outside.dense_steps(NO_CACHE if self._uncached else NOT_SPARSE_CACHE, rows)

    def disable(self) -> None:
        """End every live request, restore the model's attention implementation and generate."""
        if not self.enabled:
            return
        self.enabled = False
        for live in list(self._live):
            live.end()
        model = self.model
        model.set_attn_implementation(self.original_attn_implementation)
        if self._own_generate is not None:
            model.generate = self._own_generate
        elif "generate" in vars(model):
            del model.generate
        for module in [m for m, h in _HANDLES.items() if h is self]:
            del _HANDLES[module]
        _ENABLED.pop(model, None)

    def __enter__(self) -> SparseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    def _record(self, layer: int, selection: Selection, batch: Batch) -> None:
        """Count one decode layer's selection (device tensors only: no sync)."""
        assert batch.seq_lens is not None
        heads = selection.lengths.shape[1]
        self._counts[0] += selection.lengths.sum()
        self._counts[1] += batch.seq_lens.sum() * heads
        self._layer_steps += 1
        self.last_selections[layer] = selection
