"""The floors a step is measured against: the FLOPs of a prefill and the bytes a decode step
must read at least, from the model's shape, the sparse config and the algorithm's selection.

Why its own module: these are pure arithmetic over a model and a config (no run, no clock),
shared by the offline benchmark's figures (`offline.run_benchmark`) and by the profiling
scripts in benchmarks/, and each is tested against a hand computation on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..config import SparseConfig
from ..engine.memory import weight_bytes_of
from ..engine.models import ModelConfig

if TYPE_CHECKING:
    from ..engine.llm import LLM

__all__ = ["decode_floor_bytes", "decode_weight_bytes", "mla_attention_flops", "moe_modules", "prefill_flops",
           "selected_tokens_bound", "unrouted_expert_parameters"]


def prefill_flops(config: ModelConfig, prompt_lens: Sequence[int]) -> float:
    """FLOPs of prefilling these prompts: 2 x the parameters every token multiplies through
    (all but the embedding table, a lookup; the LM head runs on each prompt's last token
    only; an MoE layer's routed experts: the num_experts_per_tok a token is routed to, not
    all of them) per token, the head once per prompt, and attention: causal QK^T and PV,
    2·2·layers·heads·head_dim·L²/2 per prompt of L tokens; for an MLA model (DeepSeek-V3.2)
    the model's own sparse attention instead, `mla_attention_flops`."""
    embed = config.vocab_size * config.hidden_size
    head = 0 if config.tie_word_embeddings else embed
    per_token = config.num_parameters() - embed - head - unrouted_expert_parameters(config)
    if config.mla is not None:
        return float(sum(2 * per_token * n + 2 * embed + mla_attention_flops(config, n) for n in prompt_lens))
    attention = 2 * config.num_layers * config.num_heads * config.head_dim
    return float(sum(2 * per_token * n + 2 * embed + attention * n * n for n in prompt_lens))


def unrouted_expert_parameters(config: ModelConfig) -> int:
    """Parameters of the routed experts one token does not go through (every MoE layer's
    n_routed_experts - num_experts_per_tok experts); 0 for a model without an MoE."""
    m = config.mla
    if m is None:
        return 0
    moe_layers = sum(t == "sparse" for t in m.mlp_layer_types)
    return moe_layers * (m.n_routed_experts - m.num_experts_per_tok) * 3 * config.hidden_size * m.moe_intermediate_size


def mla_attention_flops(config: ModelConfig, n: int) -> float:
    """Attention FLOPs of one MLA prompt of n tokens as the model defines it (the expanded
    form, per layer): the query at position p attends to min(index_topk, p + 1) keys, QK^T over
    qk_nope + qk_rope dims and PV over v_head_dim for each of the heads, and the lightning
    indexer scores every causal key, index_n_heads x index_head_dim multiply-adds per pair
    (the per-head weighting, index_n_heads more, counted too). Latent up- and down-projections
    are parameters (counted per token)."""
    m = config.mla
    assert m is not None
    topk = m.index_topk
    causal = n * (n + 1) // 2  # (query, key) pairs with key <= query
    kept = causal if n <= topk else topk * (topk + 1) // 2 + (n - topk) * topk
    attention = config.num_heads * (m.qk_head_dim + m.v_head_dim) * kept
    indexer = m.index_n_heads * (m.index_head_dim + 1) * causal
    return 2.0 * config.num_layers * (attention + indexer)


def moe_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE blocks (modules with routed `experts`), in layer order."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.ModuleList)]


def decode_weight_bytes(model: torch.nn.Module, rows: int, experts_hit: Sequence[int | None] | None = None) -> float:
    """Weight bytes a decode step of `rows` tokens reads at least: every parameter once, except
    the embedding table, of which only the rows' own `rows` rows are read (all of it when the
    LM head shares it), and an MoE layer's routed experts, of which only those the step's
    tokens were routed to: `experts_hit[i]` of MoE block i where measured (the gathered
    dispatch counts them), else min(n_routed_experts, rows x num_experts_per_tok), the most the
    rows can hit (all of them for a batch of enough rows)."""
    total = float(weight_bytes_of(model.parameters()))
    config = getattr(model, "config", None)
    embed = dict(model.named_parameters()).get("model.embed_tokens.weight")
    if embed is not None and not getattr(config, "tie_word_embeddings", False):
        total -= embed.numel() * embed.element_size() - rows * embed.shape[1] * embed.element_size()
    mla = getattr(config, "mla", None)
    for i, moe in enumerate(moe_modules(model)):
        experts = list(moe.experts)  # type: ignore[arg-type]
        per_expert = weight_bytes_of(experts[0].parameters())
        hit = experts_hit[i] if experts_hit is not None and i < len(experts_hit) else None
        if hit is None:
            k = mla.num_experts_per_tok if mla is not None else len(experts)
            hit = min(len(experts), rows * k)
        total -= (len(experts) - hit) * per_expert
    return total


def selected_tokens_bound(algorithm: Any, config: SparseConfig) -> int:
    """The most tokens one selection holds. Page-granular: the selection's static width
    (`max_selected_tokens`: sink, budget and recent pages, a misaligned window one more).
    Token-granular: sink + top_k + recent tokens, plus the newest token where the algorithm
    forces it in on top of its budget with no recent window to hold it (DSA as DeepSeek-V3.2
    selects, newest_in_top_k or score_newest with no sink or recent tokens: exactly top_k)."""
    if algorithm.granularity != "token":
        return algorithm.max_selected_tokens(config)
    newest_on_top = bool(getattr(algorithm, "newest_forced", True)) and config.recent_tokens == 0
    return config.sink_tokens + algorithm.budget_units(config) + config.recent_tokens + int(newest_on_top)


def decode_floor_bytes(llm: LLM, rows: Sequence[tuple[int, int]],
                       experts_hit: Sequence[int | None] | None = None) -> float:
    """Bytes a decode step of these rows, (context tokens, prompt tokens) each, must read at
    least: the weights (`decode_weight_bytes`: the embedding's rows only, an MoE's routed
    experts only; `experts_hit` per MoE block where measured), then per layer and row every
    context token's K/V in a dense layer or for a request in the algorithm's dense mode
    (prompt < min_sparse_prompt_len), else at most the algorithm's largest selection of K/V
    plus its representation of the whole context (what its scoring reads). K/V rows are
    counted as stored (an MLA latent: 576 x 2 bytes in bf16, 656 in FlashMLA's FP8 rows; DSA's
    representation: one indexer key, index_dim x 2 bytes or x (1 + 4/128) in FP8). The store
    does not matter: a resident store with a sparse algorithm reads only the selection, like
    the hierarchical one."""
    model, coord = llm.model, llm.engine.runner.coord
    weights = decode_weight_bytes(model, len(rows), experts_hit)
    layout, config, algorithm = coord.layout, coord.config, coord.algorithm
    per_token = layout.bytes_per_token_per_layer
    representation = algorithm.representation_bytes_per_token(layout, config)
    selected = selected_tokens_bound(algorithm, config)
    dense_ctx = sum(ctx for ctx, prompt in rows if prompt < config.min_sparse_prompt_len)
    sparse = [ctx for ctx, prompt in rows if prompt >= config.min_sparse_prompt_len]
    sparse_layer = sum(min(ctx, selected) * per_token + ctx * representation for ctx in sparse)
    dense_layer = (dense_ctx + sum(sparse)) * per_token
    num_dense = len(coord.dense_layers)
    return weights + num_dense * dense_layer + (layout.num_layers - num_dense) * (dense_ctx * per_token + sparse_layer)
