"""`python3 -m tests.gpu_tier [PART[,PART...]] [--out DIR] [--wheels DIR] [-n N] [--budget-s S] [-- PYTEST ARGS]`
(`make test-gpu part=PART`): the GPU tier (tests/gpu), whole or in named parts, each one device command on a
bare host, with its counts written to DIR/gpu-tier-PART.json and printed in one line.

    kernels     flex attention against SDPA, the compiled train step against the eager one   (compilation-bound)
    extraction  extraction on CUDA with fla against the reference, the regeneration kernels  (fla's Triton kernels)
    training    the train command on CUDA: a run and its resume, a quantized projected tier  (child processes)
    decoding    speculative decoding on CUDA: lossless, graphed, compiled                    (CUDA graphs, inductor)
    all         every test of the tier in one command (default)

Before the clock starts it installs the carried wheels of DIR (default .whl) and checks that the modules the tests
import are importable (`benchmarks.suites.host`: one line naming each missing wheel), as the GPU suites do. Pytest
then runs under a deadline (`--budget-s`, default 450: with the set-up inside the 8 minutes a part has), with
`tests.gpu_tier_report` writing the summary after every test, so a run the deadline stops still says what ran,
what passed, and which tests were running. Exit status: pytest's, or 124 where the deadline stopped it.

Standard library only until pytest starts: the wheels that bring pytest and xdist may be the carried ones.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.suites.deadline import TIMED_OUT
from benchmarks.suites.host import REPO, needed_modules, ready, third_party

GPU = REPO / "tests" / "gpu"
# The tier's modules by what they cost, so that each part is one device command on a bare host: a module of
# tests/gpu belongs to exactly one part (tests/benchmarks/test_gpu_tier.py checks).
PARTS = {
    "kernels": ("test_attention_cuda.py", "test_compile_cuda.py"),
    "extraction": ("test_extract_cuda.py", "test_regenerate_cuda.py"),
    "training": ("test_train_cuda.py", "test_tiers_cuda.py"),
    "decoding": ("test_specdecode_cuda.py", "test_rollback_cuda.py"),
}
REPORT_ENV = "DFLASH_GPU_TIER_SUMMARY"  # where tests.gpu_tier_report writes the summary


def files_of(names: list[str]) -> list[Path]:
    """The tier's test files of the named parts ("all": every one), in order, each once."""
    unknown = [n for n in names if n != "all" and n not in PARTS]
    if unknown:
        raise SystemExit(f"tests.gpu_tier: no part {unknown[0]!r}; the parts: {', '.join(PARTS)}, all")
    chosen = [f for n in names for f in (sorted(p.name for p in GPU.glob("test_*.py")) if n == "all" else PARTS[n])]
    return [GPU / f for f in dict.fromkeys(chosen)]


def test_modules(files: list[Path]) -> list[str]:
    """The third-party modules imported at the top of `files`, of the test modules they import (transitively) and of
    the conftest files pytest loads with them: what the tier needs importable besides the project's own needs."""
    seen: set[Path] = set()
    todo = [*files, REPO / "tests" / "conftest.py", GPU / "conftest.py", GPU / "__init__.py"]
    found: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name.startswith("tests."):
                    base = REPO.joinpath(*name.split("."))
                    todo += [base.with_suffix(".py"), base / "__init__.py"]
                found |= third_party({name.split(".")[0]})
    return sorted(found)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, _, extra = (argv[: argv.index("--")], "--", argv[argv.index("--") + 1 :]) if "--" in argv else (argv, "", [])
    p = argparse.ArgumentParser(prog="python3 -m tests.gpu_tier", description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="?", default="all", help=f"comma-separated: {', '.join(PARTS)}, all")
    p.add_argument("--out", default=None, help="the summaries' folder (default: $OUT, else bench-out/gpu-tier)")
    p.add_argument("--wheels", default=".whl")
    p.add_argument("-n", dest="workers", type=int, default=4, help="pytest-xdist workers (0: none)")
    p.add_argument("--budget-s", type=float, default=450.0)
    return p.parse_args(own), extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(list(sys.argv[1:] if argv is None else argv))
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    files = files_of(names)
    tag = "-".join(names)
    out = Path(args.out or os.environ.get("OUT") or "bench-out/gpu-tier")
    out.mkdir(parents=True, exist_ok=True)
    summary = out / f"gpu-tier-{tag}.json"
    plugins = ["pytest", "pytest_timeout", *(["xdist"] if args.workers else [])]
    env = ready(args.wheels, sorted({*needed_modules(), *test_modules(files), *plugins}))
    env |= {REPORT_ENV: str(summary), "PYTHONUNBUFFERED": "1"}
    pytest = ["-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "tests.gpu_tier_report", "-p", "no:cacheprovider"]
    pytest += [*(["-n", str(args.workers)] if args.workers else []), *map(str, files), *extra]
    command = [sys.executable, "-m", "benchmarks.suites.deadline", f"{args.budget_s:.0f}", "--", *pytest]
    machine = gpu_machine()
    print(f"GPU tier, {tag}: {machine or 'no GPU'}; {len(files)} modules, -n {args.workers}", flush=True)
    started = time.time()
    code = subprocess.run(command, env=env, cwd=REPO).returncode
    print(summary_line(tag, summary, time.time() - started, code, args.budget_s, machine), flush=True)
    return code


def gpu_machine() -> dict:
    """The GPUs `nvidia-smi` lists (name, memory) and the CPU cores, without loading torch; {} without a GPU."""
    try:
        rows = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    gpus = [line.split(",") for line in rows.splitlines() if "," in line]
    if not gpus:
        return {}
    memory = float(gpus[0][1]) / 1024
    return {"gpu": gpus[0][0].strip(), "gpus": len(gpus), "gpu_memory_gib": round(memory, 1), "cores": os.cpu_count()}


def summary_line(tag: str, path: Path, seconds: float, code: int, budget_s: float, machine: dict | None = None) -> str:
    """One line: how many tests ran, passed, failed, errored, were skipped (from the report plugin's summary)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return f"GPU tier, {tag}: no summary was written ({path}); pytest exit {code} after {seconds:.0f} s"
    found |= {"wall_s": round(seconds, 1), "exit": code, "stopped_at_time_limit": code == TIMED_OUT}
    found |= {"machine": machine or {}, "command": " ".join(["python3 -m tests.gpu_tier", *sys.argv[1:]])}
    path.write_text(json.dumps(found, indent=1) + "\n")
    counts = ", ".join(f"{found[k]} {k}" for k in ("passed", "failed", "errors", "skipped"))
    line = f"GPU tier, {tag}: {found['ran']} of {found['collected']} ran: {counts} in {seconds:.0f} s"
    if code == TIMED_OUT:
        running = ", ".join(found.get("running") or []) or "none"
        line += f"; stopped at the time limit ({budget_s:.0f} s), running then: {running}"
    return f"{line}; pytest exit {code}; summary {path}"


if __name__ == "__main__":
    raise SystemExit(main())
