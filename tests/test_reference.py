"""The reference model's tasks (invariants on random draws) and the shipped weights."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sparse_framework.toy_model.tasks import (
    BOS, FILLER, KEYS, QUERY, TASKS, VALUES, TaskConfig, draw,
)

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@st.composite
def task_configs(draw_: st.DrawFn) -> TaskConfig:
    passkey_len = draw_(st.integers(2, 8))
    passkeys = draw_(st.integers(0, 4))
    pairs = draw_(st.integers(0 if passkeys else 1, 24))
    queries = draw_(st.integers(1, pairs + passkeys))
    need = 2 + pairs * 2 + passkeys * (1 + passkey_len) + queries * (1 + passkey_len) + 1
    context = draw_(st.integers(max(64, need), max(64, need) + 300))
    return TaskConfig(context=context, pairs=pairs, passkeys=passkeys, passkey_len=passkey_len, queries=queries)


@settings(max_examples=60, deadline=None)
@given(task_configs(), st.integers(0, 2**31 - 1))
def test_a_drawn_sequence_asks_for_facts_that_are_in_its_haystack(cfg: TaskConfig, seed: int) -> None:
    s = draw(cfg, torch.Generator().manual_seed(seed))
    tokens = s.tokens
    assert tokens.shape == (cfg.context,)
    assert tokens[0] == BOS and tokens[s.prompt_len - 1] == QUERY
    haystack = tokens[1 : s.prompt_len - 1]
    assert ((haystack >= FILLER[0]) & (haystack < VALUES[1])).all()
    # every key and value token occurs at most once in the haystack: answers are unambiguous
    facts = haystack[haystack >= KEYS[0]]
    assert facts.unique().numel() == facts.numel() == cfg.pairs * 2 + cfg.passkeys * (1 + cfg.passkey_len)
    assert len(s.needles) == cfg.queries
    pos = s.prompt_len
    for q, needle in enumerate(s.needles):
        fact = tokens[needle]
        n = len(fact)
        assert KEYS[0] <= fact[0] < KEYS[1] and ((fact[1:] >= VALUES[0]) & (fact[1:] < VALUES[1])).all()
        assert torch.equal(tokens[pos : pos + n], fact)  # the query repeats the fact
        assert torch.equal(s.targets[pos : pos + n - 1], fact[1:])  # and scores its value tokens
        assert (s.query_of[pos : pos + n - 1] == q).all()
        pos += n
    assert pos == cfg.context
    assert (s.targets[: s.prompt_len] == -1).all()
    # passkeys are asked first
    assert sum(len(n) > 2 for n in s.needles) == min(cfg.queries, cfg.passkeys)


def test_draws_are_determined_by_the_generator_seed() -> None:
    cfg = TaskConfig(context=512, **TASKS["passkey"])
    a, b = (draw(cfg, torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, draw(cfg, torch.Generator().manual_seed(8)).tokens)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pairs": 0, "passkeys": 0}, "at least one fact"),
        ({"pairs": 4, "queries": 5}, "queries"),
        ({"context": 64, "pairs": 40, "queries": 4}, "too short"),
        ({"pairs": 150, "passkeys": 10, "passkey_len": 8}, "distinct value tokens"),
    ],
)
def test_impossible_tasks_are_refused_with_the_reason(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TaskConfig(**fields)


def test_shipped_weights_are_small_and_the_model_is_a_llama_with_gqa_and_rope() -> None:
    from sparse_framework.toy_model.model import WEIGHTS, load_reference_model, weights_metadata

    assert WEIGHTS.stat().st_size <= 10 * 2**20
    model = load_reference_model()
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) <= 5_000_000
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    record = weights_metadata()
    assert record["parameters"] == sum(p.numel() for p in model.parameters())
    assert record["train_seconds"] <= 600


@pytest.mark.parametrize("task", [t if t == "passkey" else pytest.param(t, marks=pytest.mark.slow) for t in sorted(TASKS)])
def test_the_shipped_model_solves_held_out_retrieval_at_2k_densely(task: str) -> None:
    """Teacher-forced dense accuracy (what dense decode computes) on fresh sequences."""
    from sparse_framework.toy_model.model import load_reference_model

    model = load_reference_model()
    cfg = TaskConfig(context=2048, **TASKS[task])
    gen = torch.Generator().manual_seed(12345)
    right = total = 0
    with torch.no_grad():
        for _ in range(3):
            s = draw(cfg, gen)
            pred = model(input_ids=s.tokens[None]).logits[0].argmax(-1)
            mask = s.targets >= 0
            right += int((pred[mask] == s.targets[mask]).sum())
            total += int(mask.sum())
    assert right / total >= 0.95


def test_missing_weights_are_a_clear_error(tmp_path) -> None:
    from sparse_framework.common.errors import SparseFrameworkError
    from sparse_framework.toy_model.model import load_reference_model

    with pytest.raises(SparseFrameworkError, match="train_reference.py"):
        load_reference_model(path=tmp_path / "none.safetensors")
