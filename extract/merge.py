"""`python -m extract.merge OUT_DIR [--world N]`: merge the per-rank manifests and rejects files of
an extraction into `manifest.json` and `rejects.jsonl`.

Runs automatically at the end of an extraction (rank 0 after a barrier under torchrun/accelerate;
otherwise the last rank to finish). Run it by hand when ranks were started as independent jobs
(RANK / WORLD_SIZE set by a scheduler, no rendezvous) and the last one died before merging.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from common.config import ConfigError, knob, parse_command


@dataclass(frozen=True)
class MergeConfig:
    """`python -m extract.merge OUT_DIR`."""

    out_dir: str = knob(help="the extraction's output directory (one split)")
    world: int | None = knob(None, help="number of ranks (default: read from the rank manifests)", min=1)


def infer_world(root: str) -> int:
    """The world size the rank manifests were written with (all must agree)."""
    worlds = set()
    for name in sorted(os.listdir(root)):
        if name.startswith("manifest.rank") and name.endswith(".json"):
            with open(os.path.join(root, name), encoding="utf-8") as f:
                worlds.add(json.load(f).get("stage_state", {}).get("world_size"))
    if not worlds:
        raise ValueError(f"{root}: no manifest.rank*.json files; is this an extraction output directory?")
    if len(worlds) != 1 or None in worlds:
        raise ValueError(
            f"{root}: rank manifests disagree on the world size ({sorted(map(str, worlds))}); pass --world"
        )
    return worlds.pop()


def main(argv: list[str] | None = None) -> int:
    usage = "usage: " + __doc__.split("\n\n")[0]
    try:
        args = parse_command(MergeConfig, sys.argv[1:] if argv is None else argv, positional=["out_dir"], usage=usage)
    except ConfigError as err:
        print(f"extract.merge: {err} (--help lists the keys)", file=sys.stderr)
        return 2
    from extract import pipeline

    try:
        world = args.world or infer_world(args.out_dir)
        merged = pipeline.merge_ranks(args.out_dir, world, required=True)
    except (ValueError, FileNotFoundError) as err:
        print(f"extract.merge: {err}", file=sys.stderr)
        return 2
    print(pipeline.format_summary(pipeline.summarize_dataset(os.path.abspath(args.out_dir), merged, this_run=None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
