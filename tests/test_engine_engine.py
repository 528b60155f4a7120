"""The engine end to end on the CPU: against transformers' own greedy `generate`, continuous
batching against one request at a time, preempted-and-resumed against unpreempted, bad
requests refused one by one while the rest run."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sparse_framework import ConfigError
from sparse_framework.engine.async_steps import PENDING
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import load_model
from sparse_framework.engine.sampling import SamplingParams
from helpers import HIERARCHICAL_ALWAYS, TINY_LLAMA, TINY_LLAMA_VOCAB, random_prompts, run_batch, tiny_engine, tiny_llama_checkpoint

VOCAB = TINY_LLAMA_VOCAB
TINY = TINY_LLAMA
FULL = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 256, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
        "device_buffer_tokens": 512, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
SMALL = {**FULL, "top_k": 8, "device_buffer_tokens": 48}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory)


prompts = random_prompts


def engine_for(path, sparse: dict, **config) -> Engine:
    return tiny_engine(path, sparse, **{"max_model_len": 128, **config})


def run(engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    return run_batch(engine, batch, params)


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("sparse", [FULL, {**FULL, "store": "resident"}, {**FULL, "min_sparse_prompt_len": 1000}],
                         ids=["sparse-full-budget", "resident", "dense-mode"])
def test_engine_equals_transformers_greedy_generate(checkpoint, sparse) -> None:
    """Several prompts at once, prefilled in chunks of at most 16 tokens alongside decode rows."""
    model, path = checkpoint
    batch = prompts([37, 5, 60, 21])
    got = run(engine_for(path, sparse, max_num_batched_tokens=16, max_prefill_chunk=16), batch)
    for i, p in enumerate(batch):
        assert got[f"r{i}"] == hf_greedy(model, p, GREEDY.max_tokens), f"r{i}"


def test_continuous_batching_equals_one_request_at_a_time(checkpoint) -> None:
    """At a budget that binds (real selections), a request's tokens do not depend on the
    others it is batched with, nor on how its prompt was chunked."""
    _, path = checkpoint
    batch = prompts([70, 33, 90, 12, 55], seed=1)
    together = run(engine_for(path, SMALL, max_num_seqs=3, max_num_batched_tokens=24), batch)
    for i, p in enumerate(batch):
        alone = run(engine_for(path, SMALL, max_num_seqs=1, max_num_batched_tokens=64), [p])
        assert together[f"r{i}"] == alone["r0"], f"r{i}"


@pytest.mark.parametrize("chunk", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_preempted_and_resumed_output_equals_the_unpreempted_one(checkpoint, chunk) -> None:
    """A device pool too small for every request to grow to its end: the scheduler preempts
    (retracting to the host) and resumes, and every request's tokens are those of a run with
    room for all. The requests decode densely (prompts below min_sparse_prompt_len), so they
    grow on the device; sparse requests grow only on the host, whose room for their whole
    life is promised at admission, so they never need preempting."""
    _, path = checkpoint
    sparse = {**SMALL, "min_sparse_prompt_len": 1000}
    batch = prompts([40, 44, 48], seed=2)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    roomy = run(engine_for(path, sparse), batch, params)
    tight = engine_for(path, sparse, device_capacity_tokens=160, max_num_batched_tokens=32, max_prefill_chunk=chunk)
    got = run(tight, batch, params)
    assert tight.scheduler.num_preemptions > 0
    assert got == roomy
    assert tight.runner.coord.store.used_tokens() == 0 and not tight.runner.requests


@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "async"])
def test_a_resident_store_without_host_room_ends_only_the_request_it_cannot_keep(checkpoint, async_scheduling,
                                                                                    caplog) -> None:
    """The resident store keeps no host pool unless host_capacity_tokens is given, so a request
    that must be preempted has nowhere to go: it alone ends with finish_reason "error" and why
    (its tokens so far those of a roomy run), its pages are freed and the others finish as
    they would with room for all. (Before, `step()` raised CapacityError and every request in
    flight was lost.)"""
    _, path = checkpoint
    sparse = {**SMALL, "store": "resident"}
    batch = prompts([40, 44, 48], seed=2)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    roomy = run(engine_for(path, sparse, async_scheduling=False), batch, params)
    with caplog.at_level("WARNING", logger="sparse_framework.engine.budget"):
        tight = engine_for(path, sparse, device_capacity_tokens=160, max_num_batched_tokens=32,
                           async_scheduling=async_scheduling)
    assert "no host pool: a request that must be preempted is ended" in caplog.text  # said when built
    for i, p in enumerate(batch):
        tight.add_request(f"r{i}", p, params)
    outs = {o.request_id: o for o in tight.run_to_completion()}
    failed = [o for o in outs.values() if o.finish_reason == "error"]
    assert [o.request_id for o in failed] == ["r2"], {r: (o.finish_reason, o.error) for r, o in outs.items()}
    assert "cannot be kept" in failed[0].error and "host_capacity_tokens" in failed[0].error
    assert failed[0].token_ids == roomy["r2"][: len(failed[0].token_ids)] and PENDING not in failed[0].token_ids
    assert {r: outs[r].token_ids for r in ("r0", "r1")} == {r: roomy[r] for r in ("r0", "r1")}
    assert all(outs[r].finish_reason == "length" for r in ("r0", "r1"))
    assert tight.runner.coord.store.used_tokens() == 0 and not tight.runner.requests and not tight.runner.coord.requests


def test_a_request_chooses_its_own_sparse_or_dense_decoding(checkpoint) -> None:
    """SamplingParams.sparse: False decodes a request densely (its tokens those of a dense
    config), True sparsely even below min_sparse_prompt_len (those of a config without the
    limit), None by the config's rule; requests of each kind batched together. At a budget
    that binds, sparse and dense tokens differ, so the choice is the one taken."""
    _, path = checkpoint
    batch = prompts([70, 60, 50], seed=8)
    dense_cfg = {**SMALL, "min_sparse_prompt_len": 1000}
    sparse_run, dense_run = run(engine_for(path, SMALL), batch), run(engine_for(path, dense_cfg), batch)
    assert sparse_run != dense_run
    engine = engine_for(path, SMALL)  # every prompt sparse by the rule
    for i, (p, sparse) in enumerate(zip(batch, [False, None, True])):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, sparse=sparse))
    got = {o.request_id: o.token_ids for o in engine.run_to_completion()}
    assert got == {"r0": dense_run["r0"], "r1": sparse_run["r1"], "r2": sparse_run["r2"]}
    assert engine.runner.coord.dense_report()["dense_requests"] == {"requested dense (sparse=False)": 1}
    engine = engine_for(path, dense_cfg)  # every prompt dense by the rule
    forced = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, sparse=True)
    engine.add_request("r0", batch[0], forced)
    engine.add_request("r1", batch[1], GREEDY)
    got = {o.request_id: o.token_ids for o in engine.run_to_completion()}
    assert got == {"r0": sparse_run["r0"], "r1": dense_run["r1"]}
    assert engine.runner.coord.store.used_tokens() == 0
    with pytest.raises(ConfigError, match="SamplingParams.sparse"):
        SamplingParams(sparse="dense")  # type: ignore[arg-type]


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(checkpoint) -> None:
    _, path = checkpoint
    batch = prompts([30, 50, 20], seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    together = run(engine_for(path, SMALL), batch, params)
    alone = run(engine_for(path, SMALL), [batch[1]], params)
    assert together["r1"] == alone["r0"]


def test_bad_requests_get_one_clear_error_each_and_the_rest_run(checkpoint) -> None:
    _, path = checkpoint
    engine = engine_for(path, SMALL, max_model_len=64)
    good = prompts([20, 25], seed=4)
    engine.add_request("ok1", good[0], GREEDY)
    engine.add_request("empty", [], GREEDY)
    engine.add_request("long", list(range(60)), SamplingParams(max_tokens=10))
    engine.add_request("vocab", [1, 2, VOCAB + 5], GREEDY)
    engine.add_request("stop", [1, 2, 3], SamplingParams(stop_token_ids=[VOCAB + 1]))
    engine.add_request("ok2", good[1], GREEDY)
    with pytest.raises(ValueError, match="already queued"):
        engine.add_request("ok1", good[0], GREEDY)
    outs = {o.request_id: o for o in engine.run_to_completion()}
    assert outs["empty"].error == "the prompt is empty"
    assert "exceeds max_model_len 64" in outs["long"].error
    assert f"outside the vocabulary 0..{VOCAB - 1}" in outs["vocab"].error
    assert "stop_token_ids" in outs["stop"].error
    for rid in ("empty", "long", "vocab", "stop"):
        assert outs[rid].finish_reason == "error" and outs[rid].token_ids == []
    assert len(outs["ok1"].token_ids) == len(outs["ok2"].token_ids) == GREEDY.max_tokens
    assert engine.runner.coord.store.used_tokens() == 0


def test_abort_frees_everything_and_the_others_finish(checkpoint) -> None:
    _, path = checkpoint
    engine = engine_for(path, SMALL)
    for i, p in enumerate(prompts([30, 40, 50], seed=5)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    aborted = engine.abort("r1")
    assert aborted is not None and aborted.finish_reason == "abort"
    outs = engine.run_to_completion()
    assert sorted(o.request_id for o in outs) == ["r0", "r2"]
    assert engine.runner.coord.store.used_tokens() == 0 and not engine.runner.staging.spans
    assert engine.abort("r1") is None


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_arrivals_lengths_and_aborts_never_lose_or_mix_requests(checkpoint, data) -> None:
    """Requests arrive between steps with random lengths, some are aborted; pools are small
    enough that admission waits and dense-mode requests get preempted. Every request that is
    not aborted finishes with exactly the tokens it gets alone; the pools never hold more than
    they have and end empty."""
    _, path = checkpoint
    sparse = {**SMALL, "min_sparse_prompt_len": data.draw(st.sampled_from([0, 40, 1000, 1000]), label="short")}
    engine = engine_for(path, sparse, max_num_seqs=3, max_num_batched_tokens=24, device_capacity_tokens=100,
                        async_scheduling=data.draw(st.booleans(), label="async"))
    reqs = {}
    aborted = set()
    finished = {}
    for step in range(data.draw(st.integers(10, 40), label="steps")):
        for _ in range(data.draw(st.integers(0, 2), label="arrivals")):
            rid = f"r{len(reqs)}"
            reqs[rid] = (prompts([data.draw(st.integers(1, 60))], seed=len(reqs))[0],
                         SamplingParams(max_tokens=data.draw(st.integers(1, 30)), temperature=0.0))
            engine.add_request(rid, *reqs[rid])
        live = sorted(set(reqs) - set(finished) - aborted)
        if live and data.draw(st.booleans(), label="abort?") and data.draw(st.booleans()):
            rid = data.draw(st.sampled_from(live))
            engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in finished
            finished[out.request_id] = out
        store = engine.runner.coord.store
        for pool in store.pools:
            assert all(a.used <= a.num_pages for a in pool.alloc.values())
        assert store.host_alloc.used <= store.host_alloc.num_pages
    for out in engine.run_to_completion():
        finished[out.request_id] = out
    event(f"preempted: {engine.scheduler.num_preemptions > 0}")
    assert set(finished) | aborted == set(reqs)
    for rid, out in finished.items():
        prompt, params = reqs[rid]
        assert out.error is None, out.error
        alone = engine_for(path, sparse, max_num_seqs=1, device_capacity_tokens=512)  # room for any one
        alone.add_request("x", prompt, params)
        assert out.token_ids == alone.run_to_completion()[0].token_ids, rid
    assert engine.runner.coord.store.used_tokens() == 0 and not engine.runner.requests and not engine.runner.staging.spans


def _outputs(engine: Engine, batch: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple]:
    for i, (p, sp) in enumerate(zip(batch, params)):
        engine.add_request(f"r{i}", p, sp)
    return {o.request_id: (o.token_ids, o.finish_reason) for o in engine.run_to_completion()}


@pytest.mark.parametrize("case", ["greedy-stops", "seeded", "preemption"])
def test_async_scheduling_gives_the_same_outputs(checkpoint, case) -> None:
    """The next step built before the last one's tokens are read (tokens fed on the device,
    stop tokens seen a step late): the same tokens and finish reasons as the synchronous
    engine — with stop tokens that end requests mid-run, seeded sampling, and preemption."""
    _, path = checkpoint
    batch = prompts([37, 5, 60, 21, 44], seed=7)
    sparse, config = FULL, {"max_num_batched_tokens": 16}
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (12, 3, 9, 12, 1)]
    if case == "greedy-stops":  # stop tokens that each end one request early, taken from a plain run
        plain = _outputs(engine_for(path, sparse, **config, async_scheduling=False), batch, params)
        stops = [plain["r0"][0][4], plain["r2"][0][1], plain["r3"][0][0]]
        params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, stop_token_ids=stops) for p in params]
    elif case == "seeded":
        params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=11 * i) for i in range(5)]
    else:  # a device pool too small for every dense-mode request to grow: preemption
        sparse = {**SMALL, "min_sparse_prompt_len": 1000}
        config = {"device_capacity_tokens": 160, "max_num_batched_tokens": 32}
        batch, params = prompts([40, 44, 48], seed=2), [SamplingParams(max_tokens=30, temperature=0.0)] * 3
    want = _outputs(engine_for(path, sparse, **config, async_scheduling=False), batch, params)
    engine = engine_for(path, sparse, **config, async_scheduling=True)
    got = _outputs(engine, batch, params)
    assert got == want
    if case == "greedy-stops":
        assert sum(reason == "stop" for _, reason in got.values()) >= 3
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0
    assert engine.runner.coord.store.used_tokens() == 0 and not engine.runner.requests


def test_async_abort_reads_the_step_in_flight_first(checkpoint) -> None:
    """An abort while a step's tokens are still on the device: the request's output holds
    real token values (no placeholder), and the others finish as they would."""
    _, path = checkpoint
    engine = engine_for(path, SMALL, async_scheduling=True)
    for i, p in enumerate(prompts([30, 40, 50], seed=5)):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(5):
        engine.step()
    assert engine.async_steps.step is not None  # a step's tokens are on the device
    aborted = engine.abort("r1")
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.token_ids
    assert all(t >= 0 for t in aborted.token_ids)
    plain = engine_for(path, SMALL, async_scheduling=False)
    plain.add_request("x", prompts([30, 40, 50], seed=5)[1], GREEDY)
    assert aborted.token_ids == plain.run_to_completion()[0].token_ids[: len(aborted.token_ids)]
    outs = engine.run_to_completion()
    assert sorted(o.request_id for o in outs) == ["r0", "r2"]
    assert engine.runner.coord.store.used_tokens() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", ["eager", "decode_graphs", "cuda_graphs"])
@pytest.mark.parametrize("sparse", [{**FULL, "backend": "triton"}, {**FULL, "backend": "triton", "store": "resident"}],
                         ids=["hierarchical", "resident"])
def test_engine_on_cuda_equals_transformers_greedy_generate(checkpoint, sparse, graphs) -> None:
    """The CUDA path (Triton kernels, pinned host pool; the coordinator's per-layer decode
    graphs, or whole decode steps replayed from graphs) at a full budget, float32:
    transformers' greedy tokens on the same GPU."""
    model, path = checkpoint
    hf = model.to("cuda")
    try:
        batch = prompts([37, 5, 60, 21], seed=6)
        loaded = load_model(path, dtype=torch.float32, device="cuda")
        engine = Engine(loaded, loaded.config, sparse, EngineConfig(
            max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16,
            decode_graphs=graphs == "decode_graphs", cuda_graphs=graphs == "cuda_graphs"))
        got = run(engine, batch)
        if graphs == "cuda_graphs":
            step_graphs = engine.runner.step_graphs
            assert step_graphs.captures > 0 and step_graphs.replays > step_graphs.captures
        for i, p in enumerate(batch):
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                              do_sample=False, pad_token_id=0)
            assert got[f"r{i}"] == out[0, len(p):].tolist(), f"r{i}"
    finally:
        model.to("cpu")


FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500_000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_generates_like_transformers(family, tmp_path) -> None:
    """Each supported family (Qwen2 biases, Qwen3 q/k norms, Mistral, llama3 RoPE scaling)
    through the engine, sparse at a full budget, prompts chunked: transformers' greedy tokens."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(1)
    config = getattr(transformers, config_cls)(**{**TINY, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # biases and norms start at constants: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    batch = prompts([41, 9, 70], seed=7)
    got = run(engine_for(tmp_path, FULL, max_num_batched_tokens=16, max_prefill_chunk=16), batch)
    for i, p in enumerate(batch):
        assert got[f"r{i}"] == hf_greedy(model, p, GREEDY.max_tokens), f"{family} r{i}"


def test_bad_model_directories_are_clear_errors(tmp_path) -> None:
    from sparse_framework.engine import LLM
    from sparse_framework.engine.models import CheckpointError, UnsupportedModelError

    with pytest.raises(CheckpointError, match="model directory not found"):
        LLM(tmp_path / "nothing")
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"model_type .gpt2.\); supported: LlamaForCausalLM"):
        LLM(tmp_path)
    with pytest.raises(ConfigError, match="the engine options are"):
        LLM(None, max_num_seq=2)


FUSED = r"""
import torch
from sparse_framework.engine.async_steps import PENDING
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import ModelConfig, random_model
from sparse_framework.engine.sampling import SamplingParams

