"""How the packages import each other (docs/ARCHITECTURE.md, "Layout and dependency rules"), over the whole tree:

- no import circle, not even one closed by an import inside a function;
- no upward import between floors: common < {shards, target} < {extract, train} < recipes < benchmarks, where
  packages that share a floor never import each other (tests may import anything);
- the project's own modules imported at the top of a file, except in the entry points, which read
  their options (and answer `--help`) before torch loads: every `__main__.py`, and the modules in
  `LATE_IMPORTS_ALLOWED`, each with its reason;
- in train/serve, the decoding loop loads nothing that builds on it.

The checks read the source with `ast` (a lazy import counts like any other), and the last test
plants each fault in a small tree of its own, so that a check that stopped finding them fails too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO, child_pythonpath

# Floors, lowest first: a module may import its own floor and the ones below. Packages that
# share a floor never import each other.
FLOORS = {"common": 0, "shards": 1, "target": 1, "extract": 2, "train": 2, "recipes": 3, "benchmarks": 4, "tests": 5}
RUNTIME = ("common", "shards", "target", "extract", "train", "recipes")  # where imports belong at the top

_TORCH_AT_HELP = "its --help answers before torch loads"
_TINY_HELP = "loaded by `python -m recipes.tiny --help` (recipes/tiny/__init__.py imports the whole recipe)"
LATE_IMPORTS_ALLOWED = {
    # path: why it imports project modules inside functions (every `__main__.py` may, for one reason:
    # it is a command, and its --help answers before torch loads)
    "train/serve/export.py": f"the command `python -m train.serve.export`: {_TORCH_AT_HELP}",
    "train/serve/specdecode.py": f"the command `python -m train.serve.specdecode`: {_TORCH_AT_HELP}",
    "recipes/demo.py": f"the command `python -m recipes.demo`: {_TORCH_AT_HELP} (recipes.drafter.machine loads it)",
    "recipes/tiny/build.py": f"{_TINY_HELP}; common.device loads torch",
    "recipes/tiny/compute.py": f"{_TINY_HELP}; common.device loads torch",
    "recipes/tiny/regenerate.py": f"{_TINY_HELP}; target.load loads torch",
    "extract/regenerate/local.py": "loaded by `python -m recipes.tiny --help` (its recipe digest); "
    "extract.regenerate.static_batch loads torch",
}


# ----------------------------------------------------------------------------------------------
# Reading the tree


def modules_of(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every Python file in the floors' packages under `root`."""
    found = {}
    for package in FLOORS:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def project_imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for each import of a module in `modules`; `from
    pkg import name` names the submodule pkg.name where there is one, else the package itself."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((resolve(a.name), child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    submodule = f"{child.module}.{alias.name}"
                    found.append(
                        (submodule if submodule in modules else resolve(child.module), child.lineno, in_function)
                    )
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return [(name, line, inside) for name, line, inside in found if name is not None]


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: the project modules it imports anywhere in its file}."""
    modules = modules_of(root)
    return {name: {m for m, _, _ in project_imports(path, modules)} - {name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import each other round a circle (Tarjan's strongly connected
    components with more than one module), as one circle through them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(module: str) -> None:  # the graph has a few hundred modules: recursion is fine
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                connect(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(_one_circle(graph, set(component)))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return found


def _one_circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for other in sorted(graph[module] & component):
            if other == start:
                return paths[module] + [start]
            if other not in paths:
                paths[other] = paths[module] + [other]
                queue.append(other)
    raise AssertionError(f"no circle through {sorted(component)}")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import of a higher floor, or across the extract/train floor."""
    found = []
    for module, imported in sorted(graph.items()):
        here = module.partition(".")[0]
        for other in sorted(imported):
            there = other.partition(".")[0]
            if here != "tests" and (FLOORS[there] > FLOORS[here] or (FLOORS[there] == FLOORS[here] and there != here)):
                found.append(f"{module} -> {other}")
    return found


