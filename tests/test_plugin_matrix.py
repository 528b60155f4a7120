"""The plugin matrix (tests/plugin_matrix.py) crossed: every registered algorithm x every
registered backend (on each device type it declares) x every host, at a budget covering the
context, against the dense answer:

  coordinator   the coordinator alone over random q/k/v: each decode layer's output equals
                float64 attention of the same q over every stored K/V (the conftest oracle)
  engine        sparse_framework.engine's LLM over the random "tiny" Llama: greedy tokens equal
                the same engine's dense decode (SamplingParams(sparse=False)), logits close
  transformers  integrations.transformers.sparse over the shipped reference model: greedy
                tokens equal the unmodified model's generate, logits close
  vllm          skipped with the reason (plugin_matrix.skip_reason)

A case that cannot run here is skipped with its reason, never left out. Last, a plugin
installed through an entry point at run time joins the matrix with no test edited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from plugin_matrix import (
    HOSTS, MAX_CONTEXT, AlgorithmCase, BackendCase, algorithm_cases, backend_cases, coordinator_case, skip_reason,
    tolerance,
)
from sparse_framework import registry

ALGORITHMS = algorithm_cases()
BACKENDS = backend_cases()
SEED = 0

PROMPT_LENS = (40, 23)  # the model hosts' prompts (two requests batched)
NEW_TOKENS = 6
LOGITS_ATOL = 1e-4


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


# -- hosts ----------------------------------------------------------------------------------
def check_coordinator(algorithm: AlgorithmCase, backend: BackendCase, request: pytest.FixtureRequest) -> None:
    if backend.interpreter:
        result = interpreted(backend, request)[algorithm.name]
        assert "error" not in result, result.get("error")
    else:
        gen, layout, oracle = (request.getfixturevalue(f) for f in ("seeded_gen", "small_layout", "dense_oracle"))
        result = vars(coordinator_case(algorithm, backend, layout, gen, oracle))
    assert result["sparse_layer_steps"] == result["layer_steps"] > 0, result  # every layer selected
    assert result["max_error"] <= tolerance(backend.dtype), result


def engine_run(config: dict[str, Any], backend: BackendCase, sparse: bool) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Greedy tokens, each step's logits and the dense report of the engine over the tiny
    random Llama (2 layers, 4 query heads, 2 KV heads of 16, vocabulary 512)."""
    from sparse_framework.cli.engine import random_setup
    from sparse_framework.engine.llm import LLM
    from sparse_framework.engine.sampling import SamplingParams

    model, sparse_config = random_setup("tiny", config, backend.device, "float32")
    llm = LLM.from_model(model, sparse_config, max_num_seqs=2, max_model_len=MAX_CONTEXT, max_num_batched_tokens=64)
    runner, logits = llm.engine.runner, []
    execute = runner.execute

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = execute(*args, **kwargs)
        logits.append(out.detach().float().cpu().clone())
        return out

    runner.execute = recording  # type: ignore[method-assign]
    outs = llm.generate(prompts(model.config.vocab_size),
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, sparse=sparse))
    assert all(o.finish_reason == "length" for o in outs), [(o.request_id, o.error) for o in outs]
    return [o.token_ids for o in outs], logits, runner.coord.dense_report()


def check_engine(algorithm: AlgorithmCase, backend: BackendCase, request: pytest.FixtureRequest) -> None:
    config = algorithm.config(backend.name)
    tokens, logits, report = engine_run(config, backend, sparse=True)
    dense_tokens, dense_logits, dense_report = engine_run(config, backend, sparse=False)
    assert report["dense_requests"] == {} and report["sparse_layer_steps"] == report["layer_steps"] > 0, report
    assert dense_report["sparse_layer_steps"] == 0, dense_report  # the reference really was dense
    assert tokens == dense_tokens
    assert len(logits) == len(dense_logits)
    for step, (got, want) in enumerate(zip(logits, dense_logits)):
        torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")


@pytest.fixture(scope="module")
def reference_model() -> dict[str, Any]:
    """The shipped reference model (float32, CPU) and its unmodified greedy run, per device."""
    from sparse_framework.toy_model.model import load_reference_model

    return {"model": load_reference_model(), "dense": {}}


def hf_greedy(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.logits, 1).float().cpu()  # [1, L + new], [1, new, vocab]


def check_transformers(algorithm: AlgorithmCase, backend: BackendCase, request: pytest.FixtureRequest) -> None:
    from sparse_framework.integrations.transformers import sparse

    ref = request.getfixturevalue("reference_model")
    model = ref["model"].to(backend.device)
    ids = torch.tensor(prompts(model.config.vocab_size)[:1], device=backend.device)
    if backend.device not in ref["dense"]:
        ref["dense"][backend.device] = hf_greedy(model, ids)
    dense_seq, dense_logits = ref["dense"][backend.device]
    with sparse(model, algorithm.config(backend.name), max_requests=2, max_seq_len=MAX_CONTEXT) as handle:
        seq, logits = hf_greedy(model, ids)
        stats = handle.stats()
    assert stats["decode_steps"] == NEW_TOKENS - 1 and stats["sparse_fraction"] == 1.0, stats["dense"]
    assert stats["selected_tokens"] == stats["context_tokens"] > 0  # the budget covered every token
    assert torch.equal(seq, dense_seq)
    torch.testing.assert_close(logits, dense_logits, atol=LOGITS_ATOL, rtol=0)


