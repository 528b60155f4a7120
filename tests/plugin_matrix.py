"""The plugin matrix: every registered algorithm with its test settings, every registered
backend with where it runs on this machine, and the hosts that run them (issue 44, item 4;
modelled on kvpress's tests/default_presses.py).

Both lists are read from the registry when asked for, so a plugin installed through an entry
point joins the matrix with no test edited: an algorithm with its default extra-config (plus
the covering budget below), a backend on every device type it declares. OVERRIDES holds the
few settings the built-ins need on the small hosts of the tests; INTERPRETERS names the
backends that run on the CPU only under an interpreter switched on by an environment variable.

tests/test_plugin_matrix.py crosses algorithm x backend x host against the dense answer;
`coordinator_case` is here, not there, because the Triton interpreter's cases run it in a
fresh process (Triton reads TRITON_INTERPRET when it is imported).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sparse_framework import Batch, KVLayout, Request, registry
from sparse_framework.common.errors import ConfigError, PluginError
from sparse_framework.coordinator import SparseCoordinator

HOSTS = ("coordinator", "engine", "transformers", "vllm")

# A budget that covers every context of the matrix's cases (all below MAX_CONTEXT tokens):
# every token is selected, so each host's sparse decode must equal its dense decode. Sparse
# at every length and in every layer: sparse_policy "always" and min_sparse_prompt_len 0 (the
# defaults, "cost" and 2048, would decode these short prompts densely and prove nothing).
MAX_CONTEXT = 128
COVERING: dict[str, Any] = {
    "top_k": 2 * MAX_CONTEXT, "page_size": 4, "sink_tokens": 4, "recent_tokens": 8,
    "device_buffer_tokens": 8 * MAX_CONTEXT, "min_sparse_prompt_len": 0, "sparse_policy": "always",
}

# The built-ins' extra-config on the matrix's hosts; an algorithm not named here runs with its
# defaults. Each entry says why its defaults do not serve.
OVERRIDES: dict[str, dict[str, Any]] = {
    # the original keeps its first 2 layers dense: every layer of the 2-layer hosts
    "quest": {"dense_first_layers": 0},
    # the default source, the model's lightning indexer, needs indexer tensors the Llama models
    # of the engine and transformers hosts do not compute; "keys" scores with the real keys
    "dsa": {"source": "keys"},
    # the default window (32) is as long as the short prompts: nothing before it would be voted on
    "snapkv": {"window": 8},
    # 2**6 centroids exceed the short prompts' keys; fewer k-means iterations keep it quick
    "pqcache": {"bits": 4, "iterations": 4},
}

# backend -> the environment variable that runs it on the CPU (read at import: set it in a
# fresh process). Only the coordinator host runs there: a model forward per decode step
# through an interpreted kernel would take minutes.
INTERPRETERS: dict[str, str] = {"triton": "TRITON_INTERPRET"}


@dataclass(frozen=True)
class AlgorithmCase:
    """One registered algorithm and the extra-config the matrix runs it with."""

    name: str
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self, backend: str) -> dict[str, Any]:
        """The covering-budget sparse config of this algorithm on `backend`."""
        return {**COVERING, "algorithm": self.name, "backend": backend, "extra": dict(self.extra)}

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class BackendCase:
    """One registered backend on one device type it declares, and how it runs here:
    `skip` says why it cannot (None: it runs); `interpreter` names the environment variable
    a fresh process needs (the coordinator host only); `error`: the plugin failed to load."""

    name: str
    device: str
    dtype: torch.dtype = torch.float32
    skip: str | None = None
    interpreter: str | None = None
    error: str | None = None

    def __str__(self) -> str:
        return f"{self.name}-{self.device}"


def algorithm_cases() -> list[AlgorithmCase]:
    """Every registered algorithm (registry order), with its OVERRIDES or its defaults."""
    return [AlgorithmCase(name, OVERRIDES.get(name, {})) for name in registry.names("algorithm")]


def backend_cases() -> list[BackendCase]:
    """Every registered backend on each device type it declares (one case for a plugin that
    fails to load, carrying its error)."""
    cases = []
    for name in registry.names("backend"):
        try:
            cls = registry.load("backend", name)
        except PluginError as exc:
            cases.append(BackendCase(name, "?", error=str(exc)))
            continue
        for device in cls.device_types:
            cases.append(_backend_case(name, cls, device))
    return cases


def _backend_case(name: str, cls: Any, device: str) -> BackendCase:
    # float32 where the backend reads it (exact comparisons); else its first 16-bit dtype
    floats = [d for d in cls.dtypes if d in (torch.float32, torch.bfloat16, torch.float16)]
    dtype = torch.float32 if torch.float32 in floats else (floats[0] if floats else cls.dtypes[0])
    case = BackendCase(name, device, dtype)
    if device == "cuda" and not torch.cuda.is_available():
        return dataclasses.replace(case, skip="no CUDA GPU visible")
    variable = INTERPRETERS.get(name)
    interpreted = device == "cpu" and variable is not None and os.environ.get(variable) != "1"
    if interpreted:
        reason = cls.unavailable_reason()  # the interpreter's own import (Triton), checked here
        if reason:
            return dataclasses.replace(case, skip=reason)
        return dataclasses.replace(case, interpreter=variable)
    try:
        cls.check_layout(small_layout(device, dtype))
    except ConfigError as exc:
        return dataclasses.replace(case, skip=f"backend {name!r} {exc}")
    return case


def skip_reason(backend: BackendCase, host: str) -> str | None:
    """Why a backend case does not run on a host here (None: it runs)."""
    if backend.skip:
        return backend.skip
    if host == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not importable here (the vLLM host: tests/test_integrations_vllm.py)"
        return ("the vLLM host needs a real checkpoint and a fresh vLLM process per config (minutes): "
                "tests/test_integrations_vllm.py runs its full-budget check; not crossed here")
    if backend.interpreter and host != "coordinator":
        return (f"{backend.name} on the CPU runs only under {backend.interpreter}=1, in a fresh process: "
                "the coordinator host only (a model forward per step interpreted would take minutes)")
    if host != "coordinator" and backend.dtype != torch.float32:
        return (f"{backend.name} does not read float32: the model hosts run float32, where greedy tokens "
                "of sparse and dense runs can be required equal")
    if host == "transformers" and importlib.util.find_spec("transformers") is None:
        return "transformers is not importable here"
    return None


# -- the coordinator host -------------------------------------------------------------------
def small_layout(device: str = "cpu", dtype: torch.dtype = torch.float32) -> KVLayout:
    """The coordinator host's layout: 2 layers, 2 KV heads of 16 (GQA with 4 query heads)."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype, device=device)


