"""The transformers integration on tiny random Llama and Qwen2 models (GQA, float32, CPU):
a budget covering the context equals the unmodified model, a small budget decodes sparsely,
left-padded batches match their prompts run alone, enable/disable restores the model, the
requests' lifecycle, and the errors."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402
tf = pytest.importorskip("sparse_framework.integrations.transformers")
from sparse_framework.integrations.transformers import cache as tf_cache, compat as tf_compat  # noqa: E402

from transformers import (  # noqa: E402
    Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
# a budget covering every context below: every token selected, every layer sparse
FULL = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 512, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
        "min_sparse_prompt_len": 0, "device_buffer_tokens": 544, "extra": {"dense_first_layers": 0}}
SMALL = {**FULL, "top_k": 32, "device_buffer_tokens": 64}
MAX_LEN = 512


def build(cls, config_cls, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = cls(config_cls(**{**TINY, **kw})).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # always generate max_new_tokens
    return model


@pytest.fixture(scope="module")
def llama():
    return build(LlamaForCausalLM, LlamaConfig)


@pytest.fixture(scope="module")
def qwen2():
    return build(Qwen2ForCausalLM, Qwen2Config, seed=1)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids: torch.Tensor, mask: torch.Tensor | None = None, new: int = 8):
    out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, max_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)  # [B, L + new], [B, new, vocab]


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:] = p[0]
        mask[i, width - p.shape[1]:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def qwen3():  # head_dim from the config (32), not hidden_size // heads
    return build(Qwen3ForCausalLM, Qwen3Config, seed=2, head_dim=32)


@pytest.fixture(scope="module")
def gemma3():  # scaling = query_pre_attn_scalar ** -0.5, not head_dim ** -0.5; windows that never bind
    return build(Gemma3ForCausalLM, Gemma3TextConfig, seed=3, head_dim=16, query_pre_attn_scalar=10, sliding_window=MAX_LEN)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3"])
def test_budget_covering_the_context_equals_dense(name, request) -> None:
    model = request.getfixturevalue(name)
    ids = prompt(40, seed=3)
    dense_seq, dense_logits = greedy(model, ids, new=12)
    with tf.sparse(model, FULL, max_requests=2, max_seq_len=MAX_LEN) as handle:
        seq, logits = greedy(model, ids, new=12)
        stats = handle.stats()
    assert torch.equal(seq, dense_seq)
    assert torch.allclose(logits, dense_logits, atol=1e-5, rtol=0)
    # every decode step of every layer went through the coordinator and read everything
    assert stats["decode_steps"] == 11 and stats["layer_steps"] == 33
    assert stats["read_fraction"] == 1.0


@pytest.mark.parametrize("algorithm, extra", [("snapkv", {}), ("pqcache", {}), ("dsa", {"source": "keys"})])
def test_other_algorithms_with_a_covering_budget_equal_dense(llama, algorithm, extra) -> None:
    ids = prompt(40, seed=4)
    dense_seq, dense_logits = greedy(llama, ids)
    cfg = {**FULL, "algorithm": algorithm, "extra": extra}
    with tf.enable(llama, cfg, max_requests=1, max_seq_len=MAX_LEN):
        seq, logits = greedy(llama, ids)
    assert torch.equal(seq, dense_seq)
    assert torch.allclose(logits, dense_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_small_budget_decodes_sparsely(name, request) -> None:
    model = request.getfixturevalue(name)
    ids = prompt(300, seed=5)
    with tf.sparse(model, SMALL, max_requests=1, max_seq_len=MAX_LEN) as handle:
        seq, logits = greedy(model, ids, new=6)
        stats = handle.stats()
        coord = handle.coordinator
        assert coord.requests == {} and coord.store.used_tokens() == 0  # ended with generate
    assert seq.shape == (1, 306) and torch.isfinite(logits).all()
    assert stats["decode_steps"] == 5 and stats["layer_steps"] == 15
    assert stats["read_fraction"] < 0.25
    # the pools: sized by layer kind, nothing held once generate ended
    kinds = {p["kind"]: p for p in stats["pools"]}
    assert set(kinds) == {"sparse_layers", "dense_layers", "host"} or set(kinds) == {"sparse_layers", "host"}
    assert all(p["used_tokens"] == 0 and p["bytes"] > 0 and p["rule"] for p in stats["pools"])
    for layer in range(3):
        sel = handle.last_selections[layer]
        sel.validate(torch.tensor([305], dtype=torch.int32))
        # Quest: per KV head, whole pages: sink (1 page) + budget (8 pages) + the recent window
        assert sel.indices.shape[1] == 2 and bool((sel.lengths <= 4 + 32 + 12).all())
        assert bool((sel.lengths < 305).all())


def test_left_padded_batch_matches_each_prompt_alone(llama) -> None:
    prompts = [prompt(37, seed=6), prompt(21, seed=7)]
    ids, mask = left_pad(prompts)
    alone_dense = [greedy(llama, p) for p in prompts]
    with tf.sparse(llama, FULL, max_requests=2, max_seq_len=MAX_LEN):
        seq, logits = greedy(llama, ids, mask)
    for i, (dense_seq, dense_logits) in enumerate(alone_dense):
        assert torch.equal(seq[i, ids.shape[1]:], dense_seq[0, prompts[i].shape[1]:])
        assert torch.allclose(logits[i], dense_logits[0], atol=1e-5, rtol=0)


def test_small_budget_batch_selects_as_each_prompt_alone(llama) -> None:
    """Padding is stripped before the KV is stored: the same selections, the same tokens."""
    prompts = [prompt(260, seed=8), prompt(150, seed=9)]
    ids, mask = left_pad(prompts)
    with tf.sparse(llama, SMALL, max_requests=2, max_seq_len=MAX_LEN) as handle:
        seq, logits = greedy(llama, ids, mask, new=5)
        batched = {layer: s.indices.clone() for layer, s in handle.last_selections.items()}
        for i, p in enumerate(prompts):
            alone_seq, alone_logits = greedy(llama, p, new=5)
            assert torch.equal(seq[i, ids.shape[1]:], alone_seq[0, p.shape[1]:])
            assert torch.allclose(logits[i], alone_logits[0], atol=1e-5, rtol=0)
            for layer, s in handle.last_selections.items():
                width = s.indices.shape[-1]
                assert torch.equal(batched[layer][i, :, :width], s.indices[0])


def test_disable_restores_the_model(llama) -> None:
    ids = prompt(30, seed=10)
    before = llama(ids).logits
    dense_seq, _ = greedy(llama, ids)
    handle = tf.enable(llama, SMALL, max_requests=1, max_seq_len=MAX_LEN)
    assert llama.config._attn_implementation == tf.NAME
    # a forward without a sparse cache is plain sdpa attention
    assert torch.equal(llama(ids).logits, before)
    with pytest.raises(ValueError, match="already enabled"):
        tf.enable(llama, SMALL)
    handle.disable()
    assert llama.config._attn_implementation == "sdpa"
    assert "generate" not in vars(llama)
    assert torch.equal(llama(ids).logits, before)
    assert torch.equal(greedy(llama, ids)[0], dense_seq)
    with tf.sparse(llama, SMALL, max_requests=1, max_seq_len=MAX_LEN):  # enabled again, then restored
        pass
    assert llama.config._attn_implementation == "sdpa"


def test_request_lifecycle(llama) -> None:
    ids, mask = left_pad([prompt(20, seed=11), prompt(12, seed=12)])
    with tf.sparse(llama, SMALL, max_requests=2, max_seq_len=32) as handle:
        coord = handle.coordinator
        kw = handle.cache_kwarg  # "cache" on transformers >= 5.24, "past_key_values" before
        cache = handle.new_cache()
        out = llama(ids, attention_mask=mask, **{kw: cache}, use_cache=True)
        assert [r.prompt_len for r in cache.requests] == [20, 12]  # pad tokens stripped
        assert [r.seq_len for r in cache.requests] == [20, 12] and len(coord.requests) == 2
        assert cache.get_seq_length() == 20  # transformers' view: padded positions
        nxt = out.logits[:, -1:].argmax(-1)
        llama(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), **{kw: cache}, use_cache=True)
        assert [r.seq_len for r in cache.requests] == [21, 13] and cache.get_seq_length() == 21
        with pytest.raises(tf.UnsupportedModelError, match="one token per row"):
            llama(ids[:, :2], **{kw: cache}, use_cache=True)
        llama(nxt, **{kw: cache}, use_cache=True)  # the refused forward changed nothing
        assert [r.seq_len for r in cache.requests] == [22, 14] and cache.get_seq_length() == 22
        cache.reset()  # ends the requests; the cache can prefill again
        assert coord.requests == {} and coord.store.used_tokens() == 0
        llama(ids, attention_mask=mask, **{kw: cache}, use_cache=True)
        assert len(coord.requests) == 2
        del cache, out
        gc.collect()  # a garbage-collected cache ends its requests
        assert coord.requests == {} and coord.store.used_tokens() == 0
        # generation that fails (past max_seq_len) still ends its requests
        with pytest.raises(ValueError, match="max_seq_len"):
            llama.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        assert coord.requests == {} and coord.store.used_tokens() == 0
        out = llama.generate(ids[:1], max_new_tokens=3, do_sample=True, num_return_sequences=2)
        assert out.shape == (2, 23) and coord.requests == {}
        # disabling ends the requests of caches still alive
        kept = handle.new_cache()
        llama(ids, attention_mask=mask, **{kw: kept}, use_cache=True)
    assert coord.requests == {}
    with pytest.raises(RuntimeError, match="disabled"):
        llama(ids[:, -1:], **{kw: kept}, use_cache=True)


def test_a_forward_failing_midway_abandons_its_step(llama) -> None:
    """An exception in the model between two layers leaves the coordinator's step open; the
    cache's reset (or generate's own clean-up) abandons it with abort_step and ends the
    requests: nothing stays allocated and the next generation equals a clean one."""
    ids, mask = left_pad([prompt(20, seed=21), prompt(12, seed=22)])

    def fail_at_layer_1(event: tf.AttentionEvent) -> None:
        if event.layer == 1:
            raise RuntimeError("the model failed")

    with tf.sparse(llama, SMALL, max_requests=2, max_seq_len=64) as handle:
        coord = handle.coordinator
        clean = greedy(llama, ids, mask)
        cache = handle.new_cache()
        out = llama(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        handle.observer = fail_at_layer_1
        with pytest.raises(RuntimeError, match="the model failed"):
            llama(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), past_key_values=cache, use_cache=True)
        handle.observer = None
        assert coord.steps.step is not None and coord.steps.step.ended == {0, 1}
        cache.reset()
        assert coord.steps.step is None and coord.requests == {} and coord.store.used_tokens() == 0
        handle.observer = fail_at_layer_1  # now inside generate: at the prefill, then at a decode step
        with pytest.raises(RuntimeError, match="the model failed"):
            greedy(llama, ids, mask)
        handle.observer = None
        assert coord.steps.step is None and coord.requests == {} and coord.store.used_tokens() == 0
        again = greedy(llama, ids, mask)
    assert torch.equal(again[0], clean[0]) and torch.equal(again[1], clean[1])


def test_errors_are_clear(llama, monkeypatch) -> None:
    with pytest.raises(ImportError, match=r"transformers >= 4\.56.*found 4\.40\.0"):
        tf.check_transformers_version("4.40.0")
    # the module the integration imported: transformers 5 can swap sys.modules["transformers"]
    # when another test file's lazy model import runs first (transformers.modeling_layers)
    monkeypatch.setattr(tf_compat.transformers, "__version__", "4.55.4")
    with pytest.raises(ImportError, match="found 4.55.4"):
        tf.enable(llama, SMALL)
    monkeypatch.undo()

    no_registry = type("NoRegistryLlama", (LlamaForCausalLM,), {"_supports_attention_backend": False})
    with pytest.raises(tf.UnsupportedModelError, match="does not use transformers' attention-function registry"):
        tf.enable(no_registry(LlamaConfig(**TINY)), SMALL)
    with pytest.raises(tf.UnsupportedModelError, match="PreTrainedModel"):
        tf.enable(torch.nn.Linear(2, 2), SMALL)
    with pytest.raises(tf.UnsupportedModelError, match="source to 'keys'"):
        tf.enable(llama, {**SMALL, "algorithm": "dsa", "extra": {}})
    assert llama.config._attn_implementation == "sdpa"  # failed enables leave the model alone

    ids = prompt(20, seed=13)
    with tf.sparse(llama, SMALL, max_requests=2, max_seq_len=64):
        with pytest.raises(tf.UnsupportedModelError, match="beam search"):
            llama.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False)
        with pytest.raises(ValueError, match="not a DynamicCache"):
            llama.generate(ids, max_new_tokens=3, **{tf.cache_kwarg(llama): transformers.DynamicCache()})


def test_mistral_with_a_window_that_never_binds() -> None:
    mistral = build(MistralForCausalLM, MistralConfig, seed=2, sliding_window=256)
    ids = prompt(40, seed=14)
    dense_seq, dense_logits = greedy(mistral, ids)
    with tf.sparse(mistral, FULL, max_requests=1, max_seq_len=256):
        seq, logits = greedy(mistral, ids)
    assert torch.equal(seq, dense_seq)
    assert torch.allclose(logits, dense_logits, atol=1e-5, rtol=0)


# -- clear errors at the right moment (issue 19, item 6) --------------------------------------
@pytest.mark.slow
def test_compiled_model_decodes_like_the_uncompiled_one(llama) -> None:
    """`model.compile()` used to end in "TypeError: 'SparseCache' object is not callable"
    (dynamo traced the cache update and replaced the weak reference to the cache)."""
    ids = prompt(80, seed=21)
    with tf.sparse(llama, SMALL, max_requests=1, max_seq_len=128) as handle:
        ref_seq, ref_logits = greedy(llama, ids, new=4)
        assert handle.stats()["read_fraction"] < 1.0  # the budget binds: a sparse run
    compiled = torch.compile(llama, backend="eager")  # dynamo tracing only: fast on the CPU
    try:
        with tf.sparse(compiled, SMALL, max_requests=1, max_seq_len=128) as handle:  # the wrapper is accepted
            seq, logits = greedy(compiled, ids, new=4)
            assert handle.stats()["decode_steps"] == 3
        llama.compile(backend="eager")  # in place: the path that raised the TypeError
        with tf.sparse(llama, SMALL, max_requests=1, max_seq_len=128):
            seq2, logits2 = greedy(llama, ids, new=4)
    finally:
        llama._compiled_call_impl = None  # the module fixture is shared
    assert torch.equal(seq, ref_seq) and torch.equal(seq2, ref_seq)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
    assert torch.allclose(logits2, ref_logits, atol=1e-5, rtol=0)


def test_cache_implementation_passed_to_generate_is_refused(llama) -> None:
    ids = prompt(20, seed=22)
    with tf.sparse(llama, SMALL, max_requests=1, max_seq_len=64) as handle:
        with pytest.raises(tf.UnsupportedModelError, match=r"cache_implementation='static'.*SparseCache"):
            llama.generate(ids, max_new_tokens=2, cache_implementation="static")
        assert not handle.coordinator.requests  # refused before anything was admitted
        gen = transformers.GenerationConfig(cache_implementation="static", max_new_tokens=2, pad_token_id=0)
        with pytest.raises(tf.UnsupportedModelError, match="cache_implementation='static'"):
            llama.generate(ids, generation_config=gen)


def test_cache_implementation_of_the_model_config_is_set_aside(llama) -> None:
    """A hub default such as Gemma's "hybrid" is the model's, not the caller's: sparse generate
    runs with its own cache and leaves the model's generation_config as it was."""
    ids = prompt(30, seed=23)
    with tf.sparse(llama, FULL, max_requests=1, max_seq_len=64):
        ref, _ = greedy(llama, ids, new=3)
    llama.generation_config.cache_implementation = "dynamic"
    try:
        with tf.sparse(llama, FULL, max_requests=1, max_seq_len=64):
            seq, _ = greedy(llama, ids, new=3)
        assert llama.generation_config.cache_implementation == "dynamic"
    finally:
        llama.generation_config.cache_implementation = None
    assert torch.equal(seq, ref)


