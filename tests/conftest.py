"""Fixtures shared by the tests: a small KVLayout, a seeded generator, the float64 dense
attention oracle (helpers.dense_attention_f64: one oracle, not one per test file), and a fake
installed plugin distribution for entry-point tests."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from helpers import dense_attention_f64
from sparse_framework import KVLayout, registry


@pytest.fixture
def small_layout() -> KVLayout:
    """2 layers, 2 KV heads of 16, float32 on the CPU (plugin_matrix.small_layout)."""
    from plugin_matrix import small_layout as layout  # imported here: a conftest error would stop every test

    return layout()


@pytest.fixture
def seeded_gen() -> torch.Generator:
    """A CPU generator seeded with 0: the same random tensors on every run."""
    return torch.Generator().manual_seed(0)


@pytest.fixture
def dense_oracle() -> Callable[..., torch.Tensor]:
    """float64 dense attention: (q [Hq, D], k [L, Hk, D], v [L, Hk, Dv], scale, softcap=None,
    sinks=None) -> [Hq, Dv] (helpers.dense_attention_f64)."""
    return dense_attention_f64


FakeDistribution = Callable[[str, dict[str, dict[str, str]], dict[str, str]], Path]


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDistribution]:
    """install(dist_name, {group: {name: "module:Object"}}, {module: source}): writes an
    installed-distribution record (`<name>-0.1.dist-info` with entry_points.txt) and flat
    modules into a tmp folder put first on sys.path, then refreshes the registry, exactly what
    `pip install` of a plugin does as far as entry points see. Undone afterwards: sys.path,
    the modules imported from the folder and the registry's caches."""
    root = tmp_path / "site"
    root.mkdir()
    modules = set(sys.modules)

    def install(dist_name: str, entry_points: dict[str, dict[str, str]], sources: dict[str, str]) -> Path:
        info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
        lines = []
        for group, eps in entry_points.items():
            lines += [f"[{group}]", *(f"{name} = {target}" for name, target in eps.items()), ""]
        (info / "entry_points.txt").write_text("\n".join(lines))
        for module, source in sources.items():
            (root / f"{module}.py").write_text(source)
        monkeypatch.syspath_prepend(str(root))  # also invalidates the import caches
        registry.refresh()
        return root

    yield install
    monkeypatch.undo()  # off sys.path before the registry reads the entry points again
    for name in set(sys.modules) - modules:
        module_file = getattr(sys.modules[name], "__file__", None) or ""
        if module_file.startswith(str(root)):
            del sys.modules[name]
    registry.refresh()
    importlib.invalidate_caches()
