"""Filesystem helpers shared by every stage: resolve a local path or any `pyarrow.fs` URI, and
write files atomically (temporary name, fsync, rename) so a kill never leaves a half-written file
under its final name. On an object store (S3, GCS: `common.objstore`), which has no rename and
where a PUT is atomic per object, a file is written once, under its final name.

Temporary files are named `<name>.tmp` (or `<name>.<anything>.tmp`); readers ignore them and
writers clean them up on their next run.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any

import pyarrow.fs as pafs

from common import objstore

TMP_SUFFIX = ".tmp"


def resolve(uri_or_path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a URI such as `s3://bucket/dir`."""
    text = str(uri_or_path)
    if "://" in text:
        return objstore.resolve_store(text)
    return pafs.LocalFileSystem(), os.path.abspath(text)


def is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def in_place(fs: pafs.FileSystem) -> bool:
    """Whether files are written under their final name (an object store: a PUT is atomic, a rename is a copy)."""
    return objstore.is_object_store(fs)


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


def join_uri(root: str, *names: str) -> str:
    """`root/name` for a local path or a URI, keeping the URI's query (`s3://b/p?endpoint_override=...`)."""
    if "://" not in str(root):
        return os.path.join(root, *names)
    base, sep, query = str(root).partition("?")
    return "/".join([base.rstrip("/"), *names]) + sep + query


def list_names(root: str) -> list[str]:
    """Names directly under the directory `root` (local path or URI); [] if it does not exist."""
    fs, path = resolve(root)
    return sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)))


def exists_at(uri_or_path: str) -> bool:
    fs, path = resolve(uri_or_path)
    return exists(fs, path)


def remove_at(uri_or_path: str) -> None:
    """Delete the file `uri_or_path` if it exists."""
    fs, path = resolve(uri_or_path)
    if exists(fs, path):
        fs.delete_file(path)


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def read_json(fs: pafs.FileSystem, path: str) -> Any:
    return json.loads(read_bytes(fs, path))


def read_record(path: str | os.PathLike) -> dict:
    """A JSON record a step wrote to a local file, or {} when it is missing or unreadable (the
    caller treats it as absent: the step runs again, its numbers print as n/a)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):  # ValueError: not JSON, or bytes that are not UTF-8
        return {}


def temp_name(path: str) -> str:
    """A unique temporary sibling of `path`, ignored by readers until it is renamed."""
    return f"{path}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"


def commit(fs: pafs.FileSystem, tmp_path: str, final_path: str) -> None:
    """Make a fully written temporary file visible under its final name (atomic on local disks)."""
    if is_local(fs):
        _fsync_file(tmp_path)
        os.replace(tmp_path, final_path)
        _fsync_dir(os.path.dirname(final_path))
    else:
        fs.move(tmp_path, final_path)


def replace_local_dir(new: str | os.PathLike, final: str | os.PathLike) -> None:
    """Put the finished local directory `new` at `final`: an old `final` is renamed aside first
    (to a temporary name) and deleted after, so `final` is never a mix of the two."""
    old = None
    if os.path.exists(final):
        old = temp_name(f"{os.fspath(final)}.old")
        os.replace(final, old)
    os.replace(new, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_bytes(path: str, data: bytes, fs: pafs.FileSystem | None = None) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    if fs is None:
        fs, path = resolve(path)
    if is_local(fs):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    elif in_place(fs):  # one PUT, repeated while the store's outage clock runs (common.objstore)
        objstore.retrying(
            lambda: _put(fs, path, data), where=objstore.store_uri(fs, path), clock=objstore.outage_clock(fs)
        )
        return
    tmp = temp_name(path)
    try:
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        commit(fs, tmp, path)
    except BaseException as err:
        discard(fs, tmp)  # a full disk must not leave a half-written temporary behind
        if isinstance(err, OSError):
            raise named_os_error(err, path) from err
        raise


def _put(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def discard(fs: pafs.FileSystem, path: str) -> None:
    """Delete `path` if it exists, quietly (cleaning up after an error that is being raised)."""
    try:
        if exists(fs, path):
            fs.delete_file(path)
    except Exception:  # noqa: BLE001 - the original error matters, not this one
        pass


def named_os_error(err: OSError, path: str) -> OSError:
    """`err` naming `path` in the operating system's words ("[Errno 28] No space left on device:
    '/x'"), where it names no file (pyarrow's write errors do not, and say "Error writing bytes")."""
    if err.filename or not err.errno:
        return err
    return OSError(err.errno, os.strerror(err.errno), path)


def atomic_write_text(path: str, text: str, fs: pafs.FileSystem | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), fs)


def atomic_write_json(path: str, obj: Any, fs: pafs.FileSystem | None = None) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", fs)


def remove_temp_files(fs: pafs.FileSystem, directory: str, prefixes: tuple[str, ...] | None = None) -> list[str]:
    """Delete leftover `*.tmp` files directly under `directory` (from a killed writer); return them.

    With `prefixes`, only temporary files whose names start with one of them are deleted, so a
    writer restarting next to other live writers (one per rank) leaves their files alone.
    """
    if not exists(fs, directory):
        return []
    removed = []
    for info in fs.get_file_info(pafs.FileSelector(directory, recursive=False)):
        if info.type != pafs.FileType.File or not info.base_name.endswith(TMP_SUFFIX):
            continue
        if prefixes is not None and not info.base_name.startswith(tuple(prefixes)):
            continue
        fs.delete_file(info.path)
        removed.append(info.path)
    return removed


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
