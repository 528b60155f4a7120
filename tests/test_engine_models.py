"""The engine's models against transformers' own: tiny random checkpoints of every supported
family saved with `save_pretrained`, loaded by our loader, and compared logit for logit
(float32, CPU) — packed sequences against each sequence run alone, and cached decode against a
full forward. Plus the shipped reference model and each loader error."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from sparse_framework.common.errors import ConfigError  # noqa: E402
from sparse_framework.engine.models import (  # noqa: E402
    CheckpointError,
    DecoderModel,
    GemmaDecoderModel,
    ModelConfig,
    UnsupportedModelError,
    build_model,
    causal_attention,
    default_dtype,
    dense_causal_attend,
    load_model,
    load_reference,
    random_model,
    reference_config,
)
from sparse_framework.engine.models.rope import inverse_frequencies  # noqa: E402

VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# name -> (transformers config class, model class, extra config): each family's distinctive parts
FAMILIES = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10_000.0)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_theta=500_000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama_biases": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1_000_000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_theta=1_000_000.0)),  # head_dim != d/H
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # sliding windows (8) shorter than the 40-token sequence below; Gemma's own parts
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(sliding_window=8, use_sliding_window=True, max_window_layers=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",  # softcaps 50 / 30, alternating layers
               dict(head_dim=8, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=8, sliding_window=8, query_pre_attn_scalar=16, final_logit_softcapping=3.0,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                        "rope_theta": 1_000_000.0}})),
}


def hf_model(family: str, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # biases start at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path]]:
    """family -> (transformers model, its save_pretrained directory)."""
    out = {}
    for family in FAMILIES:
        model = hf_model(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path, safe_serialization=True)
        out[family] = (model, path)
    return out


def packed(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """token ids and positions of whole sequences packed back to back."""
    return torch.cat(list(seqs)), torch.cat([torch.arange(len(s)) for s in seqs])


def hf_logits(model, seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    """transformers' logits of each sequence run alone, rows concatenated."""
    with torch.no_grad():
        return torch.cat([model(s[None]).logits[0].float() for s in seqs])


