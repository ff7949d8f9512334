"""The size rules (docs/ARCHITECTURE.md, the developers' guide), over the whole tree:

- a runtime file (common, shards, target, extract, train, recipes) holds at most 600 lines;
- a function (a method, a nested function) spans at most 100 lines, from its `def` to its last
  line, in every package outside benchmarks/ (tests included);

except what `SIZE_ALLOWED` names, each with its reason (like the late imports of
tests/test_layering.py). The last test plants each fault in a small tree of its own, so that a check
that stopped finding them fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import REPO

RUNTIME = ("common", "shards", "target", "extract", "train", "recipes")
FUNCTION_RULE = (*RUNTIME, "tests")  # benchmarks/ may hold long measuring scripts
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100
SIZE_ALLOWED: dict[str, str] = {
    # "path" (a file over the line limit) or "path::function" (a function over it): why it may be.
    "train/export_format/dflash_hf.py": "copied verbatim into every export as its dflash.py, the one file "
    "AutoModel(trust_remote_code=True) runs: DFlash and DFlash2 (convolution, selector, propose) must sit in it "
    "whole, with no import of this project",
}


def long_files(root: Path, allowed: dict[str, str]) -> list[str]:
    """'path: N lines' for each runtime file over MAX_FILE_LINES."""
    found = []
    for package in RUNTIME:
        for path in sorted((root / package).rglob("*.py")):
            rel, lines = path.relative_to(root).as_posix(), len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_FILE_LINES and rel not in allowed:
                found.append(f"{rel}: {lines} lines")
    return found


def long_functions(root: Path, allowed: dict[str, str]) -> list[str]:
    """'path::function: N lines' for each function over MAX_FUNCTION_LINES (nested ones by their own span)."""
    found = []
    for package in FUNCTION_RULE:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{rel}::{node.name}" not in allowed:
                    found.append(f"{rel}::{node.name}: {lines} lines")
    return found


def test_runtime_files_hold_at_most_600_lines():
    found = long_files(REPO, SIZE_ALLOWED)
    assert not found, f"runtime files over {MAX_FILE_LINES} lines (split them by job):\n" + "\n".join(found)


def test_functions_span_at_most_100_lines_outside_benchmarks():
    found = long_functions(REPO, SIZE_ALLOWED)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(found)


def test_each_allowed_size_still_needs_its_exception():
    over = [line.rpartition(":")[0] for line in long_files(REPO, {}) + long_functions(REPO, {})]
    stale = [entry for entry in SIZE_ALLOWED if entry not in over]
    assert not stale, f"within the limits now: take them off SIZE_ALLOWED: {stale}"


def test_the_checks_find_a_planted_long_file_and_long_function(tmp_path):
    def function(name: str, lines: int) -> str:  # `lines` lines from its def to its end
        return f"def {name}():\n" + "    x = 1\n" * (lines - 1)

    files = {
        "train/long.py": "\n" * 600 + "x = 1\n",  # 601 lines
        "train/fits.py": "\n" * 599 + "x = 1\n",  # 600 lines
        "shards/f.py": function("ok", 100) + "\n\nclass C:\n    " + function("long", 101).replace("\n", "\n    "),
        "tests/t.py": function("test_long", 101),
        "benchmarks/b.py": function("measure", 300) + "\n" * 700,  # neither rule holds here
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert long_files(tmp_path, {}) == ["train/long.py: 601 lines"]
    assert long_files(tmp_path, {"train/long.py": "a reason"}) == []
    assert long_functions(tmp_path, {}) == ["shards/f.py::long: 101 lines", "tests/t.py::test_long: 101 lines"]
    assert long_functions(tmp_path, {"tests/t.py::test_long": "a reason"}) == ["shards/f.py::long: 101 lines"]
