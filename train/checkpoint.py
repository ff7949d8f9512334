"""Checkpoints: atomic, written in a background thread from a CPU snapshot, last K kept.

    runs/NAME/checkpoints/step-00000100/
        model.safetensors      the drafter, published parameter names (fc, hidden_norm, layers.N..., norm)
        optimizer.pt           AdamW state_dict (tensors and numbers only: torch.load(weights_only=True))
        state.json             step, data position, RNG states, counters, the resolved train config,
                               and the size and xxh3-128 of the other three files plus a checksum
                               of its own content, so `load_checkpoint` detects any damaged byte
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
import errno
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
import pyarrow.fs as pafs
import torch
import xxhash

from common.hashing import file_checksum

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
    "verify_checkpoint",
    "CheckpointSaveError",
]

log = logging.getLogger(__name__)

_FINAL = re.compile(r"^step-(\d{8})$")
_TMP_MARK = ".tmp-"
_LOCAL_FS = pafs.LocalFileSystem()
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, DRAFTER_CONFIG_FILE = (
    "model.safetensors",
    "optimizer.pt",
    "state.json",
    "drafter_config.json",
)
# state.json keys that make a checkpoint self-checking: {file: {"bytes", "xxh3_128"}} of the other
# files, and the xxh3-128 of state.json's own content without this key (see `verify_checkpoint`).
FILE_CHECKSUMS_KEY, STATE_CHECKSUM_KEY = "file_checksums", "state_checksum"


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


def take_snapshot(
    step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, drafter_config: dict
) -> Snapshot:
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


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems cannot fsync a directory (EINVAL); a file that cannot be made durable
        # (EIO, ENOSPC) must fail the save, or a checkpoint could be renamed into place unwritten.
        if not (directory and exc.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    finally:
        os.close(fd)


def _file_digest(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "xxh3_128": file_checksum(_LOCAL_FS, str(path))}


def _state_digest(state: dict) -> str:
    content = {k: v for k, v in state.items() if k != STATE_CHECKSUM_KEY}
    return xxhash.xxh3_128_hexdigest(json.dumps(content, sort_keys=True).encode("utf-8"))


_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)")


def _named_os_error(exc: BaseException, path: Path) -> BaseException:
    """The operating system's error behind a failed write, naming the file: Python's own write
    errors name none, and safetensors reports "I/O error: ... (os error 28)" in its own type."""
    if isinstance(exc, OSError):
        if exc.filename or not exc.errno:
            return exc
        return OSError(exc.errno, os.strerror(exc.errno), str(path))
    found = _OS_ERROR_IN_TEXT.search(str(exc))
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code), str(path))
    return exc


def _writing(path: Path, write) -> None:
    """`write(path)`, its OSError naming `path` (see `_named_os_error`)."""
    try:
        write(path)
    except Exception as exc:  # noqa: BLE001 - re-raised, as the OSError it stands for where there is one
        named = _named_os_error(exc, path)
        if named is exc:
            raise
        raise named from exc


class _KeptErrors:
    """A file whose write errors are kept: torch's zip writer swallows them and raises its own
    "[enforce fail at inline_container.cc:672] unexpected pos" (on a full disk, for a path or a Python
    file alike), which names neither the file nor the cause."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def save_torch(obj, file) -> None:
    """`torch.save(obj, file)`; a write that failed raises its own OSError ("[Errno 28] No space left on device")."""
    kept = _KeptErrors(file)
    try:
        torch.save(obj, kept)
    except RuntimeError:
        if kept.error is not None:
            raise kept.error from None
        raise


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        save_torch(obj, f)


