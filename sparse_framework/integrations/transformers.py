"""Hugging Face transformers: prefill dense, decode through the `SparseCoordinator`.

    from sparse_framework.integrations.transformers import sparse

    with sparse(model, {"algorithm": "quest", "top_k": 2048}, max_seq_len=32768) as handle:
        out = model.generate(**inputs, max_new_tokens=64)   # unchanged call
    print(handle.stats())                                    # what the decode steps read

Works with decoder models whose attention goes through transformers' attention-function
registry (`AttentionInterface`: Llama, Qwen2/3, Mistral, Gemma, ...) on transformers
>= 4.56 (`MIN_TRANSFORMERS`; tested with 4.56.2 and 5.24.0).

How it plugs in
  `enable(model, config)` builds a coordinator whose `KVLayout` comes from the model config
  (its full-attention layers, num_key_value_heads KV heads, head_dim, the model's dtype and device),
  registers an attention function and the sdpa mask function under the name
  "sparse_framework" (`AttentionInterface` / `AttentionMaskInterface`), switches the model to
  it (`set_attn_implementation`) and gives `model.generate` a thin wrapper (an attribute of
  this model instance) that passes a fresh `SparseCache` as the cache argument (`cache` from
  transformers 5.24, which deprecates `past_key_values`; `past_key_values` before: see
  `cache_kwarg`) and closes it when generation returns. `disable()` (or leaving the `with` block) undoes all three.

  A cache_implementation in the model's own generation_config (Gemma's "hybrid" from the
  hub) is set aside for the sparse generate; one the caller passes to generate is refused.
  `torch.compile`: enable the uncompiled model or the compiled wrapper (its `_orig_mod` is
  patched); the cache updates and the attention function run eagerly (graph breaks).

  Per layer the model applies RoPE, calls `cache.update(k, v, layer)` and then the attention
  function. `SparseCache.update` only counts tokens (transformers derives positions and mask
  sizes from the cache's length, which includes left padding) and returns this step's K/V
  unchanged: it holds no K/V itself. The attention function recognises the step as the
  cache's own (the `key` it receives is the tensor `update` returned) and drives the
  coordinator with it:
    prefill  attention_begin with the packed prompt (pad tokens stripped, so the store
             holds post-RoPE keys of real tokens only), dense attention over the padded
             batch with the sdpa mask (exactly what the sdpa model computes), attention_end.
    decode   attention_begin (store the new K/V, select, make resident, plan) + attend (the
             configured backend) + attention_end, one query token per row.
  Layer 0 of a forward opens the step (`forward_begin`), the last layer closes it
  (`forward_end`). The coordinator scales q·k by 1/sqrt(head_dim); a model with another
  scale (Gemma's query_pre_attn_scalar) has its queries multiplied to match. Calls that do
  not come through a SparseCache (`model(...)` with no cache or a DynamicCache,
  `use_cache=False`) get transformers' sdpa attention: dense, unchanged, and counted as dense
  layer-steps in `handle.stats()["dense"]` with the reason.

Hybrid sliding-window models
  A sliding-window layer (Mistral with `sliding_window`, Qwen2 with `use_sliding_window`
  from layer `max_window_layers` on, Gemma 3's local layers; `LayerMap.of` reads the
  config's `layer_types`) whose window is shorter than `max_seq_len` does not go through the
  coordinator: its token t attends densely to positions (t - window, t], transformers'
  convention in every family, and only that window is kept, on the device, in a ring of
  `window` slots per request row (`kv_store/sliding_window.py`: `SlidingWindowKV`; nothing
  of it on the host). Prefill: dense sdpa with the model's own sliding mask, then each row's
  last `window` real tokens into the ring; decode: the new token into slot position %
  window, attention over the ring's valid slots with the model's scale. The coordinator's
  `KVLayout` counts the full-attention layers only (store layer i is model layer
  `handle.layers.full[i]`: `dense_layers` and `dense_first_layers` in the config count in
  store layers), so its store and host pool hold no sliding-window KV; a model whose every
  layer slides has a layout of 0 layers (the coordinator then only tracks the requests).
  The last model layer, sliding or not, closes the step. A window >= max_seq_len never
  binds: such layers stay full layers. The observer and `last_selections` see the full
  layers only (under their model layer index); `stats()` counts the sliding layers apart.

Logit soft-capping and attention sinks (Gemma 2, GPT-OSS)
  Gemma 2 passes its attention function `softcap` (`attn_logit_softcapping`: logits s become
  softcap * tanh(s / softcap)), GPT-OSS `s_aux` (the attention module's `sinks`, one learned
  logit per query head in the softmax's denominator, with no value); both attend eagerly
  by default, since sdpa cannot express either (transformers 4.56 still defaulted Gemma 2 to
  sdpa, which there drops the soft-cap: the integration applies it, as eager attention does,
  on every version). The integration applies them on every path:
  enable gives each full layer's soft-cap and sinks to the coordinator
  (`set_attention_options`, under the store layer index), so its backend applies them at
  decode (`torch_ref` and `triton` do; a backend that cannot is refused at enable); the
  sliding-window ring takes them per call (`SlidingWindowKV.attend`); and the prefill, and
  forwards without a SparseCache, run the models' eager formula with the sdpa mask instead of
  sdpa (`eager_attention.py`), so a full budget equals the model's own dense generate.
  The sinks are read at enable: a float32 parameter is used in place, another dtype's is
  copied to float32 (enable again after loading new weights).

Requests and padding
  The first forward through a SparseCache is its prefill: each batch row becomes a
  `Request` whose prompt is the row's attended tokens (from the attention mask: left
  padding is stripped), begun with `on_request_begin`. Every later forward must bring one
  token per row (what `generate` does); rows that finished early keep decoding pad tokens
  with mask 1, exactly as in the dense model. The requests end (`on_request_end`) when
  `generate` returns or raises, when the cache is `close()`d or `reset()`, when it is
  garbage-collected, or when the integration is disabled.

Not supported (clear errors): beam search and assisted decoding (the cache cannot reorder or
crop requests), several tokens per row after the prefill (chunked prefill, multi-turn reuse
of a cache: start a new cache), layer types other than full and sliding attention (e.g.
chunked attention), a backend that cannot apply a model's soft-cap or sinks (refused at
enable: `flash_attn` without the library's support, `flashmla`), MLA models other than those
with DSA's indexer (DeepSeek-V3.2 and GLM-MoE-DSA: transformers_mla.py), algorithms that need
extra model inputs on other models (DSA's lightning indexer; DSA with `extra.source = "keys"`
works), multimodal models. One forward at a time per handle (no thread safety).
"""

