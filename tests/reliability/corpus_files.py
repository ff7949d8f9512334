"""Scenario 5, the families of issue 28: corpus files as they arrive, prompts and values that were
once read wrongly.

- directory: generated corpus directories (suffixes in any case, .json / .ndjson / .txt names,
  hidden files, subdirectories): every entry is read or listed as skipped, and exactly the lines of
  the files read are counted.
- changing: a corpus file appended to, rewritten or cut between the start of a run (its
  fingerprint) and its reading: the appended lines are never read and the records are the ones
  fingerprinted, or the run stops with an error naming the file; never other records in silence.
- compressed: .gz / .bz2 / .zst corpora truncated, with a flipped byte or with trailing bytes: a
  corpus error naming the file (and how far it was read), or reading that ends normally with every
  line a record or a counted reject; a truncated stream is always named.
- prompt_length: regeneration prompts around the target's context: a prompt that leaves no room
  for an answer is a `prompt_too_long` reject, any other gets an answer budget inside the context.
- type_confusion: token ids mixing booleans, integers, floats and strings, and per-turn `weight` /
  `train` switches of every type: a sample only from integer ids and 0/1 or boolean switches (the
  turn switched off carries no loss), else `bad_tokens` / `bad_turn_weight`.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
import random
from pathlib import Path

import zstandard

from tests.reliability.families import Tally
from tests.reliability.world import World


def _line(i: int) -> str:
    return json.dumps({"prompt": f"question {i}", "response": f"answer {i} " * 3}) + "\n"


def _write(path: Path, n: int, first: int = 0) -> None:
    data = "".join(_line(first + i) for i in range(n)).encode()
    name = path.name.lower()
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith(".bz2"):
        data = bz2.compress(data)
    elif name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def _records(corpus) -> list:
    from extract import corpus as C

    return [(r.position, r.record, r.error) for r in C.iter_records(corpus)]


# ----------------------------------------------------------------------------------------------


def directories(tally: Tally, rng: random.Random, examples: int, work: Path) -> None:
    from extract import corpus as C

    stems = ["a", "b", "data", "part-0001", "x.y"]
    suffixes = [".jsonl", ".JSONL", ".Jsonl.GZ", ".jsonl.zst", ".ndjson", ".NDJSON.bz2", ".json", ".txt", ""]
    for n in range(examples):
        root = work / f"dir-{n}"
        root.mkdir(parents=True)
        lines, names = {}, set()
        for i in range(rng.randint(1, 6)):
            name = ("." if rng.random() < 0.15 else "") + rng.choice(stems) + f"{i}" + rng.choice(suffixes)
            if rng.random() < 0.15:
                (root / name).mkdir()
                _write(root / name / "inner.jsonl", 2)
            else:
                lines[name] = rng.randint(0, 4)
                _write(root / name, lines[name])
            names.add(name)
        fmt = rng.choice(["auto", "jsonl"])
        try:
            corpus = C.find_corpus(str(root), fmt)
        except ValueError as err:
            read = {k for k in lines if not k.startswith(".") and (fmt == "jsonl" or C.data_kind(k))}
            tally.add("directory:none_readable", not read and str(root) in str(err), f"{root} ({fmt}): {err}")
            continue
        read = {os.path.basename(f) for f in corpus.files}
        skipped = {s["name"].rstrip("/") for s in corpus.skipped}
        expected = {k for k in lines if not k.startswith(".") and (fmt == "jsonl" or C.data_kind(k))}
        ok = read == expected and read | skipped == names and not read & skipped
        ok = ok and len(_records(corpus)) == sum(1 for k in read for _ in range(lines[k]))
        tally.add(f"directory:{fmt}", ok, f"{root} ({fmt}): read {sorted(read)}, skipped {sorted(skipped)}")


def changing(tally: Tally, rng: random.Random, examples: int, work: Path) -> None:
    from extract import corpus as C
    from extract.corpus.reading import corpus_fingerprint

    for n in range(examples):
        path = work / f"changing-{n}.jsonl"
        total = rng.randint(2, 40)
        _write(path, total)
        corpus = C.find_corpus(str(path))
        fingerprint = corpus_fingerprint(corpus, None)
        before = _records(corpus)
        data = path.read_bytes()
        change = rng.choice(["append", "rewrite", "cut"])
        if change == "append":
            path.write_bytes(data + "".join(_line(1000 + i) for i in range(rng.randint(1, 20))).encode())
        elif change == "rewrite":
            at = rng.randrange(len(data))
            path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
        else:
            path.write_bytes(data[: rng.randrange(len(data))])
        try:
            after = _records(corpus)
        except C.CorpusError as err:
            tally.add(f"changing:{change}", change != "append" and str(path) in str(err), f"{path} {change}: {err}")
            continue
        ok = after == before and fingerprint["records"] == total  # what was read is what was fingerprinted
        tally.add(f"changing:{change}", ok, f"{path} {change}: read {len(after)} records, fingerprinted {total}")


def compressed(tally: Tally, rng: random.Random, examples: int, work: Path) -> None:
    from extract import corpus as C
    from extract.corpus.reading import corpus_fingerprint

    for n in range(examples):
        kind = rng.choice(["gz", "bz2", "zst"])
        path = work / f"compressed-{n}.jsonl.{kind}"
        _write(path, rng.randint(5, 200))
        blob = path.read_bytes()
        damage = rng.choice(["truncated", "flipped", "garbage"])
        if damage == "truncated":
            blob = blob[: rng.randint(1, len(blob) - 1)]
        elif damage == "flipped":
            at = rng.randrange(len(blob))
            blob = blob[:at] + bytes([blob[at] ^ rng.randint(1, 255)]) + blob[at + 1 :]
        else:
            blob = blob + bytes(rng.randrange(256) for _ in range(rng.randint(1, 30)))
        path.write_bytes(blob)
        try:
            corpus = C.find_corpus(str(path))
            corpus_fingerprint(corpus, None)  # what a run does before the target loads
            records = _records(corpus)
        except C.CorpusError as err:
            ok = str(path) in str(err) and ("damaged" in str(err) and "bytes" in str(err))
            tally.add(f"compressed:{kind}_{damage}", ok, f"{path}: {err}")
            continue
        except Exception as err:  # noqa: BLE001 - anything else reaches the user as a traceback
            tally.add(f"compressed:{kind}_{damage}", False, f"{path}: {type(err).__name__}: {err}")
            continue
        # Read to the end: a truncated stream must never get here; other damage reads as its lines.
        ok = damage != "truncated" and all(r[1] is not None or r[2] is not None for r in records)
        tally.add(f"compressed:{kind}_{damage}", ok, f"{path}: read {len(records)} records without an error")


def prompt_lengths(world: World, tally: Tally, rng: random.Random, examples: int) -> None:
    from transformers import AutoTokenizer

    from extract.corpus.reading import RawRecord
    from extract.regenerate.conversation import PROMPT_TOO_LONG, Conversation, Renderer

    tokenizer = AutoTokenizer.from_pretrained(str(world.target_dir))
    renderer = Renderer(tokenizer, "disable", {"enable_thinking": False}, {"enable_thinking": False})
    for n in range(examples):
        prompt = " ".join(rng.choice(["fox", "dog", "the", "sea"]) for _ in range(rng.randint(1, 120)))
        conversation = Conversation(RawRecord(n, f"gen:{n}", {"prompt": prompt}), renderer, "keep")
        length = len(conversation.prompt()[1])
        limit = max(2, length + rng.randint(-5, 5))
        conversation.context_limit = limit
        wants = conversation.wants_turn()
        if length >= limit:
            ok = not wants and conversation.outcome is not None and conversation.outcome.reason == PROMPT_TOO_LONG
        else:
            budget = conversation.answer_budget(rng.randint(1, 50))
            ok = wants and budget >= 1 and length + budget <= limit
        tally.add("prompt_length:" + ("over" if length >= limit else "under"), ok, f"{length} tokens, limit {limit}")


def type_confusions(world: World, tally: Tally, rng: random.Random, examples: int) -> None:
    from transformers import AutoTokenizer

    from extract import corpus as C
    from tests.reliability.corpus_inputs import build_one, builder_for

    builder = builder_for(AutoTokenizer.from_pretrained(str(world.target_dir)))
    values = [True, False, 0, 1, 2, 0.0, 1.0, 0.5, "1", None, [1]]
    for _ in range(examples):
        if rng.random() < 0.5:
            ids = [rng.choice([3, 7, 11, True, False, 2.0, "4"]) for _ in range(rng.randint(1, 8))]
            good = all(type(i) is int for i in ids)
            result = build_one(builder, {"input_ids": ids})
            ok = isinstance(result, C.TokenizedSample) if good else getattr(result, "reason", None) == C.BAD_TOKENS
            tally.add("type_confusion:token_ids", ok, f"{ids}: {result}")
            continue
        key, value = rng.choice(["weight", "train"]), rng.choice(values)
        role = rng.choice(["assistant", "assistant", "user"])
        messages = [{"role": "user", "content": "the fox?"}, {"role": "assistant", "content": "the quick fox"}]
        messages.append({"role": "user", "content": "and the dog?"})
        messages.append({"role": "assistant", "content": "a lazy dog sleeps"})
        target = 1 if role == "assistant" else 0
        messages[target] = {**messages[target], key: value}
        if value is None:  # a null field is no field (Parquet gives every row every column)
            valid, trains = True, None
        else:
            valid = (value in (0, 1) and type(value) in (int, float)) if key == "weight" else isinstance(value, bool)
            trains = bool(value) if valid else None
        result = build_one(builder, {"messages": messages})
        if not valid or (role == "user" and trains):
            ok = getattr(result, "reason", None) == C.BAD_TURN_WEIGHT
        else:
            plain = build_one(builder, {"messages": [{k: v for k, v in m.items() if k != key} for m in messages]})
            ok = isinstance(result, C.TokenizedSample) and result.input_ids.tolist() == plain.input_ids.tolist()
            loss_off = int(plain.loss_mask.sum()) - int(result.loss_mask.sum())
            ok = ok and ((loss_off > 0) if (role == "assistant" and trains is False) else loss_off == 0)
        tally.add("type_confusion:turn_switch", ok, f"{role} {key}={value!r}: {result}")


def run_all(world: World, tally: Tally, *, examples: int, seed: int | None, work: Path) -> None:
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    directories(tally, rng, max(4, examples // 10), work)
    changing(tally, rng, max(6, examples // 5), work)
    compressed(tally, rng, max(9, examples // 3), work)
    prompt_lengths(world, tally, rng, max(6, examples // 5))
    type_confusions(world, tally, rng, max(10, examples // 2))
