"""Per-layer soft-capping and attention sinks through the coordinator (attention_options.py):
prefill and decode against the float64 formula (helpers.dense_attention_f64), a budget that
holds every token equal to dense attention with the same options, the default path unchanged
(backends called without the options), and clear refusals of bad values and of backends that
cannot apply them."""

from __future__ import annotations

import pytest
import torch

from sparse_framework import Batch, ConfigError, KVLayout, Request
from sparse_framework.backends.base import AttentionBackend
from sparse_framework.backends.flashmla import FlashMLABackend
from sparse_framework.common.errors import UnsupportedFeatureError
from sparse_framework.coordinator.core import SparseCoordinator

from helpers import SMALL_QUEST, dense_attention_f64

Q_HEADS, KV_HEADS, D = 4, 2, 8


def coordinator(config: dict | None = None, layers: int = 2) -> SparseCoordinator:
    layout = KVLayout(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=D)
    return SparseCoordinator({**SMALL_QUEST, **(config or {})}, layout, max_requests=2, max_seq_len=512)


def run(coord: SparseCoordinator, lens: list[int], steps: int, seed: int = 0):
    """Prefill and decode `steps` steps with random q/k/v; yields (layer, is_prefill, output,
    [per request: (q rows, k, v) it attended over])."""
    g = torch.Generator().manual_seed(seed)
    reqs = [Request(f"r{i}", n) for i, n in enumerate(lens)]
    for r in reqs:
        coord.on_request_begin(r)
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(steps + 1):
        prefill = step == 0
        batch = Batch(reqs, is_prefill=prefill)
        coord.forward_begin(batch)
        n = sum(lens) if prefill else len(reqs)
        for layer in range(coord.layout.num_layers):
            q = torch.randn(n, Q_HEADS, D, generator=g) * 3  # peaked enough for the cap to bend logits
            k, v = torch.randn(n, KV_HEADS, D, generator=g), torch.randn(n, KV_HEADS, D, generator=g)
            meta = coord.attention_begin(layer, q, k, v, batch)
            out = coord.attend(layer, q, meta)
            coord.attention_end(layer, out, batch)
            offset, seen = 0, []
            for i, r in enumerate(reqs):
                rows = slice(offset, offset + r.prompt_len) if prefill else slice(i, i + 1)
                old = kv.get((i, layer))
                kv[i, layer] = (k[rows], v[rows]) if old is None else (torch.cat([old[0], k[rows]]), torch.cat([old[1], v[rows]]))
                seen.append((q[rows], *kv[i, layer]))
                offset += r.prompt_len
            yield layer, prefill, out, seen
        coord.forward_end(batch)


def check_against_formula(coord: SparseCoordinator, options: dict[int, dict], lens: list[int], steps: int) -> int:
    """Every output (prefill: causal) equals the float64 formula with the layer's options;
    returns how many outputs were compared."""
    compared = 0
    for layer, prefill, out, seen in run(coord, lens, steps):
        opts = options.get(layer, {})
        offset = 0
        for q, k, v in seen:
            for j in range(q.shape[0]):
                visible = k.shape[0] - q.shape[0] + j + 1  # causal at prefill; everything at decode
                want = dense_attention_f64(q[j], k[:visible], v[:visible], D**-0.5, **opts)
                got = out[offset + j].double()
                assert torch.allclose(got, want, atol=1e-5, rtol=0), (layer, prefill, float((got - want).abs().max()))
                compared += 1
            offset += q.shape[0]
    return compared


def test_full_budget_equals_dense_with_the_same_options() -> None:
    """A budget that holds every token (top_k >= context): prefill and decode of each layer
    equal the dense formula with that layer's softcap and sinks (layer 0: both, layer 1: none,
    layer 2: sinks only, layer 3: softcap only)."""
    coord = coordinator({"top_k": 256, "device_buffer_tokens": 512}, layers=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 8.0])  # 8.0: the sink outweighs most tokens
    options = {0: {"softcap": 1.5, "sinks": sinks}, 2: {"sinks": sinks}, 3: {"softcap": 1.5}}
    for layer, opts in options.items():
        coord.set_attention_options(layer, **opts)
    assert coord.attention_options(1).is_default and coord.attention_options(0).softcap == 1.5
    assert check_against_formula(coord, options, [37, 20], steps=3) > 0


