"""The corpus side (`extract/corpus/`) sits below extraction's run and below regeneration, which both
read corpora through it: it imports neither, not even inside a function, and loads without torch."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

from tests.paths import REPO, child_pythonpath

CORPUS = REPO / "extract" / "corpus"
# What the corpus side may import from the rest of extract/: the config and the ranks (windows).
ALLOWED = ("extract.corpus", "extract.config", "extract.ranks")


def extract_imports(path) -> set[str]:
    """The `extract.*` modules a file imports anywhere (module level or inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} if node.module != "extract" else {f"extract.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name for name in names if name == "extract" or name.startswith("extract.")}


def test_the_corpus_side_imports_nothing_that_builds_on_it():
    files = sorted(CORPUS.glob("*.py"))
    assert len(files) >= 9, files
    reaching_up = {
        path.name: sorted(name for name in extract_imports(path) if not name.startswith(ALLOWED)) for path in files
    }
    assert not any(reaching_up.values()), reaching_up


def test_the_corpus_side_loads_without_torch():
    modules = sorted(f"extract.corpus.{path.stem}" for path in CORPUS.glob("*.py") if path.stem != "__init__")
    code = f"import json, sys, {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout))
    assert "torch" not in loaded
    assert set(modules) <= loaded
    above = {m for m in loaded if m.startswith("extract.") and not m.startswith(ALLOWED)}
    assert not above, sorted(above)
