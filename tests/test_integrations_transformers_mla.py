"""The transformers integration on tiny random MLA + DSA models (DeepSeek-V3.2, GLM-MoE-DSA;
2 layers, MoE of 4 experts, CPU): with `index_topk` below the context our sparse decode equals
the model's own indexer-masked attention (tokens, logits, the selected tokens), at a full
budget it equals dense, and the errors. The reference is the unmodified model (sdpa), which
applies its indexer's top-k as a mask at prefill and decode.

16 indexer heads: with few heads a token's index score is exactly 0 (every head's ReLU
zero) often enough that the k-th place is a tie, which the model's torch.topk and DSA break
differently."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tf = pytest.importorskip("sparse_framework.integrations.transformers")
tm = pytest.importorskip("sparse_framework.integrations.transformers.mla")
from sparse_framework.common.errors import ConfigError  # noqa: E402

# find_spec, not hasattr(transformers, ...): importing a model module here, at collection, makes
# transformers' lazy module replace itself in sys.modules, so that test files collected later
# would hold another `transformers` object than the integration (their monkeypatches missing it)
HAS_V32 = importlib.util.find_spec("transformers.models.deepseek_v32") is not None
needs_v32 = pytest.mark.skipif(not HAS_V32, reason=f"transformers {transformers.__version__} has no DeepseekV32 "
                               f"(needs >= {tm.MIN_MLA_TRANSFORMERS})")

VOCAB = 96
TOPK = 8
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, index_topk=TOPK, index_head_dim=128, index_n_heads=16,
            first_k_dense_replace=1, max_position_embeddings=256)
MAX_LEN = 64


def dsa(key_dtype: str, top_k: int = TOPK) -> dict:
    """DSA as the model's indexer selects: exactly min(top_k, length), the newest token scored."""
    return {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": top_k, "page_size": 1, "sink_tokens": 0, "recent_tokens": 0,
            "min_sparse_prompt_len": 0, "device_buffer_tokens": 2 * MAX_LEN,
            "extra": {"index_heads": 16, "index_dim": 128, "key_dtype": key_dtype, "score_newest": True}}