def test_prompt_length_in_errors_of_a_windowed_model_is_the_real_one() -> None:
    """The first layer of Mistral is windowed: the last row of its mask sees only the last
    `window` tokens, which used to be reported as the prompt length (450 tokens as 64)."""
    mistral = build(MistralForCausalLM, MistralConfig, seed=4, sliding_window=64)
    ids, mask = left_pad([prompt(450, seed=24), prompt(30, seed=25)])
    n, window = 450, 64
    pos = torch.arange(n)
    real = mask.bool()
    causal = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    sliding = causal[None, None] & real[:, None, None, :]  # what sdpa builds for a windowed layer
    assert torch.equal(tf_cache._prompt_tokens(sliding, 2, n, "cpu"), real)
    unmasked = sliding | ~sliding.any(-1, keepdim=True)  # old torch: fully masked pad rows attend to all
    assert torch.equal(tf_cache._prompt_tokens(unmasked, 2, n, "cpu"), real)
    additive = torch.zeros(sliding.shape).masked_fill(~sliding, float("-inf"))
    assert torch.equal(tf_cache._prompt_tokens(additive, 2, n, "cpu"), real)
    with tf.sparse(mistral, SMALL, max_requests=2, max_seq_len=64) as handle:
        with pytest.raises(ValueError, match="prompt_len 450 leaves no room to decode within max_seq_len 64"):
            mistral.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        assert not handle.coordinator.requests


