"""The serving modules depend one way (docs/ARCHITECTURE.md, train/serve): the target wrapper, then the
round loop, then what builds on it (DDTree, the CUDA-graph target and drafter, the peers, the
summaries, the agreement check), then the command. A circle, even through an import inside a
function, fails here."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.paths import REPO, child_pythonpath

SERVE = REPO / "train" / "serve"
# What each lower module must not load: the modules that build on it.
ABOVE_THE_LOOP = (
    "train.serve.agreement",
    "train.serve.static_target",
    "train.serve.static_drafter",
    "train.serve.peers",
    "train.serve.results",
    "train.serve.tree_decode",
    "train.serve.specdecode_run",
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


def serve_imports(path) -> set[str]:
    """The `train.serve` modules a file imports anywhere (module level or inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "train.serve":
                names |= {f"train.serve.{alias.name}" for alias in node.names}
            else:
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {n for n in names if n.startswith("train.serve.")}


def test_the_serving_modules_import_each_other_without_a_circle():
    graph = {f"train.serve.{p.stem}": serve_imports(p) for p in SERVE.glob("*.py") if p.stem != "__init__"}
    assert "train.serve.decoding" in graph["train.serve.agreement"]  # the graph is read (agreement builds on the loop)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done or module not in graph:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
