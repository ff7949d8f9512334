"""`python -m extract.merge OUT_DIR [--world N]`: merge the per-rank manifests and rejects files of
an extraction into `manifest.json` and `rejects.jsonl`.

Runs automatically at the end of an extraction (rank 0 after a barrier under torchrun/accelerate;
otherwise the last rank to finish: `finish_ranks`). Run it by hand when ranks were started as
independent jobs (RANK / WORLD_SIZE set by a scheduler, no rendezvous) and the last one died before
merging. The merge writes `rejects.jsonl`, then `manifest.json` (complete), then `summary.json`,
holding the lock of `manifest.json`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass

from common.config import ConfigError, knob, parse_command
from common.interrupts import run_main
from common.io import atomic_write_text, join_uri, list_names, remove_temp_files, resolve
from extract.ranks import CONFIG_FILE, FINAL_MANIFEST, FINAL_REJECTS, SUMMARY_FILE, Ranks, rank_names
from extract.sink import read_committed_rejects
from extract.summary import format_summary, summarize_dataset, write_summary
from shards.manifest import MERGE_WAIT_SECONDS, load_manifest, lock_manifest, merge_manifests

log = logging.getLogger("extract")


@dataclass(frozen=True)
class RankMergeConfig:
    """`python -m extract.merge OUT_DIR`."""

    out_dir: str = knob(help="the extraction's output directory (one split)", path="data_out")
    world: int | None = knob(None, help="number of ranks (default: read from the rank manifests)", min=1)


def finish_ranks(root: str, ranks: Ranks) -> dict | None:
    """Merge the rank manifests into manifest.json once every rank is done; the merged manifest, or None."""
    ranks.barrier()
    if ranks.group and ranks.rank != 0:
        return None
    return merge_ranks(root, ranks.world, required=ranks.group)


def merge_ranks(root: str, world: int, *, required: bool = True) -> dict | None:
    """Merge `manifest.rank*.json` of ranks 0..world-1 into manifest.json and the rejects files
    into rejects.jsonl. With required=False, returns None if some rank has not finished yet."""
    fs, fs_root = resolve(root)
    if "://" not in root:
        root = fs_root
    names = [rank_names(r) for r in range(world)]
    present = list_names(root)
    missing = [n["manifest"] for n in names if n["manifest"] not in present]
    unfinished = missing + [
        n["manifest"]
        for n in names
        if n["manifest"] not in missing and not load_manifest(fs, fs_root, n["manifest"]).get("complete")
    ]
    if unfinished:
        if required:
            raise ValueError(f"{root}: cannot merge, ranks not finished: {', '.join(unfinished)}")
        log.info(
            "%s: waiting for %s; the last rank to finish merges (or run `python -m extract.merge %s`)",
            root,
            ", ".join(unfinished),
            root,
        )
        return None
    extra = sorted(
        f
        for f in present
        if f.startswith("manifest.rank") and f.endswith(".json") and f not in {n["manifest"] for n in names}
    )
    if extra:
        raise ValueError(f"{root}: found {extra} from a run with more ranks; merge with that world size or remove them")
    with lock_manifest(
        fs, fs_root, FINAL_MANIFEST, wait_seconds=MERGE_WAIT_SECONDS
    ):  # the last two ranks may finish together
        return _merge_locked(root, names)


def _merge_locked(root: str, names: list[dict]) -> dict:
    fs, fs_root = resolve(root)
    if "://" not in root:
        root = fs_root
    remove_merge_leftovers(root)
    # rejects.jsonl before manifest.json: a complete manifest.json makes a rerun stop at once
    # ("already complete"), so everything else the merge writes must exist by then.
    entries = []
    for n in names:
        committed = load_manifest(fs, fs_root, n["manifest"]).get("stage_state", {}).get("rejects_bytes", 0)
        entries += read_committed_rejects(join_uri(root, n["rejects"]), committed)
    entries.sort(key=lambda e: e["position"])
    atomic_write_text(join_uri(root, FINAL_REJECTS), "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
    merged = merge_manifests(root, [n["manifest"] for n in names], FINAL_MANIFEST)
    write_summary(root, merged)
    return merged


def remove_merge_leftovers(root: str) -> None:
    """Temporaries of the merged files left by a killed merge (the shard writers clean only their own)."""
    fs, root = resolve(root)
    remove_temp_files(
        fs, root, prefixes=tuple(f"{name}." for name in (FINAL_REJECTS, FINAL_MANIFEST, SUMMARY_FILE, CONFIG_FILE))
    )


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
        args = parse_command(
            RankMergeConfig, sys.argv[1:] if argv is None else argv, positional=["out_dir"], usage=usage
        )
    except ConfigError as err:
        print(f"extract.merge: {err} (--help lists the keys)", file=sys.stderr)
        return 2
    try:
        world = args.world or infer_world(args.out_dir)
        merged = merge_ranks(args.out_dir, world, required=True)
    except (ValueError, FileNotFoundError) as err:
        print(f"extract.merge: {err}", file=sys.stderr)
        return 2
    print(format_summary(summarize_dataset(os.path.abspath(args.out_dir), merged, this_run=None)))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("extract.merge", main))
