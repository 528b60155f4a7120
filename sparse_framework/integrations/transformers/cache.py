"""The transformers Cache of sparse decode (`SparseCache`) and what one holds: the requests
of its batch rows and its open step (`_Requests`), each layer's length (`_SparseLayer`), the
layer whose update ran last (the attention function's claim). Its `_attend` drives the
coordinator for one layer: the prefill, the sparse decode, the sliding-window ring (see the
package docstring). Owns the per-cache state and the cache counter `_cache_ids`; the K/V are
in the coordinator's store and the sliding-window rings."""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...common.batch import Batch, Request, Selection
from ...coordinator.core import SparseCoordinator
from .attention import _dense, _split_options
from .compat import UnsupportedModelError

_cache_ids = itertools.count()


@dataclass
class AttentionEvent:
    """One layer of one forward, as the coordinator saw it (for `SparseHandle.observer`).

    prefill: q/k/v are the packed prompt tokens [tokens, heads, D] of `batch` (row after row,
    pad tokens dropped), `out` and `selection` are None. decode: q [B, Hq, D] (scaled so that
    q·k/sqrt(D) is the model's logit, as the algorithm sees it; the coordinator itself takes
    the model's q and the layer's scale), k/v [B, Hkv, D] this step's new token, `out`
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
    """A transformers Cache whose K/V live in a SparseCoordinator's store (the package docstring).

    Made by the generate wrapper, or by `handle.new_cache()` for manual forwards. Lengths
    (`get_seq_length`) count padded positions, as transformers expects; the stored
    sequences do not hold the pad tokens.
    """

    def __init__(self, handle: Any) -> None:
        """`handle`: the SparseHandle (handle.py, which imports this module) that made it."""
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
        batch = self._step_batch(layer, attention_mask, b, n)
        scale = d**-0.5 if scaling is None else scaling
        ring = layers.ring.get(layer)
        if ring is None:
            self._check_options(layer, softcap, sinks)
            self._set_scale(layers.store[layer], scale)
        with torch.no_grad():
            if ring is not None:
                out = self._sliding_layer(module, ring, batch, query, key, value, attention_mask, scale, kwargs,
                                          softcap, sinks)
            elif batch.is_prefill:
                out = self._prefill_layer(module, layer, batch, query, key, value, attention_mask, scale, kwargs,
                                          softcap, sinks)
            else:
                at = layers.store[layer]
                q = query[:, :, 0].contiguous()
                k, v = key[:, :, 0].contiguous(), value[:, :, 0].contiguous()
                meta = coord.attention_begin(at, q, k, v, batch)
                attended = coord.attend(at, q, meta)
                coord.attention_end(at, attended, batch)
                assert meta.selection is not None
                self.handle._record(layer, meta.selection, batch)
                if self.handle.observer is not None:
                    self.handle.observer(AttentionEvent(layer, batch, _logit_scaled(q, scale), k, v, attended,
                                                        meta.selection))
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

    def _set_scale(self, at: int, scale: float) -> None:
        """Give the coordinator's store layer `at` the model's q·k scale, once (its other
        options, set at enable, kept): q then goes to it as the model computed it."""
        coord = self.handle.coordinator
        options = coord.attention_options(at)
        factor = scale * math.sqrt(coord.layout.head_dim)
        if options.scale == (None if math.isclose(factor, 1.0, rel_tol=1e-9) else scale):
            return
        coord.set_attention_options(at, softcap=options.softcap, sinks=options.sinks, scale=scale)

    def _prefill_layer(
        self, module: Any, layer: int, batch: Batch, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float, kwargs: dict[str, Any],
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the packed prompt (pad tokens dropped) and attend densely over the padded
        batch, with the layer's soft-cap and sinks as the model's eager attention has them."""
        rows = self.live.prompt_rows
        assert rows is not None

        def packed(x: torch.Tensor) -> torch.Tensor:  # [B, H, n, D] -> [real tokens, H, D]
            return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]).index_select(0, rows)

        coord, at = self.handle.coordinator, self.handle.layers.store[layer]
        q, k, v = packed(query), packed(key), packed(value)
        coord.attention_begin(at, q, k, v, batch)
        if self.handle.observer is not None:
            self.handle.observer(AttentionEvent(layer, batch, _logit_scaled(q, scale), k, v))
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

    def _step_batch(self, layer: int, attention_mask: torch.Tensor | None, b: int, n: int) -> Batch:
        """This forward's batch: opened by layer 0, read by the later layers (an error if a later
        layer runs first)."""
        if layer == 0:
            self._open_step(attention_mask, b, n)
        batch = self.live.batch
        if batch is None:
            raise RuntimeError(f"layer {layer} ran before layer 0 of this forward")
        return batch

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


def _logit_scaled(q: torch.Tensor, scale: float) -> torch.Tensor:
    """q x (scale · sqrt(D)), whose q·k/sqrt(D) is the model's logit (what `AttentionEvent`
    holds); q itself when the factor is 1."""
    factor = scale * math.sqrt(q.shape[-1])
    return q if math.isclose(factor, 1.0, rel_tol=1e-9) else q * factor
