"""docs/reliability.md: the figures table of a full run, with the command, the date and the machine,
then what each scenario did (windows hit, what the trainer does with checksums off, load sites)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from tests.reliability.world import REPO

ISSUE_FIGURES = {
    1: "kills survived / N, samples lost, samples duplicated",
    2: "kills survived / N, steps whose loss differs",
    3: "corruptions detected / injected",
    4: "scenarios passed",
    5: "cases tried, cases with a clear answer",
    6: "checks passed",
    7: "kills survived / N with what resume promises kept; samples lost, duplicated; values not bit-identical "
    "(observed)",
}

HOW = """\
## How each scenario works

All scenarios run on a tiny random Qwen3 target (4 layers, hidden 64, the project's chat tokenizer)
built from a config by `tests/reliability/world.py`, and a 70-line chat corpus with one bad record of
each kind; the extraction stores taps [0, 2], top-4, in 30 kB shards (2-3 samples each, so a run
commits about 25 shards and every commit window comes up many times). Training runs a 1-layer
drafter on that extraction. Everything but scenario 7 is single-threaded, so results are
bit-identical between processes.

1. **Extraction kills.** `python -m extract` processes (`tests/reliability/child.py`, the real CLI
   with fault hooks installed from outside) are SIGKILLed either by a hook the n-th time they reach
   a window (shard bytes half-written, index or shard written but not renamed, shard renamed but
   not yet in the manifest, manifest written but not renamed, just after a manifest commit, the
   rejects fsync, the three steps of the final merge), with n random, or by the parent at a random
   moment (a random number of committed samples plus 0-30 ms, or a random time). About a third of
   the runs are killed twice before the final resume. After every kill the rank manifest must pass
   `verify` and hold only samples of the uninterrupted run, bit for bit, never fewer than before;
   the resumed dataset must equal the uninterrupted one (sample set, per-sample bytes, counts,
   rejects.jsonl, summary.json, no temporary file left).
2. **Training kills.** `python -m train` processes killed in a checkpoint save (model, optimizer or
   state file half-written; directory complete but not renamed; renamed before pruning; an old
   checkpoint half-deleted by pruning), in a half-written metrics line, or at a random moment (a
   random number of logged steps plus 0-30 ms). After each kill every listed checkpoint must load
   with the safe loaders and the previous save must still be there; the resumed run must log every
   step once with the uninterrupted run's exact losses and end with the same weights.
3. **Corruption.** One random byte XORed with a random value, or the file truncated at a random
   length, in a copy of the dataset (shard, index or manifest) or of a checkpoint (each of its four
   files). Detected means: `verify` reports a problem naming the file *and* the trainer's data
   stream with `data.verify_checksums=true` stops with an error naming it *and* the stream with the
   default settings (per-sample checksums on, whole-file checksums off) stops naming it or reads
   exactly the intact data (the damaged bytes are never read) (dataset files), or `load_checkpoint`
   refuses naming the file (checkpoints; a resume through `train()` is tried once per file kind).
   The stream with every check off (`data.verify_samples=false`) is observed, not judged; see
   above. Then runs with `data.on_corrupt=skip` train one epoch past a damaged shard and must count
   exactly that shard's samples, or exactly one sample for a byte flipped inside one sample.
4. **Full disk and I/O errors.** ENOSPC or EIO injected in-process at one point of the write path
   while the real CLI entry point runs; it must stop with one line on stderr naming the error and
   the file (no traceback), keep the last good state (committed samples verify and match; every
   checkpoint loads; no temporary directory), and a rerun must finish with the uninterrupted result;
   the same for `shards transcode` (a shard write, the manifest) and `extract.regenerate` (a journal
   line, data.jsonl's commit), which must exit 4. Then real full disks: each of extraction,
   transcode, regeneration and training runs in a child in its own user and mount namespace with its
   output on a tmpfs of half the clean run's size (`tests/reliability/small_disk.py`, where the kernel
   allows it; the report says when it does not): exit 4 with one line naming the file and "No space
   left on device" (also for torch's and safetensors' own writers), no temporary file left on the full
   disk, and the same command after the tmpfs has grown ends identical to a clean run. Transcode runs
   twice: also from a dataset of 7 MB into one shard, so that the disk fills inside a shard larger
   than the writer's 1 MB buffer (the buffered close fails too).
5. **Bad inputs.** Hypothesis-generated corpus records through the extraction's own reading and
   tokenizing path, one fuzzed corpus through the whole extraction (also with `on_error=fail`),
   every wrong type / range / choice of every config key plus generated unknown keys, semantic
   config errors through the CLIs (layer ids beyond the model, missing paths, widths that do not
   fit), and shards that do not fit the drafter, through `train` and `train.eval`.
   Also: chats in ShareGPT form and with OpenAI content parts (the same sample as the
   `messages` form, or the right reason), the fuzzed lines in UTF-8 with a BOM, UTF-16 and UTF-32
   (read exactly like UTF-8), generated agent conversations with tool calls through a template
   that renders tools like Qwen3.6's (the loss mask equals the one transformers derives from the
   template's `{% generation %}` markers; malformed calls and a template without tool support get
   their reasons), control-token text planted in any text of a record (the ids hold exactly the
   template's control tokens, the mask still matches), and concurrent writers: two real extractions
   into one out_dir at once with different batch settings, two trainings into one run directory,
   and a lock held by a process that is then SIGKILLed. And (`corpus_files.py`): generated corpus
   directories (suffixes in any case, unknown names, hidden files, subdirectories: every entry read
   or listed as skipped, exactly the read files' lines counted), corpus files appended to, rewritten
   or cut after their fingerprint (the fingerprinted records, or an error naming the file), damaged
   .gz / .bz2 / .zst files (an error naming the file and how far it was read, or lines read as
   records and rejects; a truncation always named), regeneration prompts around the context limit
   (`prompt_too_long` exactly when no room is left, else an answer budget inside the context), and
   type confusions (booleans among token ids, per-turn weight / train switches of every type).
   And the families of issue 45, each judged by its exit status, no traceback anywhere on stderr,
   and what its last line must and must not say (`cli.one_line_problems`): object-store setup
   errors against moto_server (a missing bucket, no bucket in the URI, `hdfs://`, no credentials, a
   bad DFLASH_LOCK_LEASE_S / DFLASH_S3_OUTAGE_S, an S3 run directory) through train, extract,
   regenerate, transcode and verify (exit 2 naming the key or setting, no "rerun" hint, nothing
   written); training through a proxy whose store goes away after step 3 for 3 s (the uninterrupted
   run's losses, step for step) or for good (exit 4, "the store is unreachable", not "corrupt"; the
   rerun ends with the uninterrupted run's losses and weights); damaged datasets at training, local
   and on S3 (a flipped byte, every index gone, a shard gone: exit 2 naming the object and `python
   -m shards verify`, no "rerun" hint; verify exits 1); each entry point given an unknown key, a
   wrong type, a missing config file, a TOML table as a path, a store URI where a local path is
   written (exit 2 naming it, nothing created in the working directory); what once passed without a
   word (a run directory on S3, a mask token the shards hold, an extraction mask token outside the
   vocabulary); and the real-target build (`recipes.smollm2`): a downloads path that is a file, an
   out_dir under a file, on a store, a TOML table; and, with the pinned wheels in artifacts/downloads,
   a build SIGKILLed in its conversion, then two builds at once sharing the downloads folder, one
   into the killed build's out_dir: both finish, its temporaries are gone, both targets have the
   same conversion checksum and an ordinary output's permissions.
   And the families of issue 54: every documented `make` line run with a recording interpreter
   (`make_lines.py`: each command gets the argument vector the line means; values with `&`, spaces,
   quotes, `$`, `;` arrive as one argument each; a multi-word RUN / ARGS once; a fresh clone's
   set-up prelude; CONFIG reaching the drafter and the demos); signals (`signal_cases.py`): the
   drafter command given SIGTERM, then its rerun given Ctrl-C, while a step's process runs (exit 143
   / 130, one line, the step's whole process group gone, the rerun resuming that step), and each
   stage command given Ctrl-C while torch loads (exit 130, one line); store outages
   (`outage_cases.py`, `DFLASH_S3_OUTAGE_S=3`): an extraction and a transcode into S3 whose store goes
   away for good after their first commit (exit 4, "the store is unreachable", within 60 s of the
   cut; the rerun with the store back gives the uninterrupted dataset) and `shards inspect` /
   `verify` of a gs:// location no credentials reach (exit 2 in time); late checks
   (`late_checks.py`): tap ids beyond the target's depth given to the drafter command, targets without
   a tokenizer or holding only config.json given to extraction and regeneration, a prompt file with a
   line that is not UTF-8, the tier comparison's held-out or lossless set on an unreachable gs:// or
   missing (exit 2 naming the key, with every model load and step start made to fail, so a later
   check shows), and `{"text": ...}` prompts, which the target must answer; and the records of the
   GPU suites (`record_cases.py`): malformed records given to `benchmarks.render --add` (exit 2, one
   line, nothing written in or outside the results folder, `--check` still passing) and two records
   of one suite in the same second (both kept).
6. **Security.** An AST scan of common/, shards/, extract/, train/ for every load site; a
   checkpoint whose optimizer.pt is a code-running pickle (with a matching checksum); a shard whose
   schema carries a pickled Arrow extension type; targets and exported drafters that ship Python
   code; generated split and run names; what `extract`, `train`, `shards merge` and `export` write,
   by running them from an empty working directory.
7. **Extraction kills, default threads.** As scenario 1 (kills at random moments) but the
   children run with torch's default thread count. Judged is what resume promises (docs/guide.md, "What
   resume guarantees" in shards/FORMAT.md): the same samples as an uninterrupted run with the same
   threads, each once, with the same tokens, loss masks, counts and rejects. Whether the stored
   values are bit-identical is observed and reported, not judged.

## Short versions in `make test`

`tests/reliability/test_*.py` run every scenario small, in forked processes (the target is loaded
once per test process): one kill in each of the shard-written, shard-renamed, manifest-update and
merge windows; kills in a half-written checkpoint file, after a checkpoint rename and in the middle
of pruning; 5 damaged dataset files and 5 damaged checkpoint files plus the three `on_corrupt=skip`
runs; ENOSPC in shard data and in a manifest update, in a checkpoint file and EIO in a checkpoint
fsync, in a transcode shard and a regeneration journal, and real full disks for extraction,
transcode (both sizes) and training; 80 generated records, one fuzzed corpus, every bad value of every
config key, the semantic and mismatched-shard cases, 30 generated cases of each corpus-input family,
60 of the corpus-file families, one pair of concurrent extractions and a crashed lock holder, every
case of issue 45's families but the build's kill and concurrent builds; of issue 54's, the signals
(Ctrl-C at start for extract and eval only), the late checks, the records, the extraction into a
store gone for good (tests/reliability/test_issue54.py) and the Makefile's (tests/test_makefile.py);
every security check; one default-threads kill. The fixes the suite led to have their own regression
tests next to the component (tests/shards/test_integrity.py, tests/extract/test_failures.py,
tests/train/test_checkpoint_integrity.py, tests/train/serve/test_remote_code.py; for the holes of
issue 28: tests/extract/test_outside_holes.py, tests/extract/test_regenerate_context.py,
tests/train/serve/test_zlab_loop.py, tests/test_interrupts.py; for issue 45:
tests/common/test_locations.py, tests/objstore/test_failures_s3.py, tests/train/test_data.py,
tests/extract/test_mask_token_vocab.py, tests/shards/test_writer.py, tests/recipes/smollm2/test_build.py,
tests/recipes/test_compare_tiers.py, tests/recipes/test_data_ladder.py; for issue 54:
tests/test_interrupts.py, tests/common/test_outage_clock.py, tests/objstore/test_failures_s3.py,
tests/train/test_checkpoint_integrity.py, tests/benchmarks/test_render.py, tests/recipes/test_drafter_config.py).
"""


def _versions() -> str:
    try:
        import pyarrow
        import torch
        import transformers

        return (
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, pyarrow {pyarrow.__version__}"
        )
    except ImportError:
        return f"Python {platform.python_version()}"


def _git_sha() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def _row(o) -> str:
    return (
        f"| {o.number} | {o.scenario} | {ISSUE_FIGURES[o.number]} | {o.figure} | "
        f"{'yes' if o.passed else '**no**'} | {o.seconds:.0f} s |"
    )


def _details(o) -> list[str]:
    lines = [f"**{o.number}. {o.scenario}.**", ""]
    lines += [f"- {d}" for d in o.details]
    if o.failures:
        lines.append(f"- FAILURES ({len(o.failures)}):")
        lines += [f"  - {f[:500]}" for f in o.failures[:30]]
    return lines + [""]


def write_report(
    path: Path, outcomes: list, *, command: str, date: str, seed: int, sizes: dict, seconds: float
) -> None:
    lines = [
        "# Reliability figures",
        "",
        "Written by `make reliability` (`tests/reliability/`); do not edit by hand.",
        "",
        f"- Command: `make reliability` = `.venv/bin/{command}`",
        f"- Date: {date}",
        f"- Machine: {platform.machine()}, {os.cpu_count()} cores ({platform.system()} {platform.release()}); "
        f"{_versions()}",
        f"- Code: git {_git_sha()}; seed {seed}; sizes {', '.join(f'{k}={v}' for k, v in sizes.items())}",
        f"- Result: {sum(o.passed for o in outcomes)}/{len(outcomes)} scenarios passed in {seconds / 60:.1f} min",
        "",
        "| # | scenario | figure asked for | result | passed | time |",
        "|---|---|---|---|---|---:|",
    ]
    lines += [_row(o) for o in outcomes]
    lines += ["", "## Details", ""]
    for o in outcomes:
        lines += _details(o)
    lines.append(HOW)
    path.write_text("\n".join(lines) + "\n")


def update_report(path: Path, outcomes: list, *, command: str, date: str, seed: int) -> None:
    """Replace the rows and details of the scenarios just rerun in an existing full report, say so
    in its header (with the command, date and code of the rerun), and refresh the fixed text."""
    lines = path.read_text().splitlines()
    numbers = ",".join(str(o.number) for o in outcomes)
    for o in outcomes:
        rows = [i for i, line in enumerate(lines) if line.startswith(f"| {o.number} | ")]
        starts = [i for i, line in enumerate(lines) if line.startswith(f"**{o.number}. ")]
        assert len(rows) == 1 and len(starts) == 1, f"{path}: no row or details of scenario {o.number} to update"
        lines[rows[0]] = _row(o)
        end = next(i for i in range(starts[0] + 1, len(lines)) if lines[i].startswith(("**", "## ")))
        lines[starts[0] : end] = _details(o)
    rerun = (
        f"- Rerun of scenario(s) {numbers} (their rows and details below): `.venv/bin/{command}` on {date}, "
        f"git {_git_sha()}, seed {seed}; {sum(o.passed for o in outcomes)}/{len(outcomes)} passed. "
        "The other scenarios' figures are from the full run above."
    )
    lines = [line for line in lines if not line.startswith(f"- Rerun of scenario(s) {numbers} ")]
    result = next(i for i, line in enumerate(lines) if line.startswith("- Result: "))
    lines.insert(result + 1, rerun)
    how = lines.index(HOW.splitlines()[0])
    path.write_text("\n".join(lines[:how]) + "\n" + HOW + "\n")
