"""Fault injection at named points of the write paths: SIGKILL the process, or fail the write with
ENOSPC / EIO, the n-th time a point is reached.

    install(Fault("kill", "shard_renamed", 3))   # in the process under test (or a forked child)
    DFLASH_FAULT=kill:shard_renamed:3 python -m tests.reliability.child extract CONFIG

The hooks wrap the project's functions from outside (monkeypatching); nothing in the project knows
about them. `Fault("count", ...)` fires nothing and only counts how often each point is reached,
which tells a scenario how many chances every window offers. A fault that fires appends one JSON
line to `$DFLASH_FAULT_LOG` (when set) before acting, so the parent knows the window was hit.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
import time
from pathlib import Path

ENV_FAULT = "DFLASH_FAULT"
ENV_LOG = "DFLASH_FAULT_LOG"

POINTS = {
    # extraction and shards
    "shard_data": "shard bytes half-written (mid record batch)",
    "index_written": "index file written under its .tmp name, not renamed",
    "index_renamed": "index renamed, shard not renamed yet",
    "shard_written": "shard complete under its .tmp name, before fsync + rename",
    "shard_renamed": "shard renamed, manifest not updated yet",
    "manifest_written": "manifest update: new manifest written under its .tmp name, not renamed",
    "manifest_renamed": "manifest renamed (commit done)",
    "rejects_fsync": "rejects file fsync (appended lines not yet committed)",
    "merged_rejects_written": "merge: rejects.jsonl written under .tmp, not renamed",
    "merged_manifest_written": "merge: manifest.json written under .tmp, not renamed",
    "merged_manifest_renamed": "merge: manifest.json renamed, summary not written",
    # regeneration
    "journal_line": "regeneration: journal line half-written",
    "regen_data_written": "regeneration: data.jsonl written under .tmp, not renamed",
    # training
    "ckpt_model": "checkpoint: model.safetensors half-written",
    "ckpt_optimizer": "checkpoint: optimizer.pt half-written",
    "ckpt_state": "checkpoint: state.json being written",
    "ckpt_fsync": "checkpoint: fsync of a checkpoint file",
    "ckpt_written": "checkpoint directory complete under .tmp-, not renamed",
    "ckpt_renamed": "checkpoint renamed, older ones not pruned yet",
    "ckpt_prune": "pruning an old checkpoint, half-deleted",
    "metrics_line": "metrics.jsonl line half-written",
}
ACTIONS = ("kill", "enospc", "eio", "count")
_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO}


@dataclasses.dataclass(frozen=True)
class Fault:
    action: str
    point: str
    nth: int = 1

    def __post_init__(self):
        assert self.action in ACTIONS, self.action
        assert self.point in POINTS or self.action == "count", self.point
        assert self.nth >= 1, self.nth

    @property
    def spec(self) -> str:
        return f"{self.action}:{self.point}:{self.nth}"

    @classmethod
    def parse(cls, spec: str) -> Fault:
        action, point, nth = spec.split(":")
        return cls(action, point, int(nth))


_active: Fault | None = None
counts: collections.Counter = collections.Counter()
fired: list = []  # faults that fired in this process
_originals: list = []  # (owner, attribute, original value) of every patched attribute


def armed(point: str) -> bool:
    """Count one arrival at `point`; True if the active fault fires here now."""
    counts[point] += 1
    fault = _active
    return fault is not None and fault.action != "count" and fault.point == point and counts[point] == fault.nth


def fire(point: str, path: str = "") -> None:
    """Act on the active fault: SIGKILL this process, or raise the configured OSError."""
    fault = _active
    assert fault is not None
    fired.append({"point": point, "nth": fault.nth, "action": fault.action, "path": str(path)})
    log_path = os.environ.get(ENV_LOG)
    if log_path:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"point": point, "nth": fault.nth, "action": fault.action, "path": str(path)}) + "\n")
            f.flush()
            os.fsync(f.fileno())
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL cannot be caught
    code = _ERRNO[fault.action]
    if not path:
        raise OSError(code, os.strerror(code))
    raise OSError(code, os.strerror(code), str(path))


def hit(point: str, path: str = "") -> None:
    if armed(point):
        fire(point, path)


def dump_counts() -> None:
    log_path = os.environ.get(ENV_LOG)
    if log_path:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"counts": dict(counts)}) + "\n")


def read_log(path: Path) -> tuple[list[dict], dict]:
    """(fired faults, counts) written by a child to its fault log."""
    fired, found = [], {}
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            entry = json.loads(line)
            if "counts" in entry:
                found = entry["counts"]
            else:
                fired.append(entry)
    return fired, found


class ModuleProxy:
    """A stand-in for a module (os, shutil) inside one project module, with some functions replaced."""

    def __init__(self, real, **overrides):
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._real, name)


# ----------------------------------------------------------------------------------------------
# Installing the hooks


def install(fault: Fault | None) -> None:
    """Activate `fault` (None: only count) and wrap the write paths (once per process)."""
    global _active
    _active = fault
    counts.clear()
    fired.clear()
    if _originals:
        return
    _hook_commits()
    _hook_shard_stream()
    _hook_rejects()
    _hook_checkpoints()
    _hook_metrics()
    _hook_journal()


def uninstall() -> None:
    """Restore every patched function (in-process use; a forked child just exits)."""
    global _active
    _active = None
    while _originals:
        owner, name, value = _originals.pop()
        setattr(owner, name, value)


@contextlib.contextmanager
def injected(fault: Fault | None):
    """`install(fault)` for the duration of a block in this process, then `uninstall()`."""
    install(fault)
    try:
        yield
    finally:
        uninstall()


def _patch(owner, name: str, value) -> None:
    _originals.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def install_from_env() -> None:
    spec = os.environ.get(ENV_FAULT)
    install(Fault.parse(spec) if spec else None)


def _commit_kind(final_path: str) -> str | None:
    name = os.path.basename(final_path)
    if name.endswith(".index.arrow"):
        return "index"
    if name.endswith(".arrow"):
        return "shard"
    if name.startswith("manifest.rank"):
        return "manifest"
    if name == "manifest.json":
        return "merged_manifest"
    if name == "rejects.jsonl":
        return "merged_rejects"
    return None


def _hook_commits() -> None:
    from common import io

    real_commit = io.commit

    def commit(fs, tmp_path, final_path):
        kind = _commit_kind(final_path)
        if kind is not None:
            hit(f"{kind}_written", final_path)
        real_commit(fs, tmp_path, final_path)
        if kind is not None:
            hit(f"{kind}_renamed", final_path)

    _patch(io, "commit", commit)


def _hook_shard_stream() -> None:
    from shards import shard_file

    real_write = shard_file.HashingStream.write

    def write(self, data):
        if armed("shard_data"):
            view = memoryview(data).cast("B")
            self.raw.write(view[: view.nbytes // 2])
            self.raw.flush()
            fire("shard_data")
        return real_write(self, data)

    _patch(shard_file.HashingStream, "write", write)


def _hook_rejects() -> None:
    from extract import sink

    def fsync(fd):
        hit("rejects_fsync")  # like os.fsync's own errors, this one names no file
        return os.fsync(fd)

    _patch(sink, "os", ModuleProxy(os, fsync=fsync))


_STEP_DIR = re.compile(r"^step-\d{8}$")


def _in_checkpoint_tmp(path) -> bool:
    return ".tmp-" in Path(path).parent.name and Path(path).parent.name.startswith("step-")


def _half_write(path, real_save, *args, **kwargs) -> None:
    """Write the file for real, then cut it to half its size (what a kill mid-write leaves)."""
    real_save(*args, **kwargs)
    size = os.path.getsize(path)
    os.truncate(path, size // 2)


def _hook_checkpoints() -> None:
    import pathlib
    import shutil

    import safetensors.torch
    import torch

    from train import checkpoint

    real_save_file = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if _in_checkpoint_tmp(filename) and armed("ckpt_model"):
            _half_write(filename, real_save_file, tensors, filename, *args, **kwargs)
            fire("ckpt_model", filename)
        return real_save_file(tensors, filename, *args, **kwargs)

    _patch(safetensors.torch, "save_file", save_file)

    real_torch_save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        path = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)  # a path, or an open file
        if isinstance(path, (str, os.PathLike)) and _in_checkpoint_tmp(path) and armed("ckpt_optimizer"):
            real_torch_save(obj, f, *args, **kwargs)
            if not isinstance(f, (str, os.PathLike)):
                f.flush()
            os.truncate(path, os.path.getsize(path) // 2)  # what a kill mid-write leaves
            fire("ckpt_optimizer", str(path))
        return real_torch_save(obj, f, *args, **kwargs)

    _patch(torch, "save", torch_save)

    real_write_text = pathlib.Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == checkpoint.STATE_FILE and _in_checkpoint_tmp(self) and armed("ckpt_state"):
            real_write_text(self, data[: len(data) // 2], *args, **kwargs)
            fire("ckpt_state", str(self))
        return real_write_text(self, data, *args, **kwargs)

    _patch(pathlib.Path, "write_text", write_text)

    def fsync(fd):
        hit("ckpt_fsync")
        return os.fsync(fd)

    def replace(src, dst):
        os.replace(src, dst)
        if _STEP_DIR.match(Path(dst).name):
            hit("ckpt_renamed", str(dst))

    _patch(checkpoint, "os", ModuleProxy(os, fsync=fsync, replace=replace))

    def rmtree(path, *args, **kwargs):
        path = Path(path)
        complete = path.name.startswith("step-") and (path / checkpoint.STATE_FILE).is_file()
        if complete and armed("ckpt_prune"):
            (path / checkpoint.MODEL_FILE).unlink(missing_ok=True)  # rmtree got this far
            fire("ckpt_prune", str(path))
        return shutil.rmtree(path, *args, **kwargs)

    _patch(checkpoint, "shutil", ModuleProxy(shutil, rmtree=rmtree))

    real_write_files = checkpoint._write_files

    def write_files(snapshot, directory):
        real_write_files(snapshot, directory)
        hit("ckpt_written", str(directory))

    _patch(checkpoint, "_write_files", write_files)


def _hook_metrics() -> None:
    from train import metrics

    real_write = metrics.MetricsLog.write

    def write(self, record):
        if armed("metrics_line"):
            line = json.dumps(record)
            self._file.write(line[: len(line) // 2])
            self._file.flush()
            fire("metrics_line", str(self.path))
        return real_write(self, record)

    _patch(metrics.MetricsLog, "write", write)


def _hook_journal() -> None:
    from extract.regenerate import store

    real_append = store.Journal.append

    def append(self, entry):
        if armed("journal_line"):
            line = json.dumps(entry, ensure_ascii=False)
            self.file.write(line[: len(line) // 2].encode("utf-8"))
            self.file.flush()
            fire("journal_line", str(self.path))
        return real_append(self, entry)

    _patch(store.Journal, "append", append)

    real_commit = store.commit  # imported by name there: the common.io hook does not reach it

    def commit(fs, tmp_path, final_path):
        if os.path.basename(final_path) == store.DATA_FILE:
            hit("regen_data_written", final_path)
        real_commit(fs, tmp_path, final_path)

    _patch(store, "commit", commit)
