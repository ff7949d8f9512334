"""Scenario 5's late-check family (issue 54): what can be checked before a command's first step (or
before a stage loads anything) is checked there, in one line, exit 2, naming the key and the file.

- the drafter command with `extract.layer_ids=[99]` (the target has 4 layers): refused at its config
  check, before step 1 (no step process starts);
- a target directory without tokenizer files, and one holding only config.json: `extract` and
  `extract.regenerate` refuse it naming `target` and what is missing, before any tokenizer or
  weights load;
- a prompts file with a line that is not UTF-8: the drafter names the file and the line;
- `{"text": ...}` prompt records, which the drafter's `--help` lists as accepted: the target answers
  them (regeneration stores answers, it does not reject them all);
- the tier comparison given `heldout=gs://...` or `lossless=gs://...` that no credentials reach, or a
  `lossless` dataset that is not there: exit 2 naming the key before any transcode.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from tests.reliability.cli import call_main, one_line_problems
from tests.reliability.store_cases import environment
from tests.reliability.world import World

GCS = "gs://dflash-reliability-no-such-bucket/x"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@contextlib.contextmanager
def nothing_runs():
    """Loading a tokenizer or weights, and starting a drafter or tier-comparison step, raise instead: a
    check that comes later than them shows as a failure (a traceback or another status)."""
    import transformers

    from recipes import runner

    def refuse(*args, **kwargs):
        raise AssertionError("loaded or started before the checks")

    loaders = (transformers.AutoTokenizer, transformers.AutoModelForCausalLM)
    places = [(cls, "from_pretrained") for cls in loaders]
    places += [(runner, "step"), (runner, "steps_together")]
    saved = [(owner, name, vars(owner).get(name)) for owner, name in places]
    try:
        for owner, name in places:
            setattr(owner, name, classmethod(lambda cls, *a, **k: refuse()) if owner in loaders else refuse)
        yield
    finally:
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)  # it was inherited
            else:
                setattr(owner, name, value)


def good_chats(world: World) -> list[dict]:
    """The corpus' well-formed chats (it also holds one bad record of each kind)."""
    chats = []
    for line in world.corpus.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            turns = record.get("messages") if isinstance(record, dict) else None
            if (
                isinstance(turns, list)
                and turns
                and all(isinstance(t, dict) for t in turns)
                and turns[0].get("role") == "user"
                and isinstance(turns[0].get("content"), str)
            ):
                chats.append(record)
    return chats


def chat_prompts(world: World, path: Path, n: int = 8) -> Path:
    path.write_text("".join(json.dumps(chat) + "\n" for chat in good_chats(world)[:n]))
    return path


def drafter_args(world: World, work: Path, name: str, *extra: str, prompts: Path | None = None) -> list[str]:
    prompts = prompts or chat_prompts(world, work / f"{name}-prompts.jsonl")
    return [f"target={world.target_dir}", f"prompts={prompts}", f"out={work / name}", "scale=smoke", "device=cpu"] + [
        *extra
    ]


def judged(tally, kind: str, code, stderr: str, says: tuple[str, ...], what: str) -> None:
    problems, _ = one_line_problems(code, stderr, exit_code=2, says=says)
    tally.add(f"late_check:{kind}", not problems, f"{what}: {'; '.join(problems)}")


def drafter_cases(world: World, tally, work: Path) -> None:
    from recipes.drafter.__main__ import main as drafter_main

    with nothing_runs():
        code, stderr = call_main(drafter_main, drafter_args(world, work, "taps", "extract.layer_ids=[99]"))
    judged(tally, "layer ids", code, stderr, ("layer_ids", "out of range"), "drafter extract.layer_ids=[99]")
    prompts = chat_prompts(world, work / "not-utf8.jsonl", 4)
    lines = prompts.read_bytes().splitlines()
    lines[2] = lines[2][:20] + b"\xff\xfe" + lines[2][20:]
    prompts.write_bytes(b"\n".join(lines) + b"\n")
    with nothing_runs():
        code, stderr = call_main(drafter_main, drafter_args(world, work, "utf8", prompts=prompts))
    judged(tally, "invalid UTF-8", code, stderr, (str(prompts), "line 3"), "drafter prompts with invalid UTF-8")


