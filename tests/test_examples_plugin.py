"""The example plugin distribution in examples/sparse-plugin-example (`keynorm`), installed
with pip as a user would install it: discovery, its extra-config, equality with dense attention
at a budget that covers the context, its selection against a plain torch re-computation, and
the CLI in a subprocess."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_framework import ConfigError, KVLayout, Request, load_config, registry
from sparse_framework.algorithms.base import SparseAlgorithm
from sparse_framework.config import dense_layer_set
from sparse_framework.config import SparseConfig, config_schema
from sparse_framework.eval.loop import run_experiment
from sparse_framework.eval.workload import WorkloadConfig
from helpers import batch_of, pip_install_to_target

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_SRC = REPO / "examples" / "sparse-plugin-example"
NAME = "keynorm"
SMALL = {"top_k": 16, "sink_tokens": 4, "recent_tokens": 8, "min_sparse_prompt_len": 0, "device_buffer_tokens": 256,
         "store": "hierarchical", "sparse_policy": "always"}
WORKLOAD = {"contexts": [40, 300], "decode_steps": 3, "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    """Re-read entry points before and after each test (autouse fixtures are torn down after
    monkeypatch restored sys.path), so the example is visible only where a test installs it."""
    registry.refresh()
    yield
    registry.refresh()


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install` the example into a private target directory, once for this module.

    The source is copied first so that the build leaves nothing in the repository."""
    return pip_install_to_target(EXAMPLE_SRC, tmp_path_factory.mktemp("example_plugin"))


@pytest.fixture
def installed(example_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(example_site))
    registry.refresh()
    yield example_site
    for module in [m for m in sys.modules if m.split(".")[0] == "sparse_plugin_example"]:
        del sys.modules[module]


def test_depends_on_this_projects_distribution(installed: Path) -> None:
    """The example requires `sparse-decode-framework` (this project's distribution, installed
    from the checkout), which the installed project meets: not PyPI's `sparse-framework`, an
    unrelated project that pip would fetch and install beside it."""
    from packaging.requirements import Requirement

    requires = [Requirement(r) for r in importlib.metadata.distribution("sparse-plugin-example").requires or []]
    assert [r.name for r in requires] == [registry.BUILTIN] == ["sparse-decode-framework"]
    assert requires[0].specifier.contains(importlib.metadata.version(registry.BUILTIN))


def config(**overrides: object) -> SparseConfig:
    extra = overrides.pop("extra", {})
    return load_config({"algorithm": NAME, **SMALL, **overrides, "extra": extra})


def test_discovered_by_name(installed: Path) -> None:
    dist = importlib.metadata.distribution("sparse-plugin-example")
    assert dist.version == "0.1.0"
    assert NAME in registry.names("algorithm")
    assert NAME in registry.names("algorithm", "sparse-plugin-example")
    assert NAME not in registry.names("algorithm", registry.BUILTIN)
    cls = registry.load("algorithm", NAME)
    assert issubclass(cls, SparseAlgorithm) and cls.__name__ == "KeyNorm"
    assert cls.granularity == "token" and cls.per_kv_head and not cls.needs_prefill_queries
    # the installed copy, not the source tree
    assert Path(sys.modules[cls.__module__].__file__).resolve().is_relative_to(installed.resolve())
    (info,) = [i for i in registry.describe("algorithm") if i.name == NAME]
    assert info.distribution == "sparse-plugin-example" and info.error is None
    assert info.target == "sparse_plugin_example.keynorm:KeyNorm"
    schema = config_schema()
    assert NAME in schema["properties"]["algorithm"]["enum"]
    assert schema["$defs"][f"extra_{NAME}"]["properties"]["prefer"]["enum"] == ["low", "high"]
    assert NAME not in config_schema(registry.BUILTIN)["properties"]["algorithm"]["enum"]