def build(kind: str = "v32", dtype: torch.dtype = torch.float32, seed: int = 0, **kw):
    if kind == "v32":
        from transformers.models.deepseek_v32 import DeepseekV32Config as config, DeepseekV32ForCausalLM as cls
    else:
        from transformers.models.glm_moe_dsa import GlmMoeDsaConfig as config, GlmMoeDsaForCausalLM as cls
    torch.manual_seed(seed)
    model = cls(config(**{**TINY, **kw})).eval().to(dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, 24 and 17 tokens (the second left-padded): both longer than index_topk."""
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :7], mask[1, :7] = 0, 0
    return ids, mask


def greedy(model, ids, mask, new: int = 10):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1).float()


def model_selections(model, ids, mask):
    """The model's own greedy run, with its indexer's top-k of each decode step and layer."""
    seen: list[torch.Tensor] = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, a, out: seen.append(out.clone()))
             for layer in model.model.layers]
    try:
        seq, logits = greedy(model, ids, mask)
    finally:
        for h in hooks:
            h.remove()
    return seq, logits, [s for s in seen if s.shape[1] == 1]  # decode steps: one query per row


def our_run(model, ids, mask, config):
    """Our sparse greedy run, with the selection of each decode step and layer (logical
    positions without the padding)."""
    seen: list[torch.Tensor] = []
    with tf.sparse(model, config, max_requests=2, max_seq_len=MAX_LEN) as handle:
        handle.observer = lambda e: seen.append(e.selection.indices.clone()) if e.selection is not None else None
        seq, logits = greedy(model, ids, mask)
        stats = handle.stats()
    return seq, logits, seen, stats


def same_tokens_selected(model_sel: list[torch.Tensor], ours: list[torch.Tensor], pads: list[int]) -> None:
    assert len(model_sel) == len(ours) > 0
    for theirs, mine in zip(model_sel, ours):
        for row, pad in enumerate(pads):
            expect = sorted(i - pad for i in theirs[row, 0].tolist())
            got = [i for i in mine[row, 0].tolist() if i >= 0]
            assert got == expect


@needs_v32
@pytest.mark.parametrize("dtype, key_dtype, atol", [
    (torch.bfloat16, "bfloat16", 1e-2),  # the released checkpoints' dtype: keys as the model has them
    (torch.float32, "float32", 1e-5),
])
def test_sparse_decode_equals_the_models_own_dsa(dtype, key_dtype, atol) -> None:
    """index_topk 8 of 17-34 tokens: the same tokens selected at every step and layer, the same
    greedy tokens, logits within the dtype's rounding (bf16: ~2 ulps at |logit| ~0.6; the
    absorbed attention rounds differently from the model's expanded one)."""
    model = build(dtype=dtype)
    ids, mask = batch(seed=1)
    ref_seq, ref_logits, ref_sel = model_selections(model, ids, mask)
    seq, logits, sel, stats = our_run(model, ids, mask, dsa(key_dtype))
    assert torch.equal(seq, ref_seq)
    assert torch.allclose(logits, ref_logits, atol=atol, rtol=0)
    same_tokens_selected(ref_sel, sel, pads=[0, 7])
    assert stats["decode_steps"] == 9 and stats["layer_steps"] == 18
    assert stats["read_fraction"] < 0.5  # 8 tokens of 24-33 (row 0) and 17-26 (row 1)


@needs_v32
def test_glm_moe_dsa_same_attention() -> None:
    """GLM-MoE-DSA: the same MLA and indexer (its indexer's RoPE interleaved), every layer with
    its own indexer: the same equality."""
    model = build("glm", dtype=torch.float32, seed=2)
    ids, mask = batch(seed=2)
    ref_seq, ref_logits, ref_sel = model_selections(model, ids, mask)
    seq, logits, sel, _ = our_run(model, ids, mask, dsa("float32"))
    assert torch.equal(seq, ref_seq)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
    same_tokens_selected(ref_sel, sel, pads=[0, 7])


@needs_v32
def test_full_budget_equals_dense() -> None:
    """index_topk >= every context: the model attends densely; so do we (every token selected)."""
    model = build(dtype=torch.float32, index_topk=MAX_LEN)
    ids, mask = batch(seed=3)
    ref_seq, ref_logits = greedy(model, ids, mask)
    seq, logits, sel, stats = our_run(model, ids, mask, dsa("bfloat16", top_k=MAX_LEN))
    assert torch.equal(seq, ref_seq)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
    assert stats["read_fraction"] == 1.0


@needs_v32
def test_fp8_keys_change_the_selection_measured() -> None:
    """V3.2's original FP8 indexer keys (and queries) against the model's bf16 scoring: the
    selections differ at some steps, and the logits with them. Prints the measure."""
    model = build(dtype=torch.bfloat16)
    ids, mask = batch(seed=1)
    ref_seq, ref_logits, ref_sel = model_selections(model, ids, mask)
    seq, logits, sel, _ = our_run(model, ids, mask, dsa("fp8_e4m3"))
    differ = sum(
        sorted(i - pad for i in theirs[row, 0].tolist()) != [i for i in mine[row, 0].tolist() if i >= 0]
        for theirs, mine in zip(ref_sel, sel) for row, pad in enumerate([0, 7])
    )
    diff = (logits - ref_logits).abs().max().item()
    print(f"fp8 keys: {differ} of {2 * len(sel)} selections differ, max logit difference {diff:.3f} "
          f"(|logits| up to {ref_logits.abs().max().item():.3f})")
    assert torch.isfinite(logits).all()
    # the first decode step's selections (identical hidden states) overlap the model's mostly
    first = [set(ref_sel[0][r, 0].tolist()) for r in range(2)]
    overlap = [len(first[r] & {i + pad for i in sel[0][r, 0].tolist() if i >= 0}) for r, pad in enumerate([0, 7])]
    assert min(overlap) >= TOPK // 2


@needs_v32
def test_indexer_outputs_reproduce_the_models_indexer() -> None:
    """Our copy of the indexer's projections and RoPE gives the model's own top-k (both models)."""
    for kind in ("v32", "glm"):
        model = build(kind, dtype=torch.float32, seed=4)
        att = model.model.layers[1].self_attn
        hidden = torch.randn(1, 20, TINY["hidden_size"], generator=torch.Generator().manual_seed(5))
        q_resid = att.q_a_layernorm(att.q_a_proj(hidden))
        pe = model.model.rotary_emb(hidden, torch.arange(20).unsqueeze(0))
        causal = torch.ones(20, 20, dtype=torch.bool).tril().unsqueeze(0)
        theirs = att.indexer(hidden, q_resid, pe, causal, None)  # [1, 20, topk]
        q, w, k = tm.indexer_outputs(att.indexer, hidden, q_resid, pe)
        scores = (torch.einsum("bshd,btd->bsht", q.float(), k.float()).relu() * w.unsqueeze(-1)).sum(2)
        ours = scores.masked_fill(~causal, float("-inf")).topk(TOPK, dim=-1).indices
        assert torch.equal(ours.sort(-1).values, theirs.long().sort(-1).values)


@needs_v32
def test_forwards_without_a_sparse_cache_and_disable() -> None:
    """model(ids) while enabled runs the model's own sparse attention (the indexer's top-k folded
    into the mask), and disable puts the indexers back."""
    model = build(dtype=torch.float32, seed=6)
    ids = torch.randint(1, VOCAB, (1, 30), generator=torch.Generator().manual_seed(7))
    before = model(ids).logits
    with tf.sparse(model, dsa("float32"), max_requests=1, max_seq_len=MAX_LEN) as handle:
        assert isinstance(handle, tm.MLAHandle)
        assert torch.allclose(model(ids).logits, before, atol=1e-5, rtol=0)
        assert "forward" in vars(model.model.layers[0].self_attn.indexer)
    assert "forward" not in vars(model.model.layers[0].self_attn.indexer)
    assert model.config._attn_implementation == "sdpa"


def test_older_transformers_get_a_clear_error() -> None:
    with pytest.raises(ImportError, match=r"transformers >= 5\.24, found 4\.56\.2"):
        tm.check_mla_transformers_version("4.56.2")
    tm.check_mla_transformers_version("5.24.0")


@needs_v32
def test_errors_are_clear() -> None:
    model = build(dtype=torch.float32)
    with pytest.raises(ConfigError, match="extra.index_heads = 16"):
        tf.enable(model, {**dsa("bfloat16"), "extra": {"index_heads": 64, "index_dim": 128}})
    glm = build("glm", index_topk_freq=2, index_skip_topk_offset=1)
    with pytest.raises(tf.UnsupportedModelError, match="indexer_types 'shared'"):
        tf.enable(glm, dsa("bfloat16"))
    from transformers.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

    v3 = DeepseekV3ForCausalLM(DeepseekV3Config(
        **{k: v for k, v in TINY.items() if not k.startswith("index_")}))
    with pytest.raises(tf.UnsupportedModelError, match="MLA without DSA's lightning indexer"):
        tf.enable(v3, dsa("bfloat16"))
    assert model.config._attn_implementation == "sdpa"


FRESH = """
import sys, torch
import sparse_framework.integrations.transformers as tf
from transformers.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM

MLA = "sparse_framework.integrations.transformers.mla"
assert MLA not in sys.modules, "importing the integration imported its MLA module"
torch.manual_seed(0)
model = DeepseekV32ForCausalLM(DeepseekV32Config(**TINY)).eval()
model.generation_config.pad_token_id = 0
model.generation_config.eos_token_id = None
ids = torch.randint(1, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
own = model.generate(ids, max_new_tokens=3, do_sample=False)
with tf.sparse(model, CONFIG, max_requests=1, max_seq_len=MAX_LEN) as handle:
    assert type(handle).__name__ == "MLAHandle" and MLA in sys.modules
    ours = model.generate(ids, max_new_tokens=3, do_sample=False)
assert handle.stats()["decode_steps"] == 2 and handle.stats()["read_fraction"] < 1
assert torch.equal(ours, own), (ours, own)
print("mla enabled fresh")
"""


@pytest.mark.slow
@needs_v32
def test_mla_models_enable_in_a_fresh_interpreter_that_never_imported_the_mla_module() -> None:
    """`enable` imports the MLA module itself when it meets an MLA config: a fresh Python that
    imports only the integration package (which does not import the MLA module) enables a tiny
    DeepSeek-V3.2, decodes sparsely (index_topk 8 of 20-22 tokens) and equals the model's own
    generate."""
    script = (FRESH.replace("TINY", repr(TINY)).replace("CONFIG", repr(dsa("float32")))
              .replace("VOCAB", str(VOCAB)).replace("MAX_LEN", str(MAX_LEN)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "mla enabled fresh" in done.stdout


def test_topk_with_the_newest_scored_equals_plain_topk() -> None:
    """`newest_scored`: the newest token is an ordinary candidate (the model's indexer rule),
    so the selection is torch.topk over every token, the newest left out when it scores low."""
    from sparse_framework.algorithms.base import topk_selection

    scores = torch.randn(3, 1, 20, generator=torch.Generator().manual_seed(8))
    lens = torch.tensor([20, 13, 5])
    scores[0, 0, 19] = -100.0  # row 0: the newest scores lowest
    sel = topk_selection(scores, lens, unit=1, budget_units=6, sink_tokens=0, recent_tokens=0, width_units=20,
                         newest_forced=False, newest_scored=True)
    for row, n in enumerate(lens.tolist()):
        expect = sorted(scores[row, 0, :n].topk(min(6, n)).indices.tolist())
        assert [i for i in sel.indices[row, 0].tolist() if i >= 0] == expect
    assert 19 not in sel.indices[0, 0].tolist()
