"""The MLA model's hook into the engine: `attend(layer, MLAInputs) -> out`, and its reference.

An MLA layer (DeepSeek-V3.2) does not hand the runner per-head K/V: it hands what its cache
holds — one latent row per token, the normalised latent c then the RoPE'd key — plus its
queries split into the part that meets c through kv_b_proj (nope) and the RoPE part, the
layer's kv_b_proj weight per head, its softmax scale, and its lightning indexer's outputs. The
runner chooses the form of attention: absorbed (decode: q_nope folded through W_UK so the
query meets the latent rows directly, the selected rows' c are the values, W_UV after) or
expanded (every latent row through kv_b_proj into per-head K/V). Both compute

    out_h = Σ_s softmax_s(scale · (q_nope_h · W_UK_h c_s + q_rot_h · k_rot_s)) · W_UV_h c_s

over the keys s the token may see: its sequence's cached ones and this step's up to itself,
restricted — as the model does at prefill and decode — to the indexer's top `index_topk` of
them by the score Σ_j w_j · ReLU(iq_j · ik_s) (`index_scores`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ...common.errors import ConfigError
from ...kernels.reference.scores import dsa_prefill_index_scores_torch

INDEX_SCORE_BYTES = 2**30  # a prefill block's float32 index scores at most (mla_prefill_attention)
PREFILL_BLOCK_FUSED = 1024  # queries per block where the fused indexer kernel runs (CUDA)
SPARSE_PREFILL = True  # CUDA prefill attends absorbed over each query's top-k rows (mla_sparse_prefill_attention)


@dataclass(frozen=True)
class MLAInputs:
    """One MLA layer's tensors for a packed step of T tokens.

    q_nope [T, H, qk_nope], q_rot [T, H, qk_rope] (post-RoPE), both unscaled;
    latent [T, kv_lora_rank + qk_rope]: the rows to cache (c after kv_a_layernorm, then the
    RoPE'd shared key), the store's MLA row (V = its first kv_lora_rank values);
    kv_b [H, qk_nope + v_head, kv_lora_rank]: kv_b_proj's weight per head (a view);
    scale: the model's softmax scale (YaRN's mscale^2 included);
    index_q [T, Hi, Di] and index_k [T, Di] (post-RoPE, the model's dtype), index_weights
    [T, Hi] float32, already × Hi^-1/2 × Di^-1/2 (DSA's `inputs` as the coordinator takes them);
    index_topk: how many keys the indexer keeps per query.
    """

    q_nope: torch.Tensor
    q_rot: torch.Tensor
    latent: torch.Tensor
    kv_b: torch.Tensor
    scale: float
    index_q: torch.Tensor
    index_weights: torch.Tensor
    index_k: torch.Tensor
    index_topk: int

    @property
    def nope_dim(self) -> int:
        return self.q_nope.shape[-1]

    @property
    def kv_lora_rank(self) -> int:
        return self.kv_b.shape[-1]

    def absorbed_queries(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """[n, H, kv_lora_rank + rope] (kv_b's dtype) whose plain dot with a latent row is the
        model's logit: scale · [W_UK_h^T q_nope_h, q_rot_h]."""
        w_uk = self.kv_b[:, : self.nope_dim]  # [H, nope, L]
        q_lat = torch.einsum("thn,hnl->thl", self.q_nope[rows].to(w_uk.dtype), w_uk)
        return torch.cat([q_lat, self.q_rot[rows].to(w_uk.dtype)], dim=-1) * self.scale

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [m, L + rope] -> per-head keys [m, H, nope + rope] and values [m, H, v]
        (the model's non-absorbed form)."""
        kv = torch.einsum("ml,hdl->mhd", latent[:, : self.kv_lora_rank].to(self.kv_b.dtype), self.kv_b)
        k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
        k_rot = latent[:, None, self.kv_lora_rank :].to(k_nope.dtype).expand(-1, k_nope.shape[1], -1)
        return torch.cat([k_nope, k_rot], dim=-1), v

    def expand_values(self, attended: torch.Tensor) -> torch.Tensor:
        """Attention over the latent values [n, H, kv_lora_rank] -> [n, H, v_head] through W_UV."""
        w_uv = self.kv_b[:, self.nope_dim :]  # [H, v, L]
        return torch.einsum("thl,hvl->thv", attended.to(w_uv.dtype), w_uv)


class MLAAttend(Protocol):
    """`attend(layer, inputs) -> [T, H, v_head_dim]` (q_nope's dtype): the attention output of
    every token of the step before o_proj (module docstring)."""

    def __call__(self, layer: int, inputs: MLAInputs) -> torch.Tensor: ...


def index_scores(index_q: torch.Tensor, index_weights: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores [n, m] float32 of n queries over m keys:
    Σ_j w_j · ReLU(iq_j · ik_s) (the weights carry the model's scales). On CUDA one fused
    Triton kernel (kernels/dsa_index.py: float32 sums of exact products, as torch's but for
    the order of the sums); elsewhere torch, which builds [n, Hi, m] float32."""
    if index_q.is_cuda:
        from ...kernels.dsa_index import dsa_prefill_index_scores_triton  # Triton only where it runs

        return dsa_prefill_index_scores_triton(index_q, index_weights, index_k)
    return dsa_prefill_index_scores_torch(index_q, index_weights, index_k)


def indexer_keep(scores: torch.Tensor, q_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """bool [n, m]: the keys each query keeps, as the model selects: among the causal ones
    (key position <= q_pos, keys at positions 0..m-1) the top min(topk, m) by score, a tie at
    the cut going to the earlier keys. The model's own top-k leaves ties to torch.topk, whose
    pick among equal scores depends on the tensor's width — here the chunk's prefix, so a
    prompt prefilled in other chunks (another schedule, a prefix-cache hit) could keep other
    keys; ReLU makes exact ties common (every head's dot negative: a score of 0)."""
    m = scores.shape[1]
    k = min(topk, m)
    causal = torch.arange(m, device=scores.device)[None, :] <= q_pos[:, None]
    masked = scores.masked_fill(~causal, float("-inf"))
    cut = masked.topk(k, dim=-1).values[:, -1:]  # the k-th best score of each query
    above = masked > cut
    tied = (masked == cut) & causal
    room = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    return above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room))


def indexer_topk(scores: torch.Tensor, q_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [n, min(topk, m)]: `indexer_keep`'s keys as positions in key order, -1 after them
    where the query has fewer causal keys (the index lists of FlashMLA's sparse kernels)."""
    keep = indexer_keep(scores, q_pos, topk)
    n, m = keep.shape
    k = min(topk, m)
    slot = torch.where(keep, keep.cumsum(-1, dtype=torch.int32) - 1, k).long()  # kept key -> its list slot
    positions = torch.arange(m, device=keep.device, dtype=torch.int32).expand(n, m)
    lists = torch.full((n, k + 1), -1, dtype=torch.int32, device=keep.device)
    return lists.scatter_(1, slot, positions)[:, :k]  # column k took the keys not kept


def dense_mla_attend(seq_lens: Sequence[int], compute_dtype: torch.dtype = torch.float32) -> MLAAttend:
    """A reference MLA `attend` for whole prompts packed back to back (no cache): per sequence,
    the latents expanded through kv_b_proj (non-absorbed), causal attention restricted to the
    indexer's top-k, in `compute_dtype`. Tests only: it builds each L x L score matrix."""
    lens = [int(n) for n in seq_lens]
    if any(n < 1 for n in lens):
        raise ConfigError(f"dense_mla_attend: every sequence length must be >= 1, got {lens}")

    def attend(layer: int, x: MLAInputs) -> torch.Tensor:
        if x.q_nope.shape[0] != sum(lens):
            raise ConfigError(f"dense_mla_attend: the step has {x.q_nope.shape[0]} tokens but seq_lens {lens} "
                              f"sum to {sum(lens)}")
        out = x.q_nope.new_empty((*x.q_nope.shape[:2], x.kv_b.shape[1] - x.nope_dim))
        start = 0
        for n in lens:
            rows = slice(start, start + n)
            out[rows] = mla_chunk_attention(x, rows, torch.arange(n, device=out.device), x.latent[rows],
                                            x.index_k[rows], compute_dtype).to(out.dtype)
            start += n
        return out

    return attend


def mla_chunk_attention(
    x: MLAInputs, rows: slice, q_pos: torch.Tensor, latent: torch.Tensor, index_k: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The queries `rows` of x (one sequence's, at positions q_pos [n]) over its latent rows
    [m, Dl] and indexer keys [m, Di] at positions 0..m-1 (the prefix, those rows included):
    expanded (non-absorbed) MLA, causal, each query restricted to its indexer top-k as the
    model does. Returns [n, H, v_head] in `compute_dtype`. Builds an [H, n, m] score matrix:
    for a prefill chunk over its staged prefix, not a whole context at once."""
    k, v = x.expand(latent)
    q = torch.cat([x.q_nope[rows], x.q_rot[rows]], dim=-1)
    logits = torch.einsum("thd,shd->hts", q.to(compute_dtype), k.to(compute_dtype)) * x.scale
    keep = indexer_keep(dsa_prefill_index_scores_torch(x.index_q[rows], x.index_weights[rows], index_k), q_pos,
                        x.index_topk)
    probs = logits.masked_fill(~keep[None], float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shv->thv", probs, v.to(compute_dtype))


def mla_prefill_attention(
    x: MLAInputs, rows: slice, q_pos: torch.Tensor, latent: torch.Tensor, index_k: torch.Tensor, block: int = 256,
) -> torch.Tensor:
    """`mla_chunk_attention` for the engine's prefill: the same keys and arithmetic (expanded
    K/V, each query's indexer top-k of the causal prefix), in blocks of `block` queries so the
    index scores ([block, Hi, m] float32) and the mask stay bounded, attention by SDPA (its
    fused kernels where the mask allows; float32 math on the CPU). Returns [n, H, v_head] in
    the latent's dtype. The block shrinks on a long prefix so that the float32 index scores
    of one block ([block, Hi, m], and their ReLU) stay within INDEX_SCORE_BYTES (DeepSeek-V3.2
    at 128K: 32 queries, not 256 x 8 GiB). On CUDA the fused indexer kernel makes only the
    [block, m] scores, so the blocks are PREFILL_BLOCK_FUSED queries (fewer launches, bigger
    top-k and SDPA calls), bounded the same way by the scores and their mask."""
    heads = x.index_q.shape[1]
    if x.index_q.is_cuda:
        block, heads = max(block, PREFILL_BLOCK_FUSED), 1
    block = max(1, min(block, INDEX_SCORE_BYTES // (4 * heads * max(1, index_k.shape[0]))))
    if x.index_q.is_cuda and SPARSE_PREFILL:
        return mla_sparse_prefill_attention(x, rows, q_pos, latent, index_k, block)
    k, v = x.expand(latent)  # [m, H, nope + rope], [m, H, v]
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    q = torch.cat([x.q_nope[rows], x.q_rot[rows]], dim=-1).to(k.dtype)
    n = q.shape[0]
    out = q.new_empty((n, q.shape[1], v.shape[-1]))
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        r = slice((rows.start or 0) + lo, (rows.start or 0) + hi)
        keep = indexer_keep(index_scores(x.index_q[r], x.index_weights[r], index_k), q_pos[lo:hi], x.index_topk)
        qh = q[lo:hi].transpose(0, 1).unsqueeze(0)
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=x.scale)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def mla_prefill_label(device: torch.device) -> str:
    """What `mla_prefill_attention` runs on `device` (bench's `prefill_attention` field)."""
    return "mla-sparse-triton" if device.type == "cuda" and SPARSE_PREFILL else "mla-masked-sdpa"


def mla_sparse_prefill_attention(
    x: MLAInputs, rows: slice, q_pos: torch.Tensor, latent: torch.Tensor, index_k: torch.Tensor,
    block: int = PREFILL_BLOCK_FUSED,
) -> torch.Tensor:
    """`mla_prefill_attention`'s result computed sparsely, as DeepSeek's own inference and
    FlashMLA's sparse prefill do: each query attends in absorbed form (`absorbed_queries`:
    q_nope folded through W_UK) to only its indexer top-k latent rows of the staged prefix
    (`indexer_topk`), by the Triton sparse MLA kernel (kernels/sparse_decode.py, one query
    token per "sequence"), then W_UV (`expand_values`). The masked SDPA computes every
    query-key pair and drops ~90% of them at 32K; this reads index_topk rows per query and
    never expands the prefix through kv_b_proj (the [m, H, nope + v] product). The same
    function in exact arithmetic; in floating point the absorbed order of the products
    differs from the expanded one by rounding. CUDA, or the CPU under TRITON_INTERPRET=1."""
    from ...kernels.sparse_decode import sparse_mla_decode  # Triton only where it runs

    start = rows.start or 0
    n = q_pos.shape[0]
    kv = latent.unsqueeze(1)  # [m, 1, kv_lora_rank + rope]: K the row, V its first kv_lora_rank
    out = torch.empty((n, x.q_nope.shape[1], x.kv_b.shape[1] - x.nope_dim), dtype=x.kv_b.dtype, device=latent.device)
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        r = slice(start + lo, start + hi)
        chosen = indexer_topk(index_scores(x.index_q[r], x.index_weights[r], index_k), q_pos[lo:hi], x.index_topk)
        q = x.absorbed_queries(r)  # [b, H, kv_lora_rank + rope], the softmax scale folded in
        attended = sparse_mla_decode(q.unsqueeze(1), kv, chosen.unsqueeze(1), 1.0, v_dim=x.kv_lora_rank)
        out[lo:hi] = x.expand_values(attended[:, 0])
    return out