def test_extra_config_validates(installed: Path) -> None:
    assert config().extra_config.model_dump() == {"prefer": "low", "dense_first_layers": 0}
    assert config(extra={"prefer": "high", "dense_first_layers": 1}).extra_config.prefer == "high"
    # the minimum config, with the framework's defaults
    assert load_config({"algorithm": NAME}).extra_config.prefer == "low"

    with pytest.raises(ConfigError) as info:
        config(extra={"prefer": "middle"})
    assert "`extra.prefer` = 'middle'" in str(info.value) and "'low' or 'high'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        config(extra={"dense_first_layers": -1})
    assert "`extra.dense_first_layers` = -1" in str(info.value) and "greater than or equal to 0" in str(info.value)
    with pytest.raises(ConfigError) as info:
        config(extra={"prefered": "low"})
    assert "`extra.prefered`: unknown option; allowed options: prefer, dense_first_layers" in str(info.value)
    # token-granular: a top_k below page_size is fine
    assert config(top_k=2, page_size=16).top_k == 2


def test_dense_first_layers_are_dense(installed: Path) -> None:
    assert dense_layer_set(config(extra={"dense_first_layers": 1}), 4) == {0}
    assert dense_layer_set(config(extra={"dense_first_layers": 9}, dense_layers=[3]), 4) == {0, 1, 2, 3}
    assert dense_layer_set(config(), 4) == set()


def test_budget_covering_the_context_equals_dense(installed: Path) -> None:
    cfg = config(top_k=1024, device_buffer_tokens=2048)
    for r in run_experiment(cfg, WorkloadConfig(**WORKLOAD)):
        assert r.algorithm == NAME and r.mode == "sparse"
        assert r.rel_error < 1e-5 and r.recall == pytest.approx(1.0)
        assert r.kv_read_fraction == pytest.approx(1.0) and r.needle_hit_rate == 1.0


def test_small_budget_reads_sink_recent_and_top_k(installed: Path) -> None:
    (r,) = run_experiment(config(), WorkloadConfig(**{**WORKLOAD, "contexts": [300]}))
    assert r.mode == "sparse"
    assert r.selected_tokens == 4 + 16 + 8  # per KV head: sink + top_k + recent (the newest is in it)
    assert r.kv_read_fraction < 0.1


def test_high_norm_preference_finds_the_workload_needles(installed: Path) -> None:
    """The synthetic needles are long keys: prefer="high" finds them all, the paper's "low"
    only those that fall in the sink or recent window — its rule is a property of trained
    models, not of isotropic random keys."""
    wl = WorkloadConfig(**{**WORKLOAD, "contexts": [1000], "needle_strength": 2.0})
    (high,) = run_experiment(config(extra={"prefer": "high"}), wl)
    (low,) = run_experiment(config(), wl)
    assert high.needle_hit_rate == 1.0 and high.recall > 0.9
    assert low.needle_hit_rate < 0.25 and low.recall < high.recall and low.rel_error > high.rel_error


# -- the selection against a plain torch re-computation ------------------------------------
def reference_selection(norms: torch.Tensor, seq_len: int, sink: int, recent: int, top_k: int, prefer: str) -> set[int]:
    """Sink, recent window and newest token, plus the top_k best-ranked other tokens.
    norms: float64 [seq_len - 1] (the newest token's key is not stored yet when a step selects)."""
    forced = set(range(min(sink, seq_len))) | set(range(max(seq_len - recent, 0), seq_len)) | {seq_len - 1}
    others = [p for p in range(seq_len) if p not in forced]
    ranked = sorted(others, key=lambda p: float(norms[p]) if prefer == "low" else -float(norms[p]))
    return forced | set(ranked[:top_k])


