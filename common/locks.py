"""One writer at a time: an exclusive lock held while a process writes a dataset (per rank),
merges one, or trains into a run directory. `writer_lock` picks the lock for a file system: `flock`
on a local disk, a lock object on S3 (`ObjectLock`); another object store (GCS) is refused unless
DFLASH_UNLOCKED_WRITES=1 (pyarrow offers it no conditional write).

Local disks. `fcntl.flock` locks belong to the open file, so the operating system releases them
when the holder exits in any way (a crash or SIGKILL included): a dead writer never leaves a
dataset locked. The lock file holds the holder's pid, host and start time for the message the next
writer prints, and is deleted on release (after a crash it stays, unlocked, and is reused).
Acquiring checks that the locked file is still the one at the path, so deleting it is race-free.
Within one process the lock is counted, not exclusive (a writer re-opened by the same process, as
in-process tests and the extraction's rank + shard writer do, shares it). On a file system without
`flock` (some network mounts) the lock is skipped with a warning.

    with exclusive_lock(os.path.join(out_dir, ".manifest.rank000.json.lock"), what="the dataset", hint="..."):
        ...

S3 (`ObjectLock`). `pyarrow.fs` cannot make a conditional write, so the lock object is written with
botocore (`common.objstore.s3_client`): created with `If-None-Match: *` (the store refuses it when
the object exists), renewed every `lease_s / 4` with `If-Match: <its ETag>`. A lock object whose
holder is gone is taken over with `If-Match` on the ETag that was read, so of two processes taking
it over at once one wins. The holder is gone when (a) it ran on this host and its pid no longer
runs, or (b) the object was not renewed for `lease_s` seconds (DFLASH_LOCK_LEASE_S, default 60),
measured on the store's clock (its `Date` against the object's `Last-Modified`), so clock skew
between hosts does not matter. A holder that could not renew for `lease_s / 2` stops committing
(`check()` raises `LockLost`). What this guarantees: while a writer runs and reaches the store, a
second writer of the same manifest, on any host, is refused at once. Not guaranteed: a holder that
stops for longer than the lease (suspended, or cut off from the store) and then resumes an upload
already in flight could still complete that one object after another writer took over; its next
commit is refused. docs/object-storage.md, "One writer".
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from email.utils import parsedate_to_datetime

import botocore.exceptions
import pyarrow.fs as pafs

from common import io, objstore

log = logging.getLogger(__name__)

# flock not offered by the file system: go on without a lock (say so) instead of refusing to work.
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


class LockedError(ValueError):
    """Another process holds the lock (a user error: two writers were started on one output)."""


class LockLost(OSError):
    """This process can no longer be sure it is the dataset's only writer (it could not renew its
    lock object in time, or another writer took it over): it must not commit."""


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
    def unheld(cls) -> Lock:
        """Nothing to release (where no lock is taken, e.g. a remote file system)."""
        return cls(None)

    def check(self) -> None:
        """Nothing to check: the operating system holds a local lock until the holder exits."""

    def release(self) -> None:
        with _guard:
            if self._released:
                return
            assert self.path is not None  # a lock of no path is released from the start
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

    def __enter__(self) -> Lock:
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


def writer_lock(fs: pafs.FileSystem, path: str, *, what: str, hint: str, wait_seconds: float = 0.0):
    """The one-writer lock at `path` on file system `fs` (see the file docstring); other file
    systems are not locked. `what` names the protected thing in messages, `hint` what to do."""
    if io.is_local(fs):
        return exclusive_lock(path, what=what, hint=hint, wait_seconds=wait_seconds)
    if objstore.is_s3(fs):
        return ObjectLock(fs, path, what=what, hint=hint, wait_seconds=wait_seconds)
    if objstore.is_object_store(fs) and not objstore.unlocked_writes():
        raise objstore.StoreSetupError(objstore.refuse_unlocked_message(what))
    return Lock.unheld()


def check_unlocked(path: str, *, what: str, hint: str) -> None:
    """LockedError if another process holds the lock on `path` now; takes nothing, creates nothing."""
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


# ----------------------------------------------------------------------------------------------
# The lock object (S3)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ObjectLock:
    """One writer at a time through a lock object (see the file docstring). Counted within one
    process, like `common.locks.exclusive_lock`."""

    _held: dict[str, ObjectLock] = {}
    _guard = threading.Lock()
    _key: str  # endpoint|path: one lock per object in this process
    _count: int  # holders in this process

    def __new__(cls, fs, path: str, *, what: str, hint: str, wait_seconds: float = 0.0):
        key = f"{objstore.endpoint_key(fs)}|{path}"
        with cls._guard:
            held = cls._held.get(key)
            if held is not None:
                held._count += 1
                return held
            lock = super().__new__(cls)
            lock._key, lock._count = key, 1
            lock._acquire(fs, path, what, hint, wait_seconds)
            cls._held[key] = lock
            return lock

    def __init__(self, *args, **kwargs):
        pass  # everything happens in __new__ (a second open in this process returns the held lock)

    def _acquire(self, fs, path: str, what: str, hint: str, wait_seconds: float) -> None:
        self.fs, self.path, self.what = fs, path, what
        self.client, self.clock = objstore.s3_client(fs), objstore.outage_clock(fs)
        self.bucket, self.key = objstore.split_path(path)
        self.lease = objstore.lease_seconds()
        self.token = uuid.uuid4().hex
        self._error: BaseException | None = None
        self._stop = threading.Event()
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                self.etag = self._put(IfNoneMatch="*")
                break
            except botocore.exceptions.ClientError as err:
                if not objstore.is_conflict(err):
                    raise OSError(f"{objstore.store_uri(fs, path)}: cannot create the lock object: {err}") from None
            taken = self._take_over_if_stale()
            if taken:
                break
            if time.monotonic() >= deadline:
                raise LockedError(
                    f"{what} is being written by another process ({self._holder}; lock object "
                    f"{objstore.store_uri(fs, path)}). {hint}"
                )
            time.sleep(0.5)
        self.renewed_at = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name="object-lock", daemon=True)
        self._thread.start()

    def _body(self) -> bytes:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "token": self.token, "lease_s": self.lease}
        info["since"] = getattr(self, "_since", None) or time.strftime("%Y-%m-%d %H:%M:%S")
        self._since = info["since"]
        return json.dumps(info).encode()

    def _put(self, **condition) -> str:
        return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(), **condition)["ETag"]

    def _take_over_if_stale(self) -> bool:
        """Read the lock object; if its holder is gone, replace it (If-Match its ETag). True if taken."""
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except botocore.exceptions.ClientError as err:
            if objstore.is_missing(err):  # released meanwhile: the next create attempt decides
                self._holder = "released meanwhile"
                return False
            raise
        body = got["Body"].read()
        try:
            info = json.loads(body)
        except ValueError:
            info = {}
        age = _server_age(got)
        self._holder = (
            f"pid {info.get('pid')} on {info.get('host')}, since {info.get('since')}, renewed {age:.0f} s ago"
            if info
            else "holder unknown"
        )
        same_host_dead = (
            info.get("host") == socket.gethostname()
            and isinstance(info.get("pid"), int)
            and not _pid_alive(info["pid"])
        )
        expired = age > float(info.get("lease_s", self.lease))
        if not (same_host_dead or expired):
            return False
        why = "its process is gone" if same_host_dead else f"not renewed for {age:.0f} s"
        try:
            self.etag = self._put(IfMatch=got["ETag"])
        except botocore.exceptions.ClientError as err:
            if objstore.is_missing(err) or objstore.is_conflict(err):
                return False  # another process took it over first (or released it): the next round decides
            raise
        log.warning(
            "%s: took over the lock object of %s (%s)", objstore.store_uri(self.fs, self.path), self._holder, why
        )
        return True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease / 4):
            try:
                self.etag = self._put(IfMatch=self.etag)
                self.renewed_at = time.monotonic()
                self.clock.answered()
            except botocore.exceptions.ClientError as err:
                if objstore.is_missing(err) or objstore.is_conflict(err):
                    self._error = LockLost(
                        f"{objstore.store_uri(self.fs, self.path)}: another process took over the lock of {self.what}; "
                        "this writer stops without committing"
                    )
                    return
                self._failed(err)
            except Exception as err:  # noqa: BLE001 - a network error: retried at the next round
                self._failed(err)

    def _failed(self, err: Exception) -> None:
        if objstore.error_kind(err) == "transient":  # the store's outage clock runs (common.objstore)
            self.clock.failed(objstore.store_uri(self.fs, self.path), err)
        log.warning("renewing the lock object %s failed (will retry): %s", self.path, err)

    def check(self) -> None:
        """Raise LockLost unless this process still holds the lock with time to spare; StoreUnreachable
        once the store's outage clock has given up."""
        if self._error is not None:
            raise self._error
        self.clock.check(objstore.store_uri(self.fs, self.path))
        idle = time.monotonic() - self.renewed_at
        if idle > self.lease / 2:
            raise LockLost(
                f"{objstore.store_uri(self.fs, self.path)}: could not renew the lock of {self.what} for {idle:.0f} s "
                "(the store is unreachable?); stopping without committing: rerun to resume"
            )

    def release(self) -> None:
        with self._guard:
            self._count -= 1
            if self._count > 0:
                return
            self._held.pop(self._key, None)
        self._stop.set()
        self._thread.join(timeout=5)
        if self._error is None and self.clock.left() > 0:  # a store gone for good: left for the next holder
            with contextlib.suppress(Exception):
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)

    def __enter__(self) -> ObjectLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _server_age(response) -> float:
    """Seconds since the object was last written, on the store's own clock."""
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    try:
        now = parsedate_to_datetime(headers["date"])
    except (KeyError, TypeError, ValueError):
        now = datetime.datetime.now(datetime.UTC)
    return (now - response["LastModified"]).total_seconds()