def partial_target(world: World, root: Path, keep: str) -> Path:
    """The world's target without its tokenizer files ("no tokenizer") or with config.json alone ("config only")."""
    target = root / f"target-{keep.replace(' ', '-')}"
    if not target.exists():
        shutil.copytree(world.target_dir, target)
        for path in target.iterdir():
            if (keep == "no tokenizer" and path.name in TOKENIZER_FILES) or (
                keep == "config only" and path.name != "config.json"
            ):
                path.unlink()
    return target


def target_cases(world: World, tally, work: Path) -> None:
    from extract.__main__ import main as extract_main
    from extract.regenerate.__main__ import main as regenerate_main

    for keep, says in (("no tokenizer", "tokenizer"), ("config only", "weights")):
        target = partial_target(world, work, keep)
        regen = [f"target={target}", f"corpus={world.corpus}", f"out={work / ('regen-' + keep[:2])}", "backend=local"]
        config = world.extract_config(work / f"extract-{keep.replace(' ', '-')}", target=str(target))
        for command, main, args in (("regenerate", regenerate_main, regen), ("extract", extract_main, [str(config)])):
            with nothing_runs():
                code, stderr = call_main(main, args)
            judged(tally, f"target {keep}", code, stderr, ("'target'", says), f"{command}, a target with {keep}")


def text_prompts(world: World, tally, work: Path) -> None:
    """`{"text": ...}` prompts through the drafter's prompt sets and regeneration: answered, not rejected."""
    from extract.regenerate.__main__ import main as regenerate_main
    from recipes.drafter.prompts import split_prompts

    texts = work / "text-prompts.jsonl"
    words = [chat["messages"][0]["content"] for chat in good_chats(world)[:12]]
    texts.write_text("".join(json.dumps({"text": w}) + "\n" for w in words))
    split = split_prompts(str(texts), "", str(work / "text-out"), asked=0, seed=0, smoke=True)
    split.write()
    out = work / "text-regen"
    args = [f"target={world.target_dir}", f"corpus={split.train}", f"out={out}", "backend=local", "max_new_tokens=8"]
    code, stderr = call_main(regenerate_main, [*args, "device=cpu", "dtype=float32", "progress=false"])
    stored = 0
    if (out / "data.jsonl").exists():
        stored = len((out / "data.jsonl").read_text().splitlines())
    ok = code == 0 and stored > 0 and "Traceback" not in stderr
    tally.add(
        "late_check:text prompts",
        ok,
        f'{{"text": ...}} prompts: exit {code}, {stored} answered: {stderr.strip()[-300:]}',
    )


def tier_cases(world: World, tally, work: Path) -> None:
    from recipes.compare_tiers import main as tiers_main

    base = [f"out_dir={work / 'tiers'}", "online=false", "tiers=['fp8']", "seeds=[0]"]
    cases = (
        ("heldout on gs://", [f"lossless={world.baseline}", f"heldout={GCS}"], ("heldout", GCS)),
        ("lossless on gs://", [f"lossless={GCS}", "heldout=none"], ("lossless", GCS)),
        ("lossless missing", [f"lossless={work / 'no-dataset'}", "heldout=none"], ("lossless", "no-dataset")),
    )
    for name, args, says in cases:
        with environment(DFLASH_S3_OUTAGE_S="3", GOOGLE_APPLICATION_CREDENTIALS=""), nothing_runs():
            code, stderr = call_main(tiers_main, [*base, *args])
        judged(tally, f"tiers {name}", code, stderr, says, f"compare_tiers {name}")


def run_all(world: World, tally, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    drafter_cases(world, tally, work)
    target_cases(world, tally, work)
    text_prompts(world, tally, work)
    tier_cases(world, tally, work)
