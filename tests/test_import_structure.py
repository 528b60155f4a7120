"""The package's floors: no import circles, and each part imports only the floors below it.

Every import counts — at module level, inside functions (lazy) and under TYPE_CHECKING — since
each is a dependency a reader must follow and a circle a refactor can trip over.

    common                      types and helpers everyone shares (imports nothing above)
    kernels                     Triton kernels and their torch references; inside it, the
                                `@triton.jit` code (kernels/triton/) and the torch twins
                                (kernels/reference/) import none of the launch modules
    kv_store, algorithms,       the store and the three plugin families (backends may read
    adaptors, backends          the adaptors' metadata types)
    registry                    entry points, checked against the plugin base classes
    config                      resolves plugins through the registry only
    coordinator                 the hooks over store, algorithm, adaptor and backend
    toy_model                   the shipped 3M-parameter model (a transformers model)
    engine                      scheduler, runner, models over the coordinator
    integrations                transformers and vLLM hosts of the coordinator
    serve                       the HTTP server over the engine
    eval, bench                 the evaluation harness; the load generators
    cli                         the command, over everything

Every part of the package is in the table: a new one fails `test_every_part_has_a_floor`
until it is given its floor.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sparse_framework"
PLUGIN_BASES = {"algorithms.base", "adaptors.base", "backends.base"}

# part -> the parts it may import (its own always allowed)
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "kernels": {"common"},
    "kv_store": {"common", "kernels"},
    "algorithms": {"common", "kernels"},
    "adaptors": {"common", "kernels"},
    "backends": {"common", "kernels", "adaptors"},
    "registry": {"common", *PLUGIN_BASES},
    "config": {"common", "registry", *PLUGIN_BASES},  # the bases for type annotations only
    "coordinator": {"common", "kernels", "kv_store", "algorithms", "adaptors", "backends", "registry", "config"},
    "toy_model": {"common"},
}
BELOW_ENGINE = ALLOWED["coordinator"] | {"coordinator"}
# inside kernels: subpackage -> the modules it may import (prefixes), under the launch modules
KERNEL_LAYERS: dict[str, set[str]] = {
    "kernels.triton": {"kernels.triton"},
    "kernels.reference": {"kernels.reference", "common"},
}
ALLOWED |= {
    "engine": BELOW_ENGINE | {"toy_model"},
    "integrations": BELOW_ENGINE | {"toy_model"},
    "serve": BELOW_ENGINE | {"engine"},
    "eval": BELOW_ENGINE | {"toy_model", "engine", "integrations"},
    "bench": BELOW_ENGINE | {"engine"},
    "cli": BELOW_ENGINE | {"toy_model", "engine", "integrations", "serve", "eval", "bench", ""},
    "": {"common", "config"},  # the package's __init__: the public names
}


# the transformers integration's modules (integrations/transformers/), lowest first: each
# imports only those before it ("" is the package's __init__, the public names), so no import
# goes back up, and the package itself never imports mla: `enable` does, when it meets an MLA
# config (enabling.family_enabler, inside the function)
TRANSFORMERS_FLOORS = ["compat", "model_info", "attention", "cache", "generate", "handle", "mla", "enabling", ""]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)  # "" is the package itself


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (relative to the package)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        package = [p for p in package if p]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                elif node.module and node.module.startswith("sparse_framework"):
                    name = node.module.removeprefix("sparse_framework").lstrip(".")
                else:
                    continue
                for alias in node.names:
                    sub = f"{name}.{alias.name}".lstrip(".")
                    targets.append(sub if sub in modules else name)
            elif isinstance(node, ast.Import):
                targets = [
                    a.name.removeprefix("sparse_framework").lstrip(".")
                    for a in node.names
                    if a.name.startswith("sparse_framework")
                ]
            graph[mod].update(t for t in targets if t in modules and t != mod)
    return graph


def part(module: str) -> str:
    """The floor a module belongs to: its subpackage, or the top-level module's own name."""
    return module.split(".")[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_relative_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "common.layout" in graph["coordinator.core"]  # module level
    assert "kernels.scoring" in graph["algorithms.base"]  # inside a function
    assert "common.settings" in graph["adaptors.base"]  # under TYPE_CHECKING
    assert "algorithms.base" in graph["registry"]


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_each_floor_imports_only_below_it(floor: str) -> None:
    graph = import_graph()
    allowed = ALLOWED[floor] | {floor}
    wrong = sorted(
        f"{mod} -> {target}"
        for mod, targets in graph.items()
        if part(mod) == floor
        for target in targets
        if part(target) not in allowed and target not in allowed
    )
    assert wrong == [], f"{floor} may import only {sorted(allowed)}"


@pytest.mark.parametrize("layer", sorted(KERNEL_LAYERS))
def test_the_kernels_jit_code_and_torch_twins_import_no_launch_module(layer: str) -> None:
    graph = import_graph()
    assert any(mod.startswith(layer + ".") for mod in graph), layer
    within = lambda mod, prefix: mod == prefix or mod.startswith(prefix + ".")  # noqa: E731
    wrong = sorted(
        f"{mod} -> {target}"
        for mod, targets in graph.items()
        if within(mod, layer)
        for target in targets
        if not any(within(target, allowed) for allowed in KERNEL_LAYERS[layer])
    )
    assert wrong == [], f"{layer} may import only {sorted(KERNEL_LAYERS[layer])}"


def test_every_part_has_a_floor() -> None:
    assert {part(m) for m in import_graph()} <= set(ALLOWED)


def test_the_package_root_holds_at_most_four_modules() -> None:
    assert len([p for p in ROOT.glob("*.py")]) <= 4, sorted(p.name for p in ROOT.glob("*.py"))


def test_only_the_cli_imports_the_server() -> None:
    """serve is the top floor: it imports the engine; nothing but the CLI imports it (the
    engine and the offline API never depend on the HTTP layer)."""
    graph = import_graph()
    wrong = sorted(f"{mod} -> {target}" for mod, targets in graph.items() for target in targets
                   if part(target) == "serve" and part(mod) not in ("serve", "cli"))
    assert wrong == []
    assert "engine.engine" in graph["serve.loop"]


def test_the_transformers_integration_imports_only_below_and_mla_lazily() -> None:
    graph = import_graph()
    pkg = "integrations.transformers"
    floors = [f"{pkg}.{m}".rstrip(".") for m in TRANSFORMERS_FLOORS]
    assert {m for m in graph if m == pkg or m.startswith(pkg + ".")} == set(floors)
    wrong = sorted(f"{mod} -> {target}" for i, mod in enumerate(floors) for target in graph[mod]
                   if target in floors[i:])
    assert wrong == []
    assert f"{pkg}.mla" not in graph[pkg]
    importers = {mod for mod, targets in graph.items() if f"{pkg}.mla" in targets}
    assert importers == {f"{pkg}.enabling"}
    enabling = ast.parse((ROOT / "integrations" / "transformers" / "enabling.py").read_text())
    top = {node.module for node in enabling.body if isinstance(node, ast.ImportFrom)}
    assert "mla" not in top  # imported inside family_enabler, not when the package is