def late_imports(root: Path, allowed: dict[str, str]) -> list[str]:
    """'path:line module' for each import of a project module inside a function, in runtime code
    outside the entry points."""
    modules = modules_of(root)
    found = []
    for path in modules.values():
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] not in RUNTIME or path.name == "__main__.py" or rel in allowed:
            continue
        found += [f"{rel}:{line} {name}" for name, line, inside in project_imports(path, modules) if inside]
    return sorted(set(found))


# ----------------------------------------------------------------------------------------------
# The tree


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO)


def test_no_module_imports_itself_round_a_circle(graph):
    assert "train.serve.decoding" in graph["train.serve.agreement"]  # the graph is read (agreement builds on the loop)
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_imports_a_floor_above_its_own(graph):
    found = upward_imports(graph)
    assert not found, (
        "upward imports (common < {shards, target} < {extract, train} < recipes < benchmarks):\n" + "\n".join(found)
    )


def test_project_modules_are_imported_at_the_top_outside_entry_points():
    found = late_imports(REPO, LATE_IMPORTS_ALLOWED)
    assert not found, "imports inside functions (move them to the top, or name the entry point):\n" + "\n".join(found)


@pytest.mark.parametrize("path", sorted(LATE_IMPORTS_ALLOWED))
def test_each_allowed_entry_point_still_needs_its_exception(path):
    modules = modules_of(REPO)
    assert any(inside for _, _, inside in project_imports(REPO / path, modules)), (
        f"{path} imports nothing inside a function any more: take it off LATE_IMPORTS_ALLOWED"
    )


# ----------------------------------------------------------------------------------------------
# The checks find what they look for


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checks_find_a_planted_circle_an_upward_import_and_a_late_import(tmp_path):
    _plant(
        tmp_path,
        {
            "common/__init__.py": "",
            "common/a.py": "def f():\n    from common import b\n",  # closes the circle from inside a function
            "common/b.py": "import common.a\n",
            "shards/__init__.py": "",
            "shards/up.py": "from train.loop import train\n",  # a floor above
            "extract/__init__.py": "",
            "extract/side.py": "from train import loop\n",  # across the extract/train floor
            "train/__init__.py": "",
            "shards/base.py": "",
            "train/loop.py": "from shards import base\n\ndef train():\n    pass\n",
            "train/__main__.py": "def main():\n    from train.loop import train\n",  # an entry point: allowed
            "recipes/__init__.py": "",
            "recipes/cli.py": "def main():\n    from train import loop\n",
            "tests/__init__.py": "",
            "tests/test_x.py": "from recipes import cli\n",  # tests may import anything
        },
    )
    graph = import_graph(tmp_path)
    assert circles(graph) == [["common.a", "common.b", "common.a"]]
    assert upward_imports(graph) == ["extract.side -> train.loop", "shards.up -> train.loop"]
    assert late_imports(tmp_path, {}) == ["common/a.py:2 common.b", "recipes/cli.py:2 train.loop"]
    assert late_imports(tmp_path, {"recipes/cli.py": "a command"}) == ["common/a.py:2 common.b"]
    assert circles({"x": {"y"}, "y": {"z"}, "z": {"x", "w"}, "w": set()}) == [["x", "y", "z", "x"]]


# ----------------------------------------------------------------------------------------------
# train/serve: the decoding loop, then what builds on it

# What each lower module must not load: the modules that build on it.
ABOVE_THE_LOOP = (
    "train.serve.agreement",
    "train.serve.static_target",
    "train.serve.static_drafter",
    "train.serve.peers",
    "train.serve.results",
    "train.serve.tree_decode",
    "train.serve.specdecode_run",
    "train.serve.specdecode",
)


def loaded_after_import(module: str) -> set[str]:
    """The `train.serve` modules in `sys.modules` after importing `module` in a fresh interpreter."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('train.serve.')))"
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env=env)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("train.serve.decoding", ABOVE_THE_LOOP),
        ("train.serve.spec_target", ("train.serve.decoding", *ABOVE_THE_LOOP)),
    ],
)
def test_the_decoding_loop_loads_nothing_that_builds_on_it(module, forbidden):
    loaded = loaded_after_import(module)
    assert module in loaded
    assert not loaded & set(forbidden), sorted(loaded & set(forbidden))