from __future__ import annotations

import inspect
import itertools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from os import PathLike
from typing import Any

import torch

from ..common.batch import Batch, Request, Selection
from ..config import SparseConfig
from ..coordinator.core import SparseCoordinator
from ..common.errors import SparseFrameworkError
from ..common.layer_map import FULL, SLIDING
from ..common.layer_map import LayerMap as CommonLayerMap
from ..common.layout import KVLayout
from ..coordinator.dense_tally import NO_CACHE, DenseTally
from ..kv_store.sliding_window import SlidingWindowKV
from .eager_attention import eager_attention
from .index_mask import fold_indices

try:
    import transformers
    from packaging.version import Version
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "sparse_framework.integrations.transformers needs transformers: "
        'pip install -e ".[transformers]" (in a checkout of the repository)'
    ) from exc

NAME = "sparse_framework"
MIN_TRANSFORMERS = "4.56"
# a forward through the integration's attention function without a SparseCache, other than
# generate(use_cache=False): e.g. model(ids) or a DynamicCache
NOT_SPARSE_CACHE = "not a sparse cache (a forward without handle.new_cache())"


class UnsupportedModelError(SparseFrameworkError, ValueError):
    """The model (or the installed transformers) cannot run through the integration; the
    message says why and what works."""


def check_transformers_version(version: str | None = None) -> None:
    """ImportError unless `version` (default: the installed transformers) is supported."""
    version = transformers.__version__ if version is None else version
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"sparse_framework's transformers integration needs transformers >= {MIN_TRANSFORMERS} "
            f"(its Cache layers and attention/mask registries), found {version}; "
            f"pip install 'transformers>={MIN_TRANSFORMERS}'"
        )


check_transformers_version()


