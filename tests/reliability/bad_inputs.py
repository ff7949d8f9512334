"""Scenario 5: bad inputs get a clear error or a counted rejection: never a traceback from deep
inside, never a silent pass.

- Corpus records, generated with hypothesis: broken JSON, invalid UTF-8, wrong types at every
  level, missing or unknown roles, missing content, no assistant turn, empty and huge contents,
  control characters, lone surrogates, bad token lists, deep nesting; plus well-formed records
  with odd text. Each line goes through the extraction's own reading and tokenizing path
  (`corpus.reading.parse_json_line`, `corpus.windows._build_guarded`). A malformed record must become a
  reject with a known reason and a detail; a well-formed one a sample (or a length/loss-token
  policy reject). A whole fuzzed corpus then runs through the extraction: every line accounted
  for, rejects.jsonl lists each reject, the dataset verifies; with on_error=fail the command
  stops with one line naming the record.
- Configs, generated with hypothesis from the config dataclasses themselves: unknown keys, wrong
  types, values out of range or outside the choices, for every key of `[extract]` and `[train]`;
  each must raise ConfigError naming the key. Then semantic errors through the command lines
  (layer ids beyond the model, missing paths, widths that do not fit the target): exit status 2
  and one line naming the key or file.
- Mismatched shards (another tokenizer, other taps, another hidden size or vocabulary, fewer
  top-k, an unfinished extraction): training and eval refuse them naming the manifest field.
- The corpus-file families (`corpus_files`): directory contents, corpora changing while read,
  damaged compressed files, over-long regeneration prompts, type confusions (booleans as ids, turn weights).
- The corpus-input families: corpus formats (ShareGPT, content parts), text encodings (BOM, UTF-16/32),
  tool calls, control tokens planted in record text (`tests/reliability/corpus_inputs.py`), and
  concurrent writers of one dataset or run (`tests/reliability/writers.py`).
- The families of issue 45: object-store setup errors, a store gone for a while or for good, damaged
  datasets at training (`tests/reliability/store_cases.py`, against moto_server where installed);
  every command's config errors, path settings that once gave a silent result, and the real-target
  build's failure modes (`tests/reliability/command_cases.py`).
Figure: cases tried, cases with a clear answer.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import types
import typing
from pathlib import Path

from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from benchmarks.s3_server import MotoServer, moto_server_command
from tests.reliability import (
    command_cases,
    corpus_files,
    corpus_inputs,
    late_checks,
    make_lines,
    outage_cases,
    record_cases,
    signal_cases,
    store_cases,
    writers,
)
from tests.reliability.cli import call_main
from tests.reliability.cli import message as cli_message
from tests.reliability.families import (
    ROLES,
    TEXT,
    WRONG,
    WRONG_NOT_NONE,
    Tally,
    hypothesis_settings,
    message,
    valid_chat,
)
from tests.reliability.outcome import Outcome
from tests.reliability.world import World

POLICY_REASONS = ("too_long", "too_few_loss_tokens", "empty_sample")


@st.composite
def malformed(draw):
    """(kind, record or raw line bytes) for one kind of broken record."""
    good = draw(valid_chat())
    kind = draw(
        st.sampled_from(
            (
                "broken_json",
                "invalid_utf8",
                "not_an_object",
                "messages_wrong_type",
                "message_wrong_type",
                "missing_role",
                "role_wrong_type",
                "unknown_role",
                "missing_content",
                "content_wrong_type",
                "reasoning_wrong_type",
                "no_assistant_turn",
                "empty_messages",
                "prompt_response",
                "text_wrong_type",
                "bad_tokens",
                "no_known_field",
                "deep_nesting",
                "lone_surrogate_escape",
            )
        )
    )
    turns = good["messages"]
    i = draw(st.integers(0, len(turns) - 1))
    if kind == "broken_json":
        text = json.dumps(good)
        return kind, text[: draw(st.integers(1, len(text) - 1))].encode()
    if kind == "invalid_utf8":
        text = json.dumps(good, ensure_ascii=False).encode()
        at = draw(st.integers(1, len(text) - 1))
        return kind, text[:at] + draw(
            st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
        ) + text[at:]
    if kind == "not_an_object":
        return kind, draw(
            st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(max_size=5), st.none(), st.booleans())
        )
    if kind == "messages_wrong_type":
        return kind, {"messages": draw(WRONG_NOT_NONE.filter(lambda v: not isinstance(v, list) or v))}
    if kind == "message_wrong_type":
        turns[i] = draw(WRONG_NOT_NONE.filter(lambda v: not isinstance(v, dict)))
    elif kind == "missing_role":
        del turns[i]["role"]
    elif kind == "role_wrong_type":
        turns[i]["role"] = draw(WRONG)
    elif kind == "unknown_role":
        turns[i]["role"] = draw(st.text(max_size=12).filter(lambda r: r not in ROLES))
    elif kind == "missing_content":
        del turns[i]["content"]
    elif kind == "content_wrong_type":
        turns[i]["content"] = draw(WRONG_NOT_NONE)
    elif kind == "reasoning_wrong_type":
        turns[-1]["reasoning_content"] = draw(WRONG_NOT_NONE)
    elif kind == "no_assistant_turn":
        turns = [t for t in turns if t["role"] != "assistant"] or [message("user", "hi")]
    elif kind == "empty_messages":
        turns = []
    elif kind == "prompt_response":
        record = {"prompt": draw(st.one_of(TEXT, WRONG_NOT_NONE)), "response": draw(st.one_of(TEXT, WRONG_NOT_NONE))}
        if all(isinstance(v, str) for v in record.values()):
            del record[draw(st.sampled_from(["prompt", "response"]))]
        return kind, record
    elif kind == "text_wrong_type":
        return kind, {"text": draw(WRONG_NOT_NONE)}
    elif kind == "bad_tokens":
        ids = draw(
            st.one_of(
                st.lists(st.integers(-5, -1), min_size=1, max_size=5),
                st.lists(st.floats(0.5, 9.5), min_size=1, max_size=5),
                st.lists(st.text(max_size=2), min_size=1, max_size=5),
                st.lists(st.lists(st.integers(0, 9), max_size=2), min_size=1, max_size=3),
                st.lists(st.integers(2**31, 2**40), min_size=1, max_size=3),
                st.lists(st.integers(100000, 200000), min_size=1, max_size=3),
            )
        )
        return kind, {"input_ids": ids}
    elif kind == "no_known_field":
        return kind, draw(
            st.dictionaries(
                st.text(max_size=8).filter(lambda k: k not in ("messages", "prompt", "response", "text", "input_ids")),
                WRONG,
                max_size=3,
            )
        )
    elif kind == "deep_nesting":
        depth = draw(st.integers(2000, 200000))
        return kind, ("[" * depth + "]" * depth).encode()
    elif kind == "lone_surrogate_escape":
        text = json.dumps(good)
        return kind, text.replace('"content": "', '"content": "\\ud800', 1).encode()
    return kind, {"messages": turns}


def as_line(record) -> bytes:
    return record if isinstance(record, bytes) else json.dumps(record).encode()


def judge_record(builder, line: bytes, should_pass: bool) -> tuple[bool, str]:
    """Run one line through extraction's reading + tokenizing path; (clear answer?, what happened)."""
    from extract import corpus as C
    from extract.corpus.windows import UNEXPECTED, _build_guarded

    try:
        raw = C.parse_json_line(line, 0, "fuzz.jsonl:1")
        result = _build_guarded(builder, [raw])[0]
    except Exception as exc:  # noqa: BLE001 - a crash of the whole run because of one record
        return False, f"raised {type(exc).__name__}: {exc}"
    if isinstance(result, C.Reject):
        if result.reason == UNEXPECTED:
            return False, f"rejected only as {UNEXPECTED}: {result.detail[:200]}"
        if not result.detail:
            return False, f"reject {result.reason} without a detail"
        if should_pass and result.reason not in POLICY_REASONS:
            return False, f"a well-formed record was rejected: {result.reason}: {result.detail[:200]}"
        return True, result.reason
    if not should_pass:
        return False, "a malformed record became a sample (silent pass)"
    if result.input_ids.size == 0 or result.loss_mask.sum() == 0:
        return False, "an empty sample passed"
    return True, "sample"


