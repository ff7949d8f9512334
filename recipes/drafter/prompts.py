"""The drafter command's prompt sets: the training prompts and the held-out ones (`split_prompts`),
written to OUT/prompts/{train,heldout}.jsonl once every check of step 1 has passed (`PromptSplit.write`).

With no held-out file, the held-out set is carved from the prompts: the records whose xxh3-64 of
(seed, the record's line) are the smallest, `heldout_count` of them (10%, at least 2, at most 64;
copies of one record fall on the same side, so none is both trained on and held out). The rule
depends only on each record's own text, so reordering or adding prompts moves few records. The
smoke scale keeps the first `SMOKE_TRAIN` training and `SMOKE_HELDOUT` held-out records.

Overlap: a training record whose prompt (every turn but the assistant's, which regeneration replaces)
is also a held-out record's is left out of training, and the count is printed and recorded: τ is
then measured on prompts the drafter never saw. Deduplicated rather than refused, because the held-out
set is the user's deliberate choice of evaluation prompts and the overlap (two files sampled from one
source, a prompt asked twice with other answers) costs training a few records; refused only when no
training record would remain.

The files are read as the corpus reader reads a JSONL file (UTF-8, with or without a byte order
mark, UTF-16/32; .gz, .bz2, .zst); a line that is not text in its encoding is refused naming the
file and the line. When the target answers the prompts (`regenerate`), a `{"text": ...}` record is
a prompt: it becomes a chat of one user turn holding that text (regeneration answers chats).
"""

from __future__ import annotations

import dataclasses
import json
import os

import xxhash

from common.io import atomic_write_text
from extract.corpus.streams import UNDECODABLE, CorpusError, text_lines

HELDOUT_SHARE, HELDOUT_MIN, HELDOUT_MAX = 0.1, 2, 64
SMOKE_TRAIN, SMOKE_HELDOUT = 32, 4


@dataclasses.dataclass(frozen=True)
class PromptSplit:
    train: str
    heldout: str
    record: dict  # how the sets were made (recorded in drafter.json)
    reason: str  # one line: printed with the other derived defaults
    lines: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # {train, heldout: records}

    def write(self) -> None:
        """OUT/prompts/{train,heldout}.jsonl, the files the steps read."""
        for name, path in (("train", self.train), ("heldout", self.heldout)):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write_text(path, "".join(line + "\n" for line in self.lines[name]))


def read_records(path: str, key: str) -> list[str]:
    """The non-empty lines of a JSONL file as text; ValueError naming the key, the file and the line
    when it cannot be read."""
    records = []
    try:
        for number, line in enumerate(text_lines(path), 1):
            if isinstance(line, bytes):
                try:
                    line = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(
                        f"config key '{key}': {path} line {number} is not UTF-8 text (byte {err.start + 1} of the "
                        f"line: {err.reason}); save the file as UTF-8"
                    ) from None
            elif UNDECODABLE in line:
                raise ValueError(f"config key '{key}': {path} line {number} holds bytes its encoding cannot decode")
            if line.strip():
                records.append(line.rstrip("\n"))
    except OSError as exc:
        raise ValueError(f"config key '{key}': cannot read {path}: {exc.strerror or exc}") from None
    except CorpusError as exc:
        raise ValueError(f"config key '{key}': {exc}") from None
    return records


def as_prompt(line: str) -> tuple[str, bool]:
    """(the record, whether it changed): a `{"text": ...}` record as a chat of one user turn."""
    try:
        record = json.loads(line)
    except ValueError:
        return line, False  # regeneration rejects it with its reason
    chat_keys = ("messages", "conversations", "prompt", "input_ids")
    if not isinstance(record, dict) or not isinstance(record.get("text"), str) or any(k in record for k in chat_keys):
        return line, False
    turn = {"role": "user", "content": record.pop("text")}
    return json.dumps({"messages": [turn], **record}, ensure_ascii=False), True


def heldout_count(n_records: int, asked: int) -> int:
    return asked or max(HELDOUT_MIN, min(HELDOUT_MAX, round(HELDOUT_SHARE * n_records)))


def carve(lines: list[str], count: int, seed: int) -> tuple[list[str], list[str]]:
    """(train, held out): the records of the `count` smallest distinct hashes held out, order kept."""
    hashes = [xxhash.xxh3_64_intdigest(f"{seed}\x00{line}".encode()) for line in lines]
    chosen = set(sorted(set(hashes))[:count])
    return [x for x, h in zip(lines, hashes, strict=True) if h not in chosen], [
        x for x, h in zip(lines, hashes, strict=True) if h in chosen
    ]


def prompt_key(line: str) -> str:
    """What makes a record the same prompt: every message but the assistant's (regeneration answers
    anew), or the record as written when it is not a chat record."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list):
        return line
    turns = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "assistant")]
    return json.dumps(turns, sort_keys=True)


def without_overlap(train: list[str], held: list[str]) -> tuple[list[str], int]:
    """(the training records whose prompt no held-out record has, how many were left out)."""
    seen = {prompt_key(line) for line in held}
    kept = [line for line in train if prompt_key(line) not in seen]
    return kept, len(train) - len(kept)


def split_prompts(
    prompts: str, heldout: str, out_dir: str, *, asked: int, seed: int, smoke: bool, texts_as_prompts: bool = True
) -> PromptSplit:
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
    if texts_as_prompts:
        train, held = ([as_prompt(line) for line in records] for records in (train, held))
        how["text_records_as_user_turns"] = sum(changed for _, changed in train + held)
        if how["text_records_as_user_turns"]:
            reason += f'; {how["text_records_as_user_turns"]} {{"text": ...}} records are user turns the target answers'
        train, held = [line for line, _ in train], [line for line, _ in held]
    train, overlap = without_overlap(train, held)
    if overlap:
        reason += f"; {overlap} training prompts also held out: left out of training"
        if not train:
            raise ValueError(
                f"config key 'heldout': every training prompt of {prompts} is also a held-out prompt; give held-out "
                "prompts the training set does not hold"
            )
    if smoke:
        train, held = train[:SMOKE_TRAIN], held[:SMOKE_HELDOUT]
        reason += f"; smoke scale: the first {len(train)} training and {len(held)} held-out prompts"
    if not train or not held:
        raise ValueError(f"config key '{'prompts' if not train else 'heldout'}': no records to use")
    paths = {name: os.path.join(out_dir, "prompts", f"{name}.jsonl") for name in ("train", "heldout")}
    record = {
        **how,
        "train_records": len(train),
        "heldout_records": len(held),
        "overlap_left_out": overlap,
        "files": paths,
    }
    return PromptSplit(paths["train"], paths["heldout"], record, reason, {"train": train, "heldout": held})
