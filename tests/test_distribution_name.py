"""This project's distribution is `sparse-decode-framework`: PyPI's `sparse-framework` is an
unrelated project, so a dependency on that name, or a `pip install` of it, installs someone
else's package. Every tracked file (`git ls-files`) is scanned for such a requirement:

- a `pip install` / `pip3 install` / `uv pip install` / `pipx install` / `uv add` / `poetry add`
  line with a requirement naming it (`sparse-framework`, `sparse_framework[...]`, `Sparse.Framework>=1`:
  names compare as PyPI normalises them);
- a quoted requirement naming it with a version, extras, a marker or a URL
  (`"sparse-framework>=0.1"`, `'sparse-framework[flashmla]'`), in any file;
- a dependency list naming it bare or not: `pyproject.toml`'s build-system requires, project
  dependencies, optional dependencies, dependency groups and Poetry's tables, requirements and
  constraints files, `setup.py`'s and `setup.cfg`'s requires, and `dependencies = [...]` /
  `requires = [...]` lines elsewhere (a pyproject quoted in a doc).

What is not a requirement passes: the command `sparse-framework` (`sparse-framework run`,
`prog="sparse-framework"`), the cache folder `~/.cache/sparse-framework`, the import name
`sparse_framework`, and prose that says PyPI's `sparse-framework` is unrelated (README)."""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RIGHT = "sparse-decode-framework"
WRONG = "sparse-framework"  # as PyPI normalises names

SKIPPED_DIRS = {
    "benchmarks/results/": "recorded output of earlier runs, kept as written (one holds a since-fixed "
                           "install hint of backends/flashmla.py); nothing installs from them",
}
SKIPPED_FILES = {"tests/test_distribution_name.py": "holds the requirements its own detector must find"}

PENDING: dict[tuple[str, str], str] = {}
"""Findings known and left to another change: (path, the stripped line) -> what to do. Each
must still be found (test_pending_findings_are_still_there), so that a fixed one is removed."""

NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
INSTALL = re.compile(r"\b(?:(?:uv\s+)?pip3?\s+install|pipx\s+install|uv\s+add|poetry\s+add)\b(?P<args>.*)", re.I)
SHELL_END = re.compile(r"&&|\|\||[;|#`)]|\$\(")
QUOTED_SPEC = re.compile(  # up to the closing quote of the same kind (a marker may quote the other)
    r"""(?P<q>["'])\s*sparse[-_.]+framework\s*(?:\[[^\]\n]*\]\s*)?"""
    r"""(?:(?:[<>=!~]=?|===|;|@)(?:(?!(?P=q))[^\n])*)?(?P=q)""",
    re.I,
)
QUOTED_WITH_MORE = re.compile(r"""["']\s*sparse[-_.]+framework\s*(?:\[|[<>=!~;@])""", re.I)
DEPENDENCY_LINE = re.compile(
    r"\b(?:dependencies|requires|install_requires|setup_requires|tests_require|extras_require|build-requires)\b"
    r"\s*[=:]", re.I,
)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names_wrong_distribution(requirement: str) -> bool:
    """Whether a PEP 508 requirement (or a pip argument) names `sparse-framework`."""
    text = requirement.strip().strip("'\"`,()").strip()
    match = NAME.match(text)
    if match is None:
        return False
    rest = text[match.end():].lstrip()
    if rest and rest[0] not in "[<>=!~;@(":
        return False  # a path (examples/...), a URL, an option's value: not a requirement by name
    return normalise(match.group()) == WRONG


def install_line_findings(line: str) -> list[str]:
    """The requirements of a `pip install ...` (or alike) line that name the wrong distribution."""
    found = []
    for match in INSTALL.finditer(line):
        args = SHELL_END.split(match.group("args"), maxsplit=1)[0]
        found += [token for token in args.split() if not token.startswith("-") and names_wrong_distribution(token)]
    return found


def line_findings(line: str) -> list[str]:
    """What in one line of any text file names the wrong distribution as a requirement."""
    found = install_line_findings(line)
    found += [m.group() for m in QUOTED_SPEC.finditer(line) if QUOTED_WITH_MORE.match(m.group())]
    if DEPENDENCY_LINE.search(line):
        found += [q for q in re.findall(r"""["']([^"'\n]*)["']""", line) if names_wrong_distribution(q)]
    return found


