"""The cost policy through the engine (greedy, a tiny random Llama on the CPU): with the resident
store the tokens equal a dense run's until the context crosses the break-even, then the steps
go sparse; the hierarchical store decides once, at admission, and sends a request it could not
keep dense to the host tier; "always" gives today's tokens and counts; /metrics counts what the
policy made dense."""

from __future__ import annotations

import torch

from sparse_framework.coordinator.dense_tally import COST_POLICY, SHORT_PROMPT
from sparse_framework.engine.llm import LLM
from sparse_framework.engine.models import ModelConfig, random_model
from sparse_framework.engine.sampling import SamplingParams
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

VOCAB = 96
CONFIG = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32,
                              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "max_position_embeddings": 256})
LAYERS = 2
BASE = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 8, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
        "device_buffer_tokens": 48, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
# no fixed overhead: sparse pays from S·P / (P − r) = 28 · 128 / 96 tokens on, whatever the batch
COST = {**BASE, "sparse_policy": "cost", "policy_overhead_us": 0.0, "policy_overhead_growth_us": 0.0}
DENSE = {**BASE, "min_sparse_prompt_len": 10**9}
BREAK_EVEN = 38


def llm(config: dict, store: str, **options) -> LLM:  # type: ignore[no-untyped-def]
    return LLM.from_model(random_model(CONFIG, torch.float32, "cpu", seed=0), {**config, "store": store},
                          **{"max_num_seqs": 3, "max_model_len": 128, "max_num_batched_tokens": 64, **options})


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def generate(model: LLM, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = model.generate(batch, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    assert all(o.finish_reason == "length" for o in outs), [(o.request_id, o.error) for o in outs]
    return [o.token_ids for o in outs]


def test_the_break_even_of_this_model() -> None:
    model = llm(COST, "resident")
    assert model.engine.runner.coord.policy.model.break_even(1) == BREAK_EVEN


def test_resident_tokens_equal_a_dense_run_until_the_switch() -> None:
    prompt, max_tokens = BREAK_EVEN - 6, 14
    batch = prompts([prompt])
    cost = llm(COST, "resident")
    got = generate(cost, batch, max_tokens)[0]
    dense = generate(llm(DENSE, "resident"), batch, max_tokens)[0]
    # token 0 comes from the prefill; decode step i feeds token i - 1 at context prompt + i and
    # attends densely while that is below the break-even: tokens 0..5 are a dense run's
    equal = BREAK_EVEN - prompt
    assert got[:equal] == dense[:equal]
    report = cost.engine.runner.coord.dense_report()
    dense_steps = BREAK_EVEN - prompt - 1  # steps 1..5
    assert report["dense_layer_steps"] == {COST_POLICY: dense_steps * LAYERS}
    assert report["sparse_layer_steps"] == (max_tokens - 1 - dense_steps) * LAYERS  # then sparse
    assert report["dense_requests"] == {}


def test_hierarchical_decides_once_at_admission() -> None:
    below, above = BREAK_EVEN - 6, BREAK_EVEN + 2
    batch = prompts([below, above], seed=1)
    cost = llm(COST, "hierarchical")
    got = generate(cost, batch, 14)
    dense = generate(llm(DENSE, "hierarchical"), batch, 14)
    sparse = generate(llm(BASE, "hierarchical"), batch, 14)
    # the short one stays dense although its context crosses the break-even; the long one is
    # sparse from its first step: each as the run of that mode
    assert got == [dense[0], sparse[1]]
    report = cost.engine.runner.coord.dense_report()
    assert report["dense_requests"] == {COST_POLICY: 1}
    assert report["dense_layer_steps"] == {COST_POLICY: 13 * LAYERS}
    assert cost.engine.runner.coord.store.used_tokens() == 0


def test_a_request_that_could_not_be_kept_dense_goes_to_the_host_tier() -> None:
    # one row: the sparse layers' pool holds 48 tokens; a 32-token prompt the policy would keep
    # dense, with 30 tokens to come, could never fit it whole: the budget sends it sparse
    batch = prompts([BREAK_EVEN - 6], seed=2)
    cost = llm(COST, "hierarchical", max_num_seqs=1)
    got = generate(cost, batch, 30)
    assert got == generate(llm(BASE, "hierarchical", max_num_seqs=1), batch, 30)
    assert cost.engine.runner.coord.dense_report()["dense_requests"] == {}
    # with room for its whole life it is kept dense
    short = llm(COST, "hierarchical", max_num_seqs=1)
    assert generate(short, batch, 10) == generate(llm(DENSE, "hierarchical", max_num_seqs=1), batch, 10)
    assert short.engine.runner.coord.dense_report()["dense_requests"] == {COST_POLICY: 1}


def test_always_gives_todays_tokens_and_counts() -> None:
    # the static rule (min_sparse_prompt_len 40: the 20-token prompt dense), whatever the
    # constants: the same tokens and the same report as a config without the field
    today = {**BASE, "min_sparse_prompt_len": 40}
    always = {**today, "sparse_policy": "always", "policy_overhead_us": 1e9, "policy_hbm_tb_s": 0.001}
    batch = prompts([20, 60], seed=3)
    for store in ("resident", "hierarchical"):
        a, b = llm(today, store), llm(always, store)
        assert generate(a, batch, 12) == generate(b, batch, 12)
        ra, rb = a.engine.runner.coord.dense_report(), b.engine.runner.coord.dense_report()
        assert ra == rb and ra["dense_requests"] == {SHORT_PROMPT: 1} and COST_POLICY not in ra["dense_layer_steps"]


def test_metrics_count_what_the_cost_policy_made_dense() -> None:
    from sparse_framework.serve.loop import EngineLoop
    from sparse_framework.serve.metrics import ServerMetrics

    cost = llm(COST, "resident")
    generate(cost, prompts([BREAK_EVEN - 6]), 14)
    metrics = ServerMetrics("tiny")
    metrics.attach(EngineLoop(cost.engine))  # not started: a scrape reads the counts as they stand
    text = metrics.render().decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines['sparse_framework_cost_policy_dense_layer_steps_total{model="tiny"}']) == 5 * LAYERS
    assert float(lines['sparse_framework_cost_policy_dense_requests_total{model="tiny"}']) == 0
    assert float(lines['sparse_framework_decode_layer_steps_total{model="tiny"}']) == 13 * LAYERS