def cache_kwarg(model: Any) -> str:
    """The keyword under which `model(...)` and `model.generate(...)` take a cache: "cache"
    where the model's forward names it so (transformers >= 5.24, which deprecates
    `past_key_values` for removal in 5.40), "past_key_values" before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402

_HANDLES: weakref.WeakKeyDictionary[Any, SparseHandle] = weakref.WeakKeyDictionary()  # attention module -> handle
_ENABLED: weakref.WeakKeyDictionary[Any, SparseHandle] = weakref.WeakKeyDictionary()  # model -> handle
_cache_ids = itertools.count()
# model families served by modules above this one, which register here when imported (an
# import from this module would be a circle): "mla" -> transformers_mla.enable_mla
FAMILY_ENABLERS: dict[str, Callable[..., Any]] = {}


def enable(
    model: Any,
    config: SparseConfig | dict[str, Any] | str | PathLike[str],
    *,
    max_requests: int = 8,
    max_seq_len: int = 8192,
    device_capacity_tokens: int | None = None,
    host_capacity_tokens: int | None = None,
    decode_graphs: bool = False,
) -> SparseHandle:
    """Run `model`'s decode through a SparseCoordinator built from `config`.

    decode_graphs: on CUDA, replay each layer's sparse decode (store write, select, make
    resident, attend) from a CUDA graph instead of launching it from Python (see
    sparse_framework/coordinator/graphs.py); the model itself still runs eagerly.

    max_requests: the most rows one generate() may have (all caches alive at once together).
    max_seq_len: the longest prompt + generated tokens of a row (padding excluded). The
    store's device pools are sized per layer kind from both and the config: dense layers
    max_requests x max_seq_len, sparse layers max_requests x the larger of
    device_buffer_tokens and min_sparse_prompt_len (docs/kv_store.md);
    device_capacity_tokens replaces the sparse layers' tokens per layer, host_capacity_tokens
    the host pool's (`sparse-framework plan` counts the same bytes; `handle.stats()["pools"]`
    and the INFO log say what was allocated). Sliding-window layers whose window is shorter
    than max_seq_len are not in the store: each keeps a device ring of max_requests x window
    tokens (`SlidingWindowKV`; see "Hybrid sliding-window models" in the module docstring). Returns the handle; `handle.disable()` restores
    the model, and the handle is also a context manager (`with sparse(...) as handle:`).
    """
    check_transformers_version()
    model = _uncompiled(model)
    if model in _ENABLED:
        raise ValueError("sparse decode is already enabled on this model; disable its handle first")
    cfg = _text_config(model)
    if is_mla(cfg):  # DeepSeek-V3.2 / GLM-MoE-DSA: latent cache, indexer inputs, absorbed decode
        if "mla" not in FAMILY_ENABLERS:
            raise UnsupportedModelError(
                f"{type(model).__name__} is an MLA model: import sparse_framework.integrations.transformers_mla "
                "first (it registers MLA + DSA models with enable)"
            )
        return FAMILY_ENABLERS["mla"](model, cfg, config, max_requests=max_requests, max_seq_len=max_seq_len,
                                      device_capacity_tokens=device_capacity_tokens,
                                      host_capacity_tokens=host_capacity_tokens, decode_graphs=decode_graphs)
    layers = LayerMap.of(cfg, max_seq_len)
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layout = KVLayout(
        num_layers=len(layers.full),  # the store holds the full-attention layers only (0 is fine)
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=model.dtype,
        device=model.device,
    )
    coord = SparseCoordinator(
        config, layout, max_requests=max_requests, max_seq_len=max_seq_len,
        device_capacity_tokens=device_capacity_tokens, host_capacity_tokens=host_capacity_tokens,
        decode_graphs=decode_graphs,
    )
    _set_attention_options(model, cfg, layers, coord)
    algo = coord.algorithm
    if algo.prefill_inputs or algo.decode_inputs:
        needs = sorted({**algo.prefill_inputs, **algo.decode_inputs})
        raise UnsupportedModelError(
            f"algorithm {coord.config.algorithm!r} with these options needs model inputs {needs} that a "
            "transformers model does not compute (for DSA set extra.source to 'keys')"
        )
    sliding = None
    if layers.sliding:
        assert layers.window is not None
        sliding = SlidingWindowKV(len(layers.sliding), layers.window, max_requests, num_kv_heads, head_dim,
                                  dtype=model.dtype, device=model.device)
    return SparseHandle(model, coord, layers, sliding)


sparse = enable  # `with sparse(model, config) as handle: ...` reads better in a with statement


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
        full_layers[i]; the config's `dense_layers` count in store layers)."""
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


