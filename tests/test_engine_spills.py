"""The hybrid store in the engine (`"store": "hybrid"`, kv_store/spills.py): requests stay whole
on the device while they fit and spill to the host tier under pressure, losslessly: the tokens
are those of the resident store with room for all (a budget that binds: real selections), and
those of transformers' own greedy generate at a budget that covers the context."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import load_model
from sparse_framework.engine.sampling import SamplingParams
from helpers import random_prompts, run_batch, tiny_engine, tiny_llama_checkpoint

# a budget that binds (8 pages of 4 tokens), a 48-token buffer once spilled; both layers sparse
SMALL = {"algorithm": "quest", "sparse_policy": "always", "top_k": 32, "page_size": 4, "sink_tokens": 4,
         "recent_tokens": 8, "device_buffer_tokens": 48, "min_sparse_prompt_len": 0,
         "extra": {"dense_first_layers": 0}}
COVERING = {**SMALL, "top_k": 112, "device_buffer_tokens": 128}  # every context below (at most 102 tokens)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory)


def engine_for(path, sparse: dict, **config) -> Engine:
    return tiny_engine(path, sparse, **{"max_model_len": 160, **config})


def test_while_everything_fits_nothing_spills_and_no_host_room_is_used(checkpoint) -> None:
    _, path = checkpoint
    batch = random_prompts([70, 33, 90], seed=1)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    hybrid = engine_for(path, {**SMALL, "store": "hybrid"})
    resident = engine_for(path, {**SMALL, "store": "resident"})
    hybrid.add_request("probe", batch[0], SamplingParams(max_tokens=3, temperature=0.0))
    hybrid.step()
    store = hybrid.runner.coord.store
    assert store.host_alloc.used == 0 and store.spill_count == 0
    hybrid.run_to_completion()
    assert run_batch(hybrid, batch, params) == run_batch(resident, batch, params)
    assert store.spill_count == 0 and store.stats()[1]["misses"] == 0


@pytest.mark.parametrize("capacity", [160, 240])
def test_under_pressure_requests_spill_and_generate_as_the_resident_store_would(checkpoint, capacity) -> None:
    """A sparse layers' pool of one or two whole requests for four: admissions spill running
    requests (the largest first) or come in spilled, growth spills; every token equals the
    resident store's with room for all, and every request ran at once (nobody preempted)."""
    _, path = checkpoint
    batch = random_prompts([70, 52, 90, 61], seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    roomy = run_batch(engine_for(path, {**SMALL, "store": "resident"}), batch, params)
    tight = engine_for(path, {**SMALL, "store": "hybrid"}, device_capacity_tokens=capacity)
    got = run_batch(tight, batch, params)
    store = tight.runner.coord.store
    assert store.spill_count > 0
    assert tight.scheduler.num_preemptions == 0
    assert got == roomy
    assert store.used_tokens() == 0 and store.host_alloc.used == 0 and not store.spills.slots


def test_room_freed_by_finished_requests_makes_spilled_requests_whole_again(checkpoint) -> None:
    """Eight requests for a pool of about six whole ones: admissions spill; six end early, and
    the room they free (beyond one more whole request's) makes a spilled one whole again; every
    token is the resident store's."""
    _, path = checkpoint
    batch = random_prompts([96, 92, 99, 95, 97, 94, 98, 93], seed=7)
    lengths = [12, 30, 12, 12, 30, 12, 12, 12]
    want, got = {}, {}
    for store, cap in (("resident", None), ("hybrid", 640)):
        engine = engine_for(path, {**SMALL, "store": store}, max_num_seqs=8, max_model_len=128,
                            device_capacity_tokens=cap, max_num_batched_tokens=256)
        for i, (p, n) in enumerate(zip(batch, lengths)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0))
        (want if store == "resident" else got).update((o.request_id, o.token_ids) for o in engine.run_to_completion())
    kv = engine.runner.coord.store
    assert kv.spill_count > 0 and kv.promote_count > 0
    assert got == want


def test_at_a_covering_budget_spilled_requests_equal_transformers(checkpoint) -> None:
    """Every request spilled once it is prefilled (a covering budget needs a buffer as long as
    the context, so pressure never spills there: the test spills them itself): the tokens are
    transformers' own."""
    model, path = checkpoint
    batch = random_prompts([70, 45, 90], seed=4)
    new = 12
    engine = engine_for(path, {**COVERING, "store": "hybrid"}, max_num_batched_tokens=32, max_prefill_chunk=32)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=new, temperature=0.0))
    store, got, spilled = engine.runner.coord.store, {}, set()
    while engine.has_unfinished():
        for out in engine.step():  # (step returns the requests that finished in it)
            got[out.request_id] = out.token_ids
        for r in engine.runner.requests.values():
            if r.seq_len >= r.prompt_len and r.rid not in spilled:  # once each (room freed later promotes)
                store.spill(r)
                spilled.add(r.rid)
    assert store.spill_count == len(batch)
    for i, p in enumerate(batch):
        ids = torch.tensor([p])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert got[f"r{i}"] == want, f"r{i}"


