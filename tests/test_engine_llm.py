"""`LLM` (engine/llm.py): an interrupted `generate` leaves nothing behind, `abort` ends
requests, calls from two threads are serialised, the reference model's max_model_len is the
CLI's, and outputs name their id `request_id` (vLLM's name; `rid` a deprecated alias)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sparse_framework.engine.llm import LLM, REFERENCE_MAX_MODEL_LEN
from sparse_framework.engine.models import ModelConfig, random_model
from sparse_framework.engine.request_output import RequestOutput
from sparse_framework.engine.sampling import SamplingParams
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

VOCAB = 96
CONFIG = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32,
                              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "max_position_embeddings": 256})
SMALL = {**HIERARCHICAL_ALWAYS, "algorithm": "quest", "top_k": 8, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
         "device_buffer_tokens": 48, "min_sparse_prompt_len": 0, "extra": {"dense_first_layers": 0}}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def llm(**options) -> LLM:  # type: ignore[no-untyped-def]
    return LLM.from_model(random_model(CONFIG, torch.float32, "cpu", seed=0), SMALL,
                          **{"max_num_seqs": 3, "max_model_len": 128, "max_num_batched_tokens": 32, **options})


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    assert all(o.finish_reason == "length" for o in outs), [(o.request_id, o.error) for o in outs]
    return [o.token_ids for o in outs]


def assert_empty(model: LLM) -> None:
    engine = model.engine
    assert not engine.has_unfinished() and not engine.runner.requests and not engine.runner.coord.requests
    assert engine.runner.coord.store.used_tokens() == 0 and not engine.runner.staging.spans


@pytest.mark.parametrize("where", [pytest.param("between steps", marks=pytest.mark.slow), "inside a step"])
def test_an_interrupted_generate_frees_its_requests_and_the_next_one_runs(where) -> None:
    """Ctrl-C (KeyboardInterrupt) inside `generate` — from the progress callback between steps,
    or from the model in the middle of a step's forward — aborts that call's requests (their
    pages freed) before it goes on; the next `generate` gives the outputs of a fresh LLM.
    (Before, the old requests stayed live, holding pages, and the next call raised KeyError;
    interrupted mid-step, it raised "schedule() called again before on_step_done()".)"""
    batch = prompts([30, 40, 20])
    want = tokens(llm().generate(batch, GREEDY))
    model = llm()
    steps = {"n": 0}

    def interrupt(*args) -> None:  # type: ignore[no-untyped-def]
        steps["n"] += 1
        if steps["n"] == 3:
            raise KeyboardInterrupt

    if where == "between steps":
        with pytest.raises(KeyboardInterrupt):
            model.generate(batch, GREEDY, on_step=interrupt)
    else:
        forward = model.engine.runner.model

        def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
            interrupt()
            return forward(*args, **kwargs)

        model.engine.runner.model = failing
        with pytest.raises(KeyboardInterrupt):
            model.generate(batch, GREEDY)
        model.engine.runner.model = forward
    assert steps["n"] == 3
    assert_empty(model)
    assert tokens(model.generate(batch, GREEDY)) == want
    assert_empty(model)


def test_abort_ends_requests_and_frees_their_pages() -> None:
    """`LLM.abort` takes one id or several: the requests end with finish_reason "abort" and
    their pages are freed; unknown ids give nothing. From another thread during a `generate`
    the abort is applied between its steps: that request comes back with "abort", the others
    as they would."""
    batch = prompts([30, 40, 20], seed=1)
    want = tokens(llm().generate(batch, GREEDY))
    model = llm()
    for i, p in enumerate(batch):
        model.engine.add_request(f"x{i}", p, GREEDY)
    model.engine.step()
    model.engine.step()
    assert [o.finish_reason for o in model.abort("x0")] == ["abort"]
    assert sorted(o.request_id for o in model.abort(["x1", "x2", "nobody"])) == ["x1", "x2"]
    assert model.abort("x0") == []
    assert_empty(model)

    started = threading.Event()

    def slow(done: int, total: int) -> None:
        started.set()
        time.sleep(0.01)

    result: list[list[RequestOutput]] = []
    worker = threading.Thread(target=lambda: result.append(model.generate(batch, GREEDY, on_step=slow)))
    worker.start()
    assert started.wait(30)
    assert model.abort("req-1") == []  # queued: the generate running on the worker applies it
    worker.join(60)
    (outs,) = result
    assert [o.finish_reason for o in outs] == ["length", "abort", "length"]
    assert [outs[0].token_ids, outs[2].token_ids] == [want[0], want[2]]
    assert_empty(model)


def test_two_threads_generating_at_once_get_the_outputs_of_one_at_a_time() -> None:
    """`generate` from two threads at once (both started together, both yielding between
    steps) is serialised: each gets the outputs of its prompts run alone. (Before, they
    stepped one engine together: "already has a staging span", KeyError or lost outputs.)"""
    first, second = prompts([30, 12, 44], seed=2), prompts([25, 50], seed=3)
    reference = llm()
    want = [tokens(reference.generate(first, GREEDY)), tokens(reference.generate(second, GREEDY))]
    model = llm()
    barrier = threading.Barrier(2)
    got: dict[int, list[list[int]] | BaseException] = {}

    def call(i: int, batch: list[list[int]]) -> None:
        barrier.wait()
        try:
            got[i] = tokens(model.generate(batch, GREEDY, on_step=lambda done, total: time.sleep(0.002)))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            got[i] = exc

    threads = [threading.Thread(target=call, args=(i, b)) for i, b in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {0: want[0], 1: want[1]}
    assert_empty(model)


def test_the_reference_model_takes_the_clis_max_model_len() -> None:
    """`LLM(None)` and `sparse-framework generate`/`serve` without --max-model-len give the
    reference model one max_model_len (it was 65536 through LLM and 8192 through the CLI); a
    given one is kept."""
    from sparse_framework.cli.engine import model_setup

    assert model_setup("reference", None, None)[3] == REFERENCE_MAX_MODEL_LEN == 8192
    assert LLM(None).engine.max_model_len == REFERENCE_MAX_MODEL_LEN
    assert LLM(None, max_num_seqs=1, max_model_len=512).engine.max_model_len == 512


def test_outputs_name_their_id_request_id_and_rid_is_a_deprecated_alias() -> None:
    (out,) = llm().generate([prompts([12])[0]], GREEDY)
    assert out.request_id == "req-0" and out.as_dict()["request_id"] == "req-0"
    with pytest.warns(DeprecationWarning, match="request_id"):
        assert out.rid == "req-0"
    with pytest.raises(AttributeError):
        out.rid = "other"  # type: ignore[misc]