Q_HEADS = 4
PROMPT_LENS = (37, 20)  # neither a whole number of pages
DECODE_STEPS = 3


def tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance against the float64 oracle for outputs in `dtype`."""
    return 1e-5 if dtype == torch.float32 else 2e-2


@dataclass
class CoordinatorResult:
    """max_error: the largest |output - oracle| over every decode step, layer, request and
    head; sparse_layer_steps: decode layer-steps that selected (every token, at this budget)."""

    max_error: float
    sparse_layer_steps: int
    layer_steps: int


Oracle = Callable[..., torch.Tensor]


def coordinator_case(
    algorithm: AlgorithmCase, backend: BackendCase, layout: KVLayout, gen: torch.Generator, oracle: Oracle
) -> CoordinatorResult:
    """Drive a coordinator like an engine over random q/k/v (and random values of any extra
    inputs the algorithm declares): prefill PROMPT_LENS, then DECODE_STEPS decode steps; at each
    decode layer compare the backend's output with `oracle` (float64 attention of the same q
    over every K/V row the request holds) and check the selection holds every token."""
    layout = dataclasses.replace(layout, device=backend.device, dtype=backend.dtype)
    coord = SparseCoordinator(algorithm.config(backend.name), layout, max_requests=4, max_seq_len=MAX_CONTEXT)
    d, hk = layout.head_dim, layout.num_kv_heads
    scale = 1 / math.sqrt(d)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=layout.device, dtype=layout.dtype)

    def inputs(tokens: int, prefill: bool) -> dict[str, torch.Tensor]:
        specs = coord.algorithm.prefill_inputs if prefill else coord.algorithm.decode_inputs
        return {name: randn(tokens, *shape) for name, shape in specs.items()}

    reqs = [Request(f"r{i}", n) for i, n in enumerate(PROMPT_LENS)]
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (request, layer) -> K, V
    for r in reqs:
        coord.on_request_begin(r)
    batch = Batch(reqs, is_prefill=True)
    coord.forward_begin(batch)
    n = sum(PROMPT_LENS)
    for layer in range(layout.num_layers):
        q, k, v = randn(n, Q_HEADS, d), randn(n, hk, d), randn(n, hk, d)
        meta = coord.attention_begin(layer, q, k, v, batch, inputs(n, prefill=True))
        coord.attention_end(layer, coord.attend(layer, q, meta), batch)
        offset = 0
        for i, r in enumerate(reqs):
            kv[i, layer] = k[offset : offset + r.prompt_len], v[offset : offset + r.prompt_len]
            offset += r.prompt_len
    coord.forward_end(batch)
    assert not any(r.dense for r in reqs), "the covering config must decode sparsely"

    worst, sparse, total = 0.0, 0, 0
    for _ in range(DECODE_STEPS):
        batch = Batch(reqs)
        coord.forward_begin(batch)
        b = len(reqs)
        for layer in range(layout.num_layers):
            q, k, v = randn(b, Q_HEADS, d), randn(b, hk, d), randn(b, hk, d)
            meta = coord.attention_begin(layer, q, k, v, batch, inputs(b, prefill=False))
            out = coord.attend(layer, q, meta)
            coord.attention_end(layer, out, batch)
            lens = meta.selection.lengths.cpu()
            for i, r in enumerate(reqs):
                pk, pv = kv[i, layer]
                kv[i, layer] = pk, pv = torch.cat([pk, k[i : i + 1]]), torch.cat([pv, v[i : i + 1]])
                assert bool((lens[i] == r.seq_len).all()), f"layer {layer}: selected {lens[i].tolist()} of {r.seq_len}"
                want = oracle(q[i].cpu(), pk.cpu(), pv.cpu(), scale)
                worst = max(worst, float((out[i].cpu().double() - want).abs().max()))
            total += 1
            sparse += layer not in coord.dense_layers
        coord.forward_end(batch)
    for r in reqs:
        coord.on_request_end(r)
    assert coord.store.used_tokens() == 0
    return CoordinatorResult(worst, sparse, total)


def interpreted_results(algorithms: list[str], backend: BackendCase, seed: int) -> dict[str, dict[str, Any]]:
    """`coordinator_case` of each algorithm (by name, with its matrix settings) on `backend`,
    in this process: what the fresh interpreted process runs. name -> the result's fields, or
    {"error": ...}."""
    from helpers import dense_attention_f64

    cases = {c.name: c for c in algorithm_cases()}
    out: dict[str, dict[str, Any]] = {}
    for name in algorithms:
        try:
            gen = torch.Generator().manual_seed(seed)
            out[name] = dataclasses.asdict(coordinator_case(cases[name], backend, small_layout(), gen, dense_attention_f64))
        except Exception as exc:  # reported by that algorithm's case, the others still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
