"""A real `python -m extract` / `python -m train` process with the fault of `$DFLASH_FAULT` installed.

    DFLASH_FAULT=kill:shard_renamed:3 DFLASH_FAULT_LOG=/tmp/f.jsonl python -m tests.reliability.child extract CONFIG
    python -m tests.reliability.child train key=value ...

Without DFLASH_FAULT the hooks only count how often each point is reached; the counts go to
`$DFLASH_FAULT_LOG` at a normal exit.
"""

from __future__ import annotations

import sys

from tests.reliability import faults


def main(argv: list[str]) -> int:
    stage, args = argv[0], argv[1:]
    faults.install_from_env()
    if stage == "extract":
        from extract.__main__ import main as stage_main
    elif stage == "train":
        from train.__main__ import main as stage_main
    else:
        raise SystemExit(f"unknown stage {stage!r}; expected extract or train")
    code = stage_main(args)
    faults.dump_counts()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
