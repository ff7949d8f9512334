"""One writer at a time: an exclusive lock on a lock file, held while a process writes a dataset
(per rank), merges one, or trains into a run directory.

`fcntl.flock` locks belong to the open file, so the operating system releases them when the
holder exits in any way (a crash or SIGKILL included): a dead writer never leaves a dataset
locked. The lock file holds the holder's pid, host and start time for the message the next writer
prints, and is deleted on release (after a crash it stays, unlocked, and is reused). Acquiring
checks that the locked file is still the one at the path, so deleting it is race-free.

Within one process the lock is counted, not exclusive (a writer re-opened by the same process,
as in-process tests and the extraction's rank + shard writer do, shares it). On a file system
without `flock` (some network mounts) the lock is skipped with a warning.

    with exclusive_lock(os.path.join(out_dir, ".manifest.rank000.json.lock"), what="the dataset", hint="..."):
        ...
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time

log = logging.getLogger(__name__)

# flock not offered by the file system: go on without a lock (say so) instead of refusing to work.
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


class LockedError(ValueError):
    """Another process holds the lock (a user error: two writers were started on one output)."""


class _Held:
    def __init__(self, fd: int | None):
        self.fd, self.count = fd, 1


_held: dict[str, _Held] = {}
_guard = threading.Lock()


class Lock:
    """A held lock; `release()` once (or leave the `with` block)."""

    def __init__(self, path: str | None):
        self.path = path
        self._released = path is None

    @classmethod
    def unheld(cls) -> "Lock":
        """Nothing to release (where no lock is taken, e.g. a remote file system)."""
        return cls(None)

    def check(self) -> None:
        """Nothing to check: the operating system holds a local lock until the holder exits."""

    def release(self) -> None:
        with _guard:
            if self._released:
                return
            self._released = True
            held = _held[self.path]
            held.count -= 1
            if held.count:
                return
            del _held[self.path]
            if held.fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)  # while still locked: the next writer sees a fresh file
                os.close(held.fd)

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def exclusive_lock(path: str, *, what: str, hint: str, wait_seconds: float = 0.0) -> Lock:
    """Lock `path` (created if needed) for this process, or raise LockedError saying who holds it.

    `what` names the thing protected ("the dataset /x (rank 0)"), `hint` what the user can do.
    `wait_seconds` > 0 waits that long for the holder (merges, which take seconds)."""
    path = os.path.abspath(path)
    with _guard:
        if path in _held:
            _held[path].count += 1
            return Lock(path)
        deadline = time.monotonic() + wait_seconds
        while True:
            fd = _try_lock(path)
            if fd is not False:
                break
            if time.monotonic() >= deadline:
                raise LockedError(
                    f"{what} is being written by another process ({_holder(path)}; lock file {path}). {hint}"
                )
            time.sleep(0.2)
        _held[path] = _Held(fd)
        if fd is not None:
            _describe_holder(fd)
        return Lock(path)


def writer_lock(fs, path: str, *, what: str, hint: str, wait_seconds: float = 0.0):
    """The one-writer lock at `path` on file system `fs`: `flock` on a local disk, a lock object
    made with conditional writes on S3 (`common.objstore.ObjectLock`); another object store (GCS)
    is refused unless DFLASH_UNLOCKED_WRITES=1 (pyarrow offers it no conditional write); other file
    systems are not locked. `what` names the protected thing in messages, `hint` what to do."""
    from common import io, objstore

    if io.is_local(fs):
        return exclusive_lock(path, what=what, hint=hint, wait_seconds=wait_seconds)
    if objstore.is_s3(fs):
        return objstore.ObjectLock(fs, path, what=what, hint=hint, wait_seconds=wait_seconds)
    if objstore.is_object_store(fs) and not objstore.unlocked_writes():
        raise ValueError(objstore.refuse_unlocked_message(what))
    return Lock.unheld()


def check_unlocked(path: str, *, what: str, hint: str) -> None:
    """LockedError if another process holds the lock on `path` now; takes nothing, creates nothing."""
    import fcntl

    path = os.path.abspath(path)
    with _guard:
        if path in _held:
            return  # this process holds it: a counted re-entry, not a second writer
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return  # no lock file: nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LockedError(
                f"{what} is being written by another process ({_holder(path)}; lock file {path}). {hint}"
            ) from None
    finally:
        os.close(fd)


def _try_lock(path: str) -> int | None | bool:
    """The locked fd; None if the file system has no flock; False if another process holds it."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            if err.errno in _UNSUPPORTED:
                log.warning(
                    "%s: the file system does not support flock (%s); going on WITHOUT protection against a "
                    "second writer",
                    path,
                    err,
                )
                return None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder deleted the file between our open and our lock: try the new one


def _describe_holder(fd: int) -> None:
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
