"""Hybrid sliding-window models through the transformers integration (issue 21, item 1):
Mistral (every layer slides), Qwen2 with use_sliding_window (layers from max_window_layers
on) and Gemma 3 (interleaved, query_pre_attn_scalar) decode at contexts several times their
window equal to transformers' dense generate; a small budget changes only the full layers;
the sliding-window ring (`SlidingWindowKV`) against a plain masked-softmax reference. Gemma 2
(softcap) and GPT-OSS (sinks): test_integrations_transformers_softcap_sinks.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
tf = pytest.importorskip("sparse_framework.integrations.transformers")

from sparse_framework.common.errors import ConfigError  # noqa: E402
from sparse_framework.common.layout import KVLayout  # noqa: E402
from sparse_framework.kv_store.sliding_window import SlidingWindowKV  # noqa: E402
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
WINDOW = 8
FULL = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 512, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
        "min_sparse_prompt_len": 0, "device_buffer_tokens": 544, "extra": {"dense_first_layers": 0}}
SMALL = {**FULL, "top_k": 16, "device_buffer_tokens": 48}
MAX_LEN = 128


def build(name: str, seed: int = 0, window: int = WINDOW):
    torch.manual_seed(seed)
    if name == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=window))
    elif name == "qwen2":  # layers >= max_window_layers slide: 0 full, 1 and 2 sliding
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **TINY, use_sliding_window=True, sliding_window=window, max_window_layers=1))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **TINY, head_dim=16, query_pre_attn_scalar=10, sliding_window=window,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    model.eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # always generate max_new_tokens
    return model


SLIDING = {"mistral": [0, 1, 2], "qwen2": [1, 2], "gemma3": [0, 2]}


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids: torch.Tensor, mask: torch.Tensor | None = None, new: int = 8):
    out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, max_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)  # [B, L + new], [B, new, vocab]


def reference_window_attention(q, keys, values, scale, window, softcap=None, sinks=None):
    """q [Hq, D] of the last token over keys/values [L, Hk, D]: the last `window` keys only."""
    hq, hk = q.shape[0], keys.shape[1]
    k = keys[-window:].float().repeat_interleave(hq // hk, 1)  # [W, Hq, D]
    v = values[-window:].float().repeat_interleave(hq // hk, 1)
    logits = torch.einsum("hd,whd->hw", q.float(), k) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if sinks is not None:
        logits = torch.cat([logits, sinks.float()[:, None]], 1)
    probs = torch.softmax(logits, -1)[:, : k.shape[0]]
    return torch.einsum("hw,whd->hd", probs, v)


# -- the ring against a plain reference -------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [3, 8, 21])
@pytest.mark.parametrize("extra", [{}, {"softcap": 2.0}, {"sinks": True}])
def test_ring_keeps_the_window_and_attends_like_a_masked_reference(prompt_len, extra) -> None:
    window, hk, hq, d, layers, rows = 8, 2, 4, 16, 2, 3
    gen = torch.Generator().manual_seed(prompt_len)
    ring = SlidingWindowKV(layers, window, rows, hk, d)
    total = prompt_len + 2 * window + 3  # decode far past the window: the ring wraps
    keys = torch.randn(rows, total, hk, d, generator=gen)
    values = torch.randn(rows, total, hk, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) if extra.get("sinks") else None
    softcap = extra.get("softcap")
    layer, live = 1, torch.tensor([2, 0])  # two of the three rows, out of order
    for r in live.tolist():
        ring.write_prefill(layer, r, keys[r, :prompt_len], values[r, :prompt_len])
    for t in range(prompt_len, total):
        pos = torch.full((2,), t)
        ring.write_decode(layer, live, pos, keys[live, t], values[live, t])
        q = torch.randn(2, hq, d, generator=gen)
        out = ring.attend(layer, q, live, pos + 1, 0.3, softcap=softcap, sinks=sinks)
        for i, r in enumerate(live.tolist()):
            ref = reference_window_attention(q[i], keys[r, : t + 1], values[r, : t + 1], 0.3, window, softcap, sinks)
            assert torch.allclose(out[i], ref, atol=1e-5, rtol=0)
            k, v = ring.window_kv(layer, r, t + 1)  # the window in token order
            assert torch.equal(k, keys[r, max(0, t + 1 - window): t + 1]) and torch.equal(v, values[r, max(0, t + 1 - window): t + 1])
    assert not ring.k[0].any()  # the other layer was never written


def test_ring_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="window must be a positive int"):
        SlidingWindowKV(1, 0, 2, 2, 8)
    ring = SlidingWindowKV(1, 4, 2, 2, 8)
    assert ring.nbytes == 2 * 4 * 2 * 2 * 8 * 4 and ring.bytes_per_token() == 2 * 2 * 8 * 4
    with pytest.raises(ValueError, match="layer 1 out of range 0..0"):
        ring.write_prefill(1, 0, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8))
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, 8\]"):
        ring.write_prefill(0, 0, torch.zeros(3, 1, 8), torch.zeros(3, 1, 8))


def test_a_layout_may_have_no_layers() -> None:
    """A model whose every layer slides (Mistral) keeps nothing in the store."""
    assert KVLayout(num_layers=0, num_kv_heads=2, head_dim=8).num_layers == 0
    with pytest.raises(ValueError, match="num_layers must be a non-negative int"):
        KVLayout(num_layers=-1, num_kv_heads=2, head_dim=8)


# -- which layers slide ------------------------------------------------------------------------
def test_layer_map_follows_the_config() -> None:
    for name, sliding in SLIDING.items():
        layers = tf.LayerMap.of(build(name).config, MAX_LEN)
        assert list(layers.sliding) == sliding and layers.window == WINDOW
        assert sorted(layers.full + layers.sliding) == list(range(3))
        assert layers.store == {layer: i for i, layer in enumerate(layers.full)}
    # a window that never binds: every layer through the coordinator, as before
    assert tf.LayerMap.of(build("gemma3").config, WINDOW) == tf.LayerMap.all_full(3)
    qwen_off = transformers.Qwen2Config(**TINY, use_sliding_window=False, sliding_window=WINDOW)
    assert tf.LayerMap.of(qwen_off, MAX_LEN) == tf.LayerMap.all_full(3)
    chunked = transformers.LlamaConfig(**TINY)
    chunked.layer_types = ["chunked_attention"] * 3
    with pytest.raises(tf.UnsupportedModelError, match=r"layer types \['chunked_attention'\] are not supported"):
        tf.LayerMap.of(chunked, MAX_LEN)


# -- a full budget equals dense far beyond the window ----------------------------------------
@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma3"])
def test_full_budget_equals_dense_far_beyond_the_window(name) -> None:
    model = build(name, seed=len(name))
    ids = prompt(30, seed=3)  # 30 + 12 tokens: over 5 windows of 8
    dense_seq, dense_logits = greedy(model, ids, new=12)
    model.config.sliding_window = 10_000  # the window binds: without it the model differs
    try:
        assert not torch.allclose(greedy(model, ids, new=2)[1], dense_logits[:, :2], atol=1e-3)
    finally:
        model.config.sliding_window = WINDOW
    with tf.sparse(model, FULL, max_requests=2, max_seq_len=MAX_LEN) as handle:
        seq, logits = greedy(model, ids, new=12)
        stats = handle.stats()
        coord = handle.coordinator
        assert coord.layout.num_layers == 3 - len(SLIDING[name])  # the store holds the full layers only
    assert torch.equal(seq, dense_seq)
    assert torch.allclose(logits, dense_logits, atol=1e-5, rtol=0)
    sliding = SLIDING[name]
    assert stats["sliding_window"] == {"layers": sliding, "window": WINDOW, "layer_steps": 11 * len(sliding)}
    assert stats["full_layers"] == [i for i in range(3) if i not in sliding]
    assert stats["layer_steps"] == 11 * (3 - len(sliding)) and stats["decode_steps"] == 11
    pools = {p["kind"]: p for p in stats["pools"]}
    assert pools["host"]["layers"] == 3 - len(sliding)
    ring = pools["sliding_window"]
    assert ring["layers"] == len(sliding) and ring["tokens_per_layer"] == 2 * WINDOW and ring["used_tokens"] == 0
    assert ring["bytes"] == 2 * len(sliding) * 2 * WINDOW * 2 * 16 * 4  # K and V, rows x window, 2 heads x 16, fp32


def test_left_padded_batch_of_a_hybrid_model_matches_each_prompt_alone() -> None:
    model = build("gemma3", seed=5)
    prompts = [prompt(37, seed=6), prompt(21, seed=7)]
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
    alone = [greedy(model, p) for p in prompts]
    with tf.sparse(model, FULL, max_requests=2, max_seq_len=MAX_LEN):
        seq, logits = greedy(model, ids, mask)
    for i, (dense_seq, dense_logits) in enumerate(alone):
        assert torch.equal(seq[i, width:], dense_seq[0, prompts[i].shape[1]:])
        assert torch.allclose(logits[i], dense_logits[0], atol=1e-5, rtol=0)


# -- a small budget: sparse full layers, exact sliding-window layers --------------------------
def test_small_budget_changes_only_the_full_layers() -> None:
    """Quest with a budget far below the context on Gemma 3's full layer; every decode step of
    the sliding layers equals dense attention over the last `window` keys of the K/V the model
    produced (recorded from prefill and decode), with the model's scale."""
    model = build("gemma3", seed=8, window=16)
    window, scale = 16, 10**-0.5  # query_pre_attn_scalar = 10
    ids = prompt(100, seed=9)
    seen: dict[int, list[torch.Tensor]] = {}  # ring layer -> [keys, values] so far, row 0
    checked = []
    with tf.sparse(model, SMALL, max_requests=1, max_seq_len=MAX_LEN) as handle:
        ring = handle.sliding
        write_prefill, write_decode, attend = ring.write_prefill, ring.write_decode, ring.attend

        def on_prefill(layer, row, k, v, start=0):
            seen[layer] = [k.clone(), v.clone()]
            write_prefill(layer, row, k, v, start)

        def on_decode(layer, rows, positions, k, v):
            seen[layer] = [torch.cat([seen[layer][0], k]), torch.cat([seen[layer][1], v])]
            write_decode(layer, rows, positions, k, v)

        def on_attend(layer, q, rows, lengths, s, **kw):
            out = attend(layer, q, rows, lengths, s, **kw)
            keys, values = seen[layer]
            assert int(lengths[0]) == keys.shape[0]
            checked.append((out[0], reference_window_attention(q[0], keys, values, scale, window)))
            return out

        ring.write_prefill, ring.write_decode, ring.attend = on_prefill, on_decode, on_attend
        seq, logits = greedy(model, ids, new=6)
        stats = handle.stats()
        assert handle.coordinator.store.used_tokens() == 0 and handle._sliding_pool()["used_tokens"] == 0
    assert len(checked) == 5 * 2  # 5 decode steps x 2 sliding layers
    for out, ref in checked:
        assert torch.allclose(out, ref, atol=1e-5, rtol=0)
    assert stats["read_fraction"] < 0.5  # the full layer read a fraction of its context
    assert stats["layer_steps"] == 5 and stats["sliding_window"]["layer_steps"] == 10
    assert torch.isfinite(logits).all() and seq.shape == (1, 106)
    dense_seq, dense_logits = greedy(model, ids, new=6)
    assert not torch.allclose(logits, dense_logits, atol=1e-5)  # the sparse full layer did change the result


def test_sliding_pool_counts_the_live_window() -> None:
    model = build("qwen2", seed=10)
    with tf.sparse(model, FULL, max_requests=2, max_seq_len=MAX_LEN) as handle:
        cache = handle.new_cache()
        ids = torch.cat([prompt(5, seed=11), prompt(5, seed=12)])
        model(ids, **{handle.cache_kwarg: cache}, use_cache=True)  # 5 tokens: inside the window
        assert handle._sliding_pool()["used_tokens"] == 2 * 5 * 2  # rows x tokens x layers
        for _ in range(6):  # 11 tokens: the window (8) is full
            model(ids[:, :1], **{handle.cache_kwarg: cache}, use_cache=True)
        assert handle._sliding_pool()["used_tokens"] == 2 * WINDOW * 2
        cache.close()
        assert handle._sliding_pool()["used_tokens"] == 0
