"""DSA top-k (DeepSeek-V3.2's lightning indexer), and exact top-k over the real keys.

`source: "indexer"` (the model has an indexer). Every token s has one indexer key k_s
(`index_dim` values, shared by all heads); a query token t has `index_heads` indexer queries
q_{t,h} and weights w_{t,h}. The index score of s for t is Σ_h w_{t,h} · ReLU(q_{t,h} · k_s),
and the selection is the top `top_k` tokens (min(top_k, length)), token-granular and shared
by all heads of the layer. The model computes q, w and k (its projections, RoPE and Hadamard
rotation are the model's business) and passes them to `attention_begin` as inputs
`index_q` [tokens, heads, dim], `index_weights` [tokens, heads] and `index_k` [tokens, dim]
(at prefill only `index_k` is needed: prefill attention is dense here).
The weights are taken as given: the original multiplies them by heads^-1/2 · dim^-1/2, and a
positive global factor does not change the top-k. The indexer keys are the representation,
stored as bfloat16 (float32 keeps a float32 model's keys unrounded) or as FP8 e4m3 with one
float32 scale per 128 values (the original's
`act_quant`: scale = amax / 448, rounded up to a power of two in the "ue8m0" format V3.2
ships with); with FP8 the queries are quantised the same way before scoring, as the original
does. That quantisation is part of the scoring function (`dsa_index_scores_fp8q`): the Triton
kernel takes the raw queries and quantises them per program, bit-exact with
`quantize_fp8_blocks`, instead of ~16 small torch kernels per step, and on sm_89+ GPUs
multiplies them with the key bits in an FP8 tensor-core dot; the torch twin quantises and
dequantises in torch. Either way the score is Σ_h w_h · ReLU(Σ_blocks q_bits·k_bits ·
q_scale · k_scale).

`source: "keys"` (no indexer). Scores with the real attention keys: per KV head, token s
scores Σ_{h in group} softmax_h(q_h · k_s / √d)_s — the attention mass the group would put on
s, so the top-k is the exact best selection of that size for the group. It keeps a copy of
the keys on the device (as much memory as the K cache itself): an oracle for evaluation, and
the baseline the accuracy table measures the others against.

The framework's sink and recent tokens are always kept (the original keeps only the top-k;
set sink_tokens / recent_tokens to 0 to match it). The newest token is always selected too:
with `newest_in_top_k` (default, as V3.2's exact `topk(min(top_k, end_pos))`) it takes one of
the top_k places unless the sink or recent window holds it; false: it is kept on top.
`score_newest` instead lets the newest token compete by its own index score (it may then be
left out), which is what V3.2's reference indexer and transformers' DeepseekV32 do (they append
the new key before scoring): the newest key is then stored at `select`, from the step's
`index_k`, before the scores are computed (the top-k then runs its torch code on any device).
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..common.batch import Batch, Request, Selection
from ..common.layout import resolve_impl
from ..kernels.reference.scores import FP8_BLOCK, quantize_fp8_blocks
from .base import NO_INPUTS, Inputs, ScoringAlgorithm, group_probabilities, key_dtype, scoring_kernel

# whether the Triton indexer also runs the top-k's first radix pass (one launch fewer per
# step). Off: measured on an H100 at 8 x 128K tokens (benchmarks/profile_decode_layer.py), the
# histograms made the indexer 18 µs slower (74 -> 92 µs) to save a 7.9 µs pass. A module
# attribute, so that tests and benchmarks can switch it on
FUSE_TOPK_FIRST_PASS = False


class DSAOptions(BaseModel):
    """DSA's extra-config (defaults: DeepSeek-V3.2's indexer)."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["indexer", "keys"] = Field(
        "indexer", description="indexer: the model's lightning indexer; keys: exact top-k over the real keys (oracle)"
    )
    index_heads: int = Field(64, ge=1, description="indexer query heads")
    index_dim: int = Field(128, ge=1, description="indexer query/key dimension")
    key_dtype: Literal["bfloat16", "float32", "fp8_e4m3"] = Field(
        "fp8_e4m3",
        description="storage of the indexer keys: bfloat16, float32 (a float32 model's own keys, unrounded), or "
        "FP8 e4m3 with a float32 scale per 128 values",
    )
    scale_format: Literal["ue8m0", "float32"] = Field(
        "ue8m0", description="FP8 scales: ue8m0 = rounded up to powers of two (V3.2's config), float32 = amax / 448"
    )
    newest_in_top_k: bool = Field(
        True,
        description="the newest token takes one of the top_k places unless the sink or recent window holds it "
        "(V3.2 selects exactly min(top_k, length) tokens: set sink_tokens = recent_tokens = 0 too); "
        "false: it is kept on top of top_k",
    )
    score_newest: bool = Field(
        False,
        description="the newest token competes for the top_k places by its own index score and may be left out, "
        "as V3.2's reference indexer and transformers' DeepseekV32 do (source 'indexer' only; overrides "
        "newest_in_top_k; the top-k runs in torch)",
    )
    impl: Literal["auto", "torch", "triton"] = Field(
        "auto", description="index-score kernel: auto = triton on CUDA, torch elsewhere"
    )

    @model_validator(mode="after")
    def _fp8_blocks(self) -> DSAOptions:
        if self.source == "indexer" and self.key_dtype == "fp8_e4m3" and self.index_dim % FP8_BLOCK:
            raise ValueError(
                f"key_dtype 'fp8_e4m3' quantises in blocks of {FP8_BLOCK} values: index_dim "
                f"({self.index_dim}) must be a multiple of {FP8_BLOCK}, or use key_dtype 'bfloat16'"
            )
        if self.score_newest and self.source != "indexer":
            raise ValueError("score_newest needs source 'indexer' (the newest token's index key comes with the step)")
        return self


