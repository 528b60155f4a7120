"""Sparse paged decode attention in Triton (flash-decoding), the `triton` backend's kernel.

  paged_decode       FlashAttention page-table semantics (`flash_attn_with_kvcache` with
                     `cache_seqlens` + `block_table`): sequence n attends to the first
                     cache_seqlens[n] rows of its pages; GQA; 1..s_q query tokens (causal).
  sparse_mla_decode  FlashMLA sparse-decode semantics: per query token a list of `topk` row
                     numbers (-1 = unused) into the latent rows [num_tokens, 1, 576], V = the
                     first `v_dim` (512) dims of each row.
  indexed_decode     the general form of the second: row numbers into paged K/V caches.

All three run one split kernel and a combine (kernels/triton/sparse_decode.py). Why their
shape — every K/V row read once by a program holding all the query rows of its KV head, the
token range split for parallelism, power-of-two head-dim chunks, MLA's V from the K tile,
masked loads so that unread rows cannot leak: docs/kernels.md, "Sparse decode".

Launch shapes: see `_tiles` and `choose_num_splits`; a `DecodeShape` passed as `shape=`
(or scoped with `launch_shape`), by default the module constants below. On the CPU the
kernels run only under TRITON_INTERPRET=1 (tests); set it before this module is imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch

from . import pdl
from ..common.arith import cdiv
from .launch import launch
from .dot_modes import _dot_mode, _launchable, _pow2
from .triton.sparse_decode import _combine_kernel, _decode_split_kernel

try:  # raised at launch when a kernel needs more shared memory than the GPU has
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - older Triton
    from triton.runtime.autotuner import OutOfResources

__all__ = ["paged_decode", "sparse_mla_decode", "indexed_decode", "choose_num_splits", "DecodeShape", "default_shape",
           "launch_shape"]

MAX_BLOCK_M = 64  # query rows (GQA heads x query tokens, or MLA heads) per program
MAX_BLOCK_N = 64  # tokens per step of the loop
# K (+ V) bytes of one step, NUM_STAGES of which sit in shared memory: 64 MLA tokens of 1152 B
# (52 µs against 62 with 32 tokens at 128K x 8 on an H100, benchmarks/tune_sparse_decode.py);
# where a GPU's shared memory cannot hold that, `_launch` halves the tile until it fits
KV_TILE_BYTES = 72 * 1024
Q_TILE_BYTES = 72 * 1024  # the program's query rows, [BLOCK_M, head dim]
NUM_STAGES = 2  # software-pipelining depth of the token loop
TARGET_WARPS_PER_SM = 8  # split until the grid gives every SM about this many warps
MAX_SPLITS = 64
WARPS_OVERRIDE: int | None = None  # warps per program instead of _tiles' choice
DEFAULT_NUM_SMS = 132  # an H100 SXM; used where there is no GPU to ask (the interpreter)


@dataclass(frozen=True)
class DecodeShape:
    """The launch shape of the decode kernels, passed per call (`shape=`) or for a block of
    calls that go through the backend (`launch_shape`); fields as the module constants of the
    same names, which give `default_shape()`."""

    max_block_m: int
    max_block_n: int
    kv_tile_bytes: int
    q_tile_bytes: int
    num_stages: int
    target_warps_per_sm: int
    max_splits: int
    warps: int | None = None  # warps per program instead of _tiles' choice


_SCOPED: ContextVar[DecodeShape | None] = ContextVar("sparse_decode_shape", default=None)
_DEFAULT: tuple[tuple, DecodeShape] = ((), DecodeShape(0, 0, 0, 0, 0, 0, 0))  # (the constants, their shape)


def default_shape() -> DecodeShape:
    """The shape calls without `shape=` use: `launch_shape`'s inside one, else the module
    constants (MAX_BLOCK_M, ..., WARPS_OVERRIDE) as they are now."""
    global _DEFAULT
    scoped = _SCOPED.get()
    if scoped is not None:
        return scoped
    values = (MAX_BLOCK_M, MAX_BLOCK_N, KV_TILE_BYTES, Q_TILE_BYTES, NUM_STAGES, TARGET_WARPS_PER_SM, MAX_SPLITS,
              WARPS_OVERRIDE)
    if _DEFAULT[0] != values:  # built once, not per call (the eager decode path counts microseconds)
        _DEFAULT = (values, DecodeShape(*values))
    return _DEFAULT[1]


@contextmanager
def launch_shape(shape: DecodeShape) -> Iterator[DecodeShape]:
    """Decode calls in this block (in this thread / context) that pass no `shape=` use `shape`:
    for callers that reach the kernels through a backend (benchmarks/tune_sparse_decode.py)."""
    token = _SCOPED.set(shape)
    try:
        yield shape
    finally:
        _SCOPED.reset(token)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FITTING_TILE: dict[tuple, int] = {}  # launch shape -> the KV tile bytes that fit this GPU (see _launch)


LOG2E = 1.4426950408889634


# -- launch shapes ------------------------------------------------------------------------------
@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tiles(
    rows: int, d: int, dv: int, q_bytes: int = 2, kv_bytes: int = 2, v_shares_k: bool = False,
    tile_bytes: int | None = None, shape: DecodeShape | None = None,
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV, num_warps) for `rows` query rows per KV
    head, head dims d (K) and dv (V), element sizes of q and of the caches, and whether V is a
    view of K's first dims; the limits below are `shape`'s fields (default `default_shape()`).

    BLOCK_DA is the largest power of two <= d (at least 16, the MMA depth) and BLOCK_DB the
    rest padded to a power of two (0 when d is one): 128 -> 128 + 0, 576 -> 512 + 64,
    192 -> 128 + 64. BLOCK_N: the most tokens (a power of two in 16..MAX_BLOCK_N) whose K and
    V tiles fit `tile_bytes` (default KV_TILE_BYTES), two stages of which sit in shared
    memory: 64 at d = 128 in bf16 (32 KB), 64 for MLA's 576 in bf16 (72 KB, V reuses the K
    tile), 32 for MLA in float32.
    BLOCK_M: the GQA rows padded to 16, at most MAX_BLOCK_M and Q_TILE_BYTES of queries
    (64 MLA heads in bf16, 32 in float32). Eight warps when the float32 accumulator has 16K
    elements or more (64 MLA heads x 512: 128 registers a thread), else four."""
    shape = default_shape() if shape is None else shape
    block_da, block_db = _head_chunks(d)
    block_dv = _pow2(dv, 16)
    token_bytes = _token_bytes(d, dv, kv_bytes, v_shares_k)
    block_n = shape.max_block_n
    while block_n > 16 and block_n * token_bytes > (shape.kv_tile_bytes if tile_bytes is None else tile_bytes):
        block_n //= 2
    block_m = min(shape.max_block_m, _pow2(rows, 16))
    while block_m > 16 and block_m * (block_da + block_db) * q_bytes > shape.q_tile_bytes:
        block_m //= 2
    warps = 8 if block_m * block_dv >= 64 * 256 else 4
    return block_m, block_n, block_da, block_db, block_dv, warps