config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
                              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "max_position_embeddings": 256})
g = torch.Generator().manual_seed(0)
batch = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (37, 5, 60)]
outs = {}
for fused in (False, True):
    model = random_model(config, torch.float32, "cpu", seed=0)
    engine = Engine(model, config, SPARSE, EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16,
                                                       fused_ops=fused))
    assert model.fused_ops == fused
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.0))
    outs[fused] = {o.request_id: o.token_ids for o in engine.run_to_completion()}
assert outs[True] == outs[False], outs
print("fused engine ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [SMALL, {**FULL, "store": "resident", "min_sparse_prompt_len": 1000}],
                         ids=["sparse-hierarchical", "dense-resident"])
def test_fused_ops_give_the_same_tokens_interpreted(sparse) -> None:
    """The model's fused projections and Triton layer kernels (what a CUDA engine runs) decode
    the same greedy tokens as the plain torch path (float32, kernels interpreted)."""
    pytest.importorskip("triton")
    from helpers import run_interpreted

    run_interpreted(FUSED.replace("SPARSE", repr(sparse)), "fused engine ok")


def test_fused_ops_need_a_model_with_a_fused_path() -> None:
    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    from sparse_framework.engine.models import ModelConfig

    config = ModelConfig.from_hf({**TINY, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="fused_ops"):
        Engine(Bare(), config, FULL, EngineConfig(max_num_seqs=1, max_model_len=64, fused_ops=True))


@pytest.mark.parametrize("where", ["model", "mid-forward", "forward_end"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_step_fails_only_its_requests_and_the_engine_serves_on(checkpoint, where, async_scheduling) -> None:
    """An exception inside a step (the model raising before any layer, a hook raising after
    layer 0 stored its K/V, or the coordinator's forward_end raising after every layer ran)
    ends the requests of that step with finish_reason "error" and the reason, frees their
    pages, and the engine keeps serving: a request that was waiting finishes exactly as it
    does alone, and new requests run. (Before, every later step raised "schedule() called
    again before on_step_done() of the previous plan"; and a failed forward_end left the step
    open, so freeing its requests raised HookOrderError out of `step()`.)"""
    _, path = checkpoint
    batch = prompts([30, 40, 50], seed=5)
    engine = engine_for(path, SMALL, max_num_seqs=2, async_scheduling=async_scheduling)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(4):  # r0 and r1 prefilled and decoding; r2 waits for a row
        assert engine.step() == []
    armed = {"on": True}
    if where == "model":
        model = engine.runner.model

        def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
            if armed.pop("on", False):
                raise RuntimeError("injected model failure")
            return model(*args, **kwargs)

        engine.runner.model = failing
    elif where == "forward_end":
        coord = engine.runner.coord
        forward_end = coord.forward_end

        def failing_forward_end(batch):  # type: ignore[no-untyped-def]
            if armed.pop("on", False):
                raise RuntimeError("injected hook failure")
            return forward_end(batch)

        coord.forward_end = failing_forward_end
    else:
        coord = engine.runner.coord
        end = coord.attention_end

        def failing_end(layer, *args, **kwargs):  # type: ignore[no-untyped-def]
            if layer == 1 and armed.pop("on", False):
                raise RuntimeError("injected hook failure")
            return end(layer, *args, **kwargs)

        coord.attention_end = failing_end
    failed = engine.step()
    assert sorted(o.request_id for o in failed if o.finish_reason == "error") == ["r0", "r1"], failed
    assert all("the engine step failed: RuntimeError: injected" in o.error for o in failed if o.finish_reason == "error")
    engine.add_request("r3", batch[0], GREEDY)  # the same prompt again, after the failure
    outs = {o.request_id: o for o in engine.run_to_completion()}
    assert sorted(outs) == ["r2", "r3"] and all(o.finish_reason == "length" for o in outs.values())
    alone = run(engine_for(path, SMALL, async_scheduling=False), [batch[2], batch[0]])
    assert outs["r2"].token_ids == alone["r0"] and outs["r3"].token_ids == alone["r1"]
    assert engine.runner.coord.store.used_tokens() == 0 and not engine.runner.staging.spans
    assert not engine.runner.requests and not engine.has_unfinished()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_frees_the_request_even_when_a_hook_raises(checkpoint, async_scheduling) -> None:
    """The algorithm's `release` (a plugin's hook, run by on_request_end) raising while a
    request is aborted: the scheduler, the runner and the coordinator free it all the same
    (its pages, its row), the error is logged and recorded in the abort's output, and the
    others finish as they would. (Before, abort raised with the request dropped by the engine
    but still held by the scheduler and the store: its pages were never freed and
    `run_to_completion` never ended.)"""
    _, path = checkpoint
    batch = prompts([30, 40, 50], seed=5)
    engine = engine_for(path, SMALL, async_scheduling=async_scheduling)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(4):
        engine.step()
    coord = engine.runner.coord
    release = coord.algorithm.release

    def failing_release(request):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected release failure")

    coord.algorithm.release = failing_release
    held = coord.store.used_tokens()
    aborted = engine.abort("r1")
    coord.algorithm.release = release
    assert aborted is not None and aborted.finish_reason == "abort"
    assert "RuntimeError: injected release failure" in aborted.error
    assert "r1" not in coord.requests and "r1" not in engine.runner.requests and coord.store.used_tokens() < held
    assert len(coord.lifecycle.free_slots) == engine.num_seqs - 2
    outs = {}
    for _ in range(200):  # bounded: the old code never ended
        if not engine.has_unfinished():
            break
        outs.update((o.request_id, o) for o in engine.step())
    assert sorted(outs) == ["r0", "r2"] and all(o.finish_reason == "length" for o in outs.values())
    alone = run(engine_for(path, SMALL), [batch[0], batch[2]])
    assert outs["r0"].token_ids == alone["r0"] and outs["r2"].token_ids == alone["r1"]
    assert coord.store.used_tokens() == 0 and not coord.requests and not engine.runner.staging.spans


def test_token_ids_of_any_integer_kind_run_and_others_are_refused_by_name(checkpoint) -> None:
    """numpy and tensor ids run as the same Python ints do; True, 2.0 and 3.7 are refused as
    not integers (True was taken as token 1, 3.7 became 3 through LLM); an id whose error
    output is still pending cannot be added again (it gave two outputs with one id)."""
    import numpy as np

    _, path = checkpoint
    (p,) = prompts([20], seed=3)
    want = run(engine_for(path, SMALL), [p])["r0"]
    engine = engine_for(path, SMALL)
    engine.add_request("np", np.array(p, dtype=np.int64), GREEDY)
    engine.add_request("pt", torch.tensor(p), GREEDY)
    engine.add_request("mixed", [np.int32(t) if i % 2 else torch.tensor(t) for i, t in enumerate(p)], GREEDY)
    for rid, bad in (("bool", [True, *p[1:]]), ("float", [*p[:-1], 2.0]), ("frac", [3.7, *p[1:]]),
                     ("floats", torch.tensor(p, dtype=torch.float32))):
        engine.add_request(rid, bad, GREEDY)
    with pytest.raises(ValueError, match="already queued or running"):
        engine.add_request("frac", p, GREEDY)  # its error output is not out yet
    outs = {o.request_id: o for o in engine.run_to_completion()}
    assert {r: outs[r].token_ids for r in ("np", "pt", "mixed")} == {"np": want, "pt": want, "mixed": want}
    for rid in ("bool", "float", "frac", "floats"):
        assert outs[rid].finish_reason == "error" and "prompt token ids must be integers" in outs[rid].error
    from sparse_framework.engine import LLM

    llm = LLM(path, SMALL, dtype="float32", max_num_seqs=2, max_model_len=128)
    (bad, good) = llm.generate([[1, 3.7], p], GREEDY)
    assert bad.finish_reason == "error" and "cannot tokenize the prompt: prompt token ids must be integers" in bad.error
    assert good.token_ids == want


def test_the_step_log_is_bounded_and_steps_still_counts_every_step(checkpoint, monkeypatch) -> None:
    """A serving engine steps forever: its step log keeps the last STEP_LOG_LIMIT steps (it
    grew by one entry per step for good), while `steps` counts them all."""
    from sparse_framework.engine import step_log as step_log_module

    _, path = checkpoint
    monkeypatch.setattr(step_log_module, "STEP_LOG_LIMIT", 3)
    engine = engine_for(path, SMALL)
    engine.add_request("r0", prompts([20], seed=1)[0], GREEDY)
    n = 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    assert engine.steps == n > 3 and len(engine.step_log) == 3


def test_the_settings_moved_to_engine_config_are_still_importable_from_engine() -> None:
    """EngineConfig, KV_CACHE_DTYPES and kv_store_dtype live in engine/engine_config.py; their
    old path, engine/engine.py, re-exports the same objects."""
    from sparse_framework.engine import engine as old, engine_config as new

    for name in ("EngineConfig", "KV_CACHE_DTYPES", "kv_store_dtype"):
        assert getattr(old, name) is getattr(new, name)
