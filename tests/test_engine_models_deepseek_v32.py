"""The engine's DeepSeek-V3.2 model (MLA + lightning indexer + MoE) against transformers'
DeepseekV32ForCausalLM on tiny random configs (float32, CPU): a checkpoint saved by
transformers loads by name, and a packed forward of several prompts, with the plain reference
MLA attention (latents expanded through kv_b_proj, causal, restricted to the indexer's top-k
as the model masks), gives the model's own logits. YaRN with mscale too. Config refusals.

16 indexer heads (as tests/test_integrations_transformers_mla.py explains): with few heads a
key's index score is exactly 0 often enough that the k-th place ties, which two top-k
implementations may break differently."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from sparse_framework.common.errors import ConfigError
from sparse_framework.engine.models import (
    DeepseekV32Model,
    ModelConfig,
    UnsupportedModelError,
    dense_mla_attend,
    load_model,
    random_model,
)

needs_v32 = pytest.mark.skipif(importlib.util.find_spec("transformers.models.deepseek_v32") is None,
                               reason="transformers without DeepseekV32 (needs >= 5.24)")

VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=32, index_n_heads=16,
            first_k_dense_replace=1, max_position_embeddings=256)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def hf_model(seed: int = 0, **kw):
    from transformers.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(DeepseekV32Config(**{**TINY, **kw})).eval()
    with torch.no_grad():  # a router bias that matters, as a trained model's does
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    return model


def saved(tmp_path, **kw):
    model = hf_model(**kw)
    model.save_pretrained(tmp_path)
    return model, load_model(tmp_path, dtype=torch.float32)


def hf_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """The model's logits of every prompt token, one prompt at a time (no padding), packed."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0].float() for p in prompts])


