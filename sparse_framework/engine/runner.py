"""`ModelRunner`: one engine step — a packed forward of decode rows and prefill chunks.

A step's tokens are packed in one tensor: first one token per decoding request, then the
prefill chunks. The model calls `attend(layer, q, k, v)` once per layer (see
engine/models), and the runner splits the rows:

  decode rows     through the coordinator's decode hooks (store write, select, make resident,
                  attend, append), one coordinator step around the whole forward;
  prefill chunks  K/V written to the prompt's staging span, queries attending causally to the
                  staged prefix (flash-attn's varlen kernel where installed, else SDPA:
                  prefill_attention.py): the prompt never passes through a
                  full-context attention and never needs more than a chunk of activations.

Sliding-window layers (a hybrid model's, `ModelConfig.layer_types`) do not go through the
coordinator: each has a `SlidingWindowKV` ring of `window` slots per request row (the row is
the coordinator's `Request.slot`). A decode row writes its token there and attends to the
ring's valid slots; a prefill chunk attends to the ring's window before it (the last window
positions of its prompt so far, written by the chunks before) and its own keys, under the
sliding mask ([chunk, window + chunk]: never the whole prefix), then writes its last `window`
keys to the ring (a prefix cache copies windows to the host at page boundaries and writes a
cached prefix's window into a new row; the ring then keeps a page more than the window per
row: `ring_page_slack`). So nothing of a sliding layer is staged, handed over or offloaded,
and the coordinator's `KVLayout` counts the full-attention layers only (`layers.store` maps a
model layer to its store layer, `layers.ring` to its ring layer). A retracted request keeps
its coordinator slot, hence its ring row and window, until it ends: resuming needs nothing
for the sliding layers (their bytes are reserved per row, like the slot). A request
preempted while still prefilling is admitted again from token 0 (or from its cached prefix,
whose window the prefix cache writes back) and rewrites its window.

Attention terms per layer come from the model's config: q·k is scaled by
`attention_scale` and soft-capped by `attn_logit_softcapping`, both set as the coordinator's
attention options of every store layer (`set_attention_options(scale=, softcap=)`; q goes to
it as the model computed it) and applied by the ring and the prefill chunks.

MLA models (`layout.is_mla`, DeepSeek-V3.2) call an `MLAAttend` instead (engine/models/mla.py):
decode rows go to the coordinator in absorbed form (queries folded through W_UK, one latent
row per token, the lightning indexer's queries, weights and key as DSA's `inputs`) and come
back through W_UV; prefill chunks stage their latent rows and indexer keys and attend in
expanded form, each query over its indexer top-k of the staged prefix, as the model does.

After the forward, each prompt whose last chunk ran is handed to the coordinator from its
staging (a prefill step of its own: the store offloads it to the host and fills the request's
buffer, the algorithm builds its representations; no attention is computed there) and its
staging span is released. The logits returned are those of the decode rows, then of the last
token of each completed prompt: the rows the engine samples.

Memory is reserved when a request is admitted (`admit`: the coordinator's device buffers and
host pages, and the staging span of the whole prompt) and grows one token per decode step;
`can_grow` says, before a step, whether it will find room, so the scheduler preempts
(`retract`) rather than failing the step.

Why this module is long: the model, the coordinator and the prefill staging it owns meet in
each step's attention function (full, sliding-window and MLA forms), which reads all three; the
staging (staging.py), the step graphs (step_graphs.py) and the choice of prefill attention
(prefill_attention.py) already live apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..common.batch import Batch, Request
from ..common.errors import CapacityError, ConfigError
from ..common.transfer import to_device
from ..common.layer_map import LayerMap
from ..common.layout import KVLayout
from ..config import SparseConfig, load_config
from ..coordinator.core import SparseCoordinator
from ..kv_store.sliding_window import SlidingWindowKV
from .models import ModelConfig, Prefetch
from .models.mla import MLAInputs, mla_prefill_attention, mla_prefill_label
from .models.mla_config import MLAConfig
from .prefill_attention import choose as choose_prefill_attention
from .staging import PrefillStaging, chunk_attention
from .step_graphs import StepGraphs


class AttendFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class Model(Protocol):
    """What the runner needs of a model (engine/models' DecoderModel or GemmaDecoderModel; its
    `config`, a ModelConfig, gives the layer types, window, scale and soft-cap)."""

    def __call__(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn, logits_rows: torch.Tensor,
        prefetch: Prefetch | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class DecodeRow:
    """One decoding request's token this step: the last one sampled, fed back (a negative
    token: still on the device, taken from the step's `TokenFeed`)."""

    rid: str
    token: int