def choose_num_splits(
    programs: int, n_tokens: int, block_n: int, num_warps: int = 4, device: torch.device | str | None = None,
    shape: DecodeShape | None = None,
) -> int:
    """Splits of the token range for a grid of `programs` (sequences x KV heads x row blocks):
    enough that the grid gives every SM about TARGET_WARPS_PER_SM warps (two 4-warp programs,
    or one 8-warp MLA program, whose shared memory would not fit twice anyway), with at least
    one BLOCK_N step per split and at most MAX_SPLITS. On an H100 (132 SMs; also assumed for
    `device` None or not CUDA): batch 8 x 8 KV heads over 2048 tokens, 64 programs -> 5 splits
    (320 programs); MLA batch 8 x 2 blocks of 64 heads -> 9 splits; batch 64 x 8 KV heads ->
    1 split (the output is written directly, no combine). TARGET_WARPS_PER_SM and MAX_SPLITS:
    `shape`'s (default `default_shape()`)."""
    shape = default_shape() if shape is None else shape
    blocks = cdiv(max(n_tokens, 0), block_n)
    if blocks <= 1 or programs <= 0:
        return 1
    sms = DEFAULT_NUM_SMS if device is None else _num_sms(torch.device(device))
    target = sms * max(1, shape.target_warps_per_sm // num_warps)
    return max(1, min(cdiv(target, programs), blocks, shape.max_splits))


# -- launchers ----------------------------------------------------------------------------------
def _check_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, what: str) -> None:
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"{what}: k_cache and v_cache must be [num_pages, page_size, kv_heads, dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"{what}: v_cache {tuple(v_cache.shape)} does not match k_cache {tuple(k_cache.shape)} "
                         "in pages, page size or heads")
    if k_cache.shape[-1] != q.shape[-1] or v_cache.shape[-1] > q.shape[-1]:
        raise ValueError(f"{what}: q's head dim {q.shape[-1]} must equal k_cache's ({k_cache.shape[-1]}) and "
                         f"be >= v_cache's ({v_cache.shape[-1]})")
    if q.shape[-2] % k_cache.shape[2]:
        raise ValueError(f"{what}: {q.shape[-2]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{what}: {name} must be float32, float16 or bfloat16, got {t.dtype} "
                             "(fp8 caches are not supported by this kernel)")