def packed_logits(ours: DeepseekV32Model, prompts: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    return ours(ids, pos, dense_mla_attend([len(p) for p in prompts]))


def prompts(seed: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


@needs_v32
@pytest.mark.parametrize("rope", [None, YARN], ids=["default-rope", "yarn"])
def test_packed_forward_equals_transformers(tmp_path, rope) -> None:
    """Three prompts packed (20, 13, 5 tokens; index_topk 8: the first two are sparse past
    token 8), every row's logits equal to the model's own within float32 rounding."""
    kw = {"rope_parameters": rope} if rope else {}
    model, ours = saved(tmp_path, **kw)
    if rope:
        assert ours.config.mla.yarn is not None and ours.config.mla.softmax_scale != 24**-0.5
    ps = prompts(1, [20, 13, 5])
    expect, got = hf_logits(model, ps), packed_logits(ours, ps)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=0)


@needs_v32
def test_packed_forward_in_bfloat16_is_within_bf16_rounding_of_transformers(tmp_path) -> None:
    """Both models in bfloat16 (our router and index weights stay float32, as transformers'
    do): every row's logits within a few bf16 steps of the model's own, and the argmax the
    same on all but near-ties. Both round at different places (fused vs separate projections,
    the reference attention's float32 math), so equality is not expected; the float32 test
    above is the exact one. Measured: max |diff| / max |logit| printed."""
    model, _ = saved(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    model = model.to(torch.bfloat16)
    ps = prompts(3, [20, 13, 5])
    expect = hf_logits(model, ps)
    got = packed_logits(ours, ps).float()
    scale = expect.abs().max()
    rel = ((got - expect).abs().max() / scale).item()
    print(f"bf16: max |ours - transformers| / max |logit| = {rel:.4f}")
    assert rel < 0.02  # measured 0.006
    top2 = expect.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale  # rows whose best token leads by 10% of the scale
    assert clear.any() and torch.equal(got.argmax(-1)[clear], expect.argmax(-1)[clear])


@needs_v32
def test_the_indexer_mask_matters(tmp_path) -> None:
    """The same prompts with index_topk >= the context equal the model run dense: the top-k
    restriction above is not vacuous (those logits differ from the sparse ones)."""
    model, ours = saved(tmp_path)
    ps = prompts(2, [20, 11])
    sparse_logits = packed_logits(ours, ps)
    dense_cfg = dataclasses.replace(ours.config, mla=dataclasses.replace(ours.config.mla, index_topk=64))
    dense = DeepseekV32Model(dense_cfg)
    dense.load_state_dict(ours.state_dict())
    model.config.index_topk = 64
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = 64
    dense_logits = packed_logits(dense, ps)
    torch.testing.assert_close(dense_logits, hf_logits(model, ps), atol=2e-5, rtol=0)
    assert (dense_logits - sparse_logits).abs().max() > 1e-3


@needs_v32
def test_logits_rows_and_parameter_count(tmp_path) -> None:
    """logits_rows picks rows of the full result; num_parameters counts what the checkpoint stores."""
    _, ours = saved(tmp_path)
    ps = prompts(3, [9, 4])
    attend = dense_mla_attend([9, 4])
    ids = torch.tensor([t for p in ps for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in ps])
    full = ours(ids, pos, attend)
    rows = torch.tensor([8, 12])
    torch.testing.assert_close(ours(ids, pos, attend, rows), full[rows], atol=1e-6, rtol=0)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = sum(f.get_slice(k).get_shape()[0] * max(1, _prod(f.get_slice(k).get_shape()[1:])) for k in f.keys())
    assert ours.config.num_parameters() == stored == sum(p.numel() for p in ours.parameters())


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def test_bf16_keeps_router_and_index_weights_in_float32() -> None:
    cfg = ModelConfig.from_hf({"architectures": ["DeepseekV32ForCausalLM"], **TINY})
    m = random_model(cfg, dtype=torch.bfloat16)
    layer = m.model.layers[1]
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert layer.self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert torch.all(layer.mlp.gate.e_score_correction_bias == 0) and torch.all(layer.self_attn.indexer.k_norm.bias == 0)
    out = m(torch.tensor([1, 2, 3]), torch.arange(3), dense_mla_attend([3]))
    assert out.shape == (3, VOCAB) and torch.isfinite(out).all()


def test_shrunk_moe_for_random_models() -> None:
    cfg = ModelConfig.from_hf({"architectures": ["DeepseekV32ForCausalLM"], **TINY})
    small = dataclasses.replace(cfg, mla=cfg.mla.with_experts(4, n_group=1, topk_group=1))
    m = random_model(small)
    assert len(m.model.layers[1].mlp.experts) == 4
    assert small.num_parameters() == sum(p.numel() for p in m.parameters()) < cfg.num_parameters()


def test_config_fields_and_layout() -> None:
    cfg = ModelConfig.from_hf({"architectures": ["DeepseekV32ForCausalLM"], **TINY})
    assert cfg.family == "deepseek_v32" and cfg.mla.mlp_layer_types == ("dense", "sparse", "sparse")
    layout = cfg.kv_layout(torch.bfloat16)
    assert layout.is_mla and layout.head_dim == 40 and layout.v_head_dim == 32


@pytest.mark.parametrize("change, words", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"indexer_types": ["full", "shared", "full"]}, "indexer_types"),
    ({"scoring_func": "softmax"}, "scoring_func"),
])
def test_refused_by_name(change, words) -> None:
    with pytest.raises(UnsupportedModelError, match=words):
        ModelConfig.from_hf({"architectures": ["DeepseekV32ForCausalLM"], **TINY, **change})


def test_bad_moe_shape_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="n_group"):
        ModelConfig.from_hf({"architectures": ["DeepseekV32ForCausalLM"], **TINY, "n_group": 3})


@needs_v32
def test_mtp_layers_are_skipped_and_other_extras_refused(tmp_path) -> None:
    """DeepSeek's checkpoints store the MTP layer after the last one (skipped, as transformers
    does); any other unknown tensor is a config mismatch."""
    from safetensors.torch import load_file, save_file

    from sparse_framework.engine.models import CheckpointError

    saved(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="eh_proj"):
        load_model(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    assert load_model(tmp_path).config.mla.num_nextn_predict_layers == 1
