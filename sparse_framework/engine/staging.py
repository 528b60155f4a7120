"""Prefill staging: the device K/V of prompts being prefilled in chunks.

A prompt is prefilled a chunk per step (the scheduler's token budget), and every chunk attends
to all of the prompt before it. Reading that prefix back from the host store would cost PCIe
traffic quadratic in the prompt, so — as HiSparse does — a prompt's K/V are staged on the
device, densely, while it is prefilled; when its last chunk is done the runner hands the whole
staged prompt to the coordinator (which offloads it to the host, keeps the request's buffer
and builds the algorithm's representations) and the staging is released.

The staging holds one contiguous span of token rows per prompt (all layers at once), reserved
when the request is admitted for its whole prompt, so a chunk never waits for room and
attention reads the prefix as one slice. Spans are placed first fit over a free list.

MLA (`layout.is_mla`): one latent row per token and layer (K; V is a view of its first
v_head_dim values, never stored twice) and, with `index_dim`, the lightning indexer's key of
each token (the model's prefill attends to each query's indexer top-k of the staged prefix,
and DSA's build reads the keys at the hand-over).
"""

from __future__ import annotations

import math

import torch

from ..common.errors import CapacityError
from ..common.layout import KVLayout
from ..common.softmax import softcap_and_sink_softmax


