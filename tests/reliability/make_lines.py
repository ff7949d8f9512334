"""Scenario 5's Makefile family (issue 54): what `make` passes to each command, word for word.

Every documented `make` line (README.md, docs/*.md, the Makefile's header) runs for real in a copy of
the Makefile with a stand-in interpreter (`PY=`) that records the argument vector each command gets;
it must be the one the line means (`expected`, from the Makefile's contract in its header). Then values
holding `&`, spaces, quotes, `$`, `;`, `|` or a TOML array reach the drafter, the extraction and the
demo as one argument each (nothing of them runs in a shell), a multi-word RUN and ARGS are passed once,
a fresh clone's `make train` / `make bench-train` runs its set-up prelude's two commands, and CONFIG
reaches the drafter and the demos. The short version: tests/test_makefile.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.paths import REPO

OWN_VARS = {"CONFIG", "RUN", "PYTHON", "PY", "VENV", "CKPT", "DATA", "OUT", "ARGS", "suite", "WHEELS"}
TINY = "configs/tiny.toml"
PRELUDE = [["-m", "recipes.tiny"], ["-m", "extract", TINY]]
# Each start: its arguments, each ended by a unit separator, then a record separator (a shell script: fast).
RECORDER = """#!/bin/sh
{ for word in "$@"; do printf '%s\\037' "$word"; done; printf '\\036'; } >> "$ARGV_LOG"
"""


def make_sandbox(root: Path) -> Path:
    """A copy of the Makefile in `root` whose set-up is done (a .venv/.installed newer than pyproject.toml)
    and a recording interpreter; no tiny shards there, so the set-up prelude of train runs."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "Makefile", root / "Makefile")
    (root / "pyproject.toml").write_text("")
    (root / ".venv").mkdir(exist_ok=True)
    past = time.time() - 100
    os.utime(root / "pyproject.toml", (past, past))
    (root / ".venv" / ".installed").write_text("")
    (root / "rec").write_text(RECORDER)
    (root / "rec").chmod(0o755)
    return root