# clean_registry is function-scoped and idempotent: running it once around all examples is fine
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    decoded=st.integers(0, 3),
    kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 8),
    sink=st.integers(0, 5),
    recent=st.integers(0, 6),
    top_k=st.integers(1, 20),
    prefer=st.sampled_from(["low", "high"]),
    seed=st.integers(0, 2**16),
)
def test_selection_matches_a_torch_reference(
    example_site: Path, prompts: list[int], decoded: int, kv_heads: int, head_dim: int, sink: int, recent: int,
    top_k: int, prefer: str, seed: int,
) -> None:
    sys.path.insert(0, str(example_site))  # not monkeypatch: hypothesis reruns the body, not the fixture
    try:
        registry.refresh()
        cfg = config(top_k=top_k, sink_tokens=sink, recent_tokens=recent, extra={"prefer": prefer})
        layout = KVLayout(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim)
        algo = cfg.algorithm_class(cfg, layout, max_requests=4, max_seq_len=64)
        g = torch.Generator().manual_seed(seed)
        slots = torch.randperm(4, generator=g)[: len(prompts)].tolist()
        reqs = [Request(f"r{i}", n, seq_len=n, slot=s) for i, (n, s) in enumerate(zip(prompts, slots))]
        keys = [torch.randn(n, kv_heads, head_dim, generator=g) for n in prompts]
        for layer in range(2):  # layer 0 gets other keys: layers must not mix
            for r, k in zip(reqs, keys):
                algo.build(layer, r, k if layer == 1 else torch.randn_like(k))
        for _ in range(decoded):
            new = torch.randn(len(reqs), kv_heads, head_dim, generator=g)
            for r in reqs:
                r.seq_len += 1
            algo.append(1, batch_of(reqs), new)
            keys = [torch.cat([k, new[i : i + 1]]) for i, k in enumerate(keys)]
        for r in reqs:
            r.seq_len += 1  # this step's token: selected before its key is appended
        batch = batch_of(reqs)
        sel = algo.select(1, torch.randn(len(reqs), kv_heads, head_dim, generator=g), batch)
        sel.validate(batch.seq_lens)
        assert sel.page_size == 1 and tuple(sel.indices.shape[:2]) == (len(reqs), kv_heads)
        assert sel.indices.shape[2] <= sink + top_k + recent + 1

        for i, r in enumerate(reqs):
            for h in range(kv_heads):
                norms = keys[i][:, h].double().pow(2).sum(-1).sqrt()
                got = set(sel.indices[i, h, : sel.lengths[i, h]].tolist())
                want = reference_selection(norms, r.seq_len, sink, recent, top_k, prefer)
                assert len(got) == len(want)
                if got != want:  # only a near-tie at the cut may go either way (float32 vs float64)
                    at_cut = [float(norms[p]) for p in got ^ want]
                    assert max(at_cut) - min(at_cut) < 1e-5, (sorted(got), sorted(want))
    finally:
        sys.path.remove(str(example_site))
        for module in [m for m in sys.modules if m.split(".")[0] == "sparse_plugin_example"]:
            del sys.modules[module]
        registry.refresh()


def test_cli_runs_it_by_name(example_site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(example_site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    cfg = '{"algorithm": "keynorm", "top_k": 32, "device_buffer_tokens": 256, "min_sparse_prompt_len": 0}'
    done = subprocess.run(
        [sys.executable, "-m", "sparse_framework.cli.main", "run", "--config", cfg, "--contexts", "200",
         "--steps", "2", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "keynorm" in done.stdout and "sparse" in done.stdout


@pytest.mark.slow
def test_sparse_framework_eval_runs_it_on_the_reference_model(example_site: Path, tmp_path: Path) -> None:
    """The installed plugin, named in an experiment file, is swept by `sparse-framework eval`."""
    pytest.importorskip("transformers")
    experiment = {
        "name": "plugin", "algorithms": [{"algorithm": "keynorm", "extra": {"prefer": "high"}}],
        "budgets": [1.0, "1/8"], "contexts": [512],
        "workloads": [{"kind": "reference", "task": "mqar", "sequences": 1}],
    }
    (tmp_path / "exp.json").write_text(json.dumps(experiment))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(example_site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "results.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "sparse_framework.cli.main", "eval", str(tmp_path / "exp.json"), "--out", str(out), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["algorithm"], r["status"]) for r in records] == [("dense", "ok"), ("keynorm", "ok"), ("keynorm", "ok")]
    full = next(r for r in records if r["budget"] == "1.0")
    assert full["metrics"]["recall"] > 0.999 and full["metrics"]["accuracy"] == records[0]["metrics"]["accuracy"]
    assert "keynorm" in done.stdout