@dataclass(frozen=True)
class TokenFeed:
    """Decode rows whose token the host has not read yet (async scheduling): row `rows[i]`
    of the step takes `tokens[sources[i]]`, a previous step's sampled tokens on the device."""

    tokens: torch.Tensor
    rows: list[int]
    sources: list[int]


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens start..start+len(tokens)-1 of request `rid`; `last` when they end it."""

    rid: str
    tokens: tuple[int, ...]
    start: int
    last: bool


class ModelRunner:
    """The model, a SparseCoordinator over its KV and the prefill staging.

    max_num_seqs / max_model_len size the coordinator (requests at once, tokens per request);
    staging_tokens: prompt tokens that can be staged at once (at least the longest prompt);
    device/host_capacity_tokens: the coordinator's pools (defaults: its own sizing);
    decode_graphs: the coordinator replays each decode layer's sparse work from a CUDA graph;
    cuda_graphs: whole decode-only steps (model and coordinator) replayed from CUDA graphs
    (step_graphs.py); prefill_attention: "auto", "flash_attn" or "sdpa" (prefill_attention.py;
    `prefill_attention_label` says which was taken). model_config: the layers' types, window,
    attention scale and soft-cap (None: `model.config` if the model has one, else every layer
    full attention at 1/sqrt(D)); `layout` is the store's, its num_layers the full-attention
    layers at max_model_len (`ModelConfig.kv_layout(dtype, device, max_model_len)`); mla: the model's
    MLAConfig when the layout is MLA (its indexer's shape: DSA's `inputs` and the staged indexer
    keys). compute_dtype: the model's dtype (None: the layout's, or bfloat16 for an fp8 one):
    the staging, queries and rows handed to the coordinator; an fp8 MLA layout (FlashMLA's
    656-byte rows) is the store's only, which quantises the latents as it writes them.
    ring_page_slack: the sliding ring keeps a page more than the window per row, so a prefix
    cache can snapshot the window at the row's last page boundary (engine/prefix_cache.py)."""

    INDEX_INPUTS = ("index_q", "index_weights", "index_k")

    def __init__(
        self,
        model: Model,
        layout: KVLayout,
        sparse_config: SparseConfig | dict[str, Any] | str,
        *,
        num_q_heads: int,
        max_num_seqs: int,
        max_model_len: int,
        staging_tokens: int,
        device_capacity_tokens: int | None = None,
        host_capacity_tokens: int | None = None,
        decode_graphs: bool = False,
        cuda_graphs: bool = False,
        prefill_attention: str = "auto",
        model_config: ModelConfig | None = None,
        mla: MLAConfig | None = None,
        compute_dtype: torch.dtype | None = None,
        ring_page_slack: bool = False,
    ) -> None:
        if layout.is_mla and mla is None:
            raise ConfigError("ModelRunner: an MLA layout needs the model's MLAConfig (mla=model_config.mla)")
        self.mla = mla if layout.is_mla else None
        self.model = model
        if layout.is_fp8 and not layout.is_flashmla_fp8:
            raise ConfigError(f"an fp8 KV cache ({layout.dtype}) is supported for MLA models only (FlashMLA's 656-byte "
                              "latent rows); an MHA model's K/V stay in the model's dtype")
        # the model's activations, the prefill staging and the queries: the model's dtype even
        # where the store keeps fp8 latents (it quantises them as it writes, flashmla_format.py)
        self.dtype = compute_dtype or (torch.bfloat16 if layout.is_fp8 else layout.dtype)
        self.compute_layout = layout if self.dtype == layout.dtype else dataclasses.replace(layout, dtype=self.dtype)
        self.prefill_attention_label, self._chunk_attention = choose_prefill_attention(
            prefill_attention, torch.device(layout.device), self.dtype)
        if layout.is_mla:  # MLA chunks take mla_prefill_attention, whatever was chosen for the others
            self.prefill_attention_label = mla_prefill_label(torch.device(layout.device))
        self.layout = layout
        self.num_q_heads = num_q_heads
        config = load_config(sparse_config)
        if cuda_graphs and torch.device(layout.device).type != "cuda":
            raise ConfigError(f"cuda_graphs=True replays decode steps from CUDA graphs: it needs a CUDA device, "
                              f"got {layout.device!r}")
        try:
            self.coord = SparseCoordinator(
                config, layout, max_requests=max_num_seqs, max_seq_len=max_model_len,
                device_capacity_tokens=device_capacity_tokens, host_capacity_tokens=host_capacity_tokens,
                decode_graphs=decode_graphs or cuda_graphs,
            )
        except CapacityError as exc:  # in the engine's terms: the user set max_num_seqs / max_model_len
            raise type(exc)(_engine_terms(str(exc))) from None
        self.step_graphs = StepGraphs(self.coord) if cuda_graphs else None
        algo = self.coord.algorithm
        needs = sorted({**algo.prefill_inputs, **algo.decode_inputs})
        if needs and (self.mla is None or set(needs) - set(self.INDEX_INPUTS)):
            raise ConfigError(
                f"algorithm {config.algorithm!r} needs model inputs {needs} that this model does not compute "
                "(an MLA + indexer model gives index_q, index_weights, index_k; otherwise for DSA set "
                "extra.source to 'keys')"
            )
        self._ring_page_slack = ring_page_slack
        # called after each prompt chunk that is not the last, with (rid, request, tokens done):
        # a prefix cache snapshots the sliding window there (engine/prefix_cache.py)
        self.chunk_hook: Callable[[str, Request, int], None] | None = None
        # called when a prompt was handed to the coordinator, before its staging is released,
        # with (rid, request): a prefix cache copies the staged indexer keys there
        self.commit_hook: Callable[[str, Request], None] | None = None
        self._layers(model_config if model_config is not None else getattr(model, "config", None),
                     layout, max_num_seqs, max_model_len)
        if needs and self.mla is not None:
            o = self.coord.config.extra_config
            if (o.index_heads, o.index_dim) != (self.mla.index_n_heads, self.mla.index_head_dim):
                raise ConfigError(
                    f"extra.index_heads / extra.index_dim are {o.index_heads} / {o.index_dim}, but the model's indexer "
                    f"has {self.mla.index_n_heads} heads of {self.mla.index_head_dim}: set extra.index_heads = "
                    f"{self.mla.index_n_heads} and extra.index_dim = {self.mla.index_head_dim}"
                )
        self.staging = PrefillStaging(self.compute_layout, staging_tokens, self.mla.index_head_dim if self.mla else 0)
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self._q_rows = algo.prefill_query_rows  # None: every prompt query; 0: none
        self._q_tails: dict[str, torch.Tensor] = {}  # rid -> [layers, rows, Hq, D]: the queries build reads

    def _set_mla_scale(self) -> None:
        """MLA: the absorbed queries carry the model's softmax scale (absorbed_queries), so
        the coordinator's logits are their plain dot with a latent row: scale 1 on every layer."""
        for layer in range(self.layout.num_layers):
            self.coord.set_attention_options(layer, softcap=self.softcap, scale=1.0)

    def _layers(self, config: ModelConfig | None, layout: KVLayout, rows: int, max_model_len: int) -> None:
        """The layer map, the sliding-window ring, the attention scale and soft-cap."""
        if not isinstance(config, ModelConfig):
            self.layers, self.scale, self.softcap = LayerMap.all_full(layout.num_layers), None, None
            self.ring = None
            if self.mla is not None:
                self._set_mla_scale()
            return
        self.layers = config.layer_map(max_model_len)
        if len(self.layers.full) != layout.num_layers:
            raise ConfigError(
                f"the KV layout has {layout.num_layers} layers but the model has {len(self.layers.full)} "
                f"full-attention layers at max_model_len {max_model_len} (layout: "
                "ModelConfig.kv_layout(dtype, device, max_model_len))"
            )
        self.scale, self.softcap = config.attention_scale, config.attn_logit_softcapping
        if self.mla is not None:
            self._set_mla_scale()
        elif self.scale is not None or self.softcap is not None:
            for layer in range(layout.num_layers):  # a scale of 1/sqrt(D) is stored as the default
                self.coord.set_attention_options(layer, softcap=self.softcap, scale=self.scale)
        self.ring = None
        if self.layers.sliding:
            assert self.layers.window is not None
            slots = self.layers.window + (self.coord.store.page_size if self._ring_page_slack else 0)
            self.ring = SlidingWindowKV(len(self.layers.sliding), self.layers.window, rows, layout.num_kv_heads,
                                        layout.head_dim, dtype=self.dtype, device=layout.device, slots=slots)

    # -- memory (what the scheduler's budget asks) -----------------------------------------------
    def admit(self, rid: str, prompt_len: int, cached_pages: torch.Tensor | None = None,
              sparse: bool | None = None) -> bool:
        """Reserve a request's device buffers, host pages and prompt staging; False (nothing
        reserved) when there is no room now. `cached_pages`: host pages of a prefix cache
        holding the K/V of the prompt's first len x page_size tokens: they are copied into the
        request's staging span (the prefill chunks attend to them, and the hand-over builds
        the device buffer and the algorithm's representations from the whole staged prompt)
        and mapped read-only into its host table; its prefill starts after them. `sparse`: the
        request's own choice of decoding (SamplingParams.sparse; None: the config's rule)."""
        if not self.staging.reserve(rid, prompt_len):
            return False
        request = Request(rid, prompt_len)
        try:
            self.coord.on_request_begin(request, cached_pages, sparse=sparse)
        except CapacityError:
            self.staging.release(rid)
            return False
        if request.cached_len:
            staged = [self.staging.k] if self.staging.v is None else [self.staging.k, self.staging.v]
            self.coord.store.load_pages(cached_pages, staged, self.staging.spans[rid][0])
        self.requests[rid] = request
        rows = prompt_len if self._q_rows is None else min(self._q_rows, prompt_len)
        if rows:
            self._q_tails[rid] = torch.empty(
                (self.layout.num_layers, rows, self.num_q_heads, self.layout.head_dim),
                dtype=self.dtype, device=self.layout.device,
            )
        return True

    def can_grow(self, rids: list[str]) -> bool:
        """Whether one more decode token of each of these requests finds room."""
        return self.coord.can_grow([self.requests[r] for r in rids])

    def retract(self, rid: str) -> str | None:
        """Preempt a decoding request: its device KV goes, its host KV stays. None when done;
        why not, with nothing changed, when the host pool has no room for its K/V (a request
        kept whole on the device, the resident store's, is copied there)."""
        try:
            self.coord.on_request_retract(self.requests[rid])
        except CapacityError as exc:
            return _engine_terms(str(exc))
        return None

    def resume(self, rid: str) -> bool:
        """Bring a retracted request back; False (still retracted) when there is no room."""
        try:
            self.coord.on_request_resume(self.requests[rid])
        except CapacityError:
            return False
        return True

    def free(self, rid: str) -> None:
        """Release everything a request holds, in any state; the staging too when the
        coordinator's `on_request_end` raises (which frees its own pages before raising)."""
        request = self.requests.pop(rid, None)
        try:
            if request is not None:
                self.coord.on_request_end(request)
        finally:
            if rid in self.staging.spans:
                self.staging.release(rid)
            self._q_tails.pop(rid, None)

    def seq_len(self, rid: str) -> int:
        """Tokens of the request whose K/V are stored (prompt + decoded so far)."""
        return self.requests[rid].seq_len

    # -- a step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, decode: list[DecodeRow], prefill: list[PrefillChunk], feed: TokenFeed | None = None) -> torch.Tensor:
        """Run one step; logits (float32) of the decode rows, then of each prompt completed.
        Nothing here waits for the device (its inputs go through pinned memory), so the host
        can build this step while the GPU still runs the one before; `feed` gives the rows whose
        token is still on the device."""
        if not decode and not prefill:
            raise ValueError("an empty step")
        device = self.layout.device
        ids, positions, logits_rows = [], [], []
        for i, row in enumerate(decode):
            ids.append(row.token)
            positions.append(self.requests[row.rid].seq_len)
            logits_rows.append(i)
        offset = len(decode)
        for chunk in prefill:
            n = len(chunk.tokens)
            ids.extend(chunk.tokens)
            positions.extend(range(chunk.start, chunk.start + n))
            if chunk.last:
                logits_rows.append(offset + n - 1)
            offset += n
        token_ids = to_device(ids, torch.long, device)
        if feed is not None and feed.rows:
            token_ids[to_device(feed.rows, torch.long, device)] = feed.tokens[to_device(feed.sources, torch.long, device)]
        pos = to_device(positions, torch.long, device)
        rows = to_device(logits_rows, torch.long, device)

        batch = Batch([self.requests[r.rid] for r in decode]) if decode else None
        if batch is not None:
            self.coord.forward_begin(batch)
        try:
            if self.step_graphs is not None and batch is not None and not prefill:
                logits = self.step_graphs.run(batch, token_ids, pos, rows, lambda i, p, r: self.model(
                    i, p, self._attend_fn(batch, len(decode), []), r, self._prefetch(batch, [])))
            else:
                logits = self.model(token_ids, pos, self._attend_fn(batch, len(decode), prefill), rows,
                                    self._prefetch(batch, prefill))
            if batch is not None:
                self.coord.forward_end(batch)
        except BaseException:  # forward_end's failure too: the step never stays open
            if batch is not None:
                self.coord.abort_step(batch)
            raise
        for chunk in prefill:
            if chunk.last:
                self._commit(chunk.rid, chunk.start + len(chunk.tokens))
            elif self.chunk_hook is not None:
                self.chunk_hook(chunk.rid, self.requests[chunk.rid], chunk.start + len(chunk.tokens))
        return logits

    def _attend_fn(self, batch: Batch | None, num_decode: int, prefill: list[PrefillChunk]) -> AttendFn:
        if self.mla is not None:
            return self._mla_attend_fn(batch, num_decode, prefill)
        coord, staging, ring_of, store_of = self.coord, self.staging, self.layers.ring, self.layers.store

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ring_layer = ring_of.get(layer)
            if ring_layer is not None:
                return self._attend_sliding(ring_layer, batch, num_decode, prefill, q, k, v)
            layer = store_of[layer]  # q as is: the coordinator scales by the layer's attention_scale
            if not prefill and batch is not None:  # decode rows only: the coordinator's output is the layer's
                meta = coord.attention_begin(layer, q, k, v, batch)
                out = coord.attend(layer, q, meta)
                coord.attention_end(layer, out, batch)
                return out
            out = torch.empty_like(q)
            if batch is not None:
                b = num_decode
                meta = coord.attention_begin(layer, q[:b], k[:b], v[:b], batch)
                out[:b] = coord.attend(layer, q[:b], meta)
                coord.attention_end(layer, out[:b], batch)
            offset = num_decode
            for chunk in prefill:
                n = len(chunk.tokens)
                rows = slice(offset, offset + n)
                staging.write(layer, chunk.rid, chunk.start, k[rows], v[rows])
                pk, pv = staging.prefix(layer, chunk.rid, chunk.start + n)
                if self.softcap is None:
                    out[rows] = self._chunk_attention(q[rows], pk, pv, self.scale)
                else:
                    out[rows] = chunk_attention(q[rows], pk, pv, scale=self.scale, softcap=self.softcap)
                self._keep_queries(layer, chunk, q[rows])
                offset += n
            return out

        return attend

    def _prefetch(self, batch: Batch | None, prefill: list[PrefillChunk]) -> Prefetch | None:
        """The step's early-query prefetch (SparseConfig.prefetch), for a decode-only step of a
        model with a store: the model layers whose selection it predicts (sparse, in the store)."""
        coord, store_of = self.coord, self.layers.store
        if prefill or batch is None or self.mla is not None or not coord.prefetching:
            return None

        def predict(layer: int, q: torch.Tensor) -> None:
            coord.prefetch(store_of[layer], q, batch)

        return Prefetch(frozenset(i for i, at in store_of.items() if i not in self.layers.ring
                                  and at not in coord.dense_layers), predict)

    def _attend_sliding(
        self, layer: int, batch: Batch | None, num_decode: int, prefill: list[PrefillChunk],
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    ) -> torch.Tensor:
        """A sliding-window layer (ring layer `layer`): decode rows write their token into the
        ring and attend to its valid slots; a prefill chunk attends to the ring's window before
        it and its own keys under the sliding mask, then leaves its last `window` keys there."""
        ring = self.ring
        assert ring is not None
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        if not prefill and batch is not None:
            ring.write_decode(layer, batch.slot_ids, batch.seq_lens.long() - 1, k, v)
            return ring.attend(layer, q, batch.slot_ids, batch.seq_lens, scale, softcap=self.softcap)
        out = torch.empty_like(q)
        b = num_decode
        if batch is not None:
            ring.write_decode(layer, batch.slot_ids, batch.seq_lens.long() - 1, k[:b], v[:b])
            out[:b] = ring.attend(layer, q[:b], batch.slot_ids, batch.seq_lens, scale, softcap=self.softcap)
        offset = num_decode
        for chunk in prefill:
            n = len(chunk.tokens)
            rows = slice(offset, offset + n)
            row = self.requests[chunk.rid].slot
            before_k, before_v = ring.window_kv(layer, row, chunk.start)  # positions (start - window, start)
            keys, values = torch.cat([before_k, k[rows]]), torch.cat([before_v, v[rows]])
            out[rows] = chunk_attention(q[rows], keys, values, scale=scale, softcap=self.softcap, window=ring.window)
            ring.write_prefill(layer, row, k[rows], v[rows], start=chunk.start)
            offset += n
        return out

    def _mla_attend_fn(self, batch: Batch | None, num_decode: int, prefill: list[PrefillChunk]) -> Any:
        """The MLAAttend of a step (module docstring): decode rows absorbed through the
        coordinator, prefill chunks expanded over their staged prefix."""
        coord, staging, lay, dtype = self.coord, self.staging, self.layout, self.dtype
        algo = coord.algorithm
        # absorbed queries carry the model's scale: the coordinator's layers have scale 1 (_set_mla_scale)

        def attend(layer: int, x: MLAInputs) -> torch.Tensor:
            t, h = x.q_nope.shape[:2]
            out = x.q_nope.new_empty((t, h, x.kv_b.shape[1] - x.nope_dim))
            if batch is not None:
                b = slice(0, num_decode)
                q = x.absorbed_queries(b).to(dtype)
                k = x.latent[b].unsqueeze(1).to(dtype).contiguous()  # [B, 1, Dl]; an fp8 store packs it
                inputs = None
                if algo.decode_inputs:
                    inputs = {"index_q": x.index_q[b], "index_weights": x.index_weights[b], "index_k": x.index_k[b]}
                meta = coord.attention_begin(layer, q, k, None, batch, inputs)
                attended = coord.attend(layer, q, meta)  # [B, H, kv_lora_rank]
                coord.attention_end(layer, attended, batch)
                out[b] = x.expand_values(attended).to(out.dtype)
            offset = num_decode
            for chunk in prefill:
                n = len(chunk.tokens)
                rows = slice(offset, offset + n)
                staging.write(layer, chunk.rid, chunk.start, x.latent[rows].unsqueeze(1), None, x.index_k[rows])
                latent, _ = staging.prefix(layer, chunk.rid, chunk.start + n)
                index_k = staging.index_prefix(layer, chunk.rid, chunk.start + n)
                q_pos = torch.arange(chunk.start, chunk.start + n, device=out.device)
                out[rows] = mla_prefill_attention(x, rows, q_pos, latent[:, 0], index_k).to(out.dtype)
                if chunk.rid in self._q_tails:
                    self._keep_queries(layer, chunk, x.absorbed_queries(rows).to(dtype))
                offset += n
            return out

        return attend

    def _keep_queries(self, layer: int, chunk: PrefillChunk, q: torch.Tensor) -> None:
        """The chunk's queries among the prompt's last ones that `build` reads."""
        tail = self._q_tails.get(chunk.rid)
        if tail is None:
            return
        prompt_len = self.requests[chunk.rid].prompt_len
        first = prompt_len - tail.shape[1]  # prompt position of the tail's row 0
        lo, hi = max(chunk.start, first), chunk.start + q.shape[0]
        if lo < hi:
            tail[layer, lo - first : hi - first] = q[lo - chunk.start : hi - chunk.start]

    def _commit(self, rid: str, prompt_len: int) -> None:
        """Hand a completed prompt from the staging to the coordinator: one prefill step of
        `store_prompt` per layer (the store writes and the algorithm's build; the chunks
        attended already)."""
        request = self.requests[rid]
        batch = Batch([request], is_prefill=True)
        self.coord.forward_begin(batch)
        try:
            index_k = "index_k" in self.coord.algorithm.prefill_inputs
            tail = self._q_tails.get(rid)  # the queries the algorithm's build reads (None: it reads none)
            for layer in range(self.layout.num_layers):
                k, v = self.staging.prefix(layer, rid, prompt_len)
                inputs = {"index_k": self.staging.index_prefix(layer, rid, prompt_len)} if index_k else None
                self.coord.store_prompt(layer, k, None if self.layout.is_mla else v, batch,
                                        None if tail is None else tail[layer], inputs)
            self.coord.forward_end(batch)
        except BaseException:
            self.coord.abort_step(batch)
            raise
        if self.commit_hook is not None:
            self.commit_hook(rid, request)
        self.staging.release(rid)
        self._q_tails.pop(rid, None)



def _engine_terms(text: str) -> str:
    """A coordinator's message in the engine's settings (EngineConfig's names)."""
    return (text.replace("build the coordinator with", "give").replace("max_requests", "max_num_seqs")
            .replace("max_seq_len", "max_model_len"))
