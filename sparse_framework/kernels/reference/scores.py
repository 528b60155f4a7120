"""Torch references of the algorithms' scoring hot paths — what the algorithms compute when
not on CUDA, and what the Triton kernels of `kernels/scoring.py` (DSA's: `kernels/dsa_index.py`)
are tested against. Kept apart from the kernels so that importing an algorithm never needs
Triton (the algorithms, the engine and the vLLM plugin import them from here).

  quest_scores          Σ_d max(q_d·min_d, q_d·max_d) per page, combined over a GQA group
                        (with `range_weight` w < 1: minus (1 − w)·Σ_d |q_d|·(max_d − min_d)/2)
  pqcache_scores        Σ_m q_m · centroid_m[code_m(t)] per token (q·centroid table gathered)
  snapkv_window_mass    the prompt's last w queries' causal softmax mass on the keys before them
  dsa_index_scores      DeepSeek's lightning indexer Σ_h w_h · ReLU(q_h · k_t), bf16 or fp8 keys
  dsa_index_scores_fp8q the same over fp8 keys, with the queries quantised like the keys first
                        (what DSA computes with fp8 keys, as DeepSeek's indexer does)
"""

from __future__ import annotations

import math

import torch


REDUCTIONS = {"max": 0, "sum": 1, "mean": 2}
PQ_REDUCTIONS = {**REDUCTIONS, "none": 3}  # none: every query head's scores, [B, Hkv, G, n]
FP8_BLOCK = 128  # values per fp8 scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn

def reduce_groups(scores: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """Combine per-query-head scores [B, Hq, N] into per-KV-head scores [B, Hkv, N] over
    each GQA group (query heads h*G .. h*G+G-1 share KV head h)."""
    b, hq, n = scores.shape
    grouped = scores.view(b, num_kv_heads, hq // num_kv_heads, n)
    if how == "max":
        return grouped.amax(dim=2)
    if how == "sum":
        return grouped.sum(dim=2)
    if how == "mean":
        return grouped.mean(dim=2)
    raise ValueError(f"gqa_reduce must be one of max, sum, mean; got {how!r}")


def _reduce(x: torch.Tensor, how: str) -> torch.Tensor:
    """[B, Hkv, G, N] -> [B, Hkv, N] over the GQA group (dim 2): `reduce_groups`."""
    return reduce_groups(x.flatten(1, 2), x.shape[1], how)


def _group(hq: int, hkv: int, what: str) -> int:
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{what}: {hq} query heads are not a multiple of {hkv} KV heads")
    return hq // hkv


def _check_rows(slot_ids: torch.Tensor, b: int, what: str) -> None:
    if slot_ids.shape != (b,) or slot_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what}: slot_ids must be int64 [{b}], got {slot_ids.dtype} {tuple(slot_ids.shape)}")


def _check_quest(q, page_min, page_max, slot_ids, n_pages, reduce, range_weight=1.0):  # type: ignore[no-untyped-def]
    if q.dim() != 3 or page_min.dim() != 4 or page_max.shape != page_min.shape:
        raise ValueError(f"quest_scores: q must be [B, Hq, D] and page_min/page_max [R, Hkv, MAXP, D]; got "
                         f"{tuple(q.shape)}, {tuple(page_min.shape)}, {tuple(page_max.shape)}")
    b, hq, d = q.shape
    _, hkv, maxp, dk = page_min.shape
    if dk != d:
        raise ValueError(f"quest_scores: head dim of q ({d}) and of the page bounds ({dk}) differ")
    if not 0 <= n_pages <= maxp:
        raise ValueError(f"quest_scores: n_pages ({n_pages}) must be in [0, {maxp}]")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of max, sum, mean; got {reduce!r}")
    if not 0.0 <= range_weight <= 1.0:
        raise ValueError(f"quest_scores: range_weight must be in [0, 1], got {range_weight}")
    _check_rows(slot_ids, b, "quest_scores")
    return b, hkv, _group(hq, hkv, "quest_scores"), d


def quest_scores_torch(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, slot_ids: torch.Tensor,
    n_pages: int, reduce: str = "max", range_weight: float = 1.0,
) -> torch.Tensor:
    """Quest page bounds. q [B, Hq, D]; page_min/page_max [R, Hkv, MAXP, D] (KV dtype);
    slot_ids int64 [B] -> float32 [B, Hkv, n_pages]: per query head Σ_d max(q_d·min_d,
    q_d·max_d), then `reduce` ("max" | "sum" | "mean") over each KV head's group.

    range_weight w in [0, 1]: each term less (1 − w)·|q_d|·(max_d − min_d)/2. As
    max(q·m, q·M) = q·(m + M)/2 + |q|·(M − m)/2, the score is q·mid + w·|q|·half-range: w = 1
    is the upper bound (exactly the terms above: the correction is 0), w = 0 the page
    midpoint's q·k (Quest's `range_weight` option)."""
    b, hkv, g, d = _check_quest(q, page_min, page_max, slot_ids, n_pages, reduce, range_weight)
    lo = page_min[slot_ids, :, :n_pages].float()  # [B, Hkv, P, D]
    hi = page_max[slot_ids, :, :n_pages].float()
    qq = q.float().view(b, hkv, g, 1, d)
    terms = torch.maximum(qq * lo.unsqueeze(2), qq * hi.unsqueeze(2))
    if range_weight != 1.0:
        terms = terms - (1.0 - range_weight) / 2 * (qq.abs() * (hi - lo).unsqueeze(2))
    return _reduce(terms.sum(-1), reduce)  # [B, Hkv, G, P] -> [B, Hkv, P]


def _check_paged(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, block_table: torch.Tensor,
                 n_pages: int) -> None:
    if page_min.dim() != 3 or page_max.shape != page_min.shape:
        raise ValueError(f"quest_paged_scores: page_min/page_max must be [num_blocks, Hkv, D]; got "
                         f"{tuple(page_min.shape)}, {tuple(page_max.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"quest_paged_scores: block_table must be [B = {q.shape[0]}, >= n_pages]; got "
                         f"{tuple(block_table.shape)}")
    if not 0 <= n_pages <= block_table.shape[1]:
        raise ValueError(f"quest_paged_scores: n_pages ({n_pages}) must be in [0, {block_table.shape[1]}]")


def quest_paged_scores_torch(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, block_table: torch.Tensor,
    n_pages: int, reduce: str = "max", range_weight: float = 1.0,
) -> torch.Tensor:
    """q [B, Hq, D]; page_min/page_max [num_blocks, Hkv, D]; block_table int [B, >= n_pages]
    -> float32 [B, Hkv, n_pages]: `quest_scores` of the gathered bounds."""
    _check_paged(q, page_min, page_max, block_table, n_pages)
    table = block_table[:, :n_pages].long().clamp(0, page_min.shape[0] - 1)
    lo = page_min[table].transpose(1, 2)  # [B, Hkv, n_pages, D]
    hi = page_max[table].transpose(1, 2)
    rows = torch.arange(q.shape[0], device=q.device)
    return quest_scores_torch(q, lo, hi, rows, n_pages, reduce, range_weight)


def _pq_table(q, codebooks, codes, slot_ids, n, reduce, fold=False):  # type: ignore[no-untyped-def]
    """Checks; the q·centroid table float32 [B, Hkv, G, M, K] (G = 1 with `fold`: the group's
    queries summed or averaged first, which "sum" and "mean" allow as they are linear in q)."""
    if q.dim() != 3 or codebooks.dim() != 5 or codes.dim() != 4:
        raise ValueError(f"pqcache_scores: q must be [B, Hq, D], codebooks [R, Hkv, M, K, d], codes "
                         f"[R, Hkv, MAXN, M]; got {tuple(q.shape)}, {tuple(codebooks.shape)}, {tuple(codes.shape)}")
    b, hq, dim = q.shape
    _, hkv, m, k, sub = codebooks.shape
    if m * sub != dim or codes.shape[1] != hkv or codes.shape[3] != m or codes.shape[0] != codebooks.shape[0]:
        raise ValueError(f"pqcache_scores: shapes disagree: q {tuple(q.shape)}, codebooks {tuple(codebooks.shape)}, "
                         f"codes {tuple(codes.shape)} (need D = M * d)")
    if codes.dtype != torch.uint8 or k > 256:
        raise ValueError(f"pqcache_scores: codes must be uint8 with K <= 256 centroids; got {codes.dtype}, K={k}")
    if not 0 <= n <= codes.shape[2]:
        raise ValueError(f"pqcache_scores: n ({n}) must be in [0, {codes.shape[2]}]")
    if reduce not in PQ_REDUCTIONS:
        raise ValueError(f"reduce must be one of {', '.join(PQ_REDUCTIONS)}; got {reduce!r}")
    _check_rows(slot_ids, b, "pqcache_scores")
    g = _group(hq, hkv, "pqcache_scores")
    books = codebooks[slot_ids]  # [B, Hkv, M, K, d]
    qq = q.float().view(b, hkv, g, m, sub)
    if fold:
        qq = qq.sum(2, keepdim=True) if reduce == "sum" else qq.mean(2, keepdim=True)
    return torch.einsum("bhgmd,bhmkd->bhgmk", qq, books.float())


def pqcache_scores_torch(
    q: torch.Tensor, codebooks: torch.Tensor, codes: torch.Tensor, slot_ids: torch.Tensor,
    n: int, reduce: str = "sum",
) -> torch.Tensor:
    """PQCache token scores. q [B, Hq, D]; codebooks float32 [R, Hkv, M, K, d] (D = M·d);
    codes uint8 [R, Hkv, MAXN, M]; slot_ids int64 [B] -> float32 [B, Hkv, n]: per query head
    Σ_m q_m · codebooks[slot, j, m, codes[slot, j, t, m]], then `reduce` over the group
    ("none": no reduction, [B, Hkv, G, n])."""
    table = _pq_table(q, codebooks, codes, slot_ids, n, reduce)  # [B, Hkv, G, M, K]
    g = table.shape[2]
    idx = codes[slot_ids, :, :n].long().permute(0, 1, 3, 2).unsqueeze(2).expand(-1, -1, g, -1, -1)  # [B, Hkv, G, M, n]
    per_head = table.gather(-1, idx).sum(3)
    return per_head if reduce == "none" else _reduce(per_head, reduce)


def _check_snapkv(q_window: torch.Tensor, keys: torch.Tensor) -> tuple[int, int, int, int, int]:
    if q_window.dim() != 3 or keys.dim() != 3 or q_window.shape[2] != keys.shape[2]:
        raise ValueError(f"snapkv_window_mass: q_window must be [w, Hq, D] and keys [n, Hkv, D]; got "
                         f"{tuple(q_window.shape)}, {tuple(keys.shape)}")
    w, hq, d = q_window.shape
    n, hkv, _ = keys.shape
    if not 1 <= w <= n:
        raise ValueError(f"snapkv_window_mass: need 1 <= w <= n, got w={w}, n={n}")
    return w, hq, n, hkv, d


def snapkv_window_mass_torch(q_window: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """SnapKV's votes before pooling. q_window [w, Hq, D] (the prompt's last w queries), keys
    [n, Hkv, D] -> float32 [Hq, n - w]: window query i (position n - w + i) attends causally
    with softmax(q·k / sqrt(D)); its probabilities on keys 0 .. n-w-1 summed over the window."""
    w, hq, n, hkv, d = _check_snapkv(q_window, keys)
    group = _group(hq, hkv, "snapkv_window_mass")
    q = q_window.float().transpose(0, 1)  # [Hq, w, D]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    scores = q @ k.transpose(1, 2) / math.sqrt(d)  # [Hq, w, n]
    pos = torch.arange(n, device=keys.device)
    seen = pos.view(1, -1) <= (n - w + torch.arange(w, device=keys.device)).view(-1, 1)  # causal
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return probs[:, :, : n - w].sum(1)


def quantize_fp8_blocks(x: torch.Tensor, pow2_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Di] (Di a multiple of 128) -> (uint8 [..., Di]: float8_e4m3fn bit patterns,
    float32 [..., Di // 128]: one scale per 128 values). As DeepSeek's act_quant: amax is
    clamped to >= 1e-4, scale = amax / 448, rounded up to a power of two with `pow2_scales`
    (its "ue8m0" scale format, the one V3.2 ships with); values = x / scale clamped to ±448
    and rounded to e4m3 (ties to even).

    The power-of-two rounding is `ceil_pow2`, exact on the float32 bits, not
    exp2(ceil(log2(s))): in float32, log2 of 2^k·(1 + 2^-23) rounds to k for most k, which
    would give a scale below amax / 448 (the block's largest value then clamps). The Triton
    kernel that quantises queries in place (`kernels.dsa_index.dsa_index_scores_fp8q_triton`)
    applies the same bit rule, so both give the same scales."""
    di = x.shape[-1]
    if di % FP8_BLOCK:
        raise ValueError(f"quantize_fp8_blocks: the last dim ({di}) must be a multiple of {FP8_BLOCK}")
    blocks = x.float().reshape(*x.shape[:-1], di // FP8_BLOCK, FP8_BLOCK)
    scales = blocks.abs().amax(-1).clamp(min=1e-4) / FP8_MAX
    if pow2_scales:
        scales = ceil_pow2(scales)
    values = (blocks / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(torch.uint8).reshape(x.shape), scales


def ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """The least power of two >= x, for positive normal float32 x, exactly: on the float32
    bits, a nonzero mantissa carries one into the exponent (adding 0x7FFFFF does both), then
    the mantissa is cleared. Powers of two stay as they are."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def dequantize_fp8_blocks(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_fp8_blocks`: uint8 [..., Di], float32 [..., Di // 128] -> float32 [..., Di]."""
    if bits.dtype != torch.uint8 or bits.shape[-1] != scales.shape[-1] * FP8_BLOCK or bits.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"dequantize_fp8_blocks: need uint8 [..., Di] and float32 [..., Di // {FP8_BLOCK}]; got "
                         f"{bits.dtype} {tuple(bits.shape)}, {tuple(scales.shape)}")
    values = bits.view(torch.float8_e4m3fn).float()
    return values * scales.float().repeat_interleave(FP8_BLOCK, dim=-1)


def _check_dsa(index_q, weights, index_k, k_scale, slot_ids, n):  # type: ignore[no-untyped-def]
    if index_q.dim() != 3 or index_k.dim() != 3 or index_q.shape[2] != index_k.shape[2]:
        raise ValueError(f"dsa_index_scores: index_q must be [B, H, Di] and index_k [R, MAXN, Di]; got "
                         f"{tuple(index_q.shape)}, {tuple(index_k.shape)}")
    b, h, di = index_q.shape
    if weights.shape != (b, h):
        raise ValueError(f"dsa_index_scores: weights must be [{b}, {h}], got {tuple(weights.shape)}")
    fp8 = index_k.dtype == torch.uint8
    if fp8 != (k_scale is not None):
        raise ValueError("dsa_index_scores: uint8 (fp8 bits) index_k needs k_scale, other dtypes take k_scale=None")
    if fp8 and (di % FP8_BLOCK or k_scale.shape != (*index_k.shape[:2], di // FP8_BLOCK)):
        raise ValueError(f"dsa_index_scores: fp8 keys need Di % {FP8_BLOCK} == 0 and k_scale [R, MAXN, Di // "
                         f"{FP8_BLOCK}]; got Di={di}, k_scale {tuple(k_scale.shape)}")
    if not 0 <= n <= index_k.shape[1]:
        raise ValueError(f"dsa_index_scores: n ({n}) must be in [0, {index_k.shape[1]}]")
    _check_rows(slot_ids, b, "dsa_index_scores")
    return b, h, di, fp8


def dsa_index_scores_torch(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, k_scale: torch.Tensor | None,
    slot_ids: torch.Tensor, n: int,
) -> torch.Tensor:
    """DSA lightning-indexer scores. index_q [B, H, Di] (bf16/fp16/float32); weights [B, H]
    (any float dtype); index_k [R, MAXN, Di] (bf16/fp16/float32, k_scale None) or uint8 fp8
    e4m3fn bits with k_scale float32 [R, MAXN, Di // 128]; slot_ids int64 [B] -> float32 [B, n]:
    score[b, s] = Σ_h weights[b, h] · ReLU(index_q[b, h] · k[slot_b, s]) in float32."""
    _check_dsa(index_q, weights, index_k, k_scale, slot_ids, n)
    rows = index_k[slot_ids, :n]
    k = dequantize_fp8_blocks(rows, k_scale[slot_ids, :n]) if k_scale is not None else rows.float()
    logits = torch.einsum("bhd,bnd->bhn", index_q.float(), k)  # [B, H, n]
    return (logits.relu() * weights.float().unsqueeze(-1)).sum(1)


def _check_prefill_index(index_q, weights, index_k):  # type: ignore[no-untyped-def]
    if index_q.dim() != 3 or index_k.dim() != 2 or index_q.shape[-1] != index_k.shape[-1]:
        raise ValueError(f"dsa_prefill_index_scores: index_q must be [n, H, Di] and index_k [m, Di]; got "
                         f"{tuple(index_q.shape)} and {tuple(index_k.shape)}")
    n, h, di = index_q.shape
    if weights.shape != (n, h):
        raise ValueError(f"dsa_prefill_index_scores: weights must be [{n}, {h}], got {tuple(weights.shape)}")
    if index_k.dtype == torch.uint8:
        raise ValueError("dsa_prefill_index_scores: index_k must be the model's keys (bf16/fp16/float32), not fp8 bits")
    return n, h, di, index_k.shape[0]


def dsa_prefill_index_scores_torch(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
    """The lightning indexer for a prefill chunk: index_q [n, H, Di], weights [n, H] and one
    sequence's keys index_k [m, Di] -> float32 [n, m], Σ_h weights[i, h] · ReLU(index_q[i, h]
    · index_k[s]) (the weights carry the model's scales). Builds [n, H, m] float32."""
    _check_prefill_index(index_q, weights, index_k)
    dots = torch.einsum("njd,md->njm", index_q.float(), index_k.float())
    return torch.einsum("nj,njm->nm", weights.float(), dots.relu())


def _check_dsa_fp8q(index_q, weights, index_k, k_scale, slot_ids, n):  # type: ignore[no-untyped-def]
    b, h, di, fp8 = _check_dsa(index_q, weights, index_k, k_scale, slot_ids, n)
    if not fp8:
        raise ValueError(f"dsa_index_scores_fp8q: needs fp8 keys (uint8 index_k with k_scale), got {index_k.dtype}")
    return b, h, di


def dsa_index_scores_fp8q_torch(
    index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, k_scale: torch.Tensor,
    slot_ids: torch.Tensor, n: int, pow2_scales: bool = True,
) -> torch.Tensor:
    """`dsa_index_scores_torch` over fp8 keys (uint8 index_k, k_scale float32) with the raw
    queries index_q [B, H, Di] (any float dtype) quantised like the keys first:
    `quantize_fp8_blocks(index_q, pow2_scales)` per (head, 128 values), then dequantised.
    The Triton twin does the quantisation inside its kernel."""
    _check_dsa_fp8q(index_q, weights, index_k, k_scale, slot_ids, n)
    q = dequantize_fp8_blocks(*quantize_fp8_blocks(index_q, pow2_scales))
    return dsa_index_scores_torch(q, weights, index_k, k_scale, slot_ids, n)