def test_sparse_selection_applies_the_options_to_the_chosen_tokens() -> None:
    """A sparse budget: each decode output equals the backend's (torch_ref) attention with the
    options over exactly the tokens the selection names."""
    coord = coordinator()
    sinks = torch.tensor([1.0, -0.5, 0.0, 3.0])
    coord.set_attention_options(0, softcap=2.0, sinks=sinks)
    g = torch.Generator().manual_seed(3)
    reqs = [Request("a", 90), Request("b", 70)]
    for r in reqs:
        coord.on_request_begin(r)
    full = {}
    for step in range(3):
        prefill = step == 0
        batch = Batch(reqs, is_prefill=prefill)
        coord.forward_begin(batch)
        n = 160 if prefill else 2
        for layer in range(2):
            q = torch.randn(n, Q_HEADS, D, generator=g) * 3
            k, v = torch.randn(n, KV_HEADS, D, generator=g), torch.randn(n, KV_HEADS, D, generator=g)
            meta = coord.attention_begin(layer, q, k, v, batch)
            out = coord.attend(layer, q, meta)
            coord.attention_end(layer, out, batch)
            for i, rows in enumerate([slice(0, 90), slice(90, 160)] if prefill else [slice(0, 1), slice(1, 2)]):
                old = full.get((i, layer))
                full[i, layer] = (k[rows], v[rows]) if old is None else (torch.cat([old[0], k[rows]]), torch.cat([old[1], v[rows]]))
            if prefill or layer != 0:
                continue
            sel = meta.selection
            assert sel.indices.shape[-1] < 90  # sparse: fewer tokens than the context
            for i in range(2):
                kf, vf = full[i, 0]
                for h in range(sel.indices.shape[1]):  # one row of indices, or one per KV head
                    toks = sel.indices[i, h, : int(sel.lengths[i, h])].long()
                    heads = range(Q_HEADS) if sel.indices.shape[1] == 1 else range(h * 2, h * 2 + 2)
                    want = dense_attention_f64(q[i], kf[toks], vf[toks], D**-0.5, softcap=2.0, sinks=sinks)
                    for j in heads:
                        assert torch.allclose(out[i, j].double(), want[j], atol=1e-5, rtol=0)
        coord.forward_end(batch)


def test_default_path_calls_backends_without_the_options(monkeypatch) -> None:
    """With no options set the backend is called exactly as before (no softcap / sinks
    keywords: plugin backends with the old signature keep working), and the outputs are those
    of plain softmax attention; setting both back to None restores that."""
    coord = coordinator({"top_k": 256, "device_buffer_tokens": 512})
    calls = []
    run_backend = coord.backend.run

    def recording(q, k_cache, v_cache, metadata, **kw):
        calls.append(kw)
        return run_backend(q, k_cache, v_cache, metadata, **kw)

    monkeypatch.setattr(coord.backend, "run", recording)
    coord.set_attention_options(1, softcap=3.0)
    coord.set_attention_options(1, softcap=None, sinks=None)
    check_against_formula(coord, {}, [30, 12], steps=2)
    assert calls and all(kw == {} for kw in calls)


def test_bad_values_are_refused_naming_the_field() -> None:
    coord = coordinator()
    for softcap in (0.0, -1.0, float("inf"), float("nan"), True, "50"):
        with pytest.raises(ConfigError, match="softcap must be None"):
            coord.set_attention_options(0, softcap=softcap)
    with pytest.raises(ConfigError, match="sinks must be None or a 1-D floating tensor"):
        coord.set_attention_options(0, sinks=torch.zeros(2, 2))
    with pytest.raises(ConfigError, match="sinks must be None or a 1-D floating tensor"):
        coord.set_attention_options(0, sinks=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ConfigError, match=r"layer must be in 0\.\.1"):
        coord.set_attention_options(2, softcap=1.0)
    assert coord.attention_options(0).is_default  # nothing was set
    coord.set_attention_options(0, sinks=torch.zeros(3))  # 3 sinks, 4 query heads: refused at the call
    with pytest.raises(ValueError, match="sinks have 3 logits but q has 4 query heads"):
        next(iter(run(coord, [10], steps=0)))


class _Plain(AttentionBackend):
    """A plugin backend that declares neither option."""

    def run(self, q, k_cache, v_cache, metadata, *, scale=None):  # pragma: no cover - never called
        raise AssertionError


def test_backends_that_cannot_apply_an_option_refuse_it(monkeypatch) -> None:
    coord = coordinator()
    monkeypatch.setattr(type(coord.config), "backend_class", property(lambda self: _Plain))
    with pytest.raises(UnsupportedFeatureError, match="does not support softcap .logit soft-capping.") as info:
        coord.set_attention_options(0, softcap=30.0)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, NotImplementedError)
    with pytest.raises(UnsupportedFeatureError, match="sinks .attention-sink logits.; use backend 'torch_ref' or 'triton'"):
        coord.set_attention_options(1, sinks=torch.zeros(4))
    with pytest.raises(UnsupportedFeatureError, match="softcap .* and sinks"):
        FlashMLABackend.check_attention_options(50.0, torch.zeros(4))