def _line_of(text: str, needle: str) -> int:
    for number, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return number
    return 0


def pyproject_findings(text: str) -> list[tuple[int, str]]:
    """Requirements in a pyproject.toml's dependency tables that name the wrong distribution."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return []
    specs: list[str] = list(data.get("build-system", {}).get("requires", []))
    project = data.get("project", {})
    specs += project.get("dependencies", [])
    for group in project.get("optional-dependencies", {}).values():
        specs += group
    for group in data.get("dependency-groups", {}).values():
        specs += [s for s in group if isinstance(s, str)]
    poetry = data.get("tool", {}).get("poetry", {})
    tables = [poetry.get("dependencies", {}), poetry.get("dev-dependencies", {})]
    tables += [g.get("dependencies", {}) for g in poetry.get("group", {}).values()]
    specs += [name for table in tables for name in table]
    return [(_line_of(text, spec), spec) for spec in specs if isinstance(spec, str) and names_wrong_distribution(spec)]


def requirements_findings(text: str) -> list[tuple[int, str]]:
    """A requirements / constraints file: one requirement a line (options and comments skipped)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        spec = line.split(" #", 1)[0].strip()
        if spec.startswith(("-e ", "--editable ")):
            spec = spec.split(None, 1)[1]
        if spec and not spec.startswith(("#", "-")) and names_wrong_distribution(spec):
            found.append((number, spec))
    return found


