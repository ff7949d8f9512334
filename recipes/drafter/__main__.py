"""`python -m recipes.drafter target=DIR prompts=FILE [key=value ...] [STAGE.key=value ...]`
(`make drafter`): a checked, exported drafter for your own target (recipes.drafter).

Exit statuses: docs/ARCHITECTURE.md, "Exit status"; rerunning the same command resumes."""

from __future__ import annotations

import os
import sys

from common.config import ConfigError, describe
from common.interrupts import run_main
from recipes.drafter.config import STAGES, DrafterRecipeConfig, parse_drafter_args

USAGE = f"""usage: python -m recipes.drafter [CONFIG.toml] target=DIR prompts=FILE [key=value ...] [STAGE.key=value ...]

Regenerates your prompts' answers with the target, extracts, trains, evaluates, exports and decodes
speculatively on held-out prompts, then writes the training-health report; every step is skipped when
its output is there and was made with the same settings. STAGE.key=value sets a stage's own key
(stages: {", ".join(STAGES)}; `python -m <stage> --help` lists its keys), e.g. train.optim.max_steps=200."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # As `make drafter` sets it (read when torch loads, here and in every step): busy-waiting OpenMP
    # threads starve each other on a few shared cores (docs/benchmarks.md, "make drafter").
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if any(word in ("-h", "--help") for word in argv):
        print(USAGE + "\n\nkeys:\n" + describe(DrafterRecipeConfig))
        return 0
    try:
        cfg = parse_drafter_args(argv)
    except ConfigError as exc:
        print(f"drafter: {exc} (--help lists the keys)", file=sys.stderr)
        return 2
    from recipes.drafter.run import run_drafter  # torch loads here, after --help and the checks

    try:
        run_drafter(cfg)
    except ValueError as exc:
        print(f"drafter: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(
        run_main(
            "drafter",
            main,
            spawns=True,
            after="the running step was stopped; rerunning the same command resumes: finished steps are skipped",
        )
    )
