"""The drafter command's prompt sets: the training prompts and the held-out ones, written to
OUT/prompts/{train,heldout}.jsonl (`split_prompts`).

With no held-out file, the held-out set is carved from the prompts: the records whose xxh3-64 of
(seed, the record's line) are the smallest, `heldout_count` of them (10%, at least 2, at most 64;
copies of one record fall on the same side, so none is both trained on and held out). The rule
depends only on each record's own text, so reordering or adding prompts moves few records. The
smoke scale keeps the first `SMOKE_TRAIN` training and `SMOKE_HELDOUT` held-out records.
"""

from __future__ import annotations

import dataclasses
import os

import xxhash

from common.io import atomic_write_text

HELDOUT_SHARE, HELDOUT_MIN, HELDOUT_MAX = 0.1, 2, 64
SMOKE_TRAIN, SMOKE_HELDOUT = 32, 4


@dataclasses.dataclass(frozen=True)
class PromptSplit:
    train: str
    heldout: str
    record: dict  # how the sets were made (recorded in drafter.json)
    reason: str  # one line: printed with the other derived defaults


def read_records(path: str, key: str) -> list[str]:
    """The non-empty lines of a JSONL file; ValueError naming the key when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except OSError as exc:
        raise ValueError(f"config key '{key}': cannot read {path}: {exc.strerror}") from None


def heldout_count(n_records: int, asked: int) -> int:
    return asked or max(HELDOUT_MIN, min(HELDOUT_MAX, round(HELDOUT_SHARE * n_records)))


def carve(lines: list[str], count: int, seed: int) -> tuple[list[str], list[str]]:
    """(train, held out): the records of the `count` smallest distinct hashes held out, order kept."""
    hashes = [xxhash.xxh3_64_intdigest(f"{seed}\x00{line}".encode()) for line in lines]
    chosen = set(sorted(set(hashes))[:count])
    return [x for x, h in zip(lines, hashes) if h not in chosen], [x for x, h in zip(lines, hashes) if h in chosen]


def split_prompts(prompts: str, heldout: str, out_dir: str, *, asked: int, seed: int, smoke: bool) -> PromptSplit:
    lines = read_records(prompts, "prompts")
    if heldout:
        train, held = lines, read_records(heldout, "heldout")
        how = {"source": "heldout", "file": heldout}
        reason = f"your held-out file {heldout}"
    else:
        count = heldout_count(len(lines), asked)
        if len(lines) < count + 1:
            raise ValueError(
                f"config key 'prompts': {prompts} holds {len(lines)} records; carving {count} held-out prompts needs "
                "at least one more (or give heldout=FILE)"
            )
        train, held = carve(lines, count, seed)
        how = {"source": "carved", "count": len(held), "of": len(lines), "seed": seed, "rule": "smallest xxh3-64"}
        reason = (
            f"none given: {len(held)} of your {len(lines)} prompts held out ("
            + (f"heldout_prompts={asked}" if asked else "10%, at least 2, at most 64")
            + f"; the records of the smallest seeded hashes, seed {seed})"
        )
    if smoke:
        train, held = train[:SMOKE_TRAIN], held[:SMOKE_HELDOUT]
        reason += f"; smoke scale: the first {len(train)} training and {len(held)} held-out prompts"
    if not train or not held:
        raise ValueError(f"config key '{'prompts' if not train else 'heldout'}': no records to use")
    paths = {}
    for name, records in (("train", train), ("heldout", held)):
        paths[name] = os.path.join(out_dir, "prompts", f"{name}.jsonl")
        os.makedirs(os.path.dirname(paths[name]), exist_ok=True)
        atomic_write_text(paths[name], "".join(line + "\n" for line in records))
    record = {**how, "train_records": len(train), "heldout_records": len(held), "files": paths}
    return PromptSplit(paths["train"], paths["heldout"], record, reason)