def fuzz_records(world: World, tally: Tally, examples: int, seed: int | None, keep: list) -> None:
    from extract import corpus as C

    tokenizer = world.target.tokenizer
    builder = C.SampleBuilder(tokenizer, C.SamplePolicy(256, "truncate", 4, {}, vocab_size=len(tokenizer)))

    @hypothesis_settings(examples, seed)
    @given(st.one_of(valid_chat().map(lambda r: ("well_formed", r)), malformed()))
    def check(case):
        kind, record = case
        line = as_line(record)
        ok, what = judge_record(builder, line, kind == "well_formed")
        tally.add(f"record:{kind}", ok, f"{what} <- {line[:160]!r}")
        if len(keep) < 400 and len(line) < 20000:
            keep.append(line)

    if seed is not None:
        check = hypothesis_seed(seed)(check)
    check()


def fuzzed_corpus_runs(world: World, tally: Tally, lines: list[bytes], work: Path) -> None:
    """The fuzzed lines as one corpus through the extraction; every line accounted for."""
    from extract.__main__ import main
    from shards import verify_dataset

    corpus = work / "fuzzed.jsonl"
    corpus.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
    out = work / "fuzzed-out"
    code, err = call_main(main, [str(world.extract_config(out, corpus))])
    if code != 0:
        tally.add("corpus:whole_run", False, f"extraction of the fuzzed corpus failed ({code}): {err[-400:]}")
        return
    summary = json.loads((out / "summary.json").read_text())
    rejects = (out / "rejects.jsonl").read_text().splitlines()
    problems = [str(p) for p in verify_dataset(str(out))]
    accounted = summary["samples"] + sum(summary["rejects"].values()) + summary["duplicates"]
    ok = accounted == len(lines) and len(rejects) == accounted - summary["samples"] and not problems
    tally.add(
        "corpus:whole_run",
        ok,
        f"{len(lines)} lines, accounted {accounted}, rejects.jsonl {len(rejects)} lines, verify {problems[:2]}",
    )
    bad_line = b'{"messages": [oops'
    corpus.write_bytes(
        as_line({"messages": [message("user", "hi"), message("assistant", "word " * 40)]}) + b"\n" + bad_line + b"\n"
    )
    code, err = call_main(main, [str(world.extract_config(work / "fail-out", corpus, on_error="fail"))])
    line = cli_message(err, "extract:")
    ok = code == 2 and "fuzzed.jsonl:2" in line and "Traceback" not in err
    tally.add("corpus:on_error=fail", ok, f"exit {code}: {line or err[-300:]}")


