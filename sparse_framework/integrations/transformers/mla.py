"""MLA models with DSA's lightning indexer in the transformers integration: DeepSeek-V3.2
(`DeepseekV32ForCausalLM`) and GLM-MoE-DSA (`GlmMoeDsaForCausalLM`), transformers >= 5.24.

    from sparse_framework.integrations.transformers import sparse  # imports this module at an MLA model's enable

    cfg = {"algorithm": "dsa", "top_k": 2048, "sink_tokens": 0, "recent_tokens": 0,
           "extra": {"index_heads": 64, "index_dim": 128, "key_dtype": "bfloat16", "score_newest": True}}
    with sparse(model, cfg, max_seq_len=32768) as handle:   # enable() dispatches to enable_mla
        out = model.generate(**inputs, max_new_tokens=64)

What the model does (transformers' modeling_deepseek_v32.py), and what changes
  Per layer the model projects the token to the MLA latent: `kv_a_layernorm(kv_pass)`
  (kv_lora_rank values, no position) and `k_rot` (qk_rope_head_dim values, interleaved RoPE
  applied), hands both to `cache.update`, expands all cached latents through `kv_b_proj` into
  per-head K (nope + rope) and V, and attends with `scaling` = (qk_nope + qk_rope)^-1/2, times
  mscale^2 under YaRN. Its indexer (`DeepseekV32Indexer`) computes per token `index_n_heads`
  queries (from the query latent `q_resid`), head weights (× index_n_heads^-1/2) and one key
  (`cache.update_indexer` appends it), scores Σ_h w_h · ReLU(q_h · k_s) · index_head_dim^-1/2
  over every cached key, the new one included, and keeps the top min(index_topk, length),
  which sdpa/eager apply as a mask. It does so at prefill too: every prompt query attends to
  its own top-k of its causal prefix (dense when the prompt is at most index_topk long).
  Keys and queries are in the model's dtype (bfloat16 for the released checkpoints; the
  original's Hadamard rotation and FP8 scoring are skipped: bf16 scores), weights float32.

  Here, through a `MLASparseCache`:
    prefill  the model's own attention, unchanged: its indexer runs, its top-k indices (the
             `indices` the model passes to a non-sdpa attention function) are folded into the
             mask and transformers' sdpa attention runs over the expanded K/V, exactly as the
             sdpa model computes. The coordinator stores the latent rows [c, k_rot]
             (kv_lora_rank + qk_rope_head_dim, post-RoPE) of the real prompt tokens in the
             store's MLA layout (`KVLayout.mla`: V is the first kv_lora_rank values) and DSA
             stores the indexer keys (`inputs["index_k"]`).
    decode   the indexer is not run by the model: a wrapper around it computes the same
             queries, weights and key (the model's projections and RoPE) and passes them to
             DSA through the coordinator's `inputs` (index_q, index_weights × index_head_dim^-1/2,
             index_k); DSA selects, the store makes the selection resident and the backend
             attends over the latent in absorbed form: q_nope is multiplied by kv_b_proj's K
             part per head (q_lat = W_UK_h^T q_nope_h), [q_lat, q_rot] attends to the latent
             rows with V = c, and the result goes out through kv_b_proj's V part (W_UV_h o_h).
             The model's expansion of this step's one latent through kv_b_proj still runs
             (its output is unused).

  To reproduce the model's selection exactly: top_k = index_topk, sink_tokens =
  recent_tokens = 0, extra.score_newest = true (the new token competes by its own score, as
  in the model), key_dtype "bfloat16" on a bfloat16 model (the model's keys are in its dtype;
  on a float32 model DSA's bfloat16 keys round them). FP8 keys (key_dtype "fp8_e4m3", V3.2's
  original) change the selection slightly; tests/test_integrations_transformers_mla.py
  measures by how much. Other algorithms (no model inputs) run too, on the latent rows with the
  absorbed queries (their q·k is the model's logit).

GLM-MoE-DSA has the same attention and indexer (its indexer's RoPE is interleaved, which is
the model's business here); layers that reuse the previous layer's top-k (`indexer_types`
"shared") are refused. DeepSeek-V2/V3 (MLA without an indexer) are not supported.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from packaging.version import Version

import transformers

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ...common.batch import Batch
from ...common.errors import ConfigError
from ...common.layout import KVLayout
from ...coordinator.core import SparseCoordinator
from ..index_mask import fold_indices
from .cache import AttentionEvent, SparseCache, _logit_scaled
from .compat import UnsupportedModelError
from .handle import SparseHandle

MIN_MLA_TRANSFORMERS = "5.24"
# the indexer classes whose forward this module reproduces at decode, with the RoPE function
# of their modeling module that the indexer applies (V3.2: half-split; GLM: interleaved)
INDEXER_ROPE = {
    "DeepseekV32Indexer": "apply_rotary_pos_emb",
    "GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave",
}
INDEX_INPUTS = ("index_q", "index_weights", "index_k")


def check_mla_transformers_version(version: str | None = None) -> None:
    """ImportError unless `version` (default: the installed transformers) has the MLA + DSA
    models in the form this module drives (tested with 5.24.0)."""
    version = transformers.__version__ if version is None else version
    if Version(version) < Version(MIN_MLA_TRANSFORMERS):
        raise ImportError(
            f"MLA models with DSA's indexer (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM) in sparse_framework's "
            f"transformers integration need transformers >= {MIN_MLA_TRANSFORMERS}, found {version}; "
            f"pip install 'transformers>={MIN_MLA_TRANSFORMERS}'"
        )


def enable_mla(model: Any, cfg: Any, config: Any, **sizes: Any) -> MLAHandle:
    """`enable` for an MLA model (enabling.enable imports this module and dispatches here):
    the latent layout, a coordinator, and a handle whose caches drive the absorbed decode
    (module docstring)."""
    check_mla_transformers_version()
    name = type(model).__name__
    modules = _attention_modules(model)
    shared = [i for i, t in enumerate(getattr(cfg, "indexer_types", None) or []) if t != "full"]
    if shared:
        raise UnsupportedModelError(
            f"{name}: layers {shared} reuse the previous layer's top-k (indexer_types 'shared'), which sparse "
            "decode does not support (every layer needs its own indexer)"
        )
    if len(modules) != cfg.num_hidden_layers:
        raise UnsupportedModelError(
            f"{name}: MLA without DSA's lightning indexer (DeepSeek-V2/V3) is not supported; MLA models with "
            f"an indexer are: DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM"
        )
    layout = KVLayout.mla(
        cfg.num_hidden_layers, latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim, v_head_dim=cfg.kv_lora_rank,
        dtype=model.dtype, device=model.device,
    )
    coord = SparseCoordinator(config, layout, **sizes)
    algo = coord.algorithm
    wants = {**algo.prefill_inputs, **algo.decode_inputs}
    if set(wants) - set(INDEX_INPUTS):
        raise UnsupportedModelError(
            f"algorithm {coord.config.algorithm!r} needs model inputs {sorted(wants)}; an MLA + DSA model gives "
            f"{list(INDEX_INPUTS)}"
        )
    if wants:
        o = coord.config.extra_config
        if (o.index_heads, o.index_dim) != (cfg.index_n_heads, cfg.index_head_dim):
            raise ConfigError(
                f"extra.index_heads / extra.index_dim are {o.index_heads} / {o.index_dim}, but {name}'s indexer has "
                f"{cfg.index_n_heads} heads of {cfg.index_head_dim} (index_n_heads / index_head_dim): set "
                f"extra.index_heads = {cfg.index_n_heads} and extra.index_dim = {cfg.index_head_dim}"
            )
    return MLAHandle(model, coord, modules)


def _attention_modules(model: Any) -> list[Any]:
    """The attention modules with an indexer this module knows, in layer order."""
    found = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
             and type(getattr(m, "indexer", None)).__name__ in INDEXER_ROPE and hasattr(m, "kv_b_proj")]
    return sorted(found, key=lambda m: m.layer_idx)


class MLAHandle(SparseHandle):
    """A SparseHandle whose caches are `MLASparseCache`s; wraps each layer's indexer so that
    at decode it hands its outputs to the cache instead of scoring every key itself."""

    def __init__(self, model: Any, coordinator: SparseCoordinator, modules: list[Any]) -> None:
        self._indexers: list[tuple[Any, Any]] = []  # (indexer, its own instance `forward` or None)
        super().__init__(model, coordinator)
        for module in modules:
            indexer = module.indexer
            self._indexers.append((indexer, vars(indexer).get("forward")))
            indexer.forward = _decode_indexer(indexer, indexer.forward)

    def new_cache(self) -> MLASparseCache:
        if not self.enabled:
            raise RuntimeError("this sparse_framework handle is disabled")
        return MLASparseCache(self)

    def disable(self) -> None:
        if not self.enabled:
            return
        for indexer, own in self._indexers:
            if own is None:
                del indexer.forward
            else:
                indexer.forward = own
        self._indexers.clear()
        super().disable()


def indexer_outputs(
    indexer: Any, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the model's indexer computes before scoring, by its own modules and RoPE:
    queries [B, S, H, D] and keys [B, S, D] (post-RoPE, the model's dtype) and head weights
    float32 [B, S, H], × H^-1/2 (the model's) × D^-1/2 (its softmax_scale, which the model
    applies to q·k inside the ReLU: a positive factor, so the score is the same)."""
    rope = getattr(sys.modules[type(indexer).__module__], INDEXER_ROPE[type(indexer).__name__])
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    rot = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rot, indexer.head_dim - rot], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rot, indexer.head_dim - rot], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return q, weights * (indexer.n_heads**-0.5 * indexer.softmax_scale), k