def _launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
    lens: torch.Tensor | None, n_tokens: int, scale: float, *, indexed: bool, causal: bool,
    num_splits: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None,
    shape: DecodeShape | None = None,
) -> torch.Tensor:
    """q [NS, S, Hq, D]; caches [num_pages, P, Hk, D / Dv]; table [NS, width] (pages, or row
    numbers when `indexed`); lens [NS] (paged only); n_tokens: the most tokens a sequence can
    have (width * P, or topk); softcap: None or > 0; sinks: None or [NS, Hq] (any strides,
    a stride of 0 broadcasts); shape: the launch shape (None: `default_shape()`). Returns
    [NS, S, Hq, Dv] in q's dtype."""
    shape = default_shape() if shape is None else shape
    ns, s_q, hq, d = q.shape
    _, page, hk, _ = k_cache.shape
    dv = v_cache.shape[-1]
    group = hq // hk
    out = torch.empty(ns, s_q, hq, dv, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    rows = group * s_q
    v_shares_k = (  # MLA: V is a view of the first dims of the K rows
        v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
        and v_cache.dtype == k_cache.dtype
    )
    tile_args = (rows, d, dv, q.element_size(), k_cache.element_size(), v_shares_k)
    key = (q.device, *tile_args, shape)
    while True:
        tiles = _tiles(*tile_args, tile_bytes=_FITTING_TILE.get(key, shape.kv_tile_bytes), shape=shape)
        try:
            _launch_tiles(q, k_cache, v_cache, table, lens, out, n_tokens, scale, tiles, indexed=indexed,
                          causal=causal, num_splits=num_splits, v_shares_k=v_shares_k, softcap=softcap, sinks=sinks,
                          shape=shape)
            return out
        except OutOfResources:
            block_n = tiles[1]
            if block_n <= 16:
                raise
            # this GPU's shared memory holds less than the tile: halve it, remember what fits
            _FITTING_TILE[key] = (block_n // 2) * _token_bytes(d, dv, k_cache.element_size(), v_shares_k)


def _head_chunks(d: int) -> tuple[int, int]:
    """(BLOCK_DA, BLOCK_DB): head dim d as two power-of-two chunks (see `_tiles`)."""
    block_da = max(16, 1 << (d.bit_length() - 1))
    return block_da, _pow2(d - block_da, 16) if d > block_da else 0


def _token_bytes(d: int, dv: int, kv_bytes: int, v_shares_k: bool) -> int:
    """Bytes of one token's K (+ V) tile rows, as `_tiles` counts them."""
    block_da, block_db = _head_chunks(d)
    v_from_k = v_shares_k and dv == block_da
    return ((block_da + block_db) + (0 if v_from_k else _pow2(dv, 16))) * kv_bytes


def _launch_tiles(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
    lens: torch.Tensor | None, out: torch.Tensor, n_tokens: int, scale: float,
    tiles: tuple[int, int, int, int, int, int], *, indexed: bool, causal: bool, num_splits: int | None,
    v_shares_k: bool, softcap: float | None = None, sinks: torch.Tensor | None = None,
    shape: DecodeShape | None = None,
) -> None:
    """`_launch`'s kernels with the tiles `tiles` (see `_tiles`) and the rest of the launch
    shape (warps, stages, splits) from `shape`. Soft-capping and sinks are constexpr switches:
    without them the kernels compile exactly as before."""
    shape = default_shape() if shape is None else shape
    ns, s_q, hq, d = q.shape
    _, page, hk, _ = k_cache.shape
    dv = v_cache.shape[-1]
    group = hq // hk
    rows = group * s_q
    block_m, block_n, block_da, block_db, block_dv, warps = tiles
    warps = shape.warps or warps
    v_from_k = v_shares_k and dv == block_da
    programs = ns * hk * cdiv(rows, block_m)
    if num_splits is None:
        num_splits = choose_num_splits(programs, n_tokens, block_n, warps, q.device, shape)
    split_len = cdiv(cdiv(max(n_tokens, 1), max(1, num_splits)), block_n) * block_n
    num_splits = max(1, cdiv(n_tokens, split_len))  # no program whose split is past every sequence
    split = num_splits > 1
    if split:
        part = torch.empty(ns * hk * rows * num_splits * dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(ns * hk * rows * num_splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    qk_mode, kdt = _dot_mode(q.dtype, k_cache.dtype)
    pv_mode, vdt = _dot_mode(v_cache.dtype, v_cache.dtype)
    use_pdl = pdl.enabled(q.device)
    has_sinks = sinks is not None
    sinks_arg, sink_strides = (sinks, tuple(sinks.stride())) if has_sinks else (q, (0, 0))  # q: never read
    cap_in, cap_out = (scale / softcap, softcap * LOG2E) if softcap is not None else (1.0, 1.0)
    launch(_decode_split_kernel, (programs, num_splits),
        q, k_cache, v_cache, table, table if lens is None else lens, out, part, lse, sinks_arg,
        n_tokens, split_len, num_splits, scale * 1.4426950408889634, cap_in, cap_out, *sink_strides,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *table.stride(), *out.stride(),
        HK=hk, G=group, S=s_q, D=d, DV=dv, PAGE=page, INDEXED=indexed, CAUSAL=causal, SPLIT=split,
        V_FROM_K=v_from_k, QK_MODE=qk_mode, KDT=kdt, PV_MODE=pv_mode, VDT=vdt,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DA=block_da, BLOCK_DB=block_db, BLOCK_DV=block_dv,
        PDL=use_pdl, SOFTCAP=softcap is not None, SINKS=has_sinks and not split,
        num_warps=warps, num_stages=shape.num_stages, launch_pdl=use_pdl,
    )
    if split:
        launch(_combine_kernel, (ns * hk * rows,),
            part, lse, out, sinks_arg, num_splits, *out.stride(), *sink_strides,
            HK=hk, G=group, S=s_q, DV=dv, BLOCK_SPLITS=_pow2(num_splits), BLOCK_DV=block_dv,
            PDL=use_pdl, SINKS=has_sinks, num_warps=max(1, min(4, block_dv // 128)), launch_pdl=use_pdl,
        )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    num_splits: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    shape: DecodeShape | None = None,
) -> torch.Tensor:
    """Paged decode attention with `torch_ref.paged_attention`'s semantics.

    q: [N, Hq, D] or [N, s_q, Hq, D] (s_q query tokens per sequence: speculative decoding);
    k_cache: [num_pages, P, Hk, D]; v_cache: [num_pages, P, Hk, Dv], Dv <= D (MLA: a strided
    view of k_cache's first 512 dims); page_table: int [N, max_pages]; cache_seqlens: int [N].
    Sequence n attends to the first cache_seqlens[n] rows (at most max_pages * P) of its pages;
    query head h reads KV head h // (Hq // Hk); with s_q > 1 and `causal`, query token i sees
    only the first cache_seqlens[n] - (s_q - 1 - i) rows (flash_attn_with_kvcache's convention:
    the query tokens are the newest rows of the cache). A row that sees nothing gives zeros.
    `num_splits`: at most this many splits of the token range (None: `choose_num_splits`).
    `softcap` (> 0) and `sinks` ([Hq] or [N, Hq], a logit per query head, any float dtype):
    Gemma 2's soft-capping and GPT-OSS's sinks, as `common.softmax.softcap_and_sink_softmax`.
    `shape`: the launch shape (None: `default_shape()`).
    Returns [N, Hq, Dv] or [N, s_q, Hq, Dv] in q's dtype (float32 accumulation)."""
    if q.dim() not in (3, 4):
        raise ValueError(f"paged_decode: q must be [N, Hq, D] or [N, s_q, Hq, D], got {tuple(q.shape)}")
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    _check_caches(q4, k_cache, v_cache, "paged_decode")
    n = q4.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] != n or tuple(cache_seqlens.shape) != (n,):
        raise ValueError(
            f"paged_decode: page_table must be [{n}, max_pages] and cache_seqlens [{n}], got "
            f"{tuple(page_table.shape)} and {tuple(cache_seqlens.shape)}"
        )
    if page_table.dtype.is_floating_point or cache_seqlens.dtype.is_floating_point:
        raise ValueError("paged_decode: page_table and cache_seqlens must be integer tensors (int32)")
    _launchable(q4, k_cache, v_cache, page_table, cache_seqlens, kernels="decode")
    sinks = _sinks_per_sequence(sinks, n, q4.shape[2], softcap, "paged_decode")
    if sinks is not None:
        _launchable(q4, sinks, kernels="decode")
    n_tokens = page_table.shape[1] * k_cache.shape[1]
    out = _launch(q4, k_cache, v_cache, page_table, cache_seqlens, n_tokens, scale,
                  indexed=False, causal=causal, num_splits=num_splits, softcap=softcap, sinks=sinks, shape=shape)
    return out[:, 0] if q.dim() == 3 else out


def indexed_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    shape: DecodeShape | None = None,
) -> torch.Tensor:
    """Sparse decode attention over row numbers (`torch_ref.indexed_attention`'s semantics).

    q: [N, s_q, Hq, D]; k_cache / v_cache: [num_pages, P, Hk, D / Dv] (any strides; Dv <= D);
    indices: int [N, s_q, topk], row numbers into the caches viewed as [-1, Hk, D] (row
    page * P + offset), -1 for unused entries (never read, anywhere in the list). Query token
    (n, i) attends to its own indices[n, i] rows; no causal mask. `softcap`, `sinks` ([Hq] or
    [N, Hq]), `shape`: as `paged_decode`. Returns [N, s_q, Hq, Dv] in q's dtype."""
    if q.dim() != 4 or indices.dim() != 3 or tuple(indices.shape[:2]) != tuple(q.shape[:2]):
        raise ValueError(
            f"indexed_decode: q must be [N, s_q, Hq, D] and indices [N, s_q, topk], got "
            f"{tuple(q.shape)} and {tuple(indices.shape)}"
        )
    if indices.dtype.is_floating_point:
        raise ValueError("indexed_decode: indices must be an integer tensor (int32)")
    _check_caches(q, k_cache, v_cache, "indexed_decode")
    _launchable(q, k_cache, v_cache, indices, kernels="decode")
    n, s_q, hq, d = q.shape
    sinks = _sinks_per_sequence(sinks, n, hq, softcap, "indexed_decode")
    if sinks is not None:
        _launchable(q, sinks, kernels="decode")
        if s_q > 1 and sinks.stride(0) != 0:  # one row per (request, query token)
            sinks = sinks.repeat_interleave(s_q, dim=0)
    # every query token is its own sequence (its own index list): fold s_q into the batch
    qf = q.reshape(n * s_q, 1, hq, d)
    table = indices.reshape(n * s_q, indices.shape[-1])
    if sinks is not None and sinks.stride(0) == 0:
        sinks = sinks[:1].expand(n * s_q, hq)
    out = _launch(qf, k_cache, v_cache, table, None, indices.shape[-1], scale,
                  indexed=True, causal=False, num_splits=num_splits, softcap=softcap, sinks=sinks, shape=shape)
    return out.view(n, s_q, hq, v_cache.shape[-1])


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    v_dim: int = 512,
    num_splits: int | None = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    shape: DecodeShape | None = None,
) -> torch.Tensor:
    """FlashMLA sparse decode: q [N, s_q, Hq, 576]; kv_cache [num_tokens, 1, 576] latent rows
    (K = the row, V = its first `v_dim` dims); indices int32 [N, s_q, topk] row numbers, -1
    unused. Heads go through the kernel in blocks of up to 64 (16 for small Hq), so each latent
    row is read once per head block and its V reuses the K tile. `softcap`, `sinks`, `shape`:
    as `paged_decode`. Returns [N, s_q, Hq, v_dim] in q's dtype."""
    if kv_cache.dim() != 3:
        raise ValueError(
            f"sparse_mla_decode: kv_cache must be [num_tokens, kv_heads, dim], got {tuple(kv_cache.shape)}"
        )
    if not 1 <= v_dim <= kv_cache.shape[-1]:
        raise ValueError(f"sparse_mla_decode: v_dim must be in 1..{kv_cache.shape[-1]}, got {v_dim}")
    paged = kv_cache.unsqueeze(1)  # [num_tokens, 1, Hk, D]: pages of one row
    return indexed_decode(q, paged, paged[..., :v_dim], indices, scale, num_splits=num_splits,
                          softcap=softcap, sinks=sinks, shape=shape)


def _sinks_per_sequence(
    sinks: torch.Tensor | None, n: int, hq: int, softcap: float | None, what: str
) -> torch.Tensor | None:
    """Check softcap; sinks [Hq] (broadcast: stride 0 over sequences) or [N, Hq] as [N, Hq]."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{what}: softcap must be None or > 0, got {softcap!r}")
    if sinks is None:
        return None
    if sinks.dtype not in _FLOAT_DTYPES or sinks.dim() not in (1, 2) or sinks.shape[-1] != hq or (
        sinks.dim() == 2 and sinks.shape[0] != n
    ):
        raise ValueError(f"{what}: sinks must be a float tensor [{hq}] (one logit per query head) or "
                         f"[{n}, {hq}], got {sinks.dtype} {list(sinks.shape)}")
    return sinks.unsqueeze(0).expand(n, hq) if sinks.dim() == 1 else sinks