@dataclass
class AttentionEvent:
    """One layer of one forward, as the coordinator saw it (for `SparseHandle.observer`).

    prefill: q/k/v are the packed prompt tokens [tokens, heads, D] of `batch` (row after row,
    pad tokens dropped), `out` and `selection` are None. decode: q [B, Hq, D] (already scaled
    so that q·k/sqrt(D) is the model's logit), k/v [B, Hkv, D] this step's new token, `out`
    [B, Hq, D] the sparse attention output and `selection` what it attended to."""

    layer: int
    batch: Batch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None = None
    selection: Selection | None = None


class _Requests:
    """The requests of one SparseCache and its open step. Apart from the cache so that a
    finalizer can end them when the cache is garbage-collected."""

    def __init__(self, coordinator: SparseCoordinator, name: str) -> None:
        self.coordinator = coordinator
        self.name = name
        self.requests: list[Request] = []
        self.batch: Batch | None = None  # the open step (between the first and the last layer)
        self.prompt_rows: torch.Tensor | None = None  # prefill: flat [row * len + pos] of real tokens

    def end(self) -> None:
        coord = self.coordinator
        if self.batch is not None:  # a forward that raised before its last layer: abandon its step
            self.batch, batch = None, self.batch
            coord.abort_step(batch)
        for r in self.requests:
            if coord.requests.get(r.rid) is r:
                coord.on_request_end(r)
        self.requests.clear()
        self.prompt_rows = None


