"""`python -m train.serve.specdecode --target DIR --drafter EXPORT_DIR [key=value | --key value ...]`:
real greedy speculative decoding with a target and an exported drafter, against target-only greedy
decoding (the work: `train.serve.specdecode_run`; the round loop: `train.serve.decoding`).

    python -m train.serve.specdecode --target DIR --drafter EXPORT_DIR [--prompts FILE.jsonl | --data SHARDS]
        [--max-new-tokens N] [--num-prompts N] [--out result.json] [--agreement [--agreement-bf16]]
        [--tree-budgets 8,32] [--dtype float32] [--threads N] [--thinking] [--no-baseline] [--stop-repeat N]
        [--time-limit-s S]
    make specdecode ARGS="--target artifacts/tiny/target --drafter exports/NAME --agreement"

Prompts: the first user turn of each `{"messages": [...]}` record (default
artifacts/tiny/corpus/heldout.jsonl), rendered with the chat template, add_generation_prompt=True and
enable_thinking=False (non-thinking, as the published drafters); or, with --data, the tokens before
each shard sample's first response.

The options are read before torch loads (`train.serve.cli`), so `--help` and a usage error answer at
once. Exit statuses: docs/ARCHITECTURE.md, "Exit status".
"""

from __future__ import annotations

import sys
import time

from common.config import ConfigError
from train.serve.cli import parse_specdecode_args, usage_error


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # `time_limit_s` counts from here
    try:
        args = parse_specdecode_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        return usage_error("train.serve.specdecode", exc)
    from train.serve.specdecode_run import run  # torch loads here, after --help and the checks

    return run(args, started)


if __name__ == "__main__":
    raise SystemExit(main())