# ----------------------------------------------------------------------------------------------
# Configs


def leaf_fields(cls, prefix: str = "") -> list[tuple[str, typing.Any, dict]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += leaf_fields(hint, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, hint, dict(f.metadata)))
    return out


def _strip_optional(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def bad_values(hint, meta: dict) -> list[tuple[str, typing.Any]]:
    """(what is wrong, value) candidates that no value of this field's type and range accepts."""
    hint = _strip_optional(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    out: list = []
    if hint is bool:
        out += [("type", 1), ("type", "yes"), ("type", [True])]
    elif hint is int:
        out += [("type", "abc"), ("type", 1.5), ("type", True), ("type", [1])]
    elif hint is float:
        out += [("type", "abc"), ("type", True), ("type", [1.0])]
    elif hint is str:
        out += [("type", 5), ("type", True), ("type", [1]), ("type", 1.5)]
    elif origin is typing.Literal:
        out += [("choice", "no-such-choice"), ("type", 5)]
    elif origin is list:
        item = args[0] if args else typing.Any
        out += [("type", 5), ("type", "abc"), ("item type", ["abc"] if item is not str else [5])]
        if item is int:
            out.append(("item type", [1.5]))
    elif hint is dict or origin is dict:
        out += [("type", 5), ("type", "abc"), ("type", [1])]
    choices = meta.get("choices")
    if choices and all(isinstance(c, str) for c in choices):
        out.append(("choice", "no-such-choice"))
    lo, hi = meta.get("min"), meta.get("max")
    is_list = origin is list
    if lo is not None:
        below = lo - 1 if (hint is int or (is_list and args and args[0] is int)) else lo - 0.5
        out.append(("below min", [below] if is_list else below))
    if hi is not None:
        above = hi + 1 if (hint is int or (is_list and args and args[0] is int)) else hi + 0.5
        out.append(("above max", [above] if is_list else above))
    return out


def toml_literal(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return json.dumps(value)


def config_cases(cls) -> list[tuple[str, str, str, tuple]]:
    """(key, what is wrong, override word, exact value) for every key of `cls`. A string key takes
    any command-line text as given, so its wrong types exist only in a config file: those cases
    carry the value itself (`exact`, set as a file would) instead of an override word."""
    cases = []
    for key, hint, meta in leaf_fields(cls):
        text_key = _strip_optional(hint) is str
        for what, value in bad_values(hint, meta):
            exact = (key, value) if text_key and what == "type" else ()
            cases.append((key, what, "" if exact else f"{key}={toml_literal(value)}", exact))
    return cases


def fuzz_configs(world: World, tally: Tally, examples: int, seed: int | None, work: Path) -> None:
    from common.config import ConfigError, load_config, parse_cli
    from extract.config import ExtractConfig
    from train.config import TrainConfig

    extract_base = str(world.extract_config(work / "cfg-base"))
    stages = {"extract": (ExtractConfig, [extract_base]), "train": (TrainConfig, [])}
    cases = [(stage, *case) for stage, (cls, _) in stages.items() for case in config_cases(cls)]
    tables = {"extract": [""], "train": ["", "model.", "data.", "loss.", "optim.", "checkpoint.", "log."]}
    unknown = st.tuples(st.sampled_from(sorted(stages)), st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True))

    def judge(stage, key, what, word, exact=()):
        cls, base = stages[stage]
        try:
            if exact:
                load_config(cls, base[0] if base else None, section=stage, values=dict([exact]))
            else:
                parse_cli(cls, base + [word], section=stage)
        except ConfigError as exc:
            ok = key in str(exc)
            tally.add(f"config:{what}", ok, f"{stage} {word or exact}: message does not name {key!r}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001
            tally.add(
                f"config:{what}", False, f"{stage} {word or exact}: {type(exc).__name__} instead of ConfigError: {exc}"
            )
            return
        tally.add(f"config:{what}", False, f"{stage} {word or exact}: accepted (silent pass)")

    @hypothesis_settings(examples, seed)
    @given(
        st.one_of(
            st.sampled_from(cases),
            unknown.flatmap(
                lambda su: st.sampled_from(tables[su[0]]).map(
                    lambda t: (su[0], t + "zz_" + su[1], "unknown key", f"{t}zz_{su[1]}=1", ())
                )
            ),
        )
    )
    def check(case):
        judge(*case)

    if seed is not None:
        check = hypothesis_seed(seed)(check)
    check()
    for case in cases:  # and every generated case once, whatever hypothesis drew
        judge(*case)


def semantic_config_cases(world: World, tally: Tally, work: Path) -> None:
    """Values that parse but cannot work, through the command lines: exit 2 naming the key or file."""
    from extract.__main__ import main as extract_main
    from train.__main__ import main as train_main

    n_layers = 4
    empty = work / "empty-dir"
    empty.mkdir(exist_ok=True)
    extract_cases = [
        ("layer_ids", dict(layer_ids=[0, n_layers])),
        ("layer_ids", dict(layer_ids=[0, 50])),
        ("layer_ids", dict(layer_ids=[1, 1])),
        ("target", dict(target=str(work / "no-such-target"))),
        ("target", dict(target=str(empty))),
        ("corpus", dict(corpus=str(work / "no-such-corpus.jsonl"))),
        ("corpus", dict(corpus=str(empty))),
        ("corpus", dict(corpus=str(world.target_dir / "config.json"))),
        ("topk", dict(topk=1000)),
        ("tokens_per_batch", dict(tokens_per_batch=100)),
        ("splits", dict(corpus="", splits={"../x": str(world.corpus)})),
    ]
    for i, (key, overrides) in enumerate(extract_cases):
        out = work / f"semantic-extract-{i}"
        code, err = call_main(extract_main, [str(world.extract_config(out, **overrides))])
        line = cli_message(err, "extract:")
        ok = code == 2 and key in line and "Traceback" not in err
        tally.add("config:semantic", ok, f"extract {overrides}: exit {code}: {line or err[-400:]}")
    runs = work / "semantic-runs"
    train_cases = [
        ("target_layer_ids", ["model.target_layer_ids=[0,9]"]),
        ("layer_ids", ["model.target_layer_ids=[0,1]"]),
        ("hidden_size", ["model.hidden_size=48"]),
        ("num_attention_heads", ["model.num_attention_heads=3"]),
        ("head_dim", ["model.head_dim=7"]),
        ("data.shards", [f"data.shards={work / 'no-such-shards'}"]),
        ("model.target", [f"model.target={work / 'no-such-target'}"]),
        ("token_budget", ["data.token_budget=8"]),
        ("block_size", ["model.block_size=300"]),
        ("mask_token_id", ["model.mask_token_id=3"]),
    ]
    for i, (key, extra) in enumerate(train_cases):
        args = world.train_args(runs, f"semantic-{i}", "optim.max_steps=1", *extra)
        code, err = call_main(train_main, args)
        line = cli_message(err, "train:")
        ok = code == 2 and key in line and "Traceback" not in err
        tally.add("config:semantic", ok, f"train {extra}: exit {code}: {line or err[-400:]}")


# ----------------------------------------------------------------------------------------------
# Mismatched shards


def write_variant(world: World, root: Path, change: str) -> str:
    """A small dataset like the reference but with one thing changed; returns the manifest field that differs."""
    from shards import ShardDataset, ShardWriter
    from shards.schema import Sample

    base = ShardDataset(str(world.baseline))
    prov = base.provenance.to_dict()
    width, topk = base.hidden_width, base.topk
    field = {
        "tokenizer": "provenance.tokenizer.hash",
        "taps": "provenance.taps.layer_ids",
        "hidden_size": "provenance.target.hidden_size",
        "vocab": "provenance.target.vocab_size",
        "incomplete": "complete",
        "target": "model.target",
    }[change]
    if change == "tokenizer":
        prov["tokenizer"]["hash"] = "0" * 32
    elif change == "taps":
        prov["taps"]["layer_ids"] = [1, 3]
    elif change == "hidden_size":
        prov["target"]["hidden_size"] = 32
        width = 2 * 32
    elif change == "vocab":
        prov["target"]["vocab_size"] = base.provenance.target.vocab_size + 10
    elif change == "target":
        prov["target"]["name_or_path"] = str(root / "no-such-target")
    with ShardWriter(str(root), provenance=prov, hidden_width=width, topk=topk) as writer:
        for i in range(4):
            s = base[i]
            hidden = s.hidden[:, :width] if width <= s.hidden.shape[1] else s.hidden
            writer.write(
                Sample(
                    s.sample_id,
                    s.input_ids,
                    s.loss_mask,
                    hidden.copy(),
                    s.topk_ids[:, :topk].copy(),
                    s.topk_logprobs[:, :topk].copy(),
                )
            )
        if change == "incomplete":
            writer.flush()
            writer.close(complete=False)
    return field


def mismatched_shards(world: World, tally: Tally, work: Path) -> None:
    from train.__main__ import main as train_main
    from train.eval.__main__ import main as eval_main
    from train.loop import train

    runs = work / "mismatch-runs"
    train(world.train_cfg(runs, "ok", "optim.max_steps=1"))
    for change in ("tokenizer", "taps", "hidden_size", "vocab", "incomplete", "target"):
        root = work / f"mismatch-{change}"
        field = write_variant(world, root, change)
        # The drafter reads the shards' taps unless told which it needs: a taps mismatch exists only then.
        extra = ["model.target_layer_ids=[0,2]"] if change == "taps" else []
        code, err = call_main(
            train_main, world.train_args(runs, f"mm-{change}", "optim.max_steps=1", *extra, shards=root)
        )
        line = cli_message(err, "train:")
        ok = code == 2 and field in line and "Traceback" not in err
        tally.add("shards:train", ok, f"{change}: exit {code}: {line[:400] or err[-400:]}")
        if change in ("incomplete", "target"):
            continue
        code, err = call_main(eval_main, [str(runs / "ok"), "--data", str(root), f"out={work / f'eval-{change}.json'}"])
        line = cli_message(err, "eval:")
        ok = code == 2 and field in line and "Traceback" not in err
        tally.add("shards:eval", ok, f"{change}: exit {code}: {line[:400] or err[-400:]}")


def issue45_families(world: World, tally: Tally, work: Path, full: bool = True) -> list[str]:
    """The object-store, damaged-data, command and build families; lines for the report."""
    lines = [command_cases.run_all(world, tally, work / "commands", full=full)]
    if moto_server_command() is None:
        return lines + [store_cases.run_all(world, tally, work / "stores", None)]
    with store_cases.environment(**MotoServer.env()), MotoServer() as server:
        return lines + [store_cases.run_all(world, tally, work / "stores", server)]


def issue54_families(world: World, tally: Tally, work: Path, full: bool = True) -> list[str]:
    """The Makefile, signal, late-check, records and store-outage families; lines for the report."""
    lines = [make_lines.run_all(tally, work / "make")]
    signal_cases.run_all(world, tally, work / "signals", full=full)
    late_checks.run_all(world, tally, work / "late")
    record_cases.run_all(tally, work / "records")
    if moto_server_command() is None:
        return lines + [outage_cases.run_all(world, tally, work / "outage", None)]
    with store_cases.environment(**MotoServer.env()), MotoServer() as server:
        return lines + [outage_cases.run_all(world, tally, work / "outage", server)]


def run(
    world: World, *, record_examples: int, config_examples: int, seed: int | None, work: Path, writer_pairs: int = 3
) -> Outcome:
    outcome = Outcome(5, "Bad inputs")
    start = time.perf_counter()
    tally = Tally()
    lines: list[bytes] = []
    fuzz_records(world, tally, record_examples, seed, lines)
    random.Random(seed).shuffle(lines)
    fuzzed_corpus_runs(world, tally, lines[:300], work)
    corpus_inputs.run_all(world, tally, examples=record_examples // 3, seed=seed, lines=lines, work=work)
    corpus_files.run_all(world, tally, examples=record_examples // 3, seed=seed, work=work / "corpus-files")
    writers_line = writers.concurrent_writers(
        world, tally, work, extraction_pairs=writer_pairs, training_pairs=max(1, writer_pairs - 1)
    )
    fuzz_configs(world, tally, config_examples, seed, work)
    semantic_config_cases(world, tally, work)
    mismatched_shards(world, tally, work)
    stores_line = issue45_families(world, tally, work / "issue45")
    stores_line += issue54_families(world, tally, work / "issue54")
    outcome.failures += tally.failures
    groups: dict = {}
    for kind, (tried, clear) in tally.kinds.items():
        group = kind.split(":")[0]
        t, c = groups.get(group, (0, 0))
        groups[group] = (t + tried, c + clear)
    outcome.details.append("by family: " + ", ".join(f"{g} {c}/{t}" for g, (t, c) in sorted(groups.items())))
    families = ("record", "format", "encoding", "tool_call", "control_token", "writers", "directory", "changing")
    families += ("compressed", "prompt_length", "type_confusion")
    families += ("store_setup", "store_gone", "train_damage", "command_config", "silent", "build")
    families += ("make", "signals", "store_outage", "late_check", "records")
    for family in families:
        outcome.details.append(
            f"{family} kinds tried: "
            + ", ".join(
                f"{k.split(':', 1)[1]} {t}" for k, (t, c) in sorted(tally.kinds.items()) if k.startswith(f"{family}:")
            )
        )
    outcome.details.append(writers_line)
    outcome.details += stores_line
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{tally.tried} cases tried, {tally.clear} with a clear answer")
