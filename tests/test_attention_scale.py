"""The coordinator's per-layer q·k scale (`set_attention_options(layer, scale=)`): a coordinator
given scale s and q equals one with the default scale (1/sqrt(D)) given q·(s·√D), which is
what hosts did before the coordinator took the scale — at prefill (causal_prefill) and at
decode (the backend), at a budget that holds every token and at a small one, with the same
selections (the algorithms are handed q·(s·√D): SnapKV's and PQCache's softmax see the same
numbers). torch_ref here; the triton backend under TRITON_INTERPRET=1 in a subprocess."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_framework import Batch, ConfigError, KVLayout, Request
from sparse_framework.coordinator.core import SparseCoordinator

from helpers import SMALL_QUEST, run_interpreted

Q_HEADS, KV_HEADS, D = 4, 2, 16
SCALE = 144**-0.5  # Gemma 2 27B's query_pre_attn_scalar: s·√D = 1/3 here
COVERING = {"top_k": 256, "device_buffer_tokens": 512}
ALGORITHMS = {
    "quest": {},
    "snapkv": {"algorithm": "snapkv", "extra": {"window": 8}},
    "pqcache": {"algorithm": "pqcache", "extra": {}},
}


def coordinator(config: dict, backend: str = "torch_ref", layers: int = 2) -> SparseCoordinator:
    layout = KVLayout(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=D)
    cfg = {**SMALL_QUEST, "backend": backend, **config}
    if cfg["algorithm"] != "quest" and "extra" in SMALL_QUEST and "extra" not in config:
        del cfg["extra"]
    return SparseCoordinator(cfg, layout, max_requests=2, max_seq_len=512)


def compare(config: dict, backend: str = "torch_ref", scale: float = SCALE, lens=(70, 45), steps: int = 4,
            seed: int = 0) -> dict[str, float]:
    """Drive two coordinators with the same random q/k/v: `scaled` has every layer's scale set
    and gets q, `plain` has the default and gets q·(scale·√D). Selections must be identical;
    returns the largest output differences at prefill and decode and the decode outputs'
    largest magnitude."""
    scaled, plain = coordinator(config, backend), coordinator(config, backend)
    for layer in range(scaled.layout.num_layers):
        scaled.set_attention_options(layer, scale=scale)
    factor = scale * math.sqrt(D)
    g = torch.Generator().manual_seed(seed)
    reqs = {c: [Request(f"r{i}", n) for i, n in enumerate(lens)] for c in (scaled, plain)}
    for c in (scaled, plain):
        for r in reqs[c]:
            c.on_request_begin(r)
    worst = {"prefill": 0.0, "decode": 0.0, "magnitude": 0.0, "selected": 0}
    for step in range(steps + 1):
        prefill = step == 0
        n = sum(lens) if prefill else len(lens)
        batches = {c: Batch(reqs[c], is_prefill=prefill) for c in (scaled, plain)}
        for c in (scaled, plain):
            c.forward_begin(batches[c])
        for layer in range(scaled.layout.num_layers):
            q = torch.randn(n, Q_HEADS, D, generator=g) * 2
            k, v = torch.randn(n, KV_HEADS, D, generator=g), torch.randn(n, KV_HEADS, D, generator=g)
            outs, metas = [], []
            for c, qc in ((scaled, q), (plain, q * factor)):
                meta = c.attention_begin(layer, qc, k, v, batches[c])
                out = c.attend(layer, qc, meta)
                c.attention_end(layer, out, batches[c])
                outs.append(out)
                metas.append(meta)
            if not prefill:
                a, b = metas[0].selection, metas[1].selection
                assert torch.equal(a.indices, b.indices) and torch.equal(a.lengths, b.lengths), (step, layer)
                worst["selected"] = max(worst["selected"], int(a.lengths.max()))
                worst["magnitude"] = max(worst["magnitude"], float(outs[1].abs().max()))
            key = "prefill" if prefill else "decode"
            worst[key] = max(worst[key], float((outs[0] - outs[1]).abs().max()))
        for c in (scaled, plain):
            c.forward_end(batches[c])
    return worst


@pytest.mark.parametrize("budget", ["covering", "small"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_scale_equals_prescaled_queries(algorithm: str, budget: str) -> None:
    config = {**ALGORITHMS[algorithm], **(COVERING if budget == "covering" else {})}
    worst = compare(config)
    assert worst["prefill"] < 1e-5 and worst["decode"] < 1e-5, worst
    if budget == "small":  # the selection left tokens out (the 70-token request's)
        assert worst["selected"] < 70 + 4, worst


def test_scale_changes_the_output() -> None:
    """The scale is applied: a coordinator with it differs from one without on the same q."""
    config = {**COVERING}
    scaled, plain = coordinator(config, layers=1), coordinator(config, layers=1)
    scaled.set_attention_options(0, scale=SCALE)
    g = torch.Generator().manual_seed(1)
    outs = []
    for c in (scaled, plain):
        g.manual_seed(1)
        r = Request("r", 20)
        c.on_request_begin(r)
        batch = Batch([r], is_prefill=True)
        c.forward_begin(batch)
        q, k, v = (torch.randn(20, h, D, generator=g) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
        meta = c.attention_begin(0, q, k, v, batch)
        outs.append(c.attend(0, q, meta))
        c.attention_end(0, outs[-1], batch)
        c.forward_end(batch)
    assert float((outs[0] - outs[1]).abs().max()) > 1e-3


def test_default_scale_is_the_default_path(monkeypatch) -> None:
    """A scale of 1/sqrt(D) is the default: stored as None, backends called without it."""
    coord = coordinator(COVERING, layers=1)
    coord.set_attention_options(0, scale=D**-0.5)
    assert coord.attention_options(0).is_default and coord.attention_options(0).scale is None
    coord.set_attention_options(0, scale=SCALE)
    options = coord.attention_options(0)
    assert options.scale == SCALE and options.kwargs() == {"scale": SCALE}
    assert math.isclose(options.query_factor(D), 1 / 3)
    coord.set_attention_options(0)
    assert coord.attention_options(0).is_default


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "0.25", True])
def test_bad_scale_is_refused(bad) -> None:
    coord = coordinator(COVERING, layers=1)
    with pytest.raises(ConfigError, match="scale"):
        coord.set_attention_options(0, scale=bad)
    assert coord.attention_options(0).is_default


def test_triton_interpreted() -> None:
    """The triton backend (interpreted) takes the scale the same way, covering and small budget."""
    run_interpreted(
        "import sys\n"
        "sys.path.insert(0, TESTS_DIR)\n"
        "from test_attention_scale import compare, COVERING\n"
        "for config in (COVERING, {}):\n"
        "    worst = compare(config, backend='triton', steps=2)\n"
        "    assert worst['prefill'] < 1e-5 and worst['decode'] < 1e-4, worst\n"
        "print('SCALE OK')\n",
        "SCALE OK",
    )
