"""The real target's prompt sets: user turns built from real text, which the target itself answers
(`make regenerate`, greedy) before extraction.

Training prompts, from what every Python installation carries:
  - "complete" : "Complete the following Python function:" and a function of Python's standard
                 library cut after its docstring (its signature and docstring, as HumanEval's prompts
                 are), one per public function or method with a docstring of 60+ characters;
  - "describe" : "Write a Python function `name(args)` that ..." with the docstring's first sentence;
  - "docs"     : the user turns of the tiny default's corpus (questions on sections of Python's
                 language reference and on module and object docstrings, recipes.tiny.corpus).
A larger, optional training pool ("library", `library_prompts` of the build): the same two forms
for public functions of widely used Python libraries (LIBRARIES: torch, transformers, numpy, pandas,
sympy, ...), one per distinct docstring, at most LIBRARY_FUNCTIONS of them in a fixed hashed order; it
goes to `prompts/library.jsonl`, which the demo does not answer (it is the data ladder's larger rung).
Held out, never trained on: a chat split (a stable hash of each prompt puts 5% of the training pool
there) and HumanEval's 164 prompts (`HUMAN_EVAL` in recipes.smollm2.pins), in the "complete" form.

The training pool is generated once (`python -m recipes.smollm2.prompts`, a maintainer's command) and
shipped in `recipes/smollm2/shipped/` (gzipped JSONL), because another Python version has another
standard library: every machine then answers the same prompts. Each record is
{"messages": [{"role": "user", "content": ...}], "kind": ..., "name": ...}.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

import xxhash

from common.interrupts import run_main
from recipes.tiny.shipped import SHIPPED_DIR

SHIPPED = Path(__file__).resolve().parent / "shipped"
POOL_FILES = {
    "train": "train_prompts.jsonl.gz",
    "chat_heldout": "chat_heldout_prompts.jsonl.gz",
    "library": "library_prompts.jsonl.gz",
}
# Libraries whose public functions make the "library" pool: permissively licensed, widely used, and
# together covering numerics, data, text, web and tooling code. Private modules (a path part starting
# with "_") and test or example code are skipped.
LIBRARIES = (
    "torch", "transformers", "numpy", "pandas", "sympy", "networkx", "matplotlib", "datasets", "pyarrow",
    "accelerate", "huggingface_hub", "tokenizers", "safetensors", "fsspec", "jinja2", "requests", "urllib3",
    "werkzeug", "flask", "click", "rich", "pygments", "packaging", "pydantic", "yaml", "dateutil", "mpmath",
    "PIL", "fontTools", "pyparsing", "attr", "tqdm", "xxhash", "filelock", "psutil", "regex", "markdown_it",
)  # fmt: skip
LIBRARY_FUNCTIONS = 8000
LIBRARY_SKIPPED_DIRS = frozenset({"test", "tests", "testing", "examples", "benchmarks"})
HELDOUT_SHARE = 0.05
MIN_DOC_CHARS = 60
MAX_STUB_CHARS = 2000  # longer docstrings are rare and make prompts far longer than HumanEval's
# Parts of the standard library that are tests, demos or GUI toolkits, not library code.
SKIPPED_DIRS = {"test", "tests", "idlelib", "tkinter", "lib2to3", "ensurepip", "turtledemo", "site-packages"}
SKIPPED_DIRS |= {"venv", "__pycache__", "pydoc_data", "distutils"}
SKIPPED_FILES = {"turtle.py", "this.py", "antigravity.py"}
COMPLETE = "Complete the following Python function:\n\n```python\n{code}\n```"


def complete_prompt(code: str) -> str:
    """The "complete" form, shared by the stub prompts and HumanEval's."""
    return COMPLETE.format(code=code.rstrip("\n"))


def user_record(content: str, kind: str, name: str) -> dict:
    return {"messages": [{"role": "user", "content": content}], "kind": kind, "name": name}


# ----------------------------------------------------------------------------------------------
# Standard-library functions


def stdlib_functions(stdlib: str | None = None) -> Iterator[tuple[str, ast.FunctionDef, str]]:
    """(module path, function node, stub source up to the end of its docstring) of every public
    function and method with a docstring of MIN_DOC_CHARS+, in a fixed order (sorted paths, source order)."""
    root = stdlib or sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
        for filename in sorted(filenames):
            if not filename.endswith(".py") or filename in SKIPPED_FILES:
                continue
            path = os.path.join(dirpath, filename)
            try:
                source = Path(path).read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
                continue
            lines = source.splitlines()
            for node in _functions_in_order(tree):
                doc = ast.get_docstring(node, clean=False)
                if node.name.startswith("_") or not doc or len(doc) < MIN_DOC_CHARS:
                    continue
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                stub = textwrap.dedent("\n".join(lines[start - 1 : node.body[0].end_lineno]))
                if len(stub) <= MAX_STUB_CHARS:
                    yield os.path.relpath(path, root), node, stub


def _functions_in_order(tree: ast.AST) -> list[ast.FunctionDef]:
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def first_sentence(doc: str) -> str:
    """The docstring's first sentence (up to the first blank line or '. '), on one line."""
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    text = " ".join(para.split())
    cut = re.search(r"(?<=[a-z0-9)\]`'\"])\.(\s|$)", text)
    return text[: cut.start() + 1] if cut else text