HOST_CHECKS = {"coordinator": check_coordinator, "engine": check_engine, "transformers": check_transformers}


def run_case(algorithm: AlgorithmCase, backend: BackendCase, host: str, request: pytest.FixtureRequest) -> None:
    if backend.error:
        pytest.fail(backend.error)
    reason = skip_reason(backend, host)
    if reason:
        pytest.skip(reason)
    HOST_CHECKS[host](algorithm, backend, request)


# -- the Triton interpreter's cases: one fresh process for every algorithm -------------------
_INTERPRETED: dict[str, dict[str, dict[str, Any]]] = {}
TESTS_DIR = Path(__file__).resolve().parent


def interpreted(backend: BackendCase, request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """Every matrix algorithm's coordinator case on `backend`, run once in a fresh process with
    its interpreter variable set (=1), then read from the cache by each case."""
    key = str(backend)
    if key not in _INTERPRETED:
        assert backend.interpreter is not None
        script = ("import json, plugin_matrix as m, torch\n"
                  f"b = m.BackendCase({backend.name!r}, {backend.device!r}, torch.{str(backend.dtype).split('.')[-1]})\n"
                  f"print('RESULT ' + json.dumps(m.interpreted_results({[a.name for a in ALGORITHMS]!r}, b, {SEED})))\n")
        path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, backend.interpreter: "1", "PYTHONPATH": path}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
        _INTERPRETED[key] = json.loads(lines[-1].removeprefix("RESULT "))
    return _INTERPRETED[key]


# -- the matrix ------------------------------------------------------------------------------
@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=str)
def test_covering_budget_equals_dense(algorithm: AlgorithmCase, backend: BackendCase, host: str,
                                      request: pytest.FixtureRequest) -> None:
    """At a budget covering the context every algorithm selects every token, and each host's
    sparse decode gives its dense answer."""
    run_case(algorithm, backend, host, request)


def test_the_matrix_lists_every_registered_plugin() -> None:
    """Nothing registered is left out: every algorithm, every backend on every device type it
    declares; and the built-ins that need settings have them."""
    assert [a.name for a in ALGORITHMS] == registry.names("algorithm")
    assert {b.name for b in BACKENDS} == set(registry.names("backend"))
    assert {"quest", "dsa", "snapkv", "pqcache"} <= {a.name for a in ALGORITHMS}
    assert {a.name: a.extra for a in ALGORITHMS}["dsa"] == {"source": "keys"}
    assert any(str(b) == "torch_ref-cpu" and b.skip is None and b.interpreter is None for b in BACKENDS)


# -- a plugin installed by entry point joins the matrix ---------------------------------------
PLUGIN_SOURCE = '''
import torch

from sparse_framework.algorithms.base import ScoringAlgorithm
from sparse_framework.backends.torch_ref import TorchRefBackend


class Oldest(ScoringAlgorithm):
    """Keeps the oldest tokens (score: minus the position); no representation, no options."""

    def build(self, layer, request, keys, queries=None, *, inputs=None):
        pass

    def append(self, layer, batch, keys, *, inputs=None):
        pass

    def score(self, layer, queries, batch, *, inputs=None):
        n = batch.max_seq_len
        return -torch.arange(n, dtype=torch.float32, device=queries.device).view(1, 1, n).expand(len(batch), 1, n)

    def release(self, request):
        pass


class Mirror(TorchRefBackend):
    """torch_ref under another name."""
'''


def test_a_plugin_installed_by_entry_point_joins_the_matrix(fake_distribution, request) -> None:
    """A distribution registering an algorithm and a backend, installed after collection:
    the matrix lists both (the algorithm with its defaults: no test names it), and the
    algorithm's covering-budget cases pass on every host that runs here, on torch_ref and on
    the new backend."""
    assert "matrix_oldest" not in registry.names("algorithm")
    fake_distribution(
        "sparse-matrix-fake-plugin",
        {"sparse_framework.algorithms": {"matrix_oldest": "fake_matrix_plugin:Oldest"},
         "sparse_framework.backends": {"matrix_mirror": "fake_matrix_plugin:Mirror"}},
        {"fake_matrix_plugin": PLUGIN_SOURCE},
    )
    algorithms = {a.name: a for a in algorithm_cases()}
    assert set(algorithms) == {a.name for a in ALGORITHMS} | {"matrix_oldest"}
    assert algorithms["matrix_oldest"].extra == {}
    backends = {str(b): b for b in backend_cases()}
    assert set(backends) >= {str(b) for b in BACKENDS} | {"matrix_mirror-cpu", "matrix_mirror-cuda"}
    ran = []
    for backend in (backends["torch_ref-cpu"], backends["matrix_mirror-cpu"]):
        for host in HOSTS:
            if skip_reason(backend, host) is None:
                HOST_CHECKS[host](algorithms["matrix_oldest"], backend, request)
                ran.append(f"{host} {backend}")
    assert {"coordinator torch_ref-cpu", "engine torch_ref-cpu", "coordinator matrix_mirror-cpu"} <= set(ran), ran