class PrefillStaging:
    """K and V rows [layers, capacity_tokens, kv_heads, head_dim] on the layout's device, with
    one span per prompt being prefilled (`reserve` / `release` by request id). MLA: latent rows
    only (`v` None) and indexer keys [layers, capacity_tokens, index_dim] when index_dim > 0."""

    def __init__(self, layout: KVLayout, capacity_tokens: int, index_dim: int = 0) -> None:
        if capacity_tokens < 1:
            raise CapacityError(f"prefill staging needs at least one token, got capacity_tokens={capacity_tokens}")
        if index_dim and not layout.is_mla:
            raise ValueError("PrefillStaging: index_dim (indexer keys) is for MLA models only")
        self.layout = layout
        self.capacity = capacity_tokens
        self.index_dim = index_dim
        shape = (layout.num_layers, capacity_tokens, layout.num_kv_heads, layout.head_dim)
        self.k = torch.empty(shape, dtype=layout.dtype, device=layout.device)
        self.v = None if layout.is_mla else torch.empty(shape, dtype=layout.dtype, device=layout.device)
        self.index_k = (torch.empty((layout.num_layers, capacity_tokens, index_dim), dtype=layout.dtype,
                                    device=layout.device) if index_dim else None)
        self._free: list[tuple[int, int]] = [(0, capacity_tokens)]  # (start, length), by start
        self.spans: dict[str, tuple[int, int]] = {}

    @staticmethod
    def bytes_per_token(layout: KVLayout, index_dim: int = 0) -> int:
        """Device bytes one staged prompt token takes (K and V, every layer; MLA: the latent
        row and the indexer key)."""
        if layout.is_mla:
            return layout.num_layers * (layout.head_dim + index_dim) * layout.dtype.itemsize
        return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * layout.dtype.itemsize

    @property
    def free_tokens(self) -> int:
        return sum(n for _, n in self._free)

    def largest_free(self) -> int:
        """The longest prompt a `reserve` can place now."""
        return max((n for _, n in self._free), default=0)

    def reserve(self, rid: str, tokens: int) -> bool:
        """A span of `tokens` rows for request `rid`, first fit; False (nothing changed) when no
        free span is long enough."""
        if rid in self.spans:
            raise ValueError(f"request {rid!r} already has a staging span")
        for i, (start, n) in enumerate(self._free):
            if n >= tokens:
                self.spans[rid] = (start, tokens)
                if n == tokens:
                    del self._free[i]
                else:
                    self._free[i] = (start + tokens, n - tokens)
                return True
        return False

    def release(self, rid: str) -> None:
        """Give a request's span back (merged with free neighbours)."""
        start, n = self.spans.pop(rid)
        self._free.append((start, n))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, m in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + m)
            else:
                merged.append((s, m))
        self._free = merged

    def _rows(self, rid: str, start: int, stop: int) -> slice:
        base, n = self.spans[rid]
        if not 0 <= start <= stop <= n:
            raise ValueError(f"request {rid!r}: rows {start}..{stop} outside its staged prompt of {n} tokens")
        return slice(base + start, base + stop)

    def write(self, layer: int, rid: str, start: int, k: torch.Tensor, v: torch.Tensor | None,
              index_k: torch.Tensor | None = None) -> None:
        """This chunk's K/V rows [n, kv_heads, head_dim] at prompt positions start..start+n-1
        (MLA: k the latent rows [n, 1, Dl], v None; index_k [n, index_dim] if staged)."""
        rows = self._rows(rid, start, start + k.shape[0])
        self.k[layer, rows] = k
        if self.v is not None:
            self.v[layer, rows] = v
        if self.index_k is not None:
            if index_k is None:
                raise ValueError("PrefillStaging.write: this staging keeps indexer keys; index_k is required")
            self.index_k[layer, rows] = index_k

    def prefix(self, layer: int, rid: str, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of prompt positions 0..stop-1 (views, no copy; MLA: V is K's first
        v_head_dim values)."""
        rows = self._rows(rid, 0, stop)
        k = self.k[layer, rows]
        return k, (k[..., : self.layout.v_head_dim] if self.v is None else self.v[layer, rows])

    def index_prefix(self, layer: int, rid: str, stop: int) -> torch.Tensor:
        """Indexer keys [stop, index_dim] of prompt positions 0..stop-1 (a view)."""
        if self.index_k is None:
            raise ValueError("PrefillStaging.index_prefix: this staging keeps no indexer keys (index_dim 0)")
        return self.index_k[layer, self._rows(rid, 0, stop)]


WINDOW_BLOCK = 2048  # queries per SDPA call of a sliding layer's chunk (each reads block + window keys)


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
    softcap: float | None = None, window: int | None = None, block: int | None = WINDOW_BLOCK,
) -> torch.Tensor:
    """Causal attention of a prompt chunk over its prefix: q [n, Hq, D] are the last n of the
    m positions whose K/V are k, v [m, Hkv, D] (GQA: Hq a multiple of Hkv). Query i sees keys
    0..m-n+i, and with a `window` only the last `window` of those (a sliding layer: keys at
    positions (t - window, t]). Logits are q·k x `scale` (None: 1/sqrt(D)), capped as
    softcap x tanh(s / softcap) when `softcap` is given. No O(m²) mask: the mask is [n, m]
    for this chunk only, and SDPA picks its fused kernels where it can (float32 math on the
    CPU); a soft-cap, which SDPA cannot apply, takes a float32 matmul path over the same
    [Hq, n, m] scores. With a `window`, queries go `block` at a time, each block over the
    band of keys it can see (block + window - 1), so a sliding layer's prefill costs
    O(n x (block + window)) rather than O(n x m): a 32K prompt with Gemma 3's 512-token
    window reads 1/20 of the keys (None: one call). Returns [n, Hq, D] in q's dtype."""
    n, hq, d = q.shape
    m, hkv, _ = k.shape
    if n > m:
        raise ValueError(f"chunk_attention: {n} queries but only {m} keys")
    if window is not None and block is not None and n > block:
        out = torch.empty_like(q)
        for s in range(0, n, block):
            e = min(n, s + block)
            stop, first = m - n + e, max(0, m - n + s - window + 1)  # the band: keys first..stop-1
            out[s:e] = chunk_attention(q[s:e], k[first:stop], v[first:stop], scale, softcap=softcap, window=window,
                                       block=None)
        return out
    scale = 1 / math.sqrt(d) if scale is None else scale
    allowed = None  # None: plain causal over the whole prefix (n == m)
    if n != m or window is not None:
        rows = torch.arange(m - n, m, device=q.device).unsqueeze(1)
        cols = torch.arange(m, device=q.device).unsqueeze(0)
        allowed = cols <= rows  # [n, m]
        if window is not None:
            allowed &= cols > rows - window
    if softcap is not None:
        return _capped_attention(q, k, v, allowed, scale, softcap)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, m, D]
    if _GQA:  # torch >= 2.5: the group shares its K/V rows (no copy per query head)
        kw: dict = {"enable_gqa": hq != hkv}
    else:
        kh, vh, kw = kh.repeat_interleave(hq // hkv, dim=1), vh.repeat_interleave(hq // hkv, dim=1), {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if allowed is None:
        out = sdpa(qh, kh, vh, is_causal=True, scale=scale, **kw)
    else:
        out = sdpa(qh, kh, vh, attn_mask=allowed, scale=scale, **kw)
    return out[0].transpose(0, 1)


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """`chunk_attention` with a logit soft-cap: float32 scores [Hq, n, m], capped, masked."""
    n, m, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, m, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) * scale
    if allowed is None:
        allowed = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
    return (softcap_and_sink_softmax(scores, ~allowed, softcap, None) @ vf).transpose(0, 1).to(q.dtype)


_GQA = "enable_gqa" in (torch.nn.functional.scaled_dot_product_attention.__doc__ or "")
