"""ModelRunner: chunked prefill through the staging and decode rows through the coordinator,
in mixed steps, against the model's plain full forward (every token attended, float32)."""

from __future__ import annotations

import pytest
import torch

from sparse_framework import ConfigError
from sparse_framework.engine.models import ModelConfig, dense_causal_attend, random_model
from sparse_framework.engine.runner import DecodeRow, ModelRunner, PrefillChunk
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

CONFIG = ModelConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
})
# a budget covering every context: sparse decode must equal dense attention
FULL = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 256, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
        "device_buffer_tokens": 512, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}


def make_runner(config: dict, **kw) -> tuple[ModelRunner, object]:
    model = random_model(CONFIG, dtype=torch.float32, seed=0)
    runner = ModelRunner(model, CONFIG.kv_layout(torch.float32), config, num_q_heads=CONFIG.num_heads,
                         **{"max_num_seqs": 4, "max_model_len": 128, "staging_tokens": 256, **kw})
    return runner, model


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """The last token's logits of a plain full forward over the whole sequence."""
    ids = torch.tensor(tokens)
    return model(ids, torch.arange(len(tokens)), dense_causal_attend([len(tokens)]), torch.tensor([len(tokens) - 1]))[0]


@pytest.mark.parametrize("config", [FULL, {**FULL, "algorithm": "snapkv", "top_k": 256, "extra": {"window": 4}},
                                    {**FULL, "min_sparse_prompt_len": 1000}])  # sparse, SnapKV, dense mode
def test_chunked_prefill_and_mixed_steps_equal_a_full_forward(config) -> None:
    runner, model = make_runner(config)
    g = torch.Generator().manual_seed(1)
    prompts = {"a": torch.randint(0, 97, (23,), generator=g).tolist(), "b": torch.randint(0, 97, (9,), generator=g).tolist()}
    seqs = {rid: list(p) for rid, p in prompts.items()}
    assert runner.admit("a", 23) and runner.admit("b", 9)
    # step 1: a's first chunk and all of b; step 2: a's second chunk with b decoding; then both decode
    steps = [
        ([], [PrefillChunk("a", tuple(prompts["a"][:10]), 0, False), PrefillChunk("b", tuple(prompts["b"]), 0, True)]),
        (["b"], [PrefillChunk("a", tuple(prompts["a"][10:]), 10, True)]),
        (["a", "b"], []), (["a", "b"], []), (["b", "a"], []),
    ]
    for decoding, chunks in steps:
        rows = [DecodeRow(rid, seqs[rid][-1]) for rid in decoding]
        logits = runner.execute(rows, chunks)
        sampled = decoding + [c.rid for c in chunks if c.last]
        assert logits.shape == (len(sampled), 97)
        for i, rid in enumerate(sampled):
            torch.testing.assert_close(logits[i], full_logits(model, seqs[rid]), atol=2e-4, rtol=1e-4)
            seqs[rid].append(int(logits[i].argmax()))
    assert runner.seq_len("a") == len(seqs["a"]) - 1 and runner.seq_len("b") == len(seqs["b"]) - 1
    assert not runner.staging.spans  # released when each prompt was handed over
    for rid in ("a", "b"):
        runner.free(rid)
    assert runner.coord.store.used_tokens() == 0 and runner.staging.free_tokens == 256


def test_sparse_budget_reads_less_and_stays_close() -> None:
    """At a small budget the decode rows go through a real selection (fewer tokens read)."""
    runner, model = make_runner({**FULL, "top_k": 8, "device_buffer_tokens": 64})
    tokens = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    assert runner.admit("a", 100)
    logits = runner.execute([], [PrefillChunk("a", tuple(tokens[:64]), 0, False)])
    assert logits.shape == (0, 97)
    logits = runner.execute([], [PrefillChunk("a", tuple(tokens[64:]), 64, True)])
    tokens.append(int(logits[0].argmax()))
    out = runner.execute([DecodeRow("a", tokens[-1])], [])
    selection = runner.coord.store.stats()[1]
    assert selection["hits"] + selection["misses"] < 100  # tokens attended in layer 1: fewer than the context
    assert torch.isfinite(out).all()


def test_admission_is_all_or_nothing_and_refusals_are_clear() -> None:
    runner, _ = make_runner(FULL, staging_tokens=30)
    assert runner.admit("a", 20) and not runner.admit("b", 20)  # the staging is full: nothing reserved for b
    assert "b" not in runner.requests and len(runner.coord.requests) == 1
    with pytest.raises(ValueError, match="an empty step"):
        runner.execute([], [])
    with pytest.raises(ConfigError, match="needs model inputs"):
        make_runner({"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": 64, "device_buffer_tokens": 256})


def test_snapkv_votes_from_chunked_prefill_equal_those_of_the_whole_prompt() -> None:
    """The chunks keep the prompt's last `window` queries for SnapKV's build: its votes equal
    those computed from the whole prompt's queries and keys of a plain forward."""
    from sparse_framework.algorithms.snapkv import snapkv_votes

    config = {**FULL, "algorithm": "snapkv", "top_k": 8, "device_buffer_tokens": 64, "extra": {"window": 6}}
    runner, model = make_runner(config)
    tokens = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    assert runner.admit("a", 30)
    for start, stop in ((0, 13), (13, 26), (26, 30)):  # the window straddles the last two chunks
        runner.execute([], [PrefillChunk("a", tuple(tokens[start:stop]), start, stop == 30)])
    seen = {}
    reference = dense_causal_attend([30])

    def capture(layer, q, k, v):
        seen[layer] = (q.clone(), k.clone())
        return reference(layer, q, k, v)

    model(torch.tensor(tokens), torch.arange(30), capture, torch.tensor([29]))
    algo, slot = runner.coord.algorithm, runner.requests["a"].slot
    for layer, (q, k) in seen.items():
        want = snapkv_votes(k, q, algo.options)
        torch.testing.assert_close(algo.votes[layer, slot, :, : want.shape[-1]], want, atol=1e-5, rtol=1e-5)