def test_a_request_spilled_after_its_prefill_swaps_in_exactly_as_the_hierarchical_stores(checkpoint) -> None:
    """The spilled path is the hierarchical store's: spilled right after the prompt (a buffer of
    the sink and the recent window, as the hierarchical store's admission leaves it), every
    request makes the same selections with the same hits and misses, and the same tokens."""
    _, path = checkpoint
    batch = random_prompts([70, 52, 90], seed=3)
    seen = {}
    for store in ("hierarchical", "hybrid"):
        # (a pool without the room to make a spilled request whole again: they stay spilled)
        engine = engine_for(path, {**SMALL, "store": store}, max_num_batched_tokens=256, device_capacity_tokens=240)
        for i, p in enumerate(batch):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0))
        kv, got = engine.runner.coord.store, {}
        while engine.has_unfinished():
            got.update((o.request_id, o.token_ids) for o in engine.step())
            if store == "hybrid":
                for r in engine.runner.requests.values():
                    if r.seq_len >= r.prompt_len and r.slot not in kv.spills:
                        kv.spill(r)
        counts = kv.stats()
        seen[store] = (got, sum(c["hits"] for c in counts), sum(c["misses"] for c in counts))
    assert seen["hybrid"] == seen["hierarchical"]
    assert seen["hybrid"][2] > 0 and kv.promote_count == 0  # (swaps happened: the budget binds)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_lengths_and_pools_spill_without_changing_a_token(checkpoint, data) -> None:
    _, path = checkpoint
    n = data.draw(st.integers(2, 4))
    lens = data.draw(st.lists(st.integers(20, 100), min_size=n, max_size=n))
    outs = data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    capacity = data.draw(st.sampled_from([96, 128, 200, 320]))
    batch = random_prompts(lens, seed=data.draw(st.integers(0, 1000)))
    want, got = {}, {}
    for store, cap in (("resident", None), ("hybrid", capacity)):
        engine = engine_for(path, {**SMALL, "store": store}, device_capacity_tokens=cap, max_num_batched_tokens=48)
        for i, (p, m) in enumerate(zip(batch, outs)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.0))
        done = {o.request_id: o.token_ids for o in engine.run_to_completion()}
        (want if store == "resident" else got).update(done)
    assert got == want


def test_the_memory_plan_admits_as_the_host_tier_holds_and_gives_the_rest_of_the_device_to_whole_requests() -> None:
    """Rows as many as the hierarchical store's (a spilled request's needs: its buffer on the
    device, its KV on the host); the sparse layers' pool takes the device budget left over, at
    most every row whole; the pools together stay within the budget. An engine built from the
    plan runs more requests at once than the resident store's plan would, none lost."""
    from sparse_framework.config import load_config
    from sparse_framework.engine.memory import plan_engine_memory
    from sparse_framework.engine.models import ModelConfig, random_model
    from sparse_framework.engine.models.random_shapes import RANDOM_MODELS

    tiny = ModelConfig.from_hf(RANDOM_MODELS["tiny"])
    layout = tiny.kv_layout(torch.float32)
    model = random_model(tiny, "float32", "cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    max_len = 64
    sparse = {**SMALL, "top_k": 16, "device_buffer_tokens": 28, "sink_tokens": 4, "recent_tokens": 4}
    args = dict(weight_bytes=weights, max_model_len=max_len, max_num_batched_tokens=32, max_num_seqs=16,
                gpu_memory_utilization=0.5, host_memory_bytes=2**40)
    resident = plan_engine_memory(tiny, layout, load_config({**sparse, "store": "resident"}), device_total_bytes=1, **args)
    fixed = resident.weight_bytes + resident.activation_bytes + resident.staging_bytes
    total = int((fixed + 3.5 * resident.device_bytes_per_request) / 0.5)  # 3 whole requests fit
    resident = plan_engine_memory(tiny, layout, load_config({**sparse, "store": "resident"}), device_total_bytes=total, **args)
    hier = plan_engine_memory(tiny, layout, load_config({**sparse, "store": "hierarchical"}), device_total_bytes=total, **args)
    hybrid = plan_engine_memory(tiny, layout, load_config({**sparse, "store": "hybrid"}), device_total_bytes=total, **args)
    assert resident.num_seqs == 3 and hybrid.num_seqs == hier.num_seqs > resident.num_seqs
    assert hier.device_capacity_tokens < hybrid.device_capacity_tokens <= hybrid.num_seqs * max_len
    assert hybrid.device_pool_bytes <= hybrid.device_budget_bytes
    engine = Engine(model, tiny, {**sparse, "store": "hybrid"}, EngineConfig(
        max_num_seqs=16, max_model_len=max_len, max_num_batched_tokens=32, gpu_memory_utilization=0.5,
        device_memory_bytes=total, host_memory_bytes=2**40))
    assert engine.num_seqs == hybrid.num_seqs
    g = torch.Generator().manual_seed(0)
    n = hybrid.num_seqs
    for i in range(n):
        ids = torch.randint(0, tiny.vocab_size, (40,), generator=g).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_len - 40, temperature=0.0, ignore_eos=True))
    most, outs = 0, []
    while engine.has_unfinished():
        outs += engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == n > resident.num_seqs and engine.runner.coord.store.spill_count > 0
    assert sorted(o.request_id for o in outs) == sorted(f"r{i}" for i in range(n))
    assert all(o.finish_reason == "length" for o in outs) and engine.scheduler.num_preemptions == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_on_cuda_spills_under_pressure_give_the_resident_stores_tokens(checkpoint, graphs) -> None:
    """On the GPU (the fused kernels, pinned host rows; whole-step CUDA graphs keyed apart for
    batches with a spilled row): the same tokens as the resident store with room for all."""
    _, path = checkpoint
    batch = random_prompts([70, 52, 90, 61], seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = {}
    for store, cap in (("resident", None), ("hybrid", 160)):
        model = load_model(path, dtype=torch.float32, device="cuda")
        engine = Engine(model, model.config, {**SMALL, "store": store}, EngineConfig(
            max_num_seqs=4, max_model_len=160, device_capacity_tokens=cap, cuda_graphs=graphs))
        outs[store] = run_batch(engine, batch, params)
        if store == "hybrid":
            assert engine.runner.coord.store.spill_count > 0
    assert outs["hybrid"] == outs["resident"]