def setup_py_findings(text: str) -> list[tuple[int, str]]:
    """setup(install_requires=..., extras_require=..., setup_requires=..., tests_require=...)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in {"install_requires", "extras_require", "setup_requires",
                                                          "tests_require"}:
            for const in ast.walk(node.value):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    if names_wrong_distribution(const.value):
                        found.append((const.lineno, const.value))
    return found


def setup_cfg_findings(text: str) -> list[tuple[int, str]]:
    parser = configparser.ConfigParser()
    try:
        parser.read_string(text)
    except configparser.Error:
        return []
    found = []
    for section in parser.sections():
        for key, value in parser.items(section):
            if section == "options.extras_require" or key in {"install_requires", "setup_requires", "tests_require"}:
                found += [(_line_of(text, s.strip()), s.strip()) for s in value.splitlines()
                          if names_wrong_distribution(s)]
    return found


def file_findings(path: str, text: str) -> list[tuple[int, str]]:
    """(line, what) for each line of one file that names the wrong distribution as a
    requirement (the first requirement found in the line)."""
    name = Path(path).name
    found: list[tuple[int, str]] = []
    if name == "pyproject.toml":
        found += pyproject_findings(text)
    elif name == "setup.py":
        found += setup_py_findings(text)
    elif name == "setup.cfg":
        found += setup_cfg_findings(text)
    elif re.fullmatch(r"(?:.*requirements.*|constraints.*)\.(?:txt|in)", name, re.I):
        found += requirements_findings(text)
    found += [(number, what) for number, line in enumerate(text.splitlines(), 1) for what in line_findings(line)]
    by_line: dict[int, str] = {}
    for number, what in found:
        by_line.setdefault(number, what)
    return sorted(by_line.items())


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc})")
    return [p for p in out.decode().split("\0") if p]


def repository_findings() -> list[tuple[str, int, str, str]]:
    """(path, line, the stripped line, what) over every tracked file."""
    found = []
    for path in tracked_files():
        if path in SKIPPED_FILES or any(path.startswith(d) for d in SKIPPED_DIRS):
            continue
        try:
            raw = (REPO / path).read_bytes()
        except OSError:  # tracked but deleted in the working tree
            continue
        if b"\0" in raw:
            continue  # binary
        text = raw.decode("utf-8", errors="replace")
        lines = text.splitlines()
        for number, what in file_findings(path, text):
            found.append((path, number, lines[number - 1].strip() if 0 < number <= len(lines) else "", what))
    return found


def test_no_tracked_file_depends_on_the_unrelated_sparse_framework() -> None:
    found = [f for f in repository_findings() if (f[0], f[2]) not in PENDING]
    assert not found, (
        f"these name PyPI's `{WRONG}`, an unrelated project, as a requirement; this project's distribution is "
        f"`{RIGHT}` (install it from the checkout):\n"
        + "\n".join(f"  {path}:{number}: {what!r}  ({line})" for path, number, line, what in found)
    )


def test_pending_findings_are_still_there() -> None:
    found = {(path, line) for path, _, line, _ in repository_findings()}
    fixed = [f"{path}: {line!r}" for path, line in PENDING if (path, line) not in found]
    assert not fixed, "fixed: delete from PENDING in tests/test_distribution_name.py:\n" + "\n".join(fixed)


# -- the detector ---------------------------------------------------------------------------

OLD_EXAMPLE_PYPROJECT = '''[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "sparse-plugin-example"
version = "0.1.0"
# torch and pydantic come with sparse-framework.
dependencies = ["sparse-framework>=0.1"]

[project.entry-points."sparse_framework.algorithms"]
keynorm = "sparse_plugin_example.keynorm:KeyNorm"
'''


def test_the_examples_old_pyproject_would_have_been_caught() -> None:
    assert file_findings("examples/sparse-plugin-example/pyproject.toml", OLD_EXAMPLE_PYPROJECT) == [
        (9, "sparse-framework>=0.1")]
    # a bare name in a dependency table is a requirement too
    bare = OLD_EXAMPLE_PYPROJECT.replace('"sparse-framework>=0.1"', '"sparse-framework"')
    assert (9, "sparse-framework") in file_findings("pyproject.toml", bare)
    fixed = OLD_EXAMPLE_PYPROJECT.replace('"sparse-framework>=0.1"', f'"{RIGHT}>=0.1"')
    assert file_findings("pyproject.toml", fixed) == []


@pytest.mark.parametrize("line", [
    "pip install sparse-framework",
    "python -m pip install --upgrade 'sparse-framework[flashmla]' && sparse-framework eval",
    "uv pip install Sparse_Framework==0.1",
    "pip3 install -U torch sparse.framework",
    "poetry add sparse-framework",
    "or `pip install 'sparse-framework[flashmla]'`, SGLang's prebuilt wheel",
    'install_requires=["torch", "sparse-framework"],',
    "    'sparse-framework ; python_version >= \"3.10\"',",
    'dependencies = ["sparse-framework>=0.1"]',
])
def test_requirements_of_the_wrong_distribution_are_found(line: str) -> None:
    assert line_findings(line), line


@pytest.mark.parametrize("line", [
    "sparse-framework run --config '{\"algorithm\": \"quest\"}'",
    'prog="sparse-framework",',
    'result["command"] = " ".join(["sparse-framework", *sys.argv[1:]])',
    "CLI=(sparse-framework)  # the command bench runs",
    "PyPI (the `sparse-framework` there is an unrelated project: installing that name gets",
    "The cache lives in `~/.cache/sparse-framework/models/<name>/`",
    "pip install -e examples/sparse-plugin-example      # from the sparse-framework checkout",
    'python -m pip install -e ".[dev]" && sparse-framework eval --no-progress',
    'name = "sparse-framework-toy-plugin"',
    'dependencies = ["sparse-decode-framework>=0.1"]',
    "from sparse_framework.integrations.vllm import register  # pip install vllm",
])
def test_what_is_not_a_requirement_passes(line: str) -> None:
    assert line_findings(line) == [], line


def test_requirements_files_setup_py_and_setup_cfg() -> None:
    assert requirements_findings("torch==2.13.0\n# sparse-framework\nsparse-framework>=0.1  # no\n-e .\n") == [
        (3, "sparse-framework>=0.1")]
    assert setup_py_findings('from setuptools import setup\nsetup(install_requires=["torch", "sparse_framework"])\n') == [
        (2, "sparse_framework")]
    assert setup_cfg_findings("[options]\ninstall_requires =\n    torch\n    sparse-framework\n") == [
        (4, "sparse-framework")]