def signature_text(node: ast.FunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"{node.name}({args})"


def function_prompts(stdlib: str | None = None) -> list[dict]:
    return prompts_of_functions(stdlib_functions(stdlib))


def prompts_of_functions(functions) -> list[dict]:
    """The "complete" and (where the docstring's first sentence is long enough) "describe" prompts of
    each (module path, function node, stub)."""
    records = []
    for module, node, stub in functions:
        name = f"{module[:-3].replace(os.sep, '.')}.{node.name}"
        records.append(user_record(complete_prompt(stub), "complete", name))
        sentence = first_sentence(ast.get_docstring(node) or "")
        if len(sentence) >= 20:
            sentence = sentence[0].lower() + sentence[1:]
            records.append(
                user_record(
                    f"Write a Python function `{signature_text(node)}` that does the following: {sentence}",
                    "describe",
                    name,
                )
            )
    return records


def library_functions(site_packages: str, libraries=LIBRARIES, limit: int = LIBRARY_FUNCTIONS):
    """(module path, node, stub) of public functions of `libraries` found under `site_packages`, one
    per distinct docstring (libraries copy docstrings between their classes), the first `limit` in
    the order of a stable hash of their stubs."""
    by_doc: dict[str, tuple] = {}
    for library in libraries:
        root = os.path.join(site_packages, library)
        if not os.path.isdir(root):
            continue
        for module, node, stub in stdlib_functions(root):
            parts = module.split(os.sep)
            if any(p.startswith("_") or p in LIBRARY_SKIPPED_DIRS for p in parts[:-1]) or parts[-1].startswith("_"):
                continue
            doc = " ".join((ast.get_docstring(node) or "").split())
            by_doc.setdefault(doc, (os.path.join(library, module), node, stub))
    found = sorted(by_doc.values(), key=lambda f: xxhash.xxh3_64_intdigest(f[2].encode("utf-8")))
    return found[:limit]


def build_library_pool(site_packages: str, exclude: set[str], libraries=LIBRARIES) -> list[dict]:
    """The "library" pool: prompts of `library_functions`, none equal to a prompt of `exclude` (the
    standard-library pool and its held-out split), each once, in a fixed shuffled order."""
    seen, records = set(exclude), []
    for record in prompts_of_functions(library_functions(site_packages, libraries)):
        text = record["messages"][0]["content"]
        if text not in seen:  # two functions of one signature and first sentence give one "describe" prompt
            seen.add(text)
            records.append(record)
    random.Random(1).shuffle(records)
    return records


# ----------------------------------------------------------------------------------------------
# The pool, its split, and HumanEval


def doc_prompts() -> list[dict]:
    """The first user turn of every record of the tiny default's shipped corpus (both of its splits)."""
    records = []
    for name in ("train.jsonl.gz", "heldout.jsonl.gz"):
        with gzip.open(SHIPPED_DIR / "corpus" / name, "rt", encoding="utf-8") as f:
            for line in f:
                messages = json.loads(line).get("messages") or []
                users = [m["content"] for m in messages if m.get("role") == "user"]
                if users:
                    records.append(user_record(users[0], "docs", "tiny-corpus"))
    return records


def is_heldout(record: dict) -> bool:
    key = record["messages"][0]["content"].encode("utf-8")
    return xxhash.xxh3_64_intdigest(key) % 10_000 < HELDOUT_SHARE * 10_000


def build_pool(stdlib: str | None = None) -> dict[str, list[dict]]:
    """{"train": [...], "chat_heldout": [...]}: every prompt once (exact duplicates dropped), split by hash,
    in a fixed shuffled order (so that the first N prompts are a sample of every kind: the data-size
    ladder of the demo takes prefixes)."""
    seen, pool = set(), {"train": [], "chat_heldout": []}
    records = function_prompts(stdlib) + doc_prompts()
    random.Random(0).shuffle(records)
    for record in records:
        text = record["messages"][0]["content"]
        if text not in seen:
            seen.add(text)
            pool["chat_heldout" if is_heldout(record) else "train"].append(record)
    return pool


def read_pool(split: str, shipped: Path | None = None) -> list[dict]:
    with gzip.open(Path(shipped or SHIPPED) / POOL_FILES[split], "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_jsonl_gz(path: Path, records: list[dict]) -> None:
    """Deterministic bytes: no timestamp or name in the gzip header."""
    data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode("utf-8")
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", filename="", mtime=0) as f:
        f.write(data)


def human_eval_prompts(jsonl_gz: Path) -> list[dict]:
    """HumanEval's 164 prompts in the "complete" form, in the file's order."""
    with gzip.open(jsonl_gz, "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return [user_record(complete_prompt(t["prompt"]), "humaneval", t["task_id"]) for t in tasks]


def main(argv: list[str] | None = None) -> int:
    """Regenerate the shipped pools (maintainers only): `all` from this Python's standard library and
    site-packages, `library` only the library pool (the shipped standard-library pool kept)."""
    argv = sys.argv[1:] if argv is None else argv
    which = argv[0] if argv else "all"
    if which not in ("all", "library"):
        print("usage: python -m recipes.smollm2.prompts [all|library]", file=sys.stderr)
        return 2
    SHIPPED.mkdir(exist_ok=True)
    pool = build_pool() if which == "all" else {split: read_pool(split) for split in ("train", "chat_heldout")}
    exclude = {r["messages"][0]["content"] for records in pool.values() for r in records}
    pool["library"] = build_library_pool(sysconfig.get_paths()["purelib"], exclude)
    if which == "library":
        pool = {"library": pool["library"]}
    for split, records in pool.items():
        write_jsonl_gz(SHIPPED / POOL_FILES[split], records)
        print(f"{split}: {len(records)} prompts -> {SHIPPED / POOL_FILES[split]}")
    print(f"built on Python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("smollm2 prompts", main))