def _decode_indexer(indexer: Any, own: Any) -> Any:
    """The indexer's forward while the integration is enabled: the model's own, except in a
    decode step of an MLASparseCache, where its outputs go to the cache (for DSA) and it
    returns no indices (the attention function does not read them at decode)."""

    @torch.no_grad()
    def forward(hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings: Any,
                attention_mask: Any = None, position_ids: Any = None, cache: Any = None, **kwargs: Any) -> torch.Tensor:
        cache = kwargs.pop("past_key_values", cache)
        if isinstance(cache, MLASparseCache) and cache._decoding():
            cache._index = indexer_outputs(indexer, hidden_states, q_resid, position_embeddings)
            b, s, _ = hidden_states.shape
            return torch.zeros(b, s, 0, dtype=torch.int32, device=hidden_states.device)
        return own(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=cache, **kwargs)

    return forward


class MLASparseCache(SparseCache):
    """A SparseCache for MLA + DSA models: `update` receives the latent (c [B, 1, n,
    kv_lora_rank], k_rot [B, 1, n, rope]) and `update_indexer` the indexer keys; the attention
    function then receives the expanded K/V, which it does not read at decode."""

    def __init__(self, handle: SparseHandle) -> None:
        super().__init__(handle)
        self._latent: tuple[torch.Tensor, torch.Tensor] | None = None  # this forward's (c, k_rot) of the open layer
        self._index_k: torch.Tensor | None = None  # prefill: the indexer keys [B, n, D] of the open layer
        self._index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # decode: (q, w, k)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._latent = (key_states, value_states)
        return out

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Prefill only (at decode the wrapped indexer does not call it): keep this layer's
        indexer keys for DSA and return them, all the model's indexer scores against."""
        self._index_k = indexer_key_states
        return indexer_key_states

    def _decoding(self) -> bool:
        """Whether the forward now running is a decode step: the cache holds requests and the
        open step (none yet before layer 0's attention) is not their prefill."""
        batch = self.live.batch
        return bool(self.live.requests) and (batch is None or not batch.is_prefill)

    def close(self) -> None:
        self._latent = self._index_k = self._index = None
        super().close()

    def _claims(self, layer: int, key: torch.Tensor) -> bool:
        # the model expands the latent into per-head K/V after `update`: `key` is not the
        # tensor update returned, so the layer alone identifies the cache's own step
        return self._pending is not None and self._pending[0] == layer and self._latent is not None

    def _attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, scaling: float | None, kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, None]:
        """One layer: query [B, H, n, nope + rope] -> ([B, n, H, v_head_dim], None)."""
        self._pending = None
        assert self._latent is not None
        c, k_rot = self._latent
        self._latent = None
        indices = kwargs.pop("indices", None)
        layer = module.layer_idx
        coord, live = self.handle.coordinator, self.live
        b, h, n, d = query.shape
        batch = self._step_batch(layer, attention_mask, b, n)
        scale = d**-0.5 if scaling is None else scaling
        latent = torch.cat([c, k_rot], dim=-1)[:, 0]  # [B, n, kv_lora_rank + rope], post-RoPE
        with torch.no_grad():
            if batch.is_prefill:
                mask = fold_indices(attention_mask, indices, key.shape[2])
                out = self._prefill_layer_mla(module, layer, batch, query, key, value, mask, latent, scale, kwargs)
            else:
                out = self._decode_layer_mla(module, layer, batch, query, latent, scale)
        if layer == coord.layout.num_layers - 1:
            coord.forward_end(batch)
            live.batch = None
            if not batch.is_prefill:
                self.handle._decode_steps += 1
        return out, None

    def _prefill_layer_mla(
        self, module: Any, layer: int, batch: Batch, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        mask: torch.Tensor | None, latent: torch.Tensor, scale: float, kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Store the packed prompt's latent rows (and indexer keys), attend as the model does."""
        rows = self.live.prompt_rows
        assert rows is not None
        coord = self.handle.coordinator
        self._set_scale(layer, 1.0)  # absorbed queries carry the model's scale (as at decode)
        packed = latent.reshape(-1, latent.shape[-1]).index_select(0, rows).unsqueeze(1)  # [T, 1, Dl]
        if coord.algorithm.needs_prefill_queries:
            q = absorb_queries(module, query.transpose(1, 2).reshape(-1, *query.shape[1::2]).index_select(0, rows), scale)
            q = q.to(packed.dtype)
        else:  # not read by the algorithm: a stand-in of the right shape, no memory
            q = packed.new_zeros(()).expand(packed.shape[0], query.shape[1], packed.shape[-1])
        inputs = None
        if "index_k" in coord.algorithm.prefill_inputs:
            assert self._index_k is not None, "the model's indexer did not run before its attention"
            inputs = {"index_k": self._index_k.reshape(-1, self._index_k.shape[-1]).index_select(0, rows)}
        self._index_k = None
        coord.attention_begin(layer, q, packed, None, batch, inputs)
        if self.handle.observer is not None:
            self.handle.observer(AttentionEvent(layer, batch, q, packed, packed[..., : coord.layout.v_head_dim]))
        out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scale, **kwargs)
        coord.attention_end(layer, None, batch)
        return out

    def _decode_layer_mla(
        self, module: Any, layer: int, batch: Batch, query: torch.Tensor, latent: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Absorbed MLA over the selected latent rows: [B, 1, H, v_head_dim]."""
        coord = self.handle.coordinator
        lay = coord.layout
        # the absorbed queries carry the model's scale: the coordinator's layer has scale 1
        self._set_scale(layer, 1.0)
        q = absorb_queries(module, query[:, :, 0], scale).to(lay.dtype)
        k = latent[:, 0].unsqueeze(1).contiguous()  # [B, 1, Dl]
        inputs = None
        if coord.algorithm.decode_inputs:
            if self._index is None:
                raise RuntimeError(f"layer {layer}: the model's indexer did not run before its attention")
            iq, w, ik = self._index
            inputs = {"index_q": iq[:, 0], "index_weights": w[:, 0], "index_k": ik[:, 0]}
        self._index = None
        meta = coord.attention_begin(layer, q, k, None, batch, inputs)
        attended = coord.attend(layer, q, meta)  # [B, H, kv_lora_rank]
        coord.attention_end(layer, attended, batch)
        assert meta.selection is not None
        self.handle._record(layer, meta.selection, batch)
        if self.handle.observer is not None:
            self.handle.observer(AttentionEvent(layer, batch, _logit_scaled(q, 1.0), k, k[..., : lay.v_head_dim], attended,
                                                meta.selection))
        return expand_values(module, attended).unsqueeze(1).to(query.dtype)


def _kv_b(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight per head (views, the model's dtype): W_UK [H, nope, kv_lora_rank]
    and W_UV [H, v_head_dim, kv_lora_rank]."""
    w = module.kv_b_proj.weight.view(module.num_heads, module.qk_nope_head_dim + module.v_head_dim, -1)
    return w[:, : module.qk_nope_head_dim], w[:, module.qk_nope_head_dim :]


def absorb_queries(module: Any, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries [T, H, nope + rope] -> [T, H, kv_lora_rank + rope] (the weights' dtype) whose
    dot with a latent row [c, k_rot] is the model's logit: scale · (q_nope · W_UK c + q_rot · k_rot)."""
    w_uk, _ = _kv_b(module)
    nope = module.qk_nope_head_dim
    q_lat = torch.einsum("thn,hnl->thl", query[..., :nope].to(w_uk.dtype), w_uk)
    return torch.cat([q_lat, query[..., nope:].to(w_uk.dtype)], dim=-1) * scale


def expand_values(module: Any, attended: torch.Tensor) -> torch.Tensor:
    """Attention over the latent [B, H, kv_lora_rank] -> [B, H, v_head_dim] through W_UV."""
    _, w_uv = _kv_b(module)
    return torch.einsum("bhl,hvl->bhv", attended.to(w_uv.dtype), w_uv)

