"""`python -m train [CONFIG] key=value ...`: train a DFlash drafter (the `[train]` table; see train/config.py).

    python -m train                                   # the tiny default (configs/tiny.toml via make train)
    python -m train configs/tiny.toml run_name=abl loss.gamma=5
    python -m train --help                            # every key with its default and allowed values

Exit status: 0 done, 2 a config or data error (the message names the key or field), 3 aborted
(too many non-finite steps in a row), 4 an I/O error such as a full disk (the message names the
file; checkpoints already written stay intact, and rerunning the same command resumes).
"""

from __future__ import annotations

import json
import logging
import sys

from common.config import config_to_dict, parse_cli


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from train.checkpoint import CheckpointSaveError
    from train.config import TrainConfig
    from train.loop import TrainingAborted, train

    try:
        cfg = parse_cli(TrainConfig, sys.argv[1:] if argv is None else argv, section="train")
        print(json.dumps(config_to_dict(cfg), sort_keys=True), flush=True)
        summary = train(cfg)
    except TrainingAborted as exc:
        print(f"train: aborted: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:
        print(f"train: {exc}", file=sys.stderr)
        return 2
    except (CheckpointSaveError, OSError) as exc:
        print(f"train: I/O error, stopping: {exc}. Rerunning the same command resumes from the last complete checkpoint.", file=sys.stderr)
        return 4
    print(json.dumps(summary, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
