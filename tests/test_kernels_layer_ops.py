"""The layer-op kernels (kernels/layer_ops.py) against the torch ops they replace, and the
model's fused path (DecoderModel.use_fused_ops) against its plain torch path.

On the CPU they run interpreted (a subprocess with TRITON_INTERPRET=1) in float32 over
random shapes: the interpreter rounds float32 -> bfloat16 towards zero where the GPU rounds
to nearest, so the bfloat16 checks run on CUDA only (`-m gpu`)."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import run_interpreted

INTERPRETED = r"""
import random
import torch
from sparse_framework.kernels.layer_ops import add_rms_norm, rope_qkv, silu_mul
from sparse_framework.engine.models import DecoderModel, ModelConfig, dense_causal_attend, random_model
from sparse_framework.engine.models.llama import RMSNorm
from sparse_framework.engine.models.rope import RotaryEmbedding, apply_rotary

rng = random.Random(0)
for case in range(12):
    g = torch.Generator().manual_seed(case)
    t, n = rng.randint(1, 7), rng.choice([8, 48, 96, 130])
    x, r, w = torch.randn(t, n, generator=g), torch.randn(t, n, generator=g), torch.randn(n, generator=g)
    eps = rng.choice([1e-5, 1e-6])
    norm = RMSNorm(n, eps)
    norm.weight.data = w
    out, summed = add_rms_norm(x, r, w, eps)
    assert torch.equal(summed, x + r), case
    torch.testing.assert_close(out, norm(x + r), rtol=2e-6, atol=2e-6)
    out, same = add_rms_norm(x, None, w, eps)
    assert same is x
    torch.testing.assert_close(out, norm(x), rtol=2e-6, atol=2e-6)
    # strided rows: a slice of a wider tensor
    wide = torch.randn(t, n + 5, generator=g)
    torch.testing.assert_close(add_rms_norm(wide[:, :n], None, w, eps)[0], norm(wide[:, :n]), rtol=2e-6, atol=2e-6)

    hq, hkv = rng.choice([(4, 2), (2, 2), (6, 1)])
    d = rng.choice([8, 16, 32])
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
    pos = torch.randint(0, 5000, (t,), generator=g)
    cos, sin = RotaryEmbedding(d, 10_000.0).cos_sin(pos, torch.float32)
    qo, ko, vo = rope_qkv(q, k, v, cos, sin, hq, hkv, d)
    assert qo.is_contiguous() and ko.is_contiguous() and vo.is_contiguous()
    torch.testing.assert_close(qo, apply_rotary(q.reshape(t, hq, d), cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ko, apply_rotary(k.reshape(t, hkv, d), cos, sin), rtol=1e-6, atol=1e-6)
    assert torch.equal(vo, v.reshape(t, hkv, d))

    i = rng.choice([3, 40, 1100])
    gu = torch.randn(t, 2 * i, generator=g)
    torch.testing.assert_close(silu_mul(gu), torch.nn.functional.silu(gu[:, :i]) * gu[:, i:], rtol=1e-6, atol=1e-6)

# the model: fused path == plain path (logits), each family's distinctive parts
base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
families = {
    "llama": dict(architectures=["LlamaForCausalLM"], rope_theta=500000.0),
    "llama_biases": dict(architectures=["LlamaForCausalLM"], attention_bias=True, mlp_bias=True),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=16),
}
for name, extra in families.items():
    config = ModelConfig.from_hf({**base, **extra})
    model = random_model(config, torch.float32, "cpu", seed=1)
    with torch.no_grad():  # biases and norms away from their init, so that they matter
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(pname))))
    lens = [5, 9, 1]
    ids = torch.randint(0, 64, (sum(lens),), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in lens])
    rows = torch.tensor([4, 13, 14])
    attend = dense_causal_attend(lens)
    plain = model(ids, pos, attend, rows)
    params = sum(p.numel() for p in model.parameters())
    model.use_fused_ops()
    assert sum(p.numel() for p in model.parameters()) == params, name  # views, no second copy
    torch.testing.assert_close(model(ids, pos, attend, rows), plain, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(model(ids, pos, attend, None)[rows], plain, rtol=2e-5, atol=2e-5)
    # a checkpoint loaded after packing lands in the packed weights
    layer = model.model.layers[0]
    layer.self_attn.k_proj.weight.data.copy_(torch.zeros_like(layer.self_attn.k_proj.weight))
    q_dim = config.num_heads * config.head_dim
    assert not layer.self_attn.qkv_weight[q_dim : q_dim + config.num_kv_heads * config.head_dim].any()
print("layer ops ok")
"""


@pytest.mark.slow
def test_layer_ops_and_fused_model_equal_torch_interpreted() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, "layer ops ok")


def test_launchers_refuse_bad_shapes() -> None:
    pytest.importorskip("triton")
    from sparse_framework.kernels.layer_ops import add_rms_norm, rope_qkv, silu_mul

    env_had = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with pytest.raises(ValueError, match="weight"):
            add_rms_norm(torch.zeros(2, 8), None, torch.ones(7), 1e-6)
        with pytest.raises(ValueError, match="rope_qkv"):
            rope_qkv(torch.zeros(2, 32), torch.zeros(2, 16), torch.zeros(2, 16), torch.zeros(2, 12),
                     torch.zeros(2, 12), 2, 1, 16)
        with pytest.raises(ValueError, match=r"\[T, 2I\]"):
            silu_mul(torch.zeros(2, 7))
        with pytest.raises(ValueError, match="contiguous"):
            silu_mul(torch.zeros(8, 2).T)
    finally:
        if env_had is None:
            del os.environ["TRITON_INTERPRET"]


def test_launchers_refuse_cpu_tensors_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from sparse_framework.kernels.layer_ops import silu_mul

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="CUDA"):
        silu_mul(torch.zeros(2, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bfloat16_equals_torch_ops() -> None:
    """bf16 on CUDA at Llama-3-8B's widths: the residual add and v equal torch's ops bit for
    bit; RMSNorm, RoPE (rounded once, torch rounds thrice) and SiLU*up differ from them by at
    most one bf16 step, in a minority of elements."""
    from sparse_framework.engine.models.llama import RMSNorm
    from sparse_framework.engine.models.rope import RotaryEmbedding, apply_rotary
    from sparse_framework.kernels.layer_ops import add_rms_norm, rope_qkv, silu_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    t, n, hq, hkv, d, i = 24, 4096, 32, 8, 128, 14336
    x, r = (torch.randn(t, n, generator=g, device="cuda").to(bf) for _ in range(2))
    norm = RMSNorm(n, 1e-5, dtype=bf, device="cuda")
    norm.weight.data = torch.randn(n, generator=g, device="cuda").to(bf)
    out, summed = add_rms_norm(x, r, norm.weight, 1e-5)
    want = norm(x + r)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g, device="cuda").to(bf)
    q, k, v = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
    cos, sin = RotaryEmbedding(d, 500_000.0).cos_sin(torch.arange(t, device="cuda") * 997, bf)
    qo, ko, vo = rope_qkv(q, k, v, cos, sin, hq, hkv, d)
    gu = torch.randn(t, 2 * i, generator=g, device="cuda").to(bf)

    def differ(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> tuple[float, float]:
        """(share of elements that differ, largest difference in bf16 steps of max(|b|, floor):
        RoPE's sums cancel, so near zero a step of the inputs' size (floor 1) is the unit)"""
        a, b = a.detach().float(), b.detach().float()
        spacing = torch.finfo(bf).eps * b.abs().clamp(min=max(floor, torch.finfo(bf).tiny))
        return float((a != b).float().mean()), float(((a - b).abs() / spacing).max())

    report = {"sum": differ(summed, x + r), "norm": differ(out, want),
              "q": differ(qo, apply_rotary(q.reshape(t, hq, d), cos, sin), 1.0),
              "k": differ(ko, apply_rotary(k.reshape(t, hkv, d), cos, sin), 1.0), "v": differ(vo, v.reshape(t, hkv, d)),
              "silu": differ(silu_mul(gu), torch.nn.functional.silu(gu[:, :i]) * gu[:, i:])}
    assert report["sum"][0] == 0 and report["v"][0] == 0, report
    for name in ("norm", "q", "k", "silu"):
        assert report[name][0] < 0.3 and report[name][1] <= 2, report  # <= one step (spacing up to 2 eps)