class _SparseLayer(CacheLayerMixin):
    """One layer of a SparseCache: only its length (padded tokens seen). The K/V are in the
    coordinator's store."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.is_initialized = True
        self.tokens += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query: int | torch.Tensor, *args: Any) -> tuple[int, int]:
        """(kv_length, kv_offset); `query` is the query length (transformers 5) or the
        cache positions (4.x)."""
        n = query if isinstance(query, int) else int(query.shape[0])
        return self.tokens + n, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.tokens = 0


class SparseCache(Cache):
    """A transformers Cache whose K/V live in a SparseCoordinator's store (module docstring).

    Made by the generate wrapper, or by `handle.new_cache()` for manual forwards. Lengths
    (`get_seq_length`) count padded positions, as transformers expects; the stored
    sequences do not hold the pad tokens.
    """

    def __init__(self, handle: SparseHandle) -> None:
        coord = handle.coordinator
        super().__init__(layers=[_SparseLayer() for _ in range(handle.layers.num_layers)])
        self.handle = handle
        self.live = _Requests(coord, f"hf{next(_cache_ids)}")
        handle._live.add(self.live)
        self._pending: tuple[int, torch.Tensor] | None = None  # (layer, key) that update returned
        self._ref = weakref.ref(self)
        weakref.finalize(self, self.live.end).atexit = False

    @property
    def requests(self) -> list[Request]:
        """The coordinator's requests of this cache, one per batch row (empty before prefill)."""
        return list(self.live.requests)

    @torch.compiler.disable(recursive=True)
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending is not None:
            raise RuntimeError(
                f"layer {self._pending[0]}'s attention did not run through sparse_framework (was the "
                "attention implementation changed, or the keys modified after the cache update?)"
            )
        if not self.handle.enabled:
            raise RuntimeError("this SparseCache's handle was disabled; generate with a new cache")
        if layer_idx == 0:
            self._check_step(key_states.shape[0], key_states.shape[-2])
        out = self.layers[layer_idx].update(key_states, value_states)
        self._pending = (layer_idx, out[0])
        self.handle._active = self._ref
        return out

    def _check_step(self, rows: int, tokens: int) -> None:
        """Before the first layer of a forward changes anything: can this cache take it?"""
        live = self.live
        if live.batch is not None:
            raise RuntimeError("the previous forward through this cache did not reach its last layer; reset() it")
        if not live.requests:
            return
        if tokens != 1:
            raise UnsupportedModelError(
                f"after its prefill a sparse cache decodes one token per row, got {tokens}: chunked prefill, "
                "assisted decoding and continuing a cache with a new prompt are not supported (use a new cache)"
            )
        if rows != len(live.requests):
            raise ValueError(f"the cache holds {len(live.requests)} rows, this forward has {rows}")

    def close(self) -> None:
        """End this cache's requests (idempotent); the cache can prefill again afterwards."""
        self._pending = None
        self.live.end()
        for layer in self.layers:
            layer.reset()

    def reset(self) -> None:
        self.close()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise UnsupportedModelError("beam search is not supported with sparse decode; use greedy or sampling")

    def crop(self, max_length: int) -> None:
        if max_length != 0 or self.live.requests:
            raise UnsupportedModelError("a sparse cache cannot be cropped (assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._before_prefill("repeat its rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._before_prefill("select rows")

    def _before_prefill(self, what: str) -> None:
        if self.live.requests:
            raise UnsupportedModelError(f"a sparse cache cannot {what} once it holds requests")

    # -- the attention function's side ------------------------------------------------------
    def _claims(self, layer: int, key: torch.Tensor) -> bool:
        return self._pending is not None and self._pending[0] == layer and self._pending[1] is key

    def _attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, scaling: float | None, kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, None]:
        """One layer: query [B, Hq, n, D], key/value [B, Hkv, n, D] (this forward's, post-RoPE)
        -> ([B, n, Hq, D], None), as transformers' attention functions return."""
        self._pending = None
        softcap, sinks = _split_options(kwargs)
        layer = module.layer_idx
        coord, live, layers = self.handle.coordinator, self.live, self.handle.layers
        b, hq, n, d = query.shape
        if layer == 0:
            self._open_step(attention_mask, b, n)
        batch = live.batch
        if batch is None:
            raise RuntimeError(f"layer {layer} ran before layer 0 of this forward")
        scale = d**-0.5 if scaling is None else scaling
        factor = scale * math.sqrt(d)  # the coordinator scales q·k by 1/sqrt(D): scale q instead
        rescale = (lambda q: q) if math.isclose(factor, 1.0, rel_tol=1e-9) else (lambda q: q * factor)
        ring = layers.ring.get(layer)
        if ring is None:
            self._check_options(layer, softcap, sinks)
        with torch.no_grad():
            if ring is not None:
                out = self._sliding_layer(module, ring, batch, query, key, value, attention_mask, scale, kwargs,
                                          softcap, sinks)
            elif batch.is_prefill:
                out = self._prefill_layer(module, layer, batch, query, key, value, attention_mask, scale, rescale, kwargs,
                                          softcap, sinks)
            else:
                at = layers.store[layer]
                q = rescale(query[:, :, 0].contiguous())
                k, v = key[:, :, 0].contiguous(), value[:, :, 0].contiguous()
                meta = coord.attention_begin(at, q, k, v, batch)
                attended = coord.attend(at, q, meta)
                coord.attention_end(at, attended, batch)
                assert meta.selection is not None
                self.handle._record(layer, meta.selection, batch)
                if self.handle.observer is not None:
                    self.handle.observer(AttentionEvent(layer, batch, q, k, v, attended, meta.selection))
                out = attended.unsqueeze(1)
        if layer == layers.num_layers - 1:
            coord.forward_end(batch)
            live.batch = None  # after: a refused forward_end leaves the step for end() to abort
            if not batch.is_prefill:
                self.handle._decode_steps += 1
        return out, None

    def _check_options(self, layer: int, softcap: float | None, sinks: torch.Tensor | None) -> None:
        """A full layer's call must bring the soft-cap and sinks `enable` gave the coordinator
        (`_set_attention_options`): the coordinator's backend applies those, not the call's."""
        options = self.handle.coordinator.attention_options(self.handle.layers.store[layer])
        if options.softcap != softcap or (options.sinks is None) != (sinks is None):
            raise RuntimeError(
                f"layer {layer}'s attention was called with softcap={softcap} and "
                f"{'no ' if sinks is None else ''}sinks, but sparse decode was enabled with softcap={options.softcap} "
                f"and {'no ' if options.sinks is None else ''}sinks for it (changed after enable? enable again)"
            )

    def _prefill_layer(
        self, module: Any, layer: int, batch: Batch, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float,
        rescale: Callable[[torch.Tensor], torch.Tensor], kwargs: dict[str, Any],
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the packed prompt (pad tokens dropped) and attend densely over the padded
        batch, with the layer's soft-cap and sinks as the model's eager attention has them."""
        rows = self.live.prompt_rows
        assert rows is not None

        def packed(x: torch.Tensor) -> torch.Tensor:  # [B, H, n, D] -> [real tokens, H, D]
            return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]).index_select(0, rows)

        coord, at = self.handle.coordinator, self.handle.layers.store[layer]
        q, k, v = rescale(packed(query)), packed(key), packed(value)
        coord.attention_begin(at, q, k, v, batch)
        if self.handle.observer is not None:
            self.handle.observer(AttentionEvent(layer, batch, q, k, v))
        out = _dense(module, query, key, value, attention_mask, scale, kwargs, softcap, sinks)
        coord.attention_end(at, out.reshape(-1, out.shape[2], out.shape[3]).index_select(0, rows), batch)
        return out

    def _sliding_layer(
        self, module: Any, ring: int, batch: Batch, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float, kwargs: dict[str, Any],
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A sliding-window layer, outside the coordinator. Prefill: dense attention with the
        mask the model built for this layer (its own sliding-window mask: what the sdpa model
        computes; the eager formula with a soft-cap or sinks), then each row's last `window`
        real tokens into the ring. Decode: the new token into the ring at position
        seq_len - 1, then attention over the ring's valid slots (positions (t - window, t]),
        the model's scale as is, with the call's soft-cap and sinks."""
        windows = self.handle.sliding
        assert windows is not None
        if batch.is_prefill:
            rows = self.live.prompt_rows
            assert rows is not None
            k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[-1]).index_select(0, rows)
            v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1]).index_select(0, rows)
            offset = 0
            for r in batch.requests:
                windows.write_prefill(ring, r.slot, k[offset : offset + r.prompt_len], v[offset : offset + r.prompt_len])
                offset += r.prompt_len
            return _dense(module, query, key, value, attention_mask, scale, kwargs, softcap, sinks)
        assert batch.seq_lens is not None and batch.slot_ids is not None
        positions = batch.seq_lens.long() - 1
        windows.write_decode(ring, batch.slot_ids, positions, key[:, :, 0], value[:, :, 0])
        attended = windows.attend(ring, query[:, :, 0], batch.slot_ids, batch.seq_lens, scale, softcap=softcap, sinks=sinks)
        self.handle._sliding_steps += len(batch)
        return attended.unsqueeze(1)

    def _open_step(self, attention_mask: torch.Tensor | None, b: int, n: int) -> None:
        """Layer 0 of a forward (checked by `_check_step`): begin the requests at prefill, then
        forward_begin."""
        live, coord = self.live, self.handle.coordinator
        if not live.requests:
            valid = _prompt_tokens(attention_mask, b, n, coord.layout.device)
            reqs = [Request(f"{live.name}/{i}", int(m)) for i, m in enumerate(valid.sum(1).tolist())]
            for r in reqs:
                coord.on_request_begin(r)
                live.requests.append(r)
            live.prompt_rows = valid.flatten().nonzero().squeeze(1)
            batch = Batch(list(live.requests), is_prefill=True)
        else:
            live.prompt_rows = None
            batch = Batch(list(live.requests))
        coord.forward_begin(batch)
        live.batch = batch