class DSA(ScoringAlgorithm):
    """Token-granular. Indexer: one selection per request, keys pooled as [layers, R,
    max_seq_len, index_dim] (+ scales [.., index_dim // 128] for FP8). Keys: one selection
    per KV head, keys pooled as [layers, R, kv_heads, max_seq_len, head_dim]."""

    Config = DSAOptions
    granularity = "token"
    per_kv_head = False

    @classmethod
    def representation_bytes_per_token(cls, layout, config) -> float:  # type: ignore[no-untyped-def]
        """Indexer: one key of index_dim values (2 bytes, or 1 + 4/128 with FP8); keys: a K row."""
        o = config.extra_config
        if o.source == "keys":
            return float(layout.row_bytes)
        if o.key_dtype == "fp8_e4m3":
            return float(o.index_dim * (1 + 4 / FP8_BLOCK))
        return float((2 if o.key_dtype == "bfloat16" else 4) * o.index_dim)

    def __init__(self, config, layout, max_requests, max_seq_len) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, layout, max_requests, max_seq_len)
        self.topk_impl = resolve_impl(self.options.impl, layout.device)
        self.newest_forced = not self.options.newest_in_top_k and not self.options.score_newest
        self.newest_scored = self.options.score_newest
        o, dev = self.options, layout.device
        if o.source == "keys":
            self.per_kv_head = layout.num_kv_heads > 1
            shape = (layout.num_layers, max_requests, layout.num_kv_heads, max_seq_len, layout.head_dim)
            self.keys = torch.zeros(shape, dtype=key_dtype(layout), device=dev)
            return
        self.prefill_inputs = {"index_k": (o.index_dim,)}
        self.decode_inputs = {
            "index_q": (o.index_heads, o.index_dim),
            "index_weights": (o.index_heads,),
            "index_k": (o.index_dim,),
        }
        shape = (layout.num_layers, max_requests, max_seq_len, o.index_dim)
        self.fp8 = o.key_dtype == "fp8_e4m3"
        self.pow2_scales = o.scale_format == "ue8m0"
        # (index_q, weights, index_k, k_scale, slot_ids, n) -> [B, n]; with fp8 keys the one that
        # quantises the raw queries like the keys (in the Triton kernel, or its torch twin)
        if self.fp8:
            fp8q = scoring_kernel("dsa_index_scores_fp8q", o.impl, dev)
            self.index_scores = partial(fp8q, pow2_scales=self.pow2_scales)
        else:
            self.index_scores = scoring_kernel("dsa_index_scores", o.impl, dev)
        stored = {"fp8_e4m3": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32}[o.key_dtype]
        self.index_k = torch.zeros(shape, dtype=stored, device=dev)
        self.k_scale = (
            torch.ones((*shape[:3], o.index_dim // FP8_BLOCK), dtype=torch.float32, device=dev) if self.fp8 else None
        )

    def _store_index_keys(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> None:
        """Write indexer keys [N, index_dim] at (slots[i], pos[i]) in the storage format."""
        if self.fp8:
            assert self.k_scale is not None
            bits, scales = quantize_fp8_blocks(keys.float(), self.pow2_scales)
            self.index_k[layer, slots, pos] = bits
            self.k_scale[layer, slots, pos] = scales
        else:
            self.index_k[layer, slots, pos] = keys.to(self.index_k.dtype)

    def build(
        self, layer: int, request: Request, keys: torch.Tensor, queries: torch.Tensor | None = None, *, inputs: Inputs = NO_INPUTS
    ) -> None:
        n = keys.shape[0]
        if self.options.source == "keys":
            self.keys[layer, request.slot, :, :n] = keys.transpose(0, 1).to(self.keys.dtype)
            return
        pos = torch.arange(n, device=keys.device)
        slots = torch.full_like(pos, request.slot)
        self._store_index_keys(layer, slots, pos, inputs["index_k"])

    def append(self, layer: int, batch: Batch, keys: torch.Tensor, *, inputs: Inputs = NO_INPUTS) -> None:
        assert batch.seq_lens is not None and batch.slot_ids is not None
        pos = batch.seq_lens.long() - 1
        if self.options.source == "keys":
            heads = torch.arange(self.layout.num_kv_heads, device=keys.device)
            self.keys[layer, batch.slot_ids.view(-1, 1), heads.view(1, -1), pos.view(-1, 1)] = keys.to(self.keys.dtype)
            return
        self._store_index_keys(layer, batch.slot_ids, pos, inputs["index_k"])

    def select(self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS) -> Selection:
        """Scores and top-k; with FP8 keys on the Triton path (and FUSE_TOPK_FIRST_PASS) the
        indexer kernel also does the top-k's first radix pass, which saves that launch."""
        # the fused first pass follows the default rule (the newest token forced on top), which
        # newest_in_top_k equals when the recent window holds the newest token
        fuse = FUSE_TOPK_FIRST_PASS and (self.newest_forced or self.config.recent_tokens >= 1)
        if self.newest_scored:  # the newest key scored with the others: stored now (append rewrites it)
            assert batch.seq_lens is not None and batch.slot_ids is not None
            self._store_index_keys(layer, batch.slot_ids, batch.seq_lens.long() - 1, inputs["index_k"])
            fuse = False
        if not (fuse and self.options.source == "indexer" and self.fp8 and self.topk_impl == "triton"):
            return super().select(layer, queries, batch, inputs=inputs)
        from ..kernels.topk import first_pass_buffer

        assert batch.seq_lens is not None and batch.slot_ids is not None and self.k_scale is not None
        hist = first_pass_buffer(batch.seq_lens.shape[0], batch.seq_lens.device)
        window = (hist, batch.seq_lens, self.config.sink_tokens, self.config.recent_tokens)
        scores = self.index_scores(inputs["index_q"], inputs["index_weights"], self.index_k[layer], self.k_scale[layer],
                                   batch.slot_ids, batch.max_seq_len, first_pass=window)
        return self.top_units(scores.unsqueeze(1), batch, first_pass=hist)

    def score(
        self, layer: int, queries: torch.Tensor, batch: Batch, *, inputs: Inputs = NO_INPUTS
    ) -> torch.Tensor:
        assert batch.seq_lens is not None and batch.slot_ids is not None
        n = batch.max_seq_len
        if self.options.source == "keys":
            return self._exact_mass(layer, queries, batch)
        # the raw queries and weights, whatever their float dtype: the scoring function casts
        # (and with fp8 keys quantises the queries) itself
        scales = None if self.k_scale is None else self.k_scale[layer]
        return self.index_scores(
            inputs["index_q"], inputs["index_weights"], self.index_k[layer], scales, batch.slot_ids, n
        ).unsqueeze(1)

    def _exact_mass(self, layer: int, queries: torch.Tensor, batch: Batch) -> torch.Tensor:
        """[B, Hkv or 1, n]: the attention mass each group puts on each stored key. The newest
        token is not stored yet (append runs after select); it is always selected anyway."""
        assert batch.seq_lens is not None and batch.slot_ids is not None
        b, hq, d = queries.shape
        hk = self.layout.num_kv_heads
        k = self.keys[layer, batch.slot_ids, :, : batch.max_seq_len].float()  # [B, Hkv, n, D]
        logits = queries.float().view(b, hk, hq // hk, d) @ k.transpose(-1, -2)  # [B, Hkv, G, n]
        mass = group_probabilities(logits, batch.seq_lens, d, "sum")  # [B, Hkv, n]
        return mass if self.per_kv_head else mass.sum(1, keepdim=True)

    def release(self, request: Request) -> None:
        """Nothing to free: the pooled rows of `request.slot` are overwritten on reuse."""
