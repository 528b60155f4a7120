"""Driving a SparseCoordinator the way an engine does, with the full K/V kept as the reference:
shared by the coordinator's tests, the flash-attn backend's, the decode graphs' and the GPU ones."""

from __future__ import annotations

import math

import torch

from sparse_framework import Batch, KVLayout, Request
from sparse_framework.coordinator.core import SparseCoordinator
from helpers import SMALL_QUEST

BASE = SMALL_QUEST


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 decode attention of one request: q [Hq, D], k/v [L, Hk, D] -> [Hq, D]."""
    group = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    probs = (torch.einsum("hd,lhd->hl", q.double(), kk) / math.sqrt(q.shape[-1])).softmax(-1)
    return torch.einsum("hl,lhd->hd", probs, vv)


class Driver:
    """Drives a coordinator like an engine and keeps the full K/V as the reference."""

    def __init__(self, coord: SparseCoordinator, q_heads: int, seed: int = 0) -> None:
        self.coord = coord
        self.q_heads = q_heads
        self.gen = torch.Generator().manual_seed(seed)
        self.kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.coord.layout.device)

    def model_inputs(self, tokens: int, prefill: bool) -> dict[str, torch.Tensor]:
        """Random values for the extra inputs the algorithm declares (e.g. DSA's indexer)."""
        algo = self.coord.algorithm
        specs = algo.prefill_inputs if prefill else algo.decode_inputs
        return {name: self.randn(tokens, *shape) for name, shape in specs.items()}

    def prefill(self, requests: list[Request]) -> None:
        lay = self.coord.layout
        for r in requests:
            self.coord.on_request_begin(r)
        batch = Batch(requests, is_prefill=True)
        self.coord.forward_begin(batch)
        n = sum(r.prompt_len for r in requests)
        for layer in range(lay.num_layers):
            q = self.randn(n, self.q_heads, lay.head_dim)
            k = self.randn(n, lay.num_kv_heads, lay.head_dim)
            v = self.randn(n, lay.num_kv_heads, lay.head_dim)
            meta = self.coord.attention_begin(layer, q, k, v, batch, self.model_inputs(n, prefill=True))
            out = self.coord.attend(layer, q, meta)
            self.coord.attention_end(layer, out, batch)
            offset = 0
            for r in requests:
                rows = slice(offset, offset + r.prompt_len)
                self.kv.setdefault(r.rid, []).append((k[rows], v[rows]))
                offset += r.prompt_len
        self.coord.forward_end(batch)

    def decode(self, requests: list[Request]) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
        """One step; per layer (output, dense reference output, metadata)."""
        lay = self.coord.layout
        batch = Batch(requests)
        self.coord.forward_begin(batch)
        results = []
        for layer in range(lay.num_layers):
            b = len(requests)
            q = self.randn(b, self.q_heads, lay.head_dim)
            k = self.randn(b, lay.num_kv_heads, lay.head_dim)
            v = self.randn(b, lay.num_kv_heads, lay.head_dim)
            meta = self.coord.attention_begin(layer, q, k, v, batch, self.model_inputs(b, prefill=False))
            meta.selection.validate(batch.seq_lens)
            out = self.coord.attend(layer, q, meta)
            self.coord.attention_end(layer, out, batch)
            refs = []
            for i, r in enumerate(requests):
                pk, pv = self.kv[r.rid][layer]
                pk, pv = torch.cat([pk, k[i : i + 1]]), torch.cat([pv, v[i : i + 1]])
                self.kv[r.rid][layer] = (pk, pv)
                refs.append(dense_reference(q[i], pk, pv))
            results.append((out, torch.stack(refs), meta))
            self.check_slots(layer, requests, meta)
        self.coord.forward_end(batch)
        return results


    def check_slots(self, layer: int, requests: list[Request], meta) -> None:
        """The device rows at the returned slots are the rows written for the selected tokens."""
        sel, slots = meta.selection, meta.slots.long()
        k_cache, v_cache = meta.k_cache, meta.v_cache
        heads = k_cache.shape[2]
        k_rows, v_rows = k_cache.reshape(-1, heads, k_cache.shape[-1]), v_cache.reshape(-1, heads, v_cache.shape[-1])
        per_head = sel.indices.shape[1] > 1
        n_slots = self.coord.store.layer_slots(layer)

        def same(stored: torch.Tensor, written: torch.Tensor) -> bool:
            """The stored rows are the written ones, cast to the cache's dtype."""
            return torch.equal(stored.float(), written.to(stored.dtype).float())

        for i, r in enumerate(requests):
            want_k, want_v = self.kv[r.rid][layer]
            for h in range(sel.indices.shape[1]):
                n = int(sel.lengths[i, h])
                toks, sl = sel.indices[i, h, :n].long(), slots[i, h, :n]
                if per_head:  # head-major buffer: KV head h's slot s is row h * num_slots + s
                    assert same(k_rows[h * n_slots + sl, 0], want_k[toks, h])
                    assert same(v_rows[h * n_slots + sl, 0], want_v[toks, h])
                else:
                    assert same(k_rows[sl], want_k[toks]) and same(v_rows[sl], want_v[toks])


def make(config: dict | None = None, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 8, device: str = "cpu",
         dtype: torch.dtype = torch.float32, **kw) -> SparseCoordinator:
    layout = KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, device=device, dtype=dtype)
    cfg = {**BASE, **(config or {})}
    if cfg["algorithm"] != "quest" and "extra" not in (config or {}):
        del cfg["extra"]  # BASE's extra is Quest's
    return SparseCoordinator(cfg, layout, **{"max_requests": 4, "max_seq_len": 512, **kw})
