"""The cost policy (sparse_framework/coordinator/policy.py): its decisions, not timings — a batch-1
short request decides dense, a long one sparse; the resident store decides per decode step
and switches as the context crosses the break-even, attending exactly as a dense run before
it; the hierarchical store decides once, at admission; "always" is the static rule; the
decision is monotone in the context (hypothesis); the constants are the committed fit's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import Batch, KVLayout, Request
from sparse_framework.config import DENSE_CONFIG, load_config
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.coordinator.dense_tally import COST_POLICY, DENSE_REQUEST, REQUESTED_DENSE, SHORT_PROMPT
from sparse_framework.common.hardware import H100
from sparse_framework.coordinator.policy import CostModel, SparsePolicy

HBM_TB_S, OVERHEAD_US, OVERHEAD_GROWTH_US = H100.hbm_tb_s, H100.policy_overhead_us, H100.policy_overhead_growth_us

from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
FIT = ROOT / "benchmarks" / "results" / "sparse_policy_fit.json"
# the Llama-3-8B layer: 8 KV heads x 128, bf16 (one layer is enough for the per-layer model)
LLAMA = KVLayout(1, 8, 128, torch.bfloat16)
QUEST = {"algorithm": "quest", "top_k": 2048, "page_size": 16, "sink_tokens": 16, "recent_tokens": 64,
         "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
# a small layout whose break-even (overhead 0) lies at a few dozen tokens
L, KV_HEADS, Q_HEADS, DIM = 2, 2, 4, 16
SMALL = {"algorithm": "quest", "top_k": 16, "page_size": 4, "sink_tokens": 4, "recent_tokens": 4,
         "device_buffer_tokens": 64, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0},
         "sparse_policy": "cost", "policy_overhead_us": 0.0, "policy_overhead_growth_us": 0.0}


def policy(config: dict, layout: KVLayout = LLAMA, **kw: int) -> SparsePolicy:
    limits = {"max_requests": 32, "max_seq_len": 131072, **kw}
    return SparsePolicy(load_config(config), layout, **limits)


# -- the model's numbers -------------------------------------------------------------------------
def test_the_dense_baseline_decodes_densely_at_any_length_and_batch() -> None:
    """DENSE_CONFIG is every evaluation's and benchmark's dense baseline. Under the default cost
    policy `min_sparse_prompt_len` is not consulted, and a 16K-32K baseline went sparse that way
    (stop 53): it must hold where the cost model would pick sparse."""
    for store in ("resident", "hybrid", "hierarchical"):
        dense = policy({**DENSE_CONFIG, "store": store})
        with pytest.warns(UserWarning, match="not consulted"):  # the trap, named
            cost = policy({**DENSE_CONFIG, "store": store, "sparse_policy": "cost"})
        for length, batch in ((65536, 1), (131000, 32)):
            assert dense.decodes_densely(length, None, batch) == (True, SHORT_PROMPT)
            assert cost.model.sparse_pays(length, batch)  # where the default policy would go sparse
        assert not dense.per_step  # no step of a dense request is decided again


def test_a_short_batch_1_request_decides_dense_and_a_long_one_sparse() -> None:
    hier = policy({**QUEST, "store": "hierarchical", "sparse_policy": "cost"})
    assert hier.decodes_densely(1024, None, 1) == (True, COST_POLICY)
    assert hier.decodes_densely(65536, None, 1) == (False, COST_POLICY)
    model = hier.model
    assert model.dense_us(1024) < model.sparse_us(1024) + model.overhead(1)  # why: sparse would cost more
    assert model.dense_us(65536) > model.sparse_us(65536) + model.overhead(1)
    # the break-evens of docs/engine.md (Llama-3-8B, top_k 2048) and their order in the batch
    assert [model.break_even(b) for b in (1, 8, 32)] == [24084, 5764, 3801]
    assert not model.sparse_pays(24083, 1) and model.sparse_pays(24084, 1)
    # what a request asks for still wins
    assert hier.decodes_densely(65536, False, 1) == (True, REQUESTED_DENSE)
    assert hier.decodes_densely(1024, True, 1) == (False, REQUESTED_DENSE)


def test_a_batch_1_short_request_is_dense_at_admission_in_the_coordinator() -> None:
    coord = SparseCoordinator({**QUEST, "store": "hierarchical", "sparse_policy": "cost"},
                              KVLayout(2, 8, 128, torch.bfloat16), max_requests=1, max_seq_len=4096)
    r = Request("short", 1024)
    coord.on_request_begin(r)
    assert r.dense and coord.store.mode(r, 1) == "resident" and not coord.store.keeps_host(r)
    report = coord.dense_report()
    assert report["dense_requests"] == {COST_POLICY: 1}
    assert report["sparse_policy"]["decided"] == "at admission"
    assert report["sparse_policy"]["break_even_context"]["1"] == 24084


def test_the_resident_store_admits_dense_what_could_never_pay() -> None:
    # within 4096 tokens and 4 requests sparse never pays for the Llama layer: dense for good
    never = policy({**QUEST, "store": "resident", "sparse_policy": "cost"}, max_requests=4, max_seq_len=4096)
    assert never.per_step and never.decodes_densely(100, None, 1) == (True, COST_POLICY)
    # with room for long contexts a request keeps its representations and each step decides
    can = policy({**QUEST, "store": "resident", "sparse_policy": "cost"}, max_requests=4, max_seq_len=131072)
    assert can.decodes_densely(100, None, 1) == (False, COST_POLICY)


def test_always_is_the_static_rule() -> None:
    # whatever the constants say: prompt < min_sparse_prompt_len, sparse= overriding
    for store in ("hierarchical", "resident"):
        p = policy({**QUEST, "store": store, "sparse_policy": "always", "min_sparse_prompt_len": 2048,
                    "policy_overhead_us": 1e9})
        assert p.mode == "always" and not p.per_step and not p.decides_at_admission
        for n in (1, 1024, 2047, 2048, 65536):
            assert p.decodes_densely(n, None, 1) == (n < 2048, SHORT_PROMPT)
            assert p.decodes_densely(n, True, 1)[0] is False and p.decodes_densely(n, False, 1)[0] is True
        assert p.describe() == {"mode": "always"}
    # stored results are keyed by every option spelt out (config.key()): the policy is always named
    assert load_config(QUEST).key()["sparse_policy"] == "cost"  # the default since issue 43
    assert load_config({**QUEST, "sparse_policy": "always"}).key()["sparse_policy"] == "always"


# -- monotone in the context ---------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    algorithm=st.sampled_from(["quest", "dsa", "pqcache", "snapkv"]),
    kv_heads=st.sampled_from([1, 2, 8]), head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    page_size=st.sampled_from([8, 16, 32]), top_k=st.sampled_from([256, 1024, 2048]),
    overhead=st.floats(0, 200), growth=st.floats(0, 10), bandwidth=st.floats(0.5, 8),
    batch=st.integers(1, 64), contexts=st.lists(st.integers(1, 1 << 20), min_size=2, max_size=8),
)
def test_the_decision_is_monotone_in_the_context(algorithm, kv_heads, head_dim, dtype, page_size, top_k,  # noqa: ANN001
                                                 overhead, growth, bandwidth, batch, contexts) -> None:
    config = load_config({"algorithm": algorithm, "top_k": top_k, "page_size": page_size, "device_buffer_tokens": 8192,
                          "sparse_policy": "cost", "policy_overhead_us": overhead,
                          "policy_overhead_growth_us": growth, "policy_hbm_tb_s": bandwidth})
    model = CostModel.for_config(config, KVLayout(1, kv_heads, head_dim, dtype))
    contexts = sorted(contexts)
    decisions = [model.sparse_pays(c, batch) for c in contexts]
    assert decisions == sorted(decisions)  # never sparse below a context that decides dense
    even = model.break_even(batch)
    assert all(d == (even is not None and c >= even) for c, d in zip(contexts, decisions))
    # a step's decision too: lengthening one request's context never turns it dense
    step = [contexts[0]] * batch
    for c in contexts[1:]:
        longer = [c, *step[1:]]
        assert not model.step_pays(step) or model.step_pays(longer)
        step = longer


# -- the resident store: per decode step ---------------------------------------------------------
def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _small_break_even(config: dict) -> int:
    even = SparsePolicy(load_config(config), KVLayout(L, KV_HEADS, DIM), max_requests=2, max_seq_len=128)
    result = even.model.break_even(1)
    assert result is not None
    return result


def _run(config: dict, prompt: int, steps: int) -> tuple[SparseCoordinator, list[torch.Tensor], list[bool]]:
    """One request prefilled then decoded `steps` steps on seeded random q/k/v (the same for
    every config); each step's attention output (all layers) and the policy's choice."""
    coord = SparseCoordinator(config, KVLayout(L, KV_HEADS, DIM, torch.float32), max_requests=2, max_seq_len=128)
    gen = torch.Generator().manual_seed(0)
    r = Request("r", prompt)
    coord.on_request_begin(r)
    batch = Batch([r], is_prefill=True)
    coord.forward_begin(batch)
    for layer in range(L):
        coord.attention_begin(layer, _rand(gen, prompt, Q_HEADS, DIM), _rand(gen, prompt, KV_HEADS, DIM),
                              _rand(gen, prompt, KV_HEADS, DIM), batch)
        coord.attention_end(layer, None, batch)
    coord.forward_end(batch)
    outputs, dense = [], []
    for _ in range(steps):
        batch = Batch([r])
        coord.forward_begin(batch)
        dense.append(coord._step_dense)
        out = []
        for layer in range(L):
            q = _rand(gen, 1, Q_HEADS, DIM)
            meta = coord.attention_begin(layer, q, _rand(gen, 1, KV_HEADS, DIM), _rand(gen, 1, KV_HEADS, DIM), batch)
            out.append(coord.attend(layer, q, meta))
            coord.attention_end(layer, out[-1], batch)
        coord.forward_end(batch)
        outputs.append(torch.stack(out))
    return coord, outputs, dense


def test_the_resident_step_switches_at_the_break_even_and_is_dense_until_then() -> None:
    config = {**SMALL, "store": "resident"}
    even = _small_break_even(config)
    prompt, steps = even - 12, 20  # starts below the break-even, crosses it during decode
    coord, outputs, dense = _run(config, prompt, steps)
    contexts = [prompt + i + 1 for i in range(steps)]  # the step's length, its new token included
    assert dense == [c < even for c in contexts] and dense[0] and not dense[-1]
    ref, ref_outputs, _ = _run({**config, "sparse_policy": "always", "min_sparse_prompt_len": 10**9}, prompt, steps)
    switch = dense.index(False)
    for i in range(switch):  # the dense steps attend exactly as a dense run's
        assert torch.equal(outputs[i], ref_outputs[i]), i
    assert not torch.equal(outputs[-1], ref_outputs[-1])  # and then sparsely: top_k 16 of > 38 tokens
    report = coord.dense_report()
    assert report["dense_requests"] == {}  # admitted able to go sparse
    assert report["dense_layer_steps"] == {COST_POLICY: switch * L}
    assert report["sparse_layer_steps"] == (steps - switch) * L
    assert report["sparse_policy"]["decided"] == "per decode step"
    # the representations were kept current through the dense steps: an "always" run of the same
    # tensors selects exactly as the switched run does once it is sparse
    always, always_outputs, _ = _run({**config, "sparse_policy": "always"}, prompt, steps)
    for i in range(switch, steps):
        assert torch.equal(outputs[i], always_outputs[i]), i


def test_a_request_that_asked_for_sparse_keeps_the_step_sparse() -> None:
    coord = SparseCoordinator({**SMALL, "store": "resident"}, KVLayout(L, KV_HEADS, DIM), max_requests=2,
                              max_seq_len=128)
    asked, other = Request("asked", 10), Request("other", 10)
    coord.on_request_begin(asked, sparse=True)
    coord.on_request_begin(other)
    batch = Batch([asked, other])
    batch.prepare("cpu")
    assert not coord.policy.step_dense(batch)  # its selection runs anyway
    coord.on_request_end(asked)
    batch = Batch([other])
    batch.prepare("cpu")
    assert coord.policy.step_dense(batch)


# -- the hierarchical store: once, at admission --------------------------------------------------
def test_the_hierarchical_store_decides_once_at_admission() -> None:
    config = {**SMALL, "store": "hierarchical"}
    even = _small_break_even(config)
    prompt, steps = even - 12, 20  # it would cross the break-even during decode: it stays dense
    coord, outputs, dense = _run(config, prompt, steps)
    assert not any(dense)
    r = coord.requests["r"]
    assert r.dense and not coord.store.keeps_host(r)
    ref, ref_outputs, _ = _run({**config, "sparse_policy": "always", "min_sparse_prompt_len": 10**9}, prompt, steps)
    assert all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs))
    report = coord.dense_report()
    assert report["dense_requests"] == {COST_POLICY: 1}
    assert report["dense_layer_steps"] == {COST_POLICY: steps * L} and DENSE_REQUEST not in report["dense_layer_steps"]
    # above the break-even: sparse, on the host tier, for good
    long, _, dense = _run(config, even + 1, 3)
    assert not any(dense) and not long.requests["r"].dense and long.store.keeps_host(long.requests["r"])
    assert long.dense_report()["dense_requests"] == {}


def test_admission_amortises_the_overhead_over_the_batch_it_joins() -> None:
    # with an overhead, the break-even falls as the batch grows: the 2nd request of a length the
    # 1st was kept dense at goes sparse
    config = {**SMALL, "store": "hierarchical", "policy_overhead_us": 0.005}
    coord = SparseCoordinator(config, KVLayout(L, KV_HEADS, DIM), max_requests=4, max_seq_len=256)
    model = coord.policy.model
    b1, b2 = model.break_even(1), model.break_even(2)
    assert b2 < b1
    first, second = Request("first", b2), Request("second", b2)
    assert coord.decodes_densely(b2) is True  # alone: dense
    coord.on_request_begin(first)
    assert coord.decodes_densely(b2) is False  # beside one: sparse
    coord.on_request_begin(second)
    assert first.dense and not second.dense


# -- the constants ---------------------------------------------------------------------------------
def test_the_h200_figures_are_the_committed_h200_fit_and_it_reproduces() -> None:
    """common/hardware.py's H200 constants are benchmarks/sparse_policy_fit.py --gpu h200's fit of the
    committed H200 layer measurements (decode_layer_short_h200.json, cells up to 16K)."""
    from sparse_framework.common.hardware import H200, figures_for_name

    fit = json.loads((FIT.parent / "sparse_policy_fit_h200.json").read_text())
    assert (H200.hbm_tb_s, H200.policy_overhead_us, H200.policy_overhead_growth_us) == (
        fit["hbm_tb_s"], fit["overhead_us"], fit["overhead_growth_us"])
    script = load_benchmark("sparse_policy_fit")
    layer = [p for p in script.layer_points(script.H200_SHORT) if p["context"] <= script.H200_FIT_MAX_CONTEXT]
    o1, g = script.least_squares([(p["batch"], p["overhead_us"]) for p in layer])
    assert (round(o1, 1), round(g, 2)) == (H200.policy_overhead_us, H200.policy_overhead_growth_us)
    assert figures_for_name("NVIDIA H200") is H200 and figures_for_name("NVIDIA H100 80GB HBM3").name == "H100"
    # the H200's own constants decide there: a layout on an H200 takes them (the CPU takes the H100's)
    model = CostModel.for_config(load_config({}), KVLayout(1, 8, 128, torch.bfloat16), figures=H200)
    assert model.break_even(8) == fit["break_even"]["by_batch"]["8"]


def test_the_h100_figures_are_the_committed_fit_and_the_fit_reproduces() -> None:
    fit = json.loads(FIT.read_text())
    assert (HBM_TB_S, OVERHEAD_US, OVERHEAD_GROWTH_US) == (
        fit["hbm_tb_s"], fit["overhead_us"], fit["overhead_growth_us"])
    config = load_config({})
    # unset: the layout's GPU's figures; on the CPU the default GPU's (the H100's)
    assert (config.policy_hbm_tb_s, config.policy_overhead_us, config.policy_overhead_growth_us) == (None, None, None)
    model = CostModel.for_config(config, KVLayout(1, 8, 128, torch.float32))
    assert (model.hbm_tb_s, model.overhead_us, model.overhead_growth_us) == (HBM_TB_S, OVERHEAD_US, OVERHEAD_GROWTH_US)
    script = load_benchmark("sparse_policy_fit")
    o1, g = script.least_squares([(b, o) for b, o in fit["fit"]["points"]])
    assert (round(o1, 1), round(g, 2)) == (OVERHEAD_US, OVERHEAD_GROWTH_US)
    points = [(p["batch"], p["overhead_us"]) for p in script.layer_points() if p["context"] == script.FIT_CONTEXT]
    assert points == [tuple(p) for p in fit["fit"]["points"]]  # from the committed measurements
    assert fit["break_even"]["by_batch"] == {"1": 24084, "2": 13616, "4": 8381, "8": 5764, "16": 4455, "32": 3801}
    # the H100 check below 16K (decode_layer_short_h100.json): brackets recomputed from the file
    brackets = script.measured_brackets()
    for row in fit["check"]["by_batch"]:
        cell = brackets[row["batch"]]
        assert (cell["dense_faster_at"], cell["sparse_faster_at"]) == (row["dense_faster_up_to"], row["sparse_faster_from"])
        lo, hi = row["dense_faster_up_to"], row["sparse_faster_from"]
        assert row["inside"] == ((lo is None or row["model"] >= lo) and (hi is None or row["model"] <= hi))
    assert [r["batch"] for r in fit["check"]["by_batch"] if not r["inside"]] == [4]  # as docs/engine.md says


@pytest.mark.parametrize("field,value", [("policy_hbm_tb_s", 0), ("policy_overhead_us", -1),
                                         ("sparse_policy", "sometimes")])
def test_bad_policy_settings_are_refused(field: str, value: object) -> None:
    from sparse_framework.common.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        load_config({field: value})


def test_a_threshold_the_cost_policy_does_not_consult_is_named() -> None:
    """min_sparse_prompt_len other than 0 or its default under the cost policy warns (naming
    sparse_policy); the same under "always", the default, and a stored key do not."""
    with pytest.warns(UserWarning, match="sparse_policy 'always'"):
        load_config({"algorithm": "quest", "min_sparse_prompt_len": 10**9})
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for config in (DENSE_CONFIG, {"algorithm": "quest"}, {"algorithm": "quest", "min_sparse_prompt_len": 0}):
            load_config(load_config(config).key())