def test_no_past_key_values_deprecation_warning(llama) -> None:
    """transformers 5.24 deprecates `past_key_values` (removal in 5.40): neither generate nor the
    evaluation's teacher-forced decode through the integration may pass it there."""
    from sparse_framework.eval.runner import teacher_forced

    ids = prompt(24, seed=21)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        warnings.filterwarnings("error", message=".*past_key_values.*", category=DeprecationWarning)
        with tf.sparse(llama, SMALL, max_requests=1, max_seq_len=64) as handle:
            greedy(llama, ids, new=3)
            cache = handle.new_cache()
            teacher_forced(llama, torch.cat([ids, prompt(4, seed=22)], 1), 24, cache)
            cache.close()
    assert handle.stats()["decode_steps"] == 2 + 3  # both decoded through the sparse cache
    expected = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    assert tf.cache_kwarg(llama) == expected


def test_stats_show_dense_fallbacks(llama) -> None:
    """A short prompt, dense layers and use_cache=False all decode densely; stats() says so,
    with the reason, instead of looking like a sparse run at full budget."""
    ids = prompt(24, seed=23)
    layers = TINY["num_hidden_layers"]
    with tf.sparse(llama, SMALL, max_requests=1, max_seq_len=64) as handle:  # min_sparse_prompt_len 0
        greedy(llama, ids, new=3)
        dense = handle.stats()["dense"]
        assert dense["requests"] == 1 and dense["dense_requests"] == {}
        assert dense["layer_steps"] == 2 * layers and dense["dense_layer_steps"] == {}  # 2 decode steps
        assert handle.stats()["sparse_fraction"] == 1.0
    short = {**SMALL, "min_sparse_prompt_len": 100}
    with tf.sparse(llama, short, max_requests=1, max_seq_len=64) as handle:
        greedy(llama, ids, new=3)
        stats = handle.stats()
        assert stats["dense"]["dense_requests"] == {"short prompt": 1}
        assert stats["dense"]["dense_layer_steps"] == {"dense request": 2 * layers}
        assert stats["sparse_fraction"] == 0.0 and stats["read_fraction"] == 1.0
        assert "1 of 1 requests dense (short prompt: 1)" in handle.dense_summary()
    one_dense = {**SMALL, "dense_layers": [0]}
    with tf.sparse(llama, one_dense, max_requests=1, max_seq_len=64) as handle:
        greedy(llama, ids, new=3)
        assert handle.stats()["dense"]["dense_layer_steps"] == {"dense layer": 2}  # layer 0, 2 steps
        assert handle.stats()["sparse_fraction"] == pytest.approx(1 - 1 / layers)
    with tf.sparse(llama, SMALL, max_requests=1, max_seq_len=64) as handle:
        llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, use_cache=False)
        stats = handle.stats()
        # 3 forwards (each generates a token), every layer dense sdpa, one row
        assert stats["dense"]["dense_layer_steps"] == {"no cache (use_cache=False)": 3 * layers}
        assert stats["decode_steps"] == 0 and stats["sparse_fraction"] == 0.0
