"""`SlidingWindowKV`: the device K/V of sliding-window layers, a ring of `window` slots per row.

A sliding-window layer (Mistral, Gemma 2/3's local layers, Qwen2 with `use_sliding_window`,
GPT-OSS's banded layers) lets the token at position t attend to the keys at positions
(t - window, t]: itself and the `window - 1` before it. This is transformers' convention for
every family (`masking_utils.sliding_window_overlay`: `kv_idx > q_idx - sliding_window`, the
same in 4.56 and 5.x; its sliding cache layers keep `window - 1` past tokens plus the new
one), so one rule serves Mistral, Qwen2 and Gemma alike.

Why a ring and not the hierarchical store: a key leaves a sliding-window layer's attention
for good `window` tokens after it arrived, so nothing of it is worth keeping on the host (a
prefix cache may snapshot the window, see `window_kv`), and the keys a decode step attends to
are exactly the live slots: no selection, no residency, no paging. Per row and layer the ring
holds `window` slots; the token at position p lives in slot p % window, so after writing
position t the ring holds exactly positions max(0, t - window + 1)..t, i.e. the window, in
slot order (0, 1, ...) until it first wraps. Softmax attention does not depend on the order
of its keys, so the decode attends over the valid slots as they lie: slots 0..min(len,
window) - 1, with `len` the row's tokens including the new one. Rows are the caller's request
rows (`Request.slot` in the coordinator); a row's stale slots from an earlier request are
masked out by `len`, so ending a request frees nothing.

Lengths are passed in, not kept: the caller already has them (`Batch.seq_lens`), and a
stateless ring cannot disagree with the coordinator about a row's length.

Attention here is plain torch in float32 (the window is small: a decode step reads
window x kv_heads x head_dim per row and layer). It takes the two extra terms some
sliding-window models have, logit soft-capping (Gemma 2) and per-head attention sinks
(GPT-OSS's `s_aux`), so that those models need only the full-attention backends to support
them (see `_set_attention_options` in integrations/transformers/attention.py: a backend
that cannot apply one refuses at enable).
"""

from __future__ import annotations

import torch

from ..common.errors import CapacityError, ConfigError
from ..common.softmax import softcap_and_sink_softmax


class SlidingWindowKV:
    """Per sliding-window layer and request row, `slots` device slots of K and V.

    k, v: [num_layers, max_rows, slots, num_kv_heads, head_dim] in `dtype` on `device`;
    layer indices are this store's (0..num_layers-1), not the model's: the caller maps them.
    `slots` (default `window`) may exceed the window: the ring then also keeps the `slots -
    window` keys just before the window, which attention masks out. A prefix cache asks for
    window + page_size slots so that, at any moment, the window ending at the row's last page
    boundary is still in the ring (engine/prefix_cache.py snapshots it there).
    """

    def __init__(
        self, num_layers: int, window: int, max_rows: int, num_kv_heads: int, head_dim: int,
        *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", slots: int | None = None,
    ) -> None:
        slots = window if slots is None else slots
        for name, value in (("num_layers", num_layers), ("window", window), ("max_rows", max_rows),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("slots", slots)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"SlidingWindowKV.{name} must be a positive int, got {value!r}")
        if slots < window:
            raise ConfigError(f"SlidingWindowKV.slots must be >= window ({window}), got {slots}")
        self.num_layers, self.window, self.max_rows, self.slots = num_layers, window, max_rows, slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_layers, max_rows, slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Device bytes of both rings (every layer and row)."""
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.k.element_size()

    # -- writes -----------------------------------------------------------------------------
    def write_prefill(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Tokens at positions start..start+n-1 of `row` (k, v [n, kv_heads, head_dim]): only
        the last `slots` of them are kept, each at slot position % slots."""
        self._check(layer, k, v)
        if not 0 <= row < self.max_rows:
            raise CapacityError(f"row {row} out of range 0..{self.max_rows - 1} (max_rows)")
        n = k.shape[0]
        keep = min(n, self.slots)
        pos = torch.arange(start + n - keep, start + n, device=self.k.device)
        slots = pos % self.slots
        self.k[layer, row, slots] = k[n - keep:].to(self.k.dtype)
        self.v[layer, row, slots] = v[n - keep:].to(self.v.dtype)

    def reset_row(self, row: int) -> None:
        """Zero a row's slots in every layer. Masked slots still enter the decode's weighted sum
        (with weight 0), so a row filled from a snapshot rather than from position 0 clears
        what an earlier request left there first."""
        self.k[:, row].zero_()
        self.v[:, row].zero_()

    def write_decode(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One new token per row: rows, positions [B] (int, device), k, v [B, kv_heads, head_dim]."""
        self._check(layer, k, v)
        slots = positions.long() % self.slots
        self.k[layer, rows.long(), slots] = k.to(self.k.dtype)
        self.v[layer, rows.long(), slots] = v.to(self.v.dtype)

    # -- reads ------------------------------------------------------------------------------
    def attend(
        self, layer: int, q: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, scale: float,
        *, softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention over each row's window, after `write_decode` stored the new token.

        q [B, Hq, D] (Hq a multiple of kv_heads: GQA), rows [B], lengths [B] (tokens of the
        row including the new one) -> [B, Hq, D] in q's dtype, accumulated in float32.
        logit = scale * q·k, then softcap * tanh(logit / softcap) when `softcap` is given;
        `sinks` [Hq]: one extra logit per head in the softmax's denominator, with no value
        (GPT-OSS)."""
        b, hq, d = q.shape
        hk = self.num_kv_heads
        if d != self.head_dim or hq % hk:
            raise ValueError(f"q [B, Hq, D] needs D = {self.head_dim} and Hq a multiple of {hk}, got {list(q.shape)}")
        rows = rows.long()
        keys = self.k[layer, rows].float()  # [B, W, Hk, D]
        values = self.v[layer, rows].float()
        qg = q.float().view(b, hk, hq // hk, d)
        logits = torch.einsum("bhgd,bwhd->bhgw", qg, keys) * scale
        # slot s holds the position p = s mod slots nearest below `lengths`: valid when p is one
        # of the row's last `window` positions (for slots == window: s < min(len, window))
        slot = torch.arange(self.slots, device=q.device)[None, :]
        lens = lengths.long()[:, None]
        valid = (slot < lens) & ((lens - 1 - slot) % self.slots < self.window)
        head_sinks = None if sinks is None else sinks.float().view(1, hk, hq // hk).expand(b, -1, -1)
        probs = softcap_and_sink_softmax(logits, ~valid[:, None, None, :], softcap, head_sinks)
        out = torch.einsum("bhgw,bwhd->bhgd", probs, values)
        return out.reshape(b, hq, d).to(q.dtype)

    def window_kv(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's window in token order: k, v [min(length, window), kv_heads, head_dim] of
        positions max(0, length - window)..length-1 (for tests and prefix-cache snapshots)."""
        return self.read(layer, row, max(0, length - self.window), length)

    def read(self, layer: int, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [end - start, kv_heads, head_dim] of positions start..end-1 of the row, which
        must be among its last `slots` written when its length is `end` or less."""
        slots = torch.arange(start, end, device=self.k.device) % self.slots
        return self.k[layer, row, slots], self.v[layer, row, slots]

    def _check(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"sliding-window layer {layer} out of range 0..{self.num_layers - 1}")
        want = (self.num_kv_heads, self.head_dim)
        if tuple(k.shape[-2:]) != want or k.shape != v.shape:
            raise ValueError(f"k and v must be [..., {want[0]}, {want[1]}] of one shape, got {list(k.shape)}, {list(v.shape)}")
