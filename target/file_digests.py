"""xxh3-128 of every byte of a file, computed once per file and cached by the file's identity.

    file_digest(path)    the digest (hashed now, or read from the cache)
    cache_file()         where the cache lives

A target's identity (`target.identity`) hashes every byte of its weight files: a weight changed in any
part of any file makes another target. That costs one read of the weights (0.8 GiB/s read and hashed
on the tests' busy 2-core VM, about a minute for a 27B target: docs/benchmarks.md, "Target identity and
self-check"), so each file is hashed once and its digest kept under its identity: the resolved path, device, inode,
size, modification time and change time (`os.stat`, nanoseconds). A file rewritten in place or
replaced gets a new modification or change time, or a new inode, and is hashed again; a tool that
rewrote a file with the same size and restored both times could pass unseen (the change time cannot
be set from user space).

Where: `$DFLASH_CACHE_DIR/file-digests.json`, else `$XDG_CACHE_HOME/dflash-offline/`, else
`~/.cache/dflash-offline/`: per user, outside the target directory (which may be read-only or
shared), kept across runs and output folders, read by every stage. A cache that cannot be written is
skipped (the digest is still computed, every time). Of the processes that need one file's digest at
once (the ranks of an extraction), one hashes it and the others wait for its entry (a lock per file
identity); processes that write the cache at once lose at most an entry, hashed again next time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import xxhash
from tqdm import tqdm

from common.io import atomic_write_text
from common.locks import exclusive_lock

__all__ = ["CACHE_ENV", "cache_file", "file_digest", "file_key"]

CACHE_ENV = "DFLASH_CACHE_DIR"
MAX_ENTRIES = 4096  # the oldest are dropped beyond this (a target of 100 files is 100 entries)
WAIT_SECONDS = 3600.0  # how long a process waits for another that hashes the same file (a 50 GB file: minutes)
_CHUNK = 16 << 20
_PROGRESS_BYTES = 1 << 30  # a progress bar for files of at least 1 GiB

log = logging.getLogger(__name__)


def cache_file() -> Path:
    root = os.environ.get(CACHE_ENV)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "dflash-offline")
    return Path(root) / "file-digests.json"


def file_key(path: str | os.PathLike) -> str:
    """The file's identity: resolved path, device, inode, size, modification and change times."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{real}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _read_cache() -> dict:
    try:
        with open(cache_file(), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(key: str, entry: dict) -> None:
    entries = _read_cache()  # read again just before writing: another process may have added entries
    entries[key] = entry
    if len(entries) > MAX_ENTRIES:
        entries = dict(sorted(entries.items(), key=lambda kv: kv[1].get("at", 0))[-MAX_ENTRIES:])
    try:
        cache_file().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(str(cache_file()), json.dumps(entries, indent=0) + "\n")
    except OSError as exc:
        log.debug("file digest cache %s not written: %s", cache_file(), exc)


def _hash(path: str, size: int) -> str:
    digest = xxhash.xxh3_128()
    name = os.path.basename(path)
    with (
        tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {name}", disable=size < _PROGRESS_BYTES) as bar,
        open(path, "rb") as f,
    ):
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _cached(key: str) -> str | None:
    entry = _read_cache().get(key)
    return entry["digest"] if isinstance(entry, dict) and isinstance(entry.get("digest"), str) else None


def _one_hasher(key: str):
    """A lock per file identity, so that of the processes that need a file's digest at once (the ranks of
    an extraction) one reads the file and the others wait for its digest; none where the cache's folder
    cannot be made."""
    folder = cache_file().parent / "locks"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return contextlib.nullcontext()
    name = xxhash.xxh3_64_hexdigest(key.encode()) + ".lock"
    return exclusive_lock(str(folder / name), what="a weight file's digest", hint="", wait_seconds=WAIT_SECONDS)


def file_digest(path: str | os.PathLike) -> str:
    """xxh3-128 of every byte of the file: from the cache when the file's identity is there, else hashed
    (with a progress bar from 1 GiB) and cached."""
    key = file_key(path)
    digest = _cached(key)
    if digest is not None:
        return digest
    with _one_hasher(key):
        digest = _cached(key)  # another process may have hashed it while this one waited
        if digest is not None:
            return digest
        size = os.path.getsize(path)
        start = time.perf_counter()
        digest = _hash(str(path), size)
        seconds = time.perf_counter() - start
        _store(key, {"digest": digest, "bytes": size, "seconds": round(seconds, 3), "at": time.time()})
    return digest