def _prompt_tokens(mask: torch.Tensor | None, b: int, n: int, device: str | torch.device) -> torch.Tensor:
    """bool [B, n]: the prompt positions a row attends to. From the mask transformers built
    (sdpa: bool [B, 1, n, n], True = attend, or None when nothing is padded): the last query
    row of a causal mask attends to every real token, wherever the padding is."""
    if mask is None:
        return torch.ones(b, n, dtype=torch.bool, device=device)
    if mask.dim() == 4:
        attend = mask[:, 0, -n:, -n:]
        attend = attend if attend.dtype == torch.bool else attend == 0  # additive float masks: 0 = attend
        # the last row attends to every real token under a causal mask, but only to the last
        # `window` ones under a sliding-window mask: a real token also attends to itself (the
        # diagonal); a fully masked pad row that an old torch fix unmasked attends to all
        diagonal = attend.diagonal(dim1=1, dim2=2) & ~attend.all(-1)
        valid = attend[:, -1] | diagonal
    elif mask.dim() == 2:
        valid = mask[:, -n:].bool()
    else:
        raise ValueError(f"unexpected attention mask of shape {list(mask.shape)}")
    return valid.expand(b, n).to(device)


@torch.compiler.disable(recursive=True)
def sparse_attention_forward(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention function registered as "sparse_framework": through the coordinator when
    the step is a SparseCache's, transformers' sdpa attention otherwise (the eager formula for
    a call with a soft-cap or attention sinks, which sdpa cannot express)."""
    handle = _HANDLES.get(module)
    cache = handle._active() if handle is not None and handle._active is not None else None
    if cache is not None and cache._claims(module.layer_idx, key):
        return cache._attend(module, query, key, value, attention_mask, scaling, kwargs)
    if handle is not None:
        handle._count_bypass(query.shape[0])
    if kwargs.get("indices") is not None:  # an MLA + DSA model's top-k, which sdpa alone would ignore
        attention_mask = fold_indices(attention_mask, kwargs.pop("indices"), key.shape[2])
    softcap, sinks = _split_options(kwargs)
    if softcap is not None or sinks is not None:  # what the model's own (eager) attention computes
        if dropout:
            raise UnsupportedModelError(
                f"attention dropout ({dropout}) with a soft-cap or sinks is not supported through {NAME}: "
                "call model.eval(), or disable the handle to train"
            )
        return _dense(module, query, key, value, attention_mask, scaling, kwargs, softcap, sinks), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _register() -> None:
    """Register the attention function and the mask function (transformers' own sdpa mask)."""
    AttentionInterface.register(NAME, sparse_attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _wrap_generate(handle: SparseHandle, generate: Callable[..., Any]) -> Callable[..., Any]:
    """generate(...) with a fresh SparseCache as its cache (under `handle.cache_kwarg`: no
    deprecation warning on transformers >= 5.24), closed when it returns. Takes a cache the
    caller made with `handle.new_cache()` under either name."""
    name = handle.cache_kwarg

    def sparse_generate(*args: Any, **kwargs: Any) -> Any:
        given = [kwargs.pop(k) for k in ("past_key_values", "cache") if kwargs.get(k) is not None]
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)
        cache = given[0] if given else None
        gen_config = kwargs.get("generation_config") or handle.model.generation_config
        use_cache = kwargs.get("use_cache", getattr(gen_config, "use_cache", True))
        if len(given) > 1 or (cache is not None and not isinstance(cache, SparseCache)):
            what = "two caches" if len(given) > 1 else f"a {type(cache).__name__}"
            raise ValueError(f"sparse decode is enabled: pass no {name} (or one handle.new_cache()), not {what}")
        if kwargs.get("cache_implementation") is not None or "generation_config" in kwargs:
            _check_cache_implementation(kwargs.get("cache_implementation", getattr(gen_config, "cache_implementation", None)))
        elif getattr(gen_config, "cache_implementation", None) is not None:
            # the model's own default (e.g. Gemma's "hybrid" from the hub), not the caller's
            # request: set aside while this generate runs
            saved, gen_config.cache_implementation = gen_config.cache_implementation, None
            try:
                return sparse_generate(*args, **({name: cache} if cache is not None else {}), **kwargs)
            finally:
                gen_config.cache_implementation = saved
        if cache is not None:
            return generate(*args, **{name: cache}, **kwargs)
        if use_cache is False:  # every layer of every step runs dense sdpa: counted as such
            handle._uncached = True
            try:
                return generate(*args, **kwargs)
            finally:
                handle._uncached = False
        cache = handle.new_cache()
        try:
            return generate(*args, **{name: cache}, **kwargs)
        finally:
            cache.close()

    sparse_generate.__wrapped__ = generate  # type: ignore[attr-defined]
    sparse_generate.__doc__ = generate.__doc__
    return sparse_generate


def _text_config(model: Any) -> Any:
    """The model's decoder config, after checking that the model can use the registry."""
    if not isinstance(model, transformers.PreTrainedModel):
        raise UnsupportedModelError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not use transformers' attention-function registry (AttentionInterface), "
            "so its attention cannot be replaced; decoders such as Llama, Qwen2/3, Mistral and Gemma do"
        )
    cfg = model.config
    if cfg.get_text_config(decoder=True) is not cfg:
        raise UnsupportedModelError(f"{name}: multimodal and encoder-decoder models are not supported yet")
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: encoder-decoder models are not supported")
    return cfg


def is_mla(cfg: Any) -> bool:
    """An MLA model (a latent KV cache): handled by transformers_mla.py."""
    return getattr(cfg, "kv_lora_rank", None) is not None


class LayerMap(CommonLayerMap):
    """common/layer_map.py's map (which layers go through the coordinator, which through the
    `SlidingWindowKV`), read from a transformers config."""

    @classmethod
    def of(cls, cfg: Any, max_seq_len: int) -> LayerMap:
        """From the decoder config: `layer_types` where the config has them (Gemma 2/3,
        Qwen2 from `use_sliding_window` and `max_window_layers`, GPT-OSS, Mistral on
        transformers 5), else every layer slides when `sliding_window` is set (Mistral on
        4.x). A sliding layer whose window is >= max_seq_len never binds: it is a full layer
        (through the coordinator, as before hybrid support)."""
        n = cfg.num_hidden_layers
        types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        if types is None:
            types = [SLIDING if window is not None else FULL] * n
        other = sorted(set(types) - {FULL, SLIDING})
        if other:
            raise UnsupportedModelError(f"layer types {other} are not supported (full and sliding attention are)")
        if len(types) != n:
            raise UnsupportedModelError(f"the config has {len(types)} layer_types for {n} layers")
        if SLIDING in types and (not isinstance(window, int) or window < 1):
            raise UnsupportedModelError(f"the config has sliding-window layers but sliding_window = {window!r}")
        return cls.from_types(types, window, max_seq_len)  # type: ignore[return-value]


def _uncompiled(model: Any) -> Any:
    """The module `torch.compile(model)` wraps: the integration patches the model itself,
    which the compiled wrapper calls (its attention and cache steps run eagerly)."""
    orig = getattr(model, "_orig_mod", None)
    return orig if isinstance(model, torch.nn.Module) and isinstance(orig, torch.nn.Module) else model


def _set_attention_options(model: Any, cfg: Any, layers: LayerMap, coord: SparseCoordinator) -> None:
    """Give each full-attention layer's soft-cap (Gemma 2's `attn_logit_softcapping`, from the
    attention module or the config) and attention sinks (GPT-OSS's `sinks` parameter) to the
    coordinator under its store layer index, so that its backend applies them at decode. A
    backend that cannot apply one refuses here, at enable (UnsupportedFeatureError naming the
    backend and the option). Sliding-window layers take them per call (`_split_options`).

    The sinks are read once: a float32 model's parameter is used in place (later in-place
    weight updates are seen); another dtype's is copied to float32, so enable again after
    loading new weights."""
    default_cap = getattr(cfg, "attn_logit_softcapping", None)
    found: dict[int, tuple[float | None, torch.Tensor | None]] = {}  # model layer -> (softcap, sinks)
    for module in model.modules():  # modules with a layer_idx: the attention module (and maybe its block)
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or layer not in layers.store:
            continue
        softcap, sinks = found.get(layer, (default_cap, None))
        softcap = getattr(module, "attn_logit_softcapping", None) or softcap
        param = getattr(module, "sinks", None)
        found[layer] = (softcap, param if isinstance(param, torch.Tensor) else sinks)
    for layer, (softcap, sinks) in found.items():
        if softcap is not None or sinks is not None:
            coord.set_attention_options(layers.store[layer], softcap=softcap, sinks=sinks)


def _split_options(kwargs: dict[str, Any]) -> tuple[float | None, torch.Tensor | None]:
    """Take the soft-cap and the sinks out of an attention call's keywords: `softcap` (Gemma
    2, None in Gemma 3) and `s_aux` (GPT-OSS; `sinks` accepted too)."""
    softcap = kwargs.pop("softcap", None)
    s_aux, sinks = kwargs.pop("s_aux", None), kwargs.pop("sinks", None)
    return softcap, s_aux if s_aux is not None else sinks


def _dense(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    scale: float | None, kwargs: dict[str, Any], softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Dense attention over the padded batch with the model's mask -> [B, n, Hq, D]:
    transformers' sdpa attention, or, for a call with a soft-cap or sinks (which sdpa cannot
    express), the eager formula those models use (eager_attention.py)."""
    if softcap is None and sinks is None:
        out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scale, **kwargs)
        return out
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return eager_attention(query, key, value, mask, scale, softcap=softcap, sinks=sinks)


def _check_cache_implementation(value: Any) -> None:
    """Sparse decode brings its own cache (a SparseCache); a cache_implementation the caller
    passes to generate would make transformers build another one."""
    if value is not None:
        raise UnsupportedModelError(
            f"generate(cache_implementation={value!r}) asks transformers for its own cache, but sparse decode "
            "keeps the K/V in its SparseCache; pass no cache_implementation while sparse decode is enabled, "
            "or disable the handle"
        )