def _write_files(snapshot: Snapshot, directory: Path) -> None:
    from safetensors.torch import save_file

    model = {k: v.contiguous() for k, v in snapshot.model.items()}
    _writing(directory / MODEL_FILE, lambda p: save_file(model, str(p), metadata={"format": "pt"}))
    _writing(directory / OPTIMIZER_FILE, lambda p: _torch_save(snapshot.optimizer, p))
    _writing(
        directory / DRAFTER_CONFIG_FILE,
        lambda p: p.write_text(json.dumps(snapshot.drafter_config, indent=2, sort_keys=True) + "\n"),
    )
    state = dict(snapshot.state)
    state[FILE_CHECKSUMS_KEY] = {
        name: _file_digest(directory / name) for name in (MODEL_FILE, OPTIMIZER_FILE, DRAFTER_CONFIG_FILE)
    }
    state[STATE_CHECKSUM_KEY] = _state_digest(state)
    # state.json last: a directory is only ever renamed complete, but this keeps even the tmp one readable in order.
    _writing(directory / STATE_FILE, lambda p: p.write_text(json.dumps(state, sort_keys=True) + "\n"))


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
        _fsync_path(tmp, directory=True)
        if final.exists():  # same step saved again (a resumed run that stopped right away): replace it
            old = root / f"{final.name}{_TMP_MARK}old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_path(root, directory=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        for _, old_dir in list_checkpoints(root)[:-keep_last]:
            _remove_checkpoint(old_dir)
    return final


def _remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory, first renaming it to a temporary name: a kill during the
    deletion then leaves a `.tmp-` directory (ignored, removed by the next run), never a listed
    checkpoint with some of its files gone."""
    doomed = path.with_name(f"{path.name}{_TMP_MARK}prune-{uuid.uuid4().hex[:8]}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


class CheckpointSaveError(RuntimeError):
    """A background checkpoint save failed (full disk, I/O error); names the last complete checkpoint."""


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

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            last = latest_checkpoint(self.root)
            raise CheckpointSaveError(
                f"checkpoint save under {self.root} failed: {error}; "
                + (f"the last complete checkpoint is {last}" if last else "no complete checkpoint exists yet")
            ) from error


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


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ValueError(f"{path}: {what} is missing") from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise ValueError(f"{path}: {what} is not valid JSON (corrupted?): {exc}") from None


def verify_checkpoint(
    path: str | os.PathLike, files: tuple[str, ...] = (MODEL_FILE, OPTIMIZER_FILE, DRAFTER_CONFIG_FILE)
) -> dict:
    """Check a checkpoint's state.json against its own checksum and `files` against the sizes and
    checksums it lists; return the state. ValueError naming the damaged file.

    A checkpoint written before checksums existed (neither key in state.json) is not checked.
    Damage to a key name itself is caught too: one key alone present is an error.
    """
    path = Path(path)
    state = _read_json(path / STATE_FILE, "checkpoint state")
    if not isinstance(state, dict):
        raise ValueError(f"{path / STATE_FILE}: expected a JSON object (corrupted?)")
    sums, own = state.get(FILE_CHECKSUMS_KEY), state.get(STATE_CHECKSUM_KEY)
    if sums is None and own is None:
        return state
    if own != _state_digest(state) or not isinstance(sums, dict):
        raise ValueError(f"{path / STATE_FILE}: content does not match its checksum (corrupted or edited)")
    for name in files:
        file, want = path / name, sums.get(name)
        if not isinstance(want, dict):
            raise ValueError(f"{path / STATE_FILE}: lists no checksum for {name}")
        if not file.is_file():
            raise ValueError(f"{file}: missing from the checkpoint")
        size = file.stat().st_size
        if size != want.get("bytes"):
            raise ValueError(f"{file}: {size} bytes, {STATE_FILE} says {want.get('bytes')} (truncated or overwritten)")
        if _file_digest(file)["xxh3_128"] != want.get("xxh3_128"):
            raise ValueError(f"{file}: checksum does not match {STATE_FILE} (corrupted file)")
    return state


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """{'model', 'optimizer', 'state', 'drafter_config'} of a checkpoint directory (safe loaders only),
    after `verify_checkpoint`; ValueError naming the file if anything is damaged."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"'{path}' is not a checkpoint directory (no {STATE_FILE})")
    state = verify_checkpoint(path)
    try:
        model = load_file(str(path / MODEL_FILE), device=str(map_location))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{path / MODEL_FILE}: cannot be read: {type(exc).__name__}: {exc}") from None
    try:
        optimizer = torch.load(path / OPTIMIZER_FILE, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors, zip errors, missing file
        raise ValueError(
            f"{path / OPTIMIZER_FILE}: cannot be read with torch.load(weights_only=True): {type(exc).__name__}: {exc}"
        ) from None
    return {
        "model": model,
        "optimizer": optimizer,
        "state": state,
        "drafter_config": _read_json(path / DRAFTER_CONFIG_FILE, "drafter config"),
    }
