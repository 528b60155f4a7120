"""The prefill chunks' attention (engine/prefill_attention.py): the choice of kernel, the
flash-attn varlen call (its arguments, through a stand-in with flash-attn's bottom-right causal
semantics, on the CPU; the real library on CUDA where installed), and an engine whose prefill
goes through it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import ConfigError
from sparse_framework.engine import prefill_attention as pa
from sparse_framework.engine.models import causal_attention
from sparse_framework.engine.staging import chunk_attention


class FakeVarlen:
    """flash_attn_varlen_func's contract, computed plainly: per sequence of cu_seqlens, causal
    aligned to the bottom right (query i of n sees keys 0..m-n+i); records its calls."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        self.calls.append(dict(cu_q=cu_seqlens_q.tolist(), cu_k=cu_seqlens_k.tolist(), max_q=max_seqlen_q,
                               max_k=max_seqlen_k, scale=softmax_scale, causal=causal, dtype=cu_seqlens_q.dtype))
        assert causal and abs(softmax_scale - q.shape[-1] ** -0.5) < 1e-12
        out = torch.empty_like(q)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for i in range(len(cq) - 1):
            qs, ks = q[cq[i] : cq[i + 1]], slice(ck[i], ck[i + 1])
            out[cq[i] : cq[i + 1]] = causal_attention(qs, k[ks], v[ks], torch.float64, offset=ck[i + 1] - ck[i] - qs.shape[0]).to(q.dtype)
        return out, None  # flash-attn 4 returns (out, lse)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), frac=st.floats(0.0, 1.0), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_flash_chunk_attention_equals_the_sdpa_chunk(m, frac, hkv, group, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    n = max(1, round(frac * m))
    q = torch.randn(n, hkv * group, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(m, hkv, 8, generator=g, dtype=torch.float64) for _ in range(2))
    fake = FakeVarlen()
    got = pa.flash_chunk_attention(fake, q, k, v)
    torch.testing.assert_close(got, chunk_attention(q, k, v))
    (call,) = fake.calls
    assert call["cu_q"] == [0, n] and call["cu_k"] == [0, m] and (call["max_q"], call["max_k"]) == (n, m)
    assert call["dtype"] == torch.int32


def test_more_queries_than_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="3 queries but only 2 keys"):
        pa.flash_chunk_attention(FakeVarlen(), torch.zeros(3, 2, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))


def test_choice_of_kernel() -> None:
    cpu = torch.device("cpu")
    assert pa.choose("sdpa", cpu, torch.bfloat16) == ("sdpa", chunk_attention)
    assert pa.choose("auto", cpu, torch.float32) == ("sdpa", chunk_attention)  # the CPU never takes flash-attn
    with pytest.raises(ConfigError, match="prefill_attention must be one of auto, flash_attn, sdpa, got 'flash'"):
        pa.choose("flash", cpu, torch.float32)
    with pytest.raises(ConfigError, match="prefill_attention='flash_attn'.*CUDA"):
        pa.choose("flash_attn", cpu, torch.bfloat16)


def test_engine_config_names_the_field() -> None:
    from sparse_framework.engine import EngineConfig

    with pytest.raises(ConfigError, match="EngineConfig.prefill_attention"):
        EngineConfig(prefill_attention="xformers")


def test_engine_prefill_through_the_varlen_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose chunks go through the varlen call (the stand-in) decodes the same
    greedy tokens as with SDPA, and every chunk of every layer made one call."""
    from sparse_framework.engine import runner as runner_module
    from sparse_framework.engine.engine import Engine
    from sparse_framework.engine.engine_config import EngineConfig
    from sparse_framework.engine.models import ModelConfig, random_model
    from sparse_framework.engine.sampling import SamplingParams

    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 256})
    sparse = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 256, "page_size": 4, "device_buffer_tokens": 512, "min_sparse_prompt_len": 0}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (30, 7, 45)]

    def run() -> dict[str, list[int]]:
        engine = Engine(random_model(config, torch.float32, "cpu", seed=0), config, sparse,
                        EngineConfig(max_num_seqs=3, max_model_len=96, max_num_batched_tokens=16))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0))
        return {o.request_id: o.token_ids for o in engine.run_to_completion()}

    plain = run()
    fake = FakeVarlen()
    monkeypatch.setattr(runner_module, "choose_prefill_attention",
                        lambda mode, device, dtype: ("fake", lambda q, k, v, s: pa.flash_chunk_attention(fake, q, k, v, s)))
    assert run() == plain
    chunks = sum(-(-len(p) // 16) for p in prompts)  # at most 16 tokens of a prompt per step
    assert len(fake.calls) >= chunks * config.num_layers
    assert all(c["cu_q"][1] <= c["cu_k"][1] for c in fake.calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_flash_attn_varlen_equals_sdpa() -> None:
    found = pa.find_varlen()
    if isinstance(found, str):
        pytest.skip(found)
    label, fn = found
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, m in ((4096, 4096), (1024, 9000), (1, 300), (77, 77)):
        q = torch.randn(n, 32, 128, generator=g, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(m, 8, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
        got = pa.flash_chunk_attention(fn, q, k, v)
        want = chunk_attention(q, k, v)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"{label} n={n} m={m}")


def test_auto_takes_sdpa_for_whole_prompts_and_varlen_for_later_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a flash-attn found (a stand-in) on a CUDA-typed device, "auto" sends a chunk that
    is its whole prompt to SDPA and any later chunk to the varlen call; "flash_attn" sends all."""
    fake = FakeVarlen()
    monkeypatch.setattr(pa, "find_varlen", lambda: ("flash-attn 9", fake))
    cuda = torch.device("cuda")
    label, auto = pa.choose("auto", cuda, torch.bfloat16)
    assert label == "flash-attn 9 (sdpa for whole prompts)"
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    torch.testing.assert_close(auto(q[:4], k[:4], v[:4]), chunk_attention(q[:4], k[:4], v[:4]))
    assert fake.calls == []
    torch.testing.assert_close(auto(q, k, v), chunk_attention(q, k, v))
    assert len(fake.calls) == 1
    label, every = pa.choose("flash_attn", cuda, torch.bfloat16)
    every(q[:4], k[:4], v[:4])
    assert label == "flash-attn 9" and len(fake.calls) == 2


def test_vllm_fa3_is_found_last_and_pinned_to_version_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without flash-attn, an installed vLLM's FlashAttention 3 serves (pinned to fa_version 3:
    its default, 2, may be missing from vLLM's Hopper builds); without FA3 support, the reason
    lands in the message, and SDPA stays."""
    import sys
    import types

    calls: list[dict] = []
    fake = types.ModuleType("vllm.vllm_flash_attn")
    fake.is_fa_version_supported = lambda version: version == 3
    fake.fa_version_unsupported_reason = lambda version: "not Hopper"
    fake.flash_attn_varlen_func = lambda *a, **kw: calls.append(kw) or "out"
    for name in ("flash_attn.cute", "flash_attn_interface", "flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fake)
    pa.find_varlen.cache_clear()
    try:
        label, fn = pa.find_varlen()
        assert label == "vLLM's flash-attn 3"
        assert fn(cu_seqlens_q=None) == "out" and calls == [{"cu_seqlens_q": None, "fa_version": 3}]
        pa.find_varlen.cache_clear()
        fake.is_fa_version_supported = lambda version: False
        why = pa.find_varlen()
        assert isinstance(why, str) and "not Hopper" in why and "flash_attn_interface" in why
    finally:
        pa.find_varlen.cache_clear()