def random_seqs(lens: Sequence[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lens]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_forward_equals_transformers_per_sequence(family: str, checkpoints) -> None:
    hf, path = checkpoints[family]
    ours = load_model(path)
    assert ours.config.architecture == FAMILIES[family][1]
    lens = [7, 40, 1]  # 40 > llama3's original context of 16: every rescaled band is used
    seqs = random_seqs(lens, seed=1)
    ids, pos = packed(seqs)
    got = ours(ids, pos, dense_causal_attend(lens, config=ours.config))  # its scale, softcap and windows
    want = hf_logits(hf, seqs)
    assert got.dtype == torch.float32 and got.shape == (sum(lens), VOCAB)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    last = torch.tensor([6, 46, 47])  # each sequence's last token
    attend = dense_causal_attend(lens, config=ours.config)
    torch.testing.assert_close(ours(ids, pos, attend, last), want[last], atol=1e-4, rtol=1e-4)


class CacheAttend:
    """Test-only decode cache: per sequence and layer, the K/V of every token seen so far; each
    step's tokens attend causally to their sequence's cache plus themselves."""

    def __init__(self, num_seqs: int) -> None:
        self.k: list[dict[int, torch.Tensor]] = [{} for _ in range(num_seqs)]
        self.v: list[dict[int, torch.Tensor]] = [{} for _ in range(num_seqs)]
        self.step_lens: list[int] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for s, n in enumerate(self.step_lens):
            rows = slice(start, start + n)
            kc = torch.cat([self.k[s].get(layer, k[:0]), k[rows]])
            vc = torch.cat([self.v[s].get(layer, v[:0]), v[rows]])
            self.k[s][layer], self.v[s][layer] = kc, vc
            out.append(causal_attention(q[rows], kc, vc, offset=kc.shape[0] - n).to(q.dtype))
            start += n
        return torch.cat(out)


@pytest.mark.parametrize("family", ["llama2", "llama3", "qwen3"])
def test_cached_decode_equals_full_forward(family: str, checkpoints) -> None:
    _, path = checkpoints[family]
    model = load_model(path)
    seqs = random_seqs([20, 33], seed=2)
    full = model(*packed(seqs), dense_causal_attend([20, 33]), torch.tensor([19, 52]))

    cache = CacheAttend(2)
    cache.step_lens = [19, 32]  # prefill all but the last token of each
    model(*packed([s[:-1] for s in seqs]), cache)
    cache.step_lens = [1, 1]  # then one decode token per sequence, packed, at positions 19 and 32
    step = model(torch.stack([s[-1] for s in seqs]), torch.tensor([19, 32]), cache)
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads_through_its_index(checkpoints, tmp_path: Path) -> None:
    hf, _ = checkpoints["llama3"]
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="8KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    seqs = random_seqs([5, 11], seed=3)
    got = load_model(tmp_path)(*packed(seqs), dense_causal_attend([5, 11]))
    torch.testing.assert_close(got, hf_logits(hf, seqs), atol=1e-4, rtol=1e-4)


def test_reference_model_equals_its_transformers_twin() -> None:
    from sparse_framework.toy_model.model import load_reference_model

    ours, theirs = load_reference(), load_reference_model()
    assert ours.config == reference_config() and ours.config.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    seqs = [torch.randint(0, ours.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (24, 9)]
    got = ours(*packed(seqs), dense_causal_attend([24, 9]))
    torch.testing.assert_close(got, hf_logits(theirs, seqs), atol=2e-4, rtol=1e-4)


def test_llama3_frequencies_equal_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = LLAMA3_ROPE | {"original_max_position_embeddings": 8192}  # Llama 3.1's own numbers
    hf_config = transformers.LlamaConfig(**TINY, rope_theta=500_000.0, rope_scaling=rope, head_dim=128)
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    ours = ModelConfig.from_hf(hf_config.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    got = inverse_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert scale == 1.0
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    plain = inverse_frequencies(128, 500_000.0)
    scaled, kept = got == plain / 8.0, got == plain
    assert scaled.any() and kept.any() and (~scaled & ~kept).any()  # all three bands occur


def test_old_style_rope_keys_are_read() -> None:
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, "rope_theta": 500000.0,
           "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}}}
    config = ModelConfig.from_hf(raw)
    assert config.rope_theta == 500000.0 and config.rope_scaling is not None
    assert config.rope_scaling.original_max_position_embeddings == 16


def test_config_facts_and_parameter_count(checkpoints) -> None:
    for family, (hf, path) in checkpoints.items():
        config = ModelConfig.from_hf(path)
        model = build_model(config)
        assert type(model) is (GemmaDecoderModel if family.startswith("gemma") else DecoderModel)
        assert config.num_parameters() == sum(p.numel() for p in model.parameters()) == hf.num_parameters()
        layout = config.kv_layout(torch.bfloat16)  # the store's layers: those not sliding at 256 tokens
        sliding = config.layer_types.count("sliding_attention")
        assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2 - sliding, 2, config.head_dim)
        assert config.qk_norm == (family in ("qwen3", "gemma3"))
        assert config.eos_token_ids == (() if hf.config.eos_token_id is None else (hf.config.eos_token_id,))


def test_dtype_and_device_defaults(checkpoints) -> None:
    _, path = checkpoints["qwen2"]
    assert default_dtype("cpu") == torch.float32 and default_dtype("cuda") == torch.bfloat16
    assert {p.dtype for p in load_model(path).parameters()} == {torch.float32}
    model = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.inv_freq.dtype == torch.float32  # never cast with the weights
    seqs = random_seqs([6, 3], seed=4)
    bf16 = model(*packed(seqs), dense_causal_attend([6, 3]))
    f32 = load_model(path)(*packed(seqs), dense_causal_attend([6, 3]))
    torch.testing.assert_close(bf16, f32, atol=0.1, rtol=0.05)  # the same model, bf16 rounding
    assert {p.dtype for p in load_model(path, dtype="float16").parameters()} == {torch.float16}
    with pytest.raises(ConfigError, match="dtype must be one of float32, bfloat16, float16"):
        load_model(path, dtype=torch.int8)


def test_random_model_is_seeded_and_tied() -> None:
    config = reference_config()
    a, b, c = random_model(config, seed=1), random_model(config, seed=1), random_model(config, seed=2)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name
    ids = torch.randint(0, config.vocab_size, (10,))
    logits = a(ids, torch.arange(10), dense_causal_attend([10]))
    assert torch.isfinite(logits).all() and logits.std() > 0


# errors: each one clear message naming what is wrong


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model directory not found: .*nowhere"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no config.json in"):
        load_model(tmp_path)


def test_unsupported_architecture_names_it_and_the_supported(tmp_path: Path) -> None:
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    supported = "'GPT2LMHeadModel' is not supported.*LlamaForCausalLM.*Qwen3ForCausalLM"
    with pytest.raises(UnsupportedModelError, match=supported):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         "rope_type 'yarn' is not supported; supported: default, llama3, linear"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "silu"},
         "hidden_act 'silu' is not supported for gemma2; its MLP uses 'gelu_pytorch_tanh'"),
        ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
         "use_bidirectional_attention is not supported"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]},
         "'Gemma3ForConditionalGeneration' is not supported.*Gemma3ForCausalLM"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 8,
          "layer_types": ["chunked_attention"] * TINY["num_hidden_layers"]},
         r"layer types \['chunked_attention'\] are not supported"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
         "per-layer-type RoPE settings .* are supported for Gemma 3 only"),
    ],
)
def test_unsupported_features_are_refused_by_name(change: dict, message: str) -> None:
    raw = {"architectures": ["LlamaForCausalLM"], **TINY} | change
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window must be a positive int"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 8, "layer_types": ["sliding_attention"]},
         "layer_types must be a list of 2 entries"),
        ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": -1.0},
         "attn_logit_softcapping must be a number > 0 or null"),
    ],
)
def test_bad_window_and_softcap_values_are_refused_by_name(change: dict, message: str) -> None:
    raw = {"architectures": ["LlamaForCausalLM"], **TINY} | change
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)


