"""Checkpoints: atomic, written in a background thread from a CPU snapshot, last K kept.

    runs/NAME/checkpoints/step-00000100/
        model.safetensors      the drafter, published parameter names (fc, hidden_norm, layers.N..., norm)
        optimizer.pt           AdamW state_dict (tensors and numbers only: torch.load(weights_only=True))
        state.json             step, data position, RNG states, counters, the resolved train config
        drafter_config.json    DrafterConfig (what export and eval rebuild the model from)

A save first takes a snapshot on the training thread: every tensor is copied to host memory (on
CUDA as asynchronous copies into pinned memory, ordered before the next step's kernels on the same
stream, so the loop does not wait for them). A background thread then waits for the copies,
writes the files into `step-XXXXXXXX.tmp-<id>/`, fsyncs them and renames the directory to its
final name, and only then deletes checkpoints beyond the last K. A kill at any moment leaves
either the complete new directory or none (plus a `.tmp-` directory that readers ignore and the
next run deletes), and the previous checkpoints untouched.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "Snapshot",
    "CheckpointWriter",
    "take_snapshot",
    "write_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "remove_partial_checkpoints",
    "rng_state",
    "restore_rng_state",
    "checkpoint_name",
]

log = logging.getLogger(__name__)

_FINAL = re.compile(r"^step-(\d{8})$")
_TMP_MARK = ".tmp-"
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, DRAFTER_CONFIG_FILE = "model.safetensors", "optimizer.pt", "state.json", "drafter_config.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# ----------------------------------------------------------------------------------------------
# RNG states as JSON


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """Python, numpy and torch (CPU and every CUDA device) generator states, JSON-able."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        # A checkpoint from a machine with more GPUs restores the devices this one has.
        for index, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(saved), index)


# ----------------------------------------------------------------------------------------------
# Snapshot


@dataclasses.dataclass
class Snapshot:
    """Host copies of everything a checkpoint holds, taken at the end of one step."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict
    state: dict
    drafter_config: dict
    ready: Any = None  # a CUDA event the copies finish at (None on CPU)

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def _to_host(value: Any, non_blocking: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value.detach().clone()
        return value.detach().to("cpu", non_blocking=non_blocking)
    if isinstance(value, dict):
        return {k: _to_host(v, non_blocking) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v, non_blocking) for v in value)
    return value


def take_snapshot(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, drafter_config: dict) -> Snapshot:
    """Copy model and optimizer tensors to host memory (asynchronously on CUDA) plus the JSON state."""
    on_cuda = any(p.is_cuda for p in model.parameters())
    model_state = _to_host(model.state_dict(), non_blocking=on_cuda)
    optimizer_state = _to_host(optimizer.state_dict(), non_blocking=on_cuda)
    ready = None
    if on_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return Snapshot(step, model_state, optimizer_state, json.loads(json.dumps(state)), dict(drafter_config), ready)


# ----------------------------------------------------------------------------------------------
# Writing


def _fsync_path(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_files(snapshot: Snapshot, directory: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in snapshot.model.items()}, str(directory / MODEL_FILE), metadata={"format": "pt"})
    torch.save(snapshot.optimizer, directory / OPTIMIZER_FILE)
    (directory / DRAFTER_CONFIG_FILE).write_text(json.dumps(snapshot.drafter_config, indent=2, sort_keys=True) + "\n")
    # state.json last: a directory is only ever renamed complete, but this keeps even the tmp one readable in order.
    (directory / STATE_FILE).write_text(json.dumps(snapshot.state, sort_keys=True) + "\n")


def write_checkpoint(root: str | os.PathLike, snapshot: Snapshot, keep_last: int | None = None) -> Path:
    """Write `snapshot` atomically as root/step-XXXXXXXX (replacing one of the same step), then prune."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    snapshot.wait_ready()
    final = root / checkpoint_name(snapshot.step)
    tmp = root / f"{final.name}{_TMP_MARK}{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_files(snapshot, tmp)
        for file in tmp.iterdir():
            _fsync_path(file)
        _fsync_path(tmp)
        if final.exists():  # same step saved again (a resumed run that stopped right away): replace it
            old = root / f"{final.name}{_TMP_MARK}old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        for _, old_dir in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old_dir, ignore_errors=True)
    return final


class CheckpointWriter:
    """Runs `write_checkpoint` in one background thread; one save in flight at a time.

    A failed save is raised on the training thread at the next `save` or `wait`, so a full disk
    stops the run instead of silently leaving it without checkpoints.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved: Path | None = None

    def _run(self, snapshot: Snapshot) -> None:
        try:
            self.last_saved = write_checkpoint(self.root, snapshot, self.keep_last)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def save(self, snapshot: Snapshot) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(snapshot,), name=f"ckpt-{snapshot.step}", daemon=False)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint save under {self.root} failed: {error}") from error


# ----------------------------------------------------------------------------------------------
# Reading


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` as (step, path), oldest first (temporary directories ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _FINAL.match(entry.name)
        if match and entry.is_dir() and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def remove_partial_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Delete `.tmp-` directories a killed save left behind; returns them."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for entry in root.iterdir():
            if _TMP_MARK in entry.name and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """{'model', 'optimizer', 'state', 'drafter_config'} of a checkpoint directory (safe loaders only)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"'{path}' is not a checkpoint directory (no {STATE_FILE})")
    return {
        "model": load_file(str(path / MODEL_FILE), device=str(map_location)),
        "optimizer": torch.load(path / OPTIMIZER_FILE, map_location=map_location, weights_only=True),
        "state": json.loads((path / STATE_FILE).read_text()),
        "drafter_config": json.loads((path / DRAFTER_CONFIG_FILE).read_text()),
    }
