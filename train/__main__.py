"""`python -m train [CONFIG] key=value ...`: train a DFlash drafter (the `[train]` table; see train/config.py).

    python -m train                                   # the tiny default (configs/tiny.toml via make train)
    python -m train configs/tiny.toml run_name=abl loss.gamma=5
    python -m train --help                            # every key with its default and allowed values
    torchrun --nproc-per-node 8 -m train CONFIG ...   # data parallel over 8 GPUs (docs/guide.md)

After an I/O error, a lost rank or Ctrl-C, checkpoints already written stay intact and rerunning the
same command resumes from the last complete one. Exit statuses: docs/ARCHITECTURE.md, "Exit status".
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from common.config import config_to_dict, parse_cli
from common.interrupts import run_main
from train.config import TrainConfig

# After naming a lost rank, a surviving rank waits this long before exiting, so that torchrun
# (which polls its workers every 0.1 s) sees the rank that really failed first and reports it as
# the root cause, then stops this one itself.
LINGER_AFTER_PEER_LOST_S = 3.0


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", 0))
    prefix = f"[rank {rank}] " if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 else ""
    # Ranks other than 0 say only what goes wrong; rank 0 speaks for the run.
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    is_main = int(os.environ.get("RANK", 0)) == 0
    try:  # before torch loads: --help and a bad key answer at once
        cfg = parse_cli(TrainConfig, sys.argv[1:] if argv is None else argv, section="train")
    except ValueError as exc:
        print(f"train: {exc}", file=sys.stderr)
        return 2
    from train.checkpoint import CheckpointSaveError
    from train.distributed import PeerLost
    from train.loop import TrainingAborted, train

    try:
        if is_main:
            print(json.dumps(config_to_dict(cfg), sort_keys=True), flush=True)
        summary = train(cfg)
    except PeerLost as exc:
        print(
            f"train: {exc}. Stopping; rerunning the same command resumes from the last complete checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(LINGER_AFTER_PEER_LOST_S)
        sys.stdout.flush()
        os._exit(5)  # skip the process group's destructors: with a peer gone they can abort the process
    except TrainingAborted as exc:
        print(f"train: aborted: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:
        print(f"train: {exc}", file=sys.stderr)
        return 2
    except (CheckpointSaveError, OSError) as exc:
        print(
            f"train: I/O error, stopping: {exc}. Rerunning the same command resumes from the last complete checkpoint.",
            file=sys.stderr,
        )
        return 4
    except KeyboardInterrupt:
        print(
            "train: interrupted; rerunning the same command resumes from the last complete checkpoint.", file=sys.stderr
        )
        return 130
    if is_main:
        print(json.dumps(summary, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("train", main))