def test_layer_types_as_transformers_reads_them() -> None:
    """Mistral slides every layer; Qwen2 from max_window_layers on and only with
    use_sliding_window; Gemma 2 alternates (sliding first); Gemma 3 has one full layer per
    sliding_window_pattern; a window as long as the context never binds (routed full)."""
    n = TINY["num_hidden_layers"]
    S, F = "sliding_attention", "full_attention"
    mistral = ModelConfig.from_hf({"architectures": ["MistralForCausalLM"], **TINY, "sliding_window": 8})
    assert mistral.layer_types == (S,) * n and mistral.sliding_window == 8
    assert mistral.layer_map(64).sliding == tuple(range(n)) and mistral.kv_layout(torch.float32, "cpu", 64).num_layers == 0
    assert mistral.layer_map(8).full == tuple(range(n))  # window 8 >= context 8: never binds
    qwen = {"architectures": ["Qwen2ForCausalLM"], **TINY, "sliding_window": 8}
    assert ModelConfig.from_hf(qwen).layer_types == ()  # use_sliding_window unset: no window
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1}).layer_types == (F, S)
    gemma2 = ModelConfig.from_hf({"architectures": ["Gemma2ForCausalLM"], **TINY, "sliding_window": 8})
    assert gemma2.layer_types == (S, F) and gemma2.attn_logit_softcapping == 50.0  # transformers' defaults
    assert gemma2.final_logit_softcapping == 30.0 and gemma2.attention_scale == 256**-0.5
    gemma3 = ModelConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], **TINY, "sliding_window": 8,
                                  "sliding_window_pattern": 2, "rope_local_base_freq": 10.0})
    assert gemma3.layer_types == (S, F) and gemma3.local_rope_theta == 10.0 and gemma3.qk_norm


def test_windows_that_never_bind_are_accepted() -> None:
    base = {**TINY}
    assert ModelConfig.from_hf({"architectures": ["MistralForCausalLM"], **base, "sliding_window": 256})
    assert ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], **base, "sliding_window": 8})  # not used


def _copy_checkpoint(src: Path, dst: Path, edit) -> Path:
    """dst: src's config and its single safetensors file after `edit(state)`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_missing_misshapen_and_unexpected_tensors_are_named(checkpoints, tmp_path: Path) -> None:
    _, src = checkpoints["llama2"]
    name = "model.layers.1.self_attn.k_proj.weight"
    missing = _copy_checkpoint(src, tmp_path / "missing", lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match=f"lacks 1 tensor.*'{name}'"):
        load_model(missing)

    def reshape(s: dict) -> None:
        s[name] = torch.zeros(8, 32)

    misshapen = _copy_checkpoint(src, tmp_path / "misshapen", reshape)
    with pytest.raises(CheckpointError, match=rf"'{name}' in model.safetensors has shape \[8, 32\].* needs \[16, 32\]"):
        load_model(misshapen)

    def add_bias(s: dict) -> None:
        s["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)

    extra = _copy_checkpoint(src, tmp_path / "extra", add_bias)
    with pytest.raises(CheckpointError, match="does not use .*q_proj.bias"):
        load_model(extra)


def test_no_weights_names_what_was_found(checkpoints, tmp_path: Path) -> None:
    _, src = checkpoints["llama2"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights in .*pytorch_model.bin"):
        load_model(tmp_path)


def test_dense_causal_attend_checks_lengths() -> None:
    attend = dense_causal_attend([3, 2])
    q = torch.randn(4, 4, 8)
    with pytest.raises(ConfigError, match="4 tokens but seq_lens \\[3, 2\\] sum to 5"):
        attend(0, q, q[:, :2], q[:, :2])


def test_forward_wants_packed_tokens() -> None:
    model = random_model(reference_config())
    with pytest.raises(ValueError, match=r"both be \[T\] \(packed, no batch dim\); got \(1, 4\) and \(1, 4\)"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), dense_causal_attend([4]))
