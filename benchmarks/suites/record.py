"""One suite run's record: ONE JSON file with the suite, the commit, the machine, the package versions, the date,
the command, the plan, every part's outcome and every figure measured (flat keys, `SUITE.PART.WHAT`), written
again after every part so a run cut short keeps what it measured.

Per part: its units, its estimate, its outcome and steps, the date it started, `cold` (its family's first run
on that machine: the cost learned from it includes the cold start), and `earlier` (the date of the earlier
command it ran in, where a command continued another: `continues` lists those commands).

The same schema holds the records imported from the log of docs/benchmarks.md or of its dated archives beside it
(`status` "imported", `source` the log entry they were copied from, `docs/PAGE.md#anchor`): `benchmarks.render`
reads both alike.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
from pathlib import Path

import torch

from benchmarks.carry import git_commit
from common.device import describe_machine

SCHEMA = 1
# The pages that hold the log: docs/benchmarks.md (today's entries) and its dated archives beside it.
LOG_ENTRY = re.compile(r"docs/benchmarks(-log-\d{4}-\d\d-\d\d-to-\d{4}-\d\d-\d\d)?\.md#[\w-]+")
PACKAGES = (
    "torch",
    "transformers",
    "pyarrow",
    "accelerate",
    "numpy",
    "safetensors",
    "triton",
    "fla-core",
    "flash-linear-attention",
    "zstandard",
    "datasets",
    "gguf",
    "moto",
    "botocore",
)
SCALE_NAMES = {"h200": "gpu"}  # the GPU scale's name in records written before 2026-12-05
REQUIRED = ("schema", "suite", "status", "date", "commit", "machine", "packages", "command", "figures")
REPO = Path(__file__).resolve().parents[2]


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def commit(repo: Path = REPO, wheels: Path | None = None) -> str:
    """The tree's commit: git's where it names a clean tree; else what `benchmarks.carry stamp`/`pack` wrote beside
    the wheels (a device host gets the tree without its .git, or with a .git of an older commit, which git then
    reports as that commit '+changes': seen on 2026-12-05); else git's answer, else 'unknown'."""
    found = git_commit(repo)
    written = (wheels or repo / ".whl") / "COMMIT"
    if (not found or found.endswith("+changes")) and written.is_file():
        return written.read_text().strip()
    return found or "unknown"


def machine() -> dict:
    """The GPU(s) torch sees, their memory, the CPU and its usable cores, the host's OS."""
    out = describe_machine()
    out.pop("torch", None)  # in `packages`
    out["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if out["gpus"]:
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    out["os"] = platform.platform()
    return out


def machine_line(found: dict) -> str:
    """One line: the GPU(s) and their memory, the CPU, the OS."""
    gpus = found.get("gpus") or 0
    gpu = f"{found['gpu']} ({found.get('gpu_memory_gib', '?')} GiB)" if gpus else "no GPU"
    gpu = f"{gpus} x {gpu}" if gpus > 1 else gpu
    return f"machine: {gpu}; {found.get('cpu')}, {found.get('cores')} cores; {found.get('os')}"


def packages() -> dict:
    """Python's version and each of `PACKAGES` installed here, by its distribution's version."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def new_record(
    suite: str, scale: str, command: str, budget_s: float, wheels: Path | None = None, options: dict | None = None
) -> dict:
    return {
        "schema": SCHEMA,
        "suite": suite,
        "scale": scale,
        "options": options or {},
        "status": "running",
        "date": utc_now(),
        "commit": commit(REPO, wheels),
        "machine": machine(),
        "packages": packages(),
        "command": command,
        "budget_s": budget_s,
        "plan": None,
        "parts": {},
        "cut": [],
        "figures": {},
        "raw": {},
    }


def write_record(record: dict, path: Path) -> None:
    """Atomically: a reader (or a kill) never sees half a record."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def check_record(record: dict, where: str) -> None:
    """A ValueError naming `where` and the first thing wrong, where a record cannot be rendered."""
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        raise ValueError(f"{where}: record lacks {', '.join(missing)}")
    if record["schema"] != SCHEMA:
        raise ValueError(f"{where}: record schema {record['schema']}, this code reads {SCHEMA}")
    try:
        datetime.datetime.strptime(record["date"], "%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError):
        raise ValueError(f"{where}: date {record['date']!r} is not YYYY-MM-DDTHH:MM:SSZ (UTC)") from None
    if not isinstance(record["figures"], dict):
        raise ValueError(f"{where}: figures must be an object of key: value")
    if record["status"] == "imported" and not LOG_ENTRY.fullmatch(record.get("source", "")):
        raise ValueError(
            f"{where}: an imported record names its log entry as source = docs/benchmarks.md#anchor "
            "(or docs/benchmarks-log-FIRST-to-LAST.md#anchor, a dated archive of the log)"
        )


def load_records(directory: Path) -> list[tuple[Path, dict]]:
    """Every record in `directory` (*.json), checked, oldest first (by date, then file name)."""
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        check_record(record, str(path))
        records.append((path, record))
    return sorted(records, key=lambda item: (item[1]["date"], item[0].name))


def scale_of(record: dict) -> str | None:
    """The record's scale under its current name ("gpu" or "smoke")."""
    scale = record.get("scale")
    return SCALE_NAMES.get(scale, scale)


def gpu_kind(machine: dict | None) -> str | None:
    """The kind of GPU a record's machine names, the model without its memory or maker ("NVIDIA H100 80GB HBM3":
    H100), or None without a GPU: costs learned on one kind plan only runs on the same kind."""
    name = str((machine or {}).get("gpu") or "").removeprefix("NVIDIA ")
    found = re.match(r"([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)  # a data-centre model: H100, H200, A100, L40S
    return found.group(1) if found else (name or None)


def measured_costs(records: list[tuple[Path, dict]], suite: str, scale: str, kind: str | None) -> dict[str, dict]:
    """Per part, the newest finished run of it in this suite's records at this scale on this kind of GPU:
    {"part", "seconds", "units", "date", "cold" (it ran on a bare machine), "gpu"}. A part copied from an earlier
    command of the same run counts once, as that command measured it."""
    found: dict[str, dict] = {}
    for _path, record in records:
        if record["suite"] != suite or scale_of(record) != scale or gpu_kind(record.get("machine")) != kind:
            continue
        for name, part in (record.get("parts") or {}).items():
            if part.get("status") == "ok" and part.get("seconds"):
                found[name] = {
                    "part": name,
                    "seconds": part["seconds"],
                    "units": part.get("units"),
                    "date": part.get("date", record["date"])[:10],
                    "cold": part.get("cold", True),  # records before 2026-12-06 ran on bare machines
                    "gpu": kind,
                }
    return found
