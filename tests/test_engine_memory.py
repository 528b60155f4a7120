"""The engine's memory plan (engine/memory.py): its terms against their definitions, the pools
a planned engine allocates against the plan, and an engine on the CPU with a small injected
device budget admitting exactly the planned number of requests."""

from __future__ import annotations

import logging

import pytest
import torch

from sparse_framework import CapacityError, ConfigError
from sparse_framework.config import load_config
from sparse_framework.engine import LLM
from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine import memory
from sparse_framework.engine.memory import HOST_MEMORY_FRACTION, EngineMemoryPlan, plan_engine_memory
from sparse_framework.engine.models import ModelConfig, random_model
from sparse_framework.engine.sampling import SamplingParams
from sparse_framework.engine.staging import PrefillStaging
from sparse_framework.coordinator.footprint import coordinator_parts
from sparse_framework.kv_store.pinned import meminfo_bytes
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

TINY = ModelConfig.from_hf(RANDOM_MODELS["tiny"])
SPARSE = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 16, "page_size": 4, "sink_tokens": 4, "recent_tokens": 4,
          "device_buffer_tokens": 32, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 1}}
RESIDENT = {**SPARSE, "store": "resident"}
MAX_LEN = 64
U = 0.5


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, "float32", "cpu")


def weights_of(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def plan_for(model, sparse=SPARSE, **kw) -> EngineMemoryPlan:
    args = dict(weight_bytes=weights_of(model), max_model_len=MAX_LEN, max_num_batched_tokens=32, max_num_seqs=8,
                gpu_memory_utilization=U, device_total_bytes=2**40, host_memory_bytes=2**40)
    return plan_engine_memory(TINY, TINY.kv_layout(torch.float32), load_config(sparse), **{**args, **kw})


def total_for(model, rows: float, sparse=SPARSE) -> int:
    """Device memory whose fraction U leaves room for `rows` request rows (+ a part of one)."""
    probe = plan_for(model, sparse)
    fixed = probe.weight_bytes + probe.activation_bytes + probe.staging_bytes
    return int((fixed + rows * probe.device_bytes_per_request) / U) + 1


@pytest.mark.parametrize("sparse", [SPARSE, RESIDENT], ids=["hierarchical", "resident"])
def test_plan_terms_follow_their_definitions(model, sparse) -> None:
    layout = TINY.kv_layout(torch.float32)
    total, host = 16 * 2**20, 100_000
    plan = plan_for(model, sparse, device_total_bytes=total, host_memory_bytes=host, device_free_bytes=total - total // 8)
    # the store's bytes per request row: what the coordinator's own estimate counts for one row
    parts = coordinator_parts(load_config(sparse), layout, max_requests=1, max_seq_len=MAX_LEN)
    device = sum(p.bytes for p in parts if p.what != "host KV pool")
    host_kv = sum(p.bytes for p in parts if p.what == "host KV pool")
    assert (plan.device_bytes_per_request, plan.host_bytes_per_request) == (device, host_kv)
    # the staging: the K/V of one max_model_len prompt (Quest's build reads no queries)
    assert plan.staging_bytes == MAX_LEN * PrefillStaging.bytes_per_token(layout) == 2 * 2 * 2 * 16 * 4 * MAX_LEN
    assert plan.weight_bytes == TINY.num_parameters() * 4
    # others: what is not free beyond the weights
    assert plan.device_other_bytes == total // 8 - plan.weight_bytes > 0
    assert plan.activation_bytes == max(plan.layer_activation_bytes, plan.logits_bytes, plan.handover_bytes) > 0
    budget = int(U * total) - plan.weight_bytes - plan.activation_bytes - plan.staging_bytes - plan.device_other_bytes
    assert plan.device_budget_bytes == budget
    assert plan.requests_by_device == max(0, budget) // device
    if sparse is RESIDENT:
        assert host_kv == 0 and plan.requests_by_host is None and plan.host_capacity_tokens is None
        assert plan.max_requests == plan.requests_by_device and plan.limited_by == "device"
    else:
        assert plan.requests_by_host == host // host_kv
        assert plan.max_requests == min(plan.requests_by_device, plan.requests_by_host)
        assert plan.host_capacity_tokens == plan.num_seqs * MAX_LEN
    assert plan.num_seqs == min(8, plan.max_requests) > 0
    assert plan.device_pool_bytes == plan.num_seqs * device and plan.host_pool_bytes == plan.num_seqs * host_kv
    # every part is linear in the rows: the coordinator's estimate for num_seqs rows is the plan's
    rows = coordinator_parts(load_config(sparse), layout, max_requests=plan.num_seqs, max_seq_len=MAX_LEN,
                             device_capacity_tokens=plan.device_capacity_tokens,
                             host_capacity_tokens=plan.host_capacity_tokens)
    assert sum(p.bytes for p in rows if p.what != "host KV pool") == plan.device_pool_bytes
    assert "memory-bound maximum" in plan.describe() and all(len(line) <= 100 for line in plan.describe().splitlines())


def test_activations_grow_with_the_step_and_the_prefix(model) -> None:
    small = plan_for(model)
    more_tokens = plan_for(model, max_num_batched_tokens=256)
    longer = plan_for(model, max_model_len=4 * MAX_LEN)
    assert more_tokens.layer_activation_bytes > small.layer_activation_bytes
    assert longer.layer_activation_bytes > small.layer_activation_bytes  # the chunk's mask over its prefix
    assert longer.staging_bytes == 4 * small.staging_bytes
    # the sampled rows are bounded by max_num_seqs: fewer rows, fewer logits
    assert plan_for(model, max_num_seqs=2).logits_bytes < small.logits_bytes


def test_host_budget_defaults_to_a_fraction_of_memavailable(model) -> None:
    plan = plan_for(model, host_memory_bytes=None)
    available = meminfo_bytes("MemAvailable")
    assert plan.host_budget_source.startswith(f"{HOST_MEMORY_FRACTION:g} x MemAvailable")
    # MemAvailable moves between two reads: within 1% of the fraction
    assert abs(plan.host_budget_bytes - HOST_MEMORY_FRACTION * available) < 0.01 * available


def test_engine_on_the_cpu_takes_the_planned_rows_and_allocates_the_planned_pools(model) -> None:
    total = total_for(model, 3.5)
    config = EngineConfig(max_num_seqs=8, max_model_len=MAX_LEN, max_num_batched_tokens=32, gpu_memory_utilization=U,
                          device_memory_bytes=total, host_memory_bytes=2**40)
    engine = Engine(model, TINY, SPARSE, config)
    plan = engine.memory_plan
    assert plan is not None and plan.requests_by_device == 3 and plan.limited_by == "device"
    assert engine.num_seqs == plan.num_seqs == 3
    assert plan == plan_for(model, device_total_bytes=total)  # the same function, the same inputs
    pools = engine.runner.coord.memory_stats()
    device_kv = sum(p["bytes"] for p in pools if p["kind"] != "host")
    host_kv = sum(p["bytes"] for p in pools if p["kind"] == "host")
    parts = coordinator_parts(load_config(SPARSE), TINY.kv_layout(torch.float32), max_requests=3, max_seq_len=MAX_LEN)
    assert device_kv == sum(p.bytes for p in parts if p.what.startswith("device KV pool"))
    assert host_kv == plan.host_pool_bytes == 3 * MAX_LEN * 2 * 2 * 2 * 16 * 4  # 3 full requests, every layer
    assert engine.runner.staging.capacity == plan.staging_tokens == MAX_LEN


def serve(engine: Engine, n: int, prompt_len: int, max_tokens: int) -> tuple[int, list]:
    """Queue n requests at once, step to the end; (the most running at once, the outputs)."""
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        ids = torch.randint(0, TINY.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    most, outs = 0, []
    while engine.has_unfinished():
        outs += engine.step()
        most = max(most, len(engine.scheduler.running))
    return most, outs


@pytest.mark.parametrize("bound", ["device", "host", pytest.param("max_num_seqs", marks=pytest.mark.slow)])
def test_engine_admits_exactly_the_planned_number_of_requests(model, bound) -> None:
    """N + 2 requests of max_model_len queued at once: N run together, never more, none lost."""
    n = {"device": 3, "host": 2, "max_num_seqs": 2}[bound]
    probe = plan_for(model)
    total = total_for(model, 3.5)
    host = int(2.5 * probe.host_bytes_per_request) if bound == "host" else 2**40
    config = EngineConfig(max_num_seqs=2 if bound == "max_num_seqs" else 8, max_model_len=MAX_LEN,
                          max_num_batched_tokens=32, gpu_memory_utilization=U, device_memory_bytes=total,
                          host_memory_bytes=host)
    engine = Engine(model, TINY, SPARSE, config)
    assert engine.memory_plan is not None and engine.memory_plan.num_seqs == n
    assert engine.memory_plan.limited_by == ("host" if bound == "host" else "device")
    most, outs = serve(engine, n + 2, prompt_len=40, max_tokens=MAX_LEN - 40)  # each to max_model_len
    assert most == n
    assert sorted(o.request_id for o in outs) == [f"r{i}" for i in range(n + 2)]
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_LEN - 40 for o in outs), [o.error for o in outs]
    assert engine.scheduler.num_preemptions == 0  # the rows hold their requests to full length


def test_captured_graphs_are_reserved_and_take_rows_where_the_device_binds(model) -> None:
    """cuda_graphs / decode_graphs reserve the graphs' pools (memory.graph_bytes, sized for
    max_num_seqs rows): a term of its own, subtracted from the device budget, in describe() and
    as_dict(); on a device with room for exactly 3 rows without graphs, fewer fit with them."""
    total = total_for(model, 3)
    off = plan_for(model, device_total_bytes=total)
    on = plan_for(model, device_total_bytes=total, cuda_graphs=True)
    layers = plan_for(model, device_total_bytes=total, decode_graphs=True)
    assert off.graph_bytes == 0 < layers.graph_bytes < on.graph_bytes
    assert on.device_budget_bytes == off.device_budget_bytes - on.graph_bytes
    assert on.requests_by_device < off.requests_by_device == 3 and on.num_seqs < off.num_seqs
    # whole steps add the LM head's peak (hidden rows, logits in bf16/f32 alike here: float32)
    # and the float32 logits buffer every step graph writes, for the 8 rows of max_num_seqs
    rows, vocab, hidden = 8, TINY.vocab_size, TINY.hidden_size
    assert on.graph_bytes - layers.graph_bytes >= rows * hidden * 4 + rows * vocab * 8 + rows * vocab * 4
    assert plan_for(model, device_total_bytes=total, cuda_graphs=True, max_num_seqs=16).graph_bytes > on.graph_bytes
    assert "captured graphs" in on.describe() and "captured graphs" not in off.describe()
    assert on.as_dict()["graph_bytes"] == on.graph_bytes and off.as_dict()["graph_bytes"] == 0
    assert all(len(line) <= 100 for line in on.describe().splitlines())


def test_no_room_for_one_request_is_one_clear_error(model) -> None:
    config = EngineConfig(max_model_len=MAX_LEN, gpu_memory_utilization=U, device_memory_bytes=total_for(model, 0.5),
                          host_memory_bytes=2**40)
    with pytest.raises(CapacityError) as err:
        Engine(model, TINY, SPARSE, config)
    text = str(err.value)
    for word in ("gpu_memory_utilization=0.5", "host_memory_bytes", f"max_model_len={MAX_LEN}", "GiB", "weights"):
        assert word in text
    # the host too small: the message says so with its bytes
    tiny_host = EngineConfig(max_model_len=MAX_LEN, gpu_memory_utilization=U, device_memory_bytes=total_for(model, 4),
                             host_memory_bytes=1000)
    with pytest.raises(CapacityError, match="of host memory, more than the 0.00 GiB of the host budget"):
        Engine(model, TINY, SPARSE, tiny_host)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be None or in (0, 1]"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be None or in (0, 1]"),
        ({"gpu_memory_utilization": -0.1}, "gpu_memory_utilization must be None or in (0, 1]"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization must be None or in (0, 1]"),
        ({"gpu_memory_utilization": 0.9, "host_memory_bytes": 0}, "host_memory_bytes must be None or >= 1"),
        ({"host_memory_bytes": 2**30}, "host_memory_bytes is a budget of the memory plan: set gpu_memory_utilization"),
        ({"device_memory_bytes": 2**30}, "device_memory_bytes is a budget of the memory plan"),
        ({"gpu_memory_utilization": 0.9, "device_capacity_tokens": 64}, "device_capacity_tokens and gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0.9, "host_capacity_tokens": 64}, "host_capacity_tokens and gpu_memory_utilization"),
    ],
)
def test_bad_memory_settings_name_the_field(fields, message) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(**fields)
    assert message in str(err.value)


def test_a_cpu_device_needs_device_memory_bytes(model) -> None:
    with pytest.raises(ConfigError, match="give EngineConfig.device_memory_bytes"):
        Engine(model, TINY, SPARSE, EngineConfig(max_model_len=MAX_LEN, gpu_memory_utilization=0.9))


def test_plan_for_takes_the_weights_and_the_device_memory(model) -> None:
    """memory.plan_for (what the engine and bench call) = plan_engine_memory with the model's
    parameter bytes and the given device memory; nothing in use on a CPU device."""
    args = dict(max_model_len=MAX_LEN, max_num_batched_tokens=32, max_num_seqs=8, gpu_memory_utilization=U,
                host_memory_bytes=2**40)
    planned = memory.plan_for(model.parameters(), TINY, TINY.kv_layout(torch.float32), load_config(SPARSE),
                              device=torch.device("cpu"), device_memory_bytes=3 * 2**20, **args)
    assert planned == plan_for(model, device_total_bytes=3 * 2**20)
    assert planned.weight_bytes == weights_of(model) and planned.device_other_bytes == 0
    assert memory.device_memory(torch.device("cpu"), 123) == (123, None)
    with pytest.raises(ConfigError, match="--device-memory-gib"):
        memory.device_memory(torch.device("meta"), None)


def test_cuda_device_memory_counts_cached_blocks_as_free_and_takes_a_given_total(monkeypatch) -> None:
    """On CUDA (faked here: the machine has none) free = what the driver reports + torch's
    cached blocks no tensor uses; device_memory_bytes replaces the measured total only."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * 2**30)
    cuda = torch.device("cuda", 0)
    assert memory.device_memory(cuda, None) == (80 * 2**30, 34 * 2**30)
    assert memory.device_memory(cuda, 40 * 2**30) == (40 * 2**30, 34 * 2**30)


def test_without_utilization_the_engine_sizes_as_before(model) -> None:
    engine = Engine(model, TINY, SPARSE, EngineConfig(max_num_seqs=5, max_model_len=MAX_LEN))
    assert engine.memory_plan is None and engine.num_seqs == 5
    assert len(engine.runner.coord.lifecycle.free_slots) == 5


def test_the_plan_is_logged_and_llm_passes_the_options(model, caplog) -> None:
    total = total_for(model, 2.5)
    options = dict(max_model_len=MAX_LEN, max_num_batched_tokens=32, gpu_memory_utilization=U,
                   device_memory_bytes=total, host_memory_bytes=2**40)
    with caplog.at_level(logging.INFO, logger="sparse_framework.engine.engine"):
        llm = LLM.from_model(model, SPARSE, **options)
    assert llm.engine.memory_plan is not None and llm.engine.memory_plan.num_seqs == 2
    assert "memory-bound maximum 2 (device)" in caplog.text
    ref = LLM(None, RESIDENT, max_model_len=MAX_LEN, gpu_memory_utilization=1.0, device_memory_bytes=2**30,
              host_memory_bytes=2**30)
    plan = ref.engine.memory_plan
    assert plan is not None and plan.weight_bytes == sum(p.numel() * 4 for p in ref.model.parameters())
    assert ref.engine.num_seqs == min(8, plan.max_requests)


def test_the_command_line_flags_reach_the_engine(monkeypatch) -> None:
    """`generate`/`bench` pass --gpu-memory-utilization and --host-memory-gib to the engine: on
    the CPU (no device memory to measure) it answers with its own clear error."""
    import io

    from rich.console import Console

    from sparse_framework.cli import main as cli

    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=100, force_terminal=False))
    bench = ["bench", "--random", "tiny", "--num-prompts", "1", "--input-len", "8", "--output-len", "2", "--no-progress"]
    assert cli.main([*bench, "--gpu-memory-utilization", "0.9"]) == 2
    assert "give EngineConfig.device_memory_bytes" in " ".join(out.getvalue().split())
    assert cli.main([*bench, "--gpu-memory-utilization", "1.2"]) == 2
    assert "gpu_memory_utilization must be None or in (0, 1]" in " ".join(out.getvalue().split())
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--host-memory-gib", "-1"]) == 2
    assert "--host-memory-gib must be > 0" in " ".join(out.getvalue().split())
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--host-memory-gib", "1"]) == 2  # without the utilization
    assert "host_memory_bytes is a budget of the memory plan" in " ".join(out.getvalue().split())
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--device-memory-gib", "0"]) == 2
    assert "--device-memory-gib must be > 0" in " ".join(out.getvalue().split())
    assert cli.main(["generate", "--model", "reference", "--no-progress", "--device-memory-gib", "1"]) == 2  # without the utilization
    assert "device_memory_bytes is a budget of the memory plan" in " ".join(out.getvalue().split())


def test_device_memory_gib_makes_the_utilization_usable_on_the_cpu(monkeypatch, tmp_path) -> None:
    """`bench --gpu-memory-utilization U --device-memory-gib G` on the CPU: the engine plans for G
    and admits by it; the bench reports that plan (the engine's own)."""
    import io
    import json

    from rich.console import Console

    from sparse_framework.cli import main as cli

    monkeypatch.setattr(cli, "console", Console(file=io.StringIO(), width=100, force_terminal=False))
    path = tmp_path / "b.json"
    assert cli.main(["bench", "--random", "tiny", "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
                     "--no-progress", "--gpu-memory-utilization", "0.6", "--device-memory-gib", "0.25",
                     "--host-memory-gib", "0.5", "--config", json.dumps(SPARSE), "--json", str(path)]) == 0
    plan = json.loads(path.read_text())["memory_plan"]
    assert plan["gpu_memory_utilization"] == 0.6 and plan["device_total_bytes"] == 2**28
    assert plan["host_budget_bytes"] == 2**29 and plan["num_seqs"] == 2  # --concurrency (all 2) bounds the rows


def test_mla_activations_cover_the_expanded_prefix_of_a_last_chunk() -> None:
    """An MLA model's attention term (memory.mla_attention_bytes) covers what a last prefill
    chunk's `mla_prefill_attention` allocates for its max_model_len prefix: the [m, H, nope + v]
    product of kv_b_proj and the keys' cat, measured on the tensors `MLAInputs.expand` makes
    (tiny DeepSeek-V3.2 preset); the layer's peak takes that term."""
    from sparse_framework.engine.models.mla import MLAInputs

    config = ModelConfig.from_hf(RANDOM_MODELS["deepseek-v3.2-tiny"])
    m, n, mml = config.mla, 16, 512
    heads, itemsize = config.num_heads, 2
    x = MLAInputs(q_nope=torch.zeros(n, heads, m.qk_nope_head_dim), q_rot=torch.zeros(n, heads, m.qk_rope_head_dim),
                  latent=torch.zeros(n, m.kv_lora_rank + m.qk_rope_head_dim),
                  kv_b=torch.zeros(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank, dtype=torch.bfloat16),
                  scale=1.0, index_q=torch.zeros(n, m.index_n_heads, m.index_head_dim),
                  index_weights=torch.zeros(n, m.index_n_heads), index_k=torch.zeros(n, m.index_head_dim), index_topk=4)
    k, v = x.expand(torch.zeros(mml, m.kv_lora_rank + m.qk_rope_head_dim, dtype=torch.bfloat16))
    product = mml * heads * (m.qk_nope_head_dim + m.v_head_dim) * itemsize  # v is a view of it
    made = product + k.numel() * k.element_size()
    assert v.untyped_storage().nbytes() == product
    got = memory.mla_attention_bytes(config, itemsize, tokens=n, chunk_tokens=n, max_model_len=mml, decode_rows=0,
                                     selection_units=0)
    assert got >= made
    layer, _, _ = memory.activation_bytes(config, itemsize, tokens=n, logits_rows=1, chunk_tokens=n,
                                          max_model_len=mml, selection_units=1)
    assert layer >= got


@pytest.mark.parametrize("kind", ["mla", "hybrid"])
def test_prefix_caching_plans_the_caches_host_copies_beside_the_pool(kind) -> None:
    """With prefix caching the host term of a request row grows by what the cache keeps beside
    the host pool: an indexer key per token (MLA; layers x index_dim x 2 bytes) or the
    sliding-window copies at the engine's SWA limit (hybrid); the pool itself is unchanged,
    and an engine built from the plan caps its cache's SWA pages at the planned limit."""
    from sparse_framework.engine.prefix_cache import SWA_WINDOWS_PER_ROW, swa_limit_pages

    if kind == "mla":
        config = ModelConfig.from_hf(RANDOM_MODELS["deepseek-v3.2-tiny"])
        sparse = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": 16, "page_size": 4, "sink_tokens": 0, "recent_tokens": 0,
                  "min_sparse_prompt_len": 0, "device_buffer_tokens": 32,
                  "extra": {"index_heads": 4, "index_dim": 32, "key_dtype": "float32", "score_newest": True}}
        side = config.num_layers * 32 * 2 * MAX_LEN  # bf16 keys of a row's 64 tokens
    else:
        config = ModelConfig.from_hf({"architectures": ["Gemma2ForCausalLM"], "vocab_size": 96, "hidden_size": 32,
                                      "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 8,
                                      "query_pre_attn_scalar": 16, "max_position_embeddings": 256})
        sparse = {**SPARSE, "extra": {"dense_first_layers": 0}}
        per_page = 2 * 2 * 4 * 2 * 8 * 2  # k and v, 2 sliding layers, 4 tokens, 2 KV heads x 8, bf16
        side = SWA_WINDOWS_PER_ROW * (8 // 4 + 1) * per_page
    layout = config.kv_layout(torch.bfloat16, max_model_len=MAX_LEN)
    args = dict(weight_bytes=0, max_model_len=MAX_LEN, max_num_batched_tokens=32, max_num_seqs=8,
                gpu_memory_utilization=U, device_total_bytes=2**40, host_memory_bytes=2**40, dtype=torch.bfloat16)
    off = plan_engine_memory(config, layout, load_config(sparse), **args)
    on = plan_engine_memory(config, layout, load_config(sparse), **args, prefix_caching=True)
    assert memory.prefix_cache_host_bytes(config, 4, torch.bfloat16, MAX_LEN) == side > 0
    assert on.host_bytes_per_request == off.host_bytes_per_request + side
    assert on.host_pool_bytes == off.host_pool_bytes and on.prefix_cache_host_bytes == on.num_seqs * side
    assert "prefix cache beside the host pool" in on.describe()
    if kind == "hybrid":
        model = random_model(config, torch.float32)
        engine = Engine(model, config, sparse, EngineConfig(max_num_seqs=3, max_model_len=MAX_LEN,
                                                             enable_prefix_caching=True))
        assert engine.prefix_cache.swa_limit_pages == swa_limit_pages(3, 8, 4) == 3 * SWA_WINDOWS_PER_ROW * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", ["llama-3-8b", "deepseek-v3.2-mini"])
def test_measured_step_peak_stays_within_the_planned_activations(shape) -> None:
    """On CUDA: the peak allocated during the steps of an 8K prompt (two 4K chunks, the second
    over the whole staged prefix) beyond what was allocated before the steps (weights, pools,
    staging) stays within the plan's activation term. Two layers of each shape (the real
    per-layer sizes), random bf16 weights."""
    raw = {**RANDOM_MODELS[shape], "num_hidden_layers": 2}
    config = ModelConfig.from_hf(raw)
    model = random_model(config, torch.bfloat16, "cuda")
    if config.mla is not None:
        sparse = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": 2048, "page_size": 64, "sink_tokens": 0, "recent_tokens": 0,
                  "min_sparse_prompt_len": 0, "device_buffer_tokens": 4096, "backend": "triton",
                  "extra": {"index_heads": 64, "index_dim": 128, "score_newest": True}}
    else:
        sparse = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 2048, "page_size": 16, "device_buffer_tokens": 4096,
                  "backend": "triton"}
    engine = Engine(model, config, sparse, EngineConfig(
        max_num_seqs=2, max_model_len=8192 + 64, max_num_batched_tokens=4096, gpu_memory_utilization=0.9,
        cuda_graphs=False, async_scheduling=False))
    plan = engine.memory_plan
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.add_request("r", torch.randint(0, config.vocab_size, (8192,)).tolist(),
                       SamplingParams(max_tokens=4, temperature=0.0))
    engine.run_to_completion()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    print(f"{shape}: measured step peak {peak / 2**30:.2f} GiB, planned activations "
          f"{plan.activation_bytes / 2**30:.2f} GiB")
    assert peak <= plan.activation_bytes