def argvs(sandbox: Path, words: list[str]) -> list[list[str]]:
    """The argument vectors the commands of `make WORDS` were started with (after `python`), in order."""
    log = sandbox / "argv.log"
    log.unlink(missing_ok=True)
    done = subprocess.run(
        ["make", "-s", *words, f"PY={sandbox / 'rec'}"],
        cwd=sandbox,
        env={**os.environ, "ARGV_LOG": str(log)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"make {shlex.join(words)}: exit {done.returncode}: {done.stderr[-800:]}"
    starts = log.read_text().split("\x1e")[:-1] if log.exists() else []
    return [start.split("\x1f")[:-1] for start in starts]


def expected(words: list[str]) -> list[list[str]]:
    """What `make WORDS` must start, from the Makefile's contract (its header): each NAME=value not read by
    the Makefile itself is one argument, sorted by name; CONFIG, CKPT, DATA, OUT, suite and a training's RUN
    one argument each; ARGS and a report's RUN split into words."""
    target = words[0]
    given = dict(word.split("=", 1) for word in words[1:])
    overrides = [f"{k}={given[k]}" for k in sorted(given) if k not in OWN_VARS]
    args = shlex.split(given.get("ARGS", ""))
    config = given.get("CONFIG", TINY)
    optional_config = [given["CONFIG"]] if "CONFIG" in given else []
    prelude = PRELUDE if config == TINY else []
    recipes = {
        "demo": "recipes.demo",
        "drafter": "recipes.drafter",
        "tiny": "recipes.tiny",
        "smollm2": "recipes.smollm2",
    }
    benches = {
        "bench-shards": "benchmarks.shards",
        "bench-tiers": "benchmarks.shard_tiers",
        "bench-extract": "benchmarks.extract",
        "bench-regenerate": "benchmarks.regenerate",
        "bench-render": "benchmarks.render",
        "reliability": "tests.reliability",
    }
    lint = [["-m", "ruff", "format", "--check", "."], ["-m", "ruff", "check", "."], ["-m", "mypy"]]
    if target in recipes:
        return [["-m", recipes[target], *optional_config, *overrides]]
    if target in benches:
        return [["-m", benches[target], *args, *overrides]]
    if target in ("extract", "regenerate"):
        build = [["-m", "recipes.tiny"]] if config == TINY else []
        return [*build, ["-m", "extract" if target == "extract" else "extract.regenerate", config, *overrides]]
    if target == "train":
        run = [f"run_name={given['RUN']}"] if given.get("RUN") else []
        return [*prelude, ["-m", "train", config, *run, *overrides]]
    if target == "bench-train":
        return [*prelude, ["-m", "benchmarks.train", *args, *overrides]]
    if target == "tiers":
        return [*prelude, ["-m", "recipes.compare_tiers", config, *overrides]]
    if target == "eval":
        data = ["--data", given["DATA"]] if given.get("DATA") else []
        return [["-m", "train.eval", *[given[k] for k in ("CKPT",) if given.get(k)], *data, *overrides, *args]]
    if target == "export":
        paths = [given[k] for k in ("CKPT", "OUT") if given.get(k)]
        return [["-m", "train.serve.export", *paths, *overrides, *args]]
    if target == "specdecode":
        return [["-m", "train.serve.specdecode", *overrides, *args]]
    if target == "report":
        return [["-m", "train.report", *given.get("RUN", "").split(), *overrides, *args]]
    if target == "bench-gpu":
        suite = [given["suite"]] if given.get("suite") else []
        return [["-m", "benchmarks.suites", *suite, "--wheels", given.get("WHEELS", ".whl"), *args, *overrides]]
    if target == "test":
        return [*lint, ["-m", "pytest", "-q", "-n", "2", *args]]
    if target == "test-gpu":
        return [["-m", "tests.gpu_tier", given.get("part", "all"), "--wheels", given.get("WHEELS", ".whl"), *args]]
    if target == "lint":
        return lint
    if target == "format":
        return [["-m", "ruff", "check", "--fix", "."], ["-m", "ruff", "format", "."]]
    raise AssertionError(f"no expectation for make {target}")


def documented_lines() -> list[tuple[str, list[str]]]:
    """(where, the words after `make`) of every `make` line the docs show: in code blocks, in inline code,
    and in the Makefile's header (its optional [parts] left out). Lines with placeholders ('...', '*') are
    not commands."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if path.name == "reliability.md":
            continue
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            texts = [line.strip()] if fenced and line.strip().startswith("make ") else []
            texts += [] if fenced else re.findall(r"`(make [a-z][^`]*)`", line)
            found += [(f"{path.name}:{number}", text) for text in texts]
    for number, line in enumerate((REPO / "Makefile").read_text().splitlines(), 1):
        if line.startswith("#   make "):
            text = re.sub(r"\[[^\]]*\]", "", line[1:].split("  ", 2)[1] if "  " in line[5:] else line[1:])
            found.append((f"Makefile:{number}", text.strip()))
    lines = []
    for where, text in found:
        words = shlex.split(text, comments=True)[1:]
        if words and "..." not in text and "*" not in text and all(w.count("=") or i == 0 for i, w in enumerate(words)):
            lines.append((where, words))
    return lines


TRICKY = [
    "out_dir=s3://bucket/p?endpoint_override=127.0.0.1:9000&scheme=http",
    "prompts=my prompts.jsonl",
    "heldout=it's here.jsonl",
    "chat_template=$HOME/t.jinja",
    "note=$(shell touch pwned)",
    "server=a;b|c>d",
    'tiers=["fp8","nf4-g64","fp8@pca:rank=32"]',
    "train.optim.max_steps=3",
]


def real_make(words: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`make WORDS` in the checkout with this interpreter (set-up taken as done: VENV is a folder whose
    .installed is newer than pyproject.toml)."""
    venv = tmp_path / "venv"
    venv.mkdir(exist_ok=True)
    (venv / ".installed").write_text("")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        ["make", "-s", "-C", str(REPO), *words, f"PY={sys.executable}", f"VENV={venv}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def run_all(tally, work: Path) -> str:
    sandbox = make_sandbox(work / "make")
    lines = documented_lines()
    for where, words in lines:
        got = argvs(sandbox, words)
        tally.add("make:documented line", got == expected(words), f"{where}: make {shlex.join(words)}: got {got}")
    for target in ("drafter", "extract", "demo", "tiny", "regenerate", "train", "tiers"):
        got = argvs(sandbox, [target, *TRICKY])
        tally.add("make:shell characters", got == expected([target, *TRICKY]), f"make {target} TRICKY: got {got}")
    tally.add("make:shell characters", not (sandbox / "pwned").exists(), "a value's $(shell ...) ran")
    for words in (["report", "RUN=runs/a runs/b"], ["eval", "CKPT=c", "DATA=d", "ARGS=--max-anchors 4"]):
        got = argvs(sandbox, words)
        tally.add("make:multi-word", got == expected(words), f"make {shlex.join(words)}: got {got}")
    for words in (["train"], ["bench-train"], ["drafter", "CONFIG=mine.toml"], ["smollm2", "CONFIG=mine.toml"]):
        got = argvs(sandbox, words)
        tally.add("make:prelude and config", got == expected(words), f"make {shlex.join(words)}: got {got}")
    return f"make: {len(lines)} documented lines run with a recording interpreter"
