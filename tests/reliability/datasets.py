"""Comparing shard datasets sample by sample (lost, duplicated, changed bytes) and reading what a
killed extraction left on disk."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from pathlib import Path

RANK_MANIFEST = "manifest.rank000.json"
RANK_PREFIX = "r000-shard-"
FIELDS = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs")


def sample_bytes(root: Path, manifest_name: str = "manifest.json") -> list[tuple[str, bytes]]:
    """(sample id, all stored bytes of the sample) in dataset order."""
    from shards import ShardDataset

    out = []
    for sample in ShardDataset(str(root), manifest_name=manifest_name):
        blob = b"|".join(getattr(sample, f).tobytes() for f in FIELDS)
        out.append((sample.sample_id, blob))
    return out


@dataclasses.dataclass
class Comparison:
    lost: int
    duplicated: int
    changed: int
    extra: int

    @property
    def equal(self) -> bool:
        return not (self.lost or self.duplicated or self.changed or self.extra)


def compare(got: list[tuple[str, bytes]], reference: dict[str, bytes], *, subset: bool = False) -> Comparison:
    """How `got` differs from `reference` (with subset=True, missing samples are not 'lost')."""
    ids = collections.Counter(sid for sid, _ in got)
    duplicated = sum(n - 1 for n in ids.values() if n > 1)
    changed = sum(1 for sid, blob in got if sid in reference and reference[sid] != blob)
    extra = sum(1 for sid in ids if sid not in reference)
    lost = 0 if subset else sum(1 for sid in reference if sid not in ids)
    return Comparison(lost, duplicated, changed, extra)


def killed_extraction_state(out: Path) -> str:
    """Which window a killed extraction was in, judged from what it left on disk."""
    if not out.is_dir() or not (out / RANK_MANIFEST).exists():
        return "before the first manifest (start-up)"
    names = set(os.listdir(out))
    try:
        manifest = json.loads((out / RANK_MANIFEST).read_text())
    except ValueError:
        return "rank manifest unreadable"
    listed = {e["file"] for e in manifest["shards"]} | {e["index_file"] for e in manifest["shards"]}
    if any(n.startswith(RANK_MANIFEST + ".") and n.endswith(".tmp") for n in names):
        return "manifest update (.tmp manifest left)"
    if any(n.startswith(RANK_PREFIX) and n.endswith(".arrow") and n not in listed for n in names):
        return "between shard rename and manifest update"
    if any(n.startswith(RANK_PREFIX) and n.endswith(".tmp") for n in names):
        return "shard being written (.tmp shard left)"
    if manifest.get("complete"):
        if "manifest.json" not in names:
            return "merge (rank done, no manifest.json)"
        if "summary.json" not in names:
            return "merge (manifest.json done, no summary.json)"
        return "after the merge"
    return "between commits (tokenizing, forward, queues)"