def test_capacity_errors_speak_the_engines_terms(model) -> None:
    """The coordinator's sizing error reaches an engine user in the names they set
    (max_num_seqs, max_model_len; it said max_requests / max_seq_len), and a plan whose weights
    alone exceed the device says so, with no negative store size."""
    with pytest.raises(CapacityError) as err:
        LLM(None, max_model_len=10**9)
    text = str(err.value)
    assert "max_model_len=1000000000" in text and "max_num_seqs=" in text
    assert "max_seq_len" not in text and "max_requests" not in text
    weights = weights_of(model)
    config = EngineConfig(max_model_len=MAX_LEN, gpu_memory_utilization=0.9, device_memory_bytes=weights // 2,
                          host_memory_bytes=2**40)
    with pytest.raises(CapacityError) as err:
        Engine(model, TINY, SPARSE, config)
    text = str(err.value)
    assert "leaves nothing (" in text and "short)" in text and "-" not in text.split("leaves")[1].split("for the store")[0]
    assert "The weights alone need more than" in text


def test_fp8_host_rows_about_double_the_host_bound_rows() -> None:
    """The engine's plan at Llama-3-8B's shape, 32K, 128 GiB of host: host_kv_dtype fp8_e4m3
    counts (head_dim + 1) / (2 head_dim) of bf16's host bytes per request row, so the host
    admits 1.98x the rows (the device's rows do not change)."""
    model = ModelConfig.from_hf(RANDOM_MODELS["llama-3-8b"])
    layout = model.kv_layout(torch.bfloat16, max_model_len=32768)
    args = dict(weight_bytes=model.num_parameters() * 2, max_model_len=32768, max_num_batched_tokens=8192,
                max_num_seqs=256, gpu_memory_utilization=0.9, device_total_bytes=80 * 2**30,
                host_memory_bytes=128 * 2**30)
    cfg = {"top_k": 2048, "store": "hierarchical", "extra": {"dense_first_layers": 0}}
    bf16 = plan_engine_memory(model, layout, load_config(cfg), **args)
    fp8 = plan_engine_memory(model, layout, load_config({**cfg, "host_kv_dtype": "fp8_e4m3"}), **args)
    assert fp8.host_bytes_per_request * 256 == bf16.host_bytes_per_request * 129
    assert fp8.device_bytes_per_request == bf16.device_bytes_per_request
    assert (bf16.requests_by_host, fp8.requests_by_host) == (32, 63)
    assert bf16.limited_by == "host" and fp8.max_requests == min(fp8.requests_by_device, 63) > 1.5 * bf16.max_requests
    assert "per request (fp8_e4m3 rows) = 63" in fp8.describe() and "rows)" not in bf16.describe()
    assert all(len(line) <= 100 for line in fp8.describe().splitlines())
