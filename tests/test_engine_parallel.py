"""Tensor parallelism (engine/parallel.py, engine/models/tensor_parallel.py) on the CPU: two
ranks over gloo, each with its shard of a tiny random Llama, against one unsplit engine.

The two ranks run in one `parallel.spawn` for the whole module (a process start costs
seconds on this machine); each scenario's outputs come back per rank and each test compares
them with a TP=1 engine run here over the same random weights. Greedy decoding: a sum split
over two ranks rounds differently from one matmul (float32, ~1e-7), which the greedy tokens
of these tiny models do not feel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from sparse_framework.common.errors import ConfigError
from sparse_framework.engine import parallel
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import ModelConfig, random_model
from sparse_framework.engine.models.tensor_parallel import TPShard, local_config, take_shard
from sparse_framework.engine.sampling import SamplingParams
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

VOCAB = 96
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
CONFIG = ModelConfig.from_hf(TINY)
# q/k/v and o_proj biases and an MLP bias: the row-parallel biases are held by rank 0 only
BIASED = ModelConfig.from_hf({**TINY, "attention_bias": True, "mlp_bias": True})

QUEST = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 256, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
         "device_buffer_tokens": 512, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
DENSE = {**QUEST, "min_sparse_prompt_len": 10**6}  # every request in the algorithm's dense mode
SPARSE = {**QUEST, "top_k": 8, "device_buffer_tokens": 48}  # a binding budget: 8 of 40-60 tokens
DSA_KEYS = {**HIERARCHICAL_ALWAYS, "algorithm": "dsa", "top_k": 8, "page_size": 4, "sink_tokens": 4, "recent_tokens": 4,
            "device_buffer_tokens": 48, "min_sparse_prompt_len": 0, "extra": {"source": "keys"}}
GREEDY = {"max_tokens": 10, "temperature": 0.0}


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


# name -> (model config, sparse config, EngineConfig arguments, prompt lengths, sampling arguments per request)
SCENARIOS: dict[str, tuple[ModelConfig, dict, dict, list[int], list[dict]]] = {
    "dense": (CONFIG, DENSE, {"max_num_batched_tokens": 16}, [37, 5, 60], [GREEDY] * 3),
    "dense_biased": (BIASED, DENSE, {}, [23, 41], [GREEDY] * 2),
    "sparse": (CONFIG, SPARSE, {"max_num_batched_tokens": 16}, [37, 5, 60], [GREEDY] * 3),
    "dsa_keys": (CONFIG, DSA_KEYS, {}, [40, 52], [GREEDY] * 2),
    # a device pool too small for all three to grow to their end: preempted (to the host) and resumed
    "preempt": (CONFIG, {**SPARSE, "min_sparse_prompt_len": 1000},
                {"device_capacity_tokens": 160, "max_num_batched_tokens": 32, "max_prefill_chunk": 16},
                [40, 44, 48], [{"max_tokens": 30, "temperature": 0.0}] * 3),
    # sampled on rank 0 from the request's own seed, the tokens shared with rank 1
    "seeded": (CONFIG, SPARSE, {}, [30, 33], [{"max_tokens": 8, "temperature": 0.8, "top_k": 20, "seed": 7},
                                             {"max_tokens": 8, "temperature": 1.0, "seed": 11}]),
    # async scheduling (opt-in with TP): rank 0's tokens broadcast as tensors, plans checked on the host
    "async_sparse": (CONFIG, SPARSE, {"max_num_batched_tokens": 16, "async_scheduling": True}, [37, 5, 60],
                     [GREEDY] * 3),
    "async_preempt": (CONFIG, {**SPARSE, "min_sparse_prompt_len": 1000},
                      {"device_capacity_tokens": 160, "max_num_batched_tokens": 32, "max_prefill_chunk": 16,
                       "async_scheduling": True}, [40, 44, 48], [{"max_tokens": 30, "temperature": 0.0}] * 3),
    # stop tokens seen one step late: the rows decoded past them are dropped on every rank alike
    "async_seeded_stops": (CONFIG, SPARSE, {"async_scheduling": True}, [30, 33, 26],
                           [{"max_tokens": 12, "temperature": 1.0, "seed": 5, "stop_token_ids": list(range(0, VOCAB, 4))},
                            {"max_tokens": 12, "temperature": 0.0, "stop_token_ids": list(range(1, VOCAB, 5))},
                            {"max_tokens": 12, "temperature": 0.7, "seed": 9}]),
    # prompts sharing a 36-token prefix, two running at a time: later ones hit the prefix cache,
    # and each rank's cache (its own KV heads' pages) must decide alike
    "prefix_cache": (CONFIG, SPARSE, {"max_num_seqs": 2, "enable_prefix_caching": True}, [5, 9, 3, 12],
                     [GREEDY] * 4),
    "prefix_cache_async": (CONFIG, {**SPARSE, "min_sparse_prompt_len": 1000},
                           {"max_num_seqs": 2, "enable_prefix_caching": True, "async_scheduling": True},
                           [5, 9, 3, 12], [GREEDY] * 4),
}


def _model(config: ModelConfig, shard: TPShard | None = None, device: Any = "cpu") -> Any:
    """random_model's weights x 10 (std 0.2): at its std 0.02 a tiny model's logits hardly
    depend on its layers (the embedding dominates the residual), so a broken all-reduce could
    pass; scaled, every layer moves the greedy tokens. Scaling the shards scales the whole.
    (benchmarks/tp_equality.py builds its GPU models here too.)"""
    model = random_model(config, torch.float32, device, seed=3, tp=shard)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(10.0)
    return model


def _run(model: Any, name: str, tp: int, sparse: dict | None = None, model_config: ModelConfig | None = None,
         **change: Any) -> tuple[dict[str, tuple[list[int], str]], tuple[int, int]]:
    """Scenario `name` (its sparse config replaced by `sparse` if given, its model config by
    `model_config`, EngineConfig arguments by `change`): tokens and finish reason per request,
    and (preemptions, prefix-cache hit tokens). A "prefix_cache" scenario's prompts share a
    36-token prefix."""
    config, own, options, lens, params = SCENARIOS[name]
    config = model_config or config
    sparse = sparse or own
    engine = Engine(model, config, sparse, EngineConfig(**{"max_num_seqs": 4, "max_model_len": 128,
                                                           "tensor_parallel_size": tp, **options, **change}))
    assert engine.async_scheduling == bool({**options, **change}.get("async_scheduling"))
    prompts = _prompts(lens, seed=len(name))
    if name.startswith("prefix_cache"):
        prompts = [_prompts([36], seed=1)[0] + p for p in prompts]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, SamplingParams(**p))
    outs = engine.run_to_completion()
    assert all(o.finish_reason in ("length", "stop") for o in outs), [(o.request_id, o.error) for o in outs]
    assert engine.runner.coord.store.used_tokens() == 0 and not engine.runner.requests
    hits = engine.prefix_cache.stats.hit_tokens if engine.prefix_cache is not None else 0
    return {o.request_id: (o.token_ids, o.finish_reason) for o in outs}, (engine.scheduler.num_preemptions, hits)


def _rank_work(ctx: parallel.TPContext) -> dict[str, Any]:
    """What each rank runs: every scenario, its layout's KV heads, the memory plan's rows, and a
    step where rank 1 was given a different request."""
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, (config, *_rest) in SCENARIOS.items():
        results[name] = _run(_model(config, ctx.shard), name, ctx.world_size)
    model = random_model(CONFIG, torch.float32, "cpu", seed=3, tp=ctx.shard)
    gib = 2**30
    # device room differs by rank (rank 1 has less): both must take the smaller plan
    planned = Engine(model, CONFIG, SPARSE, EngineConfig(
        max_num_seqs=64, max_model_len=128, gpu_memory_utilization=0.5, device_memory_bytes=int((5.5 - 0.1 * ctx.rank) * 2**20),
        host_memory_bytes=gib // 256, tensor_parallel_size=ctx.world_size))
    assert planned.memory_plan is not None
    results["plan"] = (planned.num_seqs, planned.memory_plan.num_seqs, planned.memory_plan.host_budget_bytes,
                       planned.runner.layout.num_kv_heads, planned.runner.num_q_heads)
    engine = Engine(model, CONFIG, SPARSE, EngineConfig(max_num_seqs=4, max_model_len=128,
                                                        tensor_parallel_size=ctx.world_size))
    engine.add_request("r0", _prompts([20 + 5 * ctx.rank], seed=0)[0], SamplingParams(max_tokens=4, temperature=0.0))
    try:
        engine.run_to_completion()
        results["diverged"] = None
    except RuntimeError as exc:
        results["diverged"] = str(exc)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return parallel.spawn(_rank_work, world_size=2, backend="gloo")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "dense" else n for n in SCENARIOS])
def test_tp2_output_equals_tp1_token_for_token(ranks, name) -> None:
    """Dense, sparse (Quest at a binding budget: selections per KV head stay on their rank),
    DSA over the keys, biases, preemption and seeded sampling, with async scheduling
    (sparse, preemption, stop tokens) and with the prefix cache (sparse; dense mode with async
    scheduling): both ranks give the tokens of one unsplit engine over the same weights."""
    config = SCENARIOS[name][0]
    want, (preemptions, hits) = _run(_model(config), name, 1)
    for rank in ranks:
        got, rank_counts = rank[name]
        assert got == want
        assert rank_counts == (preemptions, hits)  # preempted and served from the cache alike
    if name in ("preempt", "async_preempt"):
        assert preemptions > 0  # the scenario preempts (TP=1 and both ranks alike)
    if name in ("sparse", "dsa_keys"):  # the budget binds: dense attention gives other tokens
        assert _run(_model(config), name, 1, sparse=DENSE)[0] != want
    if name.startswith("async"):  # and async scheduling changes nothing
        assert _run(_model(config), name, 1, async_scheduling=False)[0] == want
    if name == "async_seeded_stops":  # the stop tokens are met, before max_tokens
        assert {reason for _, reason in want.values()} == {"stop", "length"}
    if name.startswith("prefix_cache"):  # hits, and the outputs of the cache off
        assert hits > 0 and _run(_model(config), name, 1, enable_prefix_caching=False)[0] == want


def test_each_rank_holds_its_kv_heads_and_takes_the_smallest_memory_plan(ranks) -> None:
    """Each rank's store holds num_kv_heads / 2 KV heads (and its coordinator num_heads / 2
    query heads); the rank with less device memory plans fewer rows and both take its count;
    the host budget is split between the ranks."""
    (rows0, own0, host0, kv0, q0), (rows1, own1, host1, kv1, q1) = ranks[0]["plan"], ranks[1]["plan"]
    assert (kv0, q0) == (kv1, q1) == (CONFIG.num_kv_heads // 2, CONFIG.num_heads // 2)
    assert own1 < own0  # the plans differ by rank...
    assert rows0 == rows1 == min(own0, own1)  # ...and both engines take the smaller
    assert host0 == host1 == 2**30 // 256 // 2


def test_ranks_that_scheduled_different_steps_fail_together(ranks) -> None:
    for rank in ranks:
        assert rank["diverged"] is not None and "plan digests" in rank["diverged"]


def test_shards_put_together_are_the_unsplit_weights() -> None:
    """Column-parallel rows, row-parallel columns, the row-parallel bias on rank 0 only,
    replicated embeddings and head; random_model draws the full tensors, then slices them."""
    full = dict(random_model(BIASED, torch.float32, "cpu", seed=1).named_parameters())
    parts = [dict(random_model(BIASED, torch.float32, "cpu", seed=1, tp=TPShard(r, 2)).named_parameters())
             for r in range(2)]
    for name, tensor in full.items():
        kind = name.split(".")[-2]
        if kind in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            assert torch.equal(torch.cat([p[name] for p in parts]), tensor), name
        elif kind in ("o_proj", "down_proj") and name.endswith("weight"):
            assert torch.equal(torch.cat([p[name] for p in parts], dim=1), tensor), name
        elif kind in ("o_proj", "down_proj"):
            assert torch.equal(parts[0][name], tensor) and not parts[1][name].any(), name
        else:
            assert all(torch.equal(p[name], tensor) for p in parts), name
        for r in range(2):
            assert torch.equal(take_shard(name, tensor, TPShard(r, 2)), parts[r][name]), name


def test_sharded_checkpoint_load_equals_sharded_random_weights(tmp_path) -> None:
    """load_model(tp=...) reads each rank's slice of the stored tensors: the same as slicing
    the model in memory."""
    from safetensors.torch import save_file

    model = random_model(BIASED, torch.float32, "cpu", seed=2)
    (tmp_path / "config.json").write_text(__import__("json").dumps({**TINY, "attention_bias": True, "mlp_bias": True}))
    save_file({n: p.contiguous() for n, p in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    from sparse_framework.engine.models import load_model

    for r in range(2):
        loaded = dict(load_model(tmp_path, torch.float32, tp=TPShard(r, 2)).named_parameters())
        drawn = dict(random_model(BIASED, torch.float32, "cpu", seed=2, tp=TPShard(r, 2)).named_parameters())
        assert loaded.keys() == drawn.keys()
        assert all(torch.equal(loaded[n], drawn[n]) for n in loaded)


def test_bad_settings_are_refused_by_name() -> None:
    # KV heads not divisible
    odd = ModelConfig.from_hf({**TINY, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48})
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2.*num_heads \(6\).*num_kv_heads \(3\)"):
        local_config(odd, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        random_model(odd, torch.float32, "cpu", tp=TPShard(0, 2))
    with pytest.raises(ConfigError, match="tensor_parallel_size=2.*num_kv_heads"):
        Engine(random_model(odd, torch.float32), odd, DENSE, EngineConfig(tensor_parallel_size=2, max_model_len=64))
    # another family
    gemma = ModelConfig.from_hf({**TINY, "architectures": ["Gemma2ForCausalLM"], "head_dim": 8})
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2.*Llama family.*Gemma2ForCausalLM"):
        Engine(random_model(gemma, torch.float32), gemma, DENSE, EngineConfig(tensor_parallel_size=2, max_model_len=64))
    with pytest.raises(ConfigError, match="tensor_parallel_size=2.*Gemma2ForCausalLM"):
        random_model(gemma, torch.float32, tp=TPShard(0, 2))
    # no process group / an unsplit model
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs a process group"):
        Engine(random_model(CONFIG, torch.float32), CONFIG, DENSE, EngineConfig(tensor_parallel_size=2, max_model_len=64))
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(tensor_parallel_size=0)
    assert dataclasses.replace(local_config(CONFIG, 2), num_heads=4, num_kv_heads=2, intermediate_size=48) == CONFIG


def _rank_one_fails(ctx: parallel.TPContext) -> int:
    if ctx.rank == 1:
        raise ValueError("rank one's own error")
    return ctx.rank


def test_a_failing_rank_reports_its_traceback_and_the_others_their_state() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)rank 0: .*rank 1: Traceback.*rank one's own error"):
        parallel.spawn(_rank_one_fails, world_size=2, backend="gloo")
