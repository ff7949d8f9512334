"""`manifest.json`: what a dataset is (provenance, layout, counts, the committed shards), and the
helpers to create, load, save, compare and merge manifests.

A shard belongs to the dataset only once the manifest lists it, so the manifest is always written
last and atomically (temporary name, fsync, rename; see `common.io`). Every save also stores
`manifest_checksum`, the xxh3-128 of the manifest's own content, so that a damaged byte anywhere in
it (a count, a checksum, a provenance field) is detected when it is loaded.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from common import io, locks, objstore
from common.hashing import CHECKSUM_ALGO, bytes_digest, text_digest
from common.provenance import git_sha, tool_version
from shards.provenance import comparable_provenance
from shards.quant import parse_encoding
from shards.sample_checksums import SAMPLE_CHECKSUM_ALGOS
from shards.schema import (
    FIRST_SPLIT_VERSION,
    FORMAT_NAME,
    SUPPORTED_FORMAT_VERSIONS,
    TIER_FORMAT_VERSION,
    ShardFormatError,
    check_encoding,
    check_hidden_split,
    check_prefix,
    format_version_for,
    index_schema,
)

MANIFEST_NAME = "manifest.json"
MANIFEST_CHECKSUM_KEY = "manifest_checksum"
RESERVED_COUNTS = ("samples", "tokens", "loss_tokens")
# Optional in a shard entry: the per-sample checksum algorithm of its index (absent: format version 1
# shards, whose samples are read without a per-sample check).
SAMPLE_CHECKSUM_ALGO_KEY = "sample_checksum_algo"
SHARD_ENTRY_KEYS = (
    "file",
    "index_file",
    "samples",
    "tokens",
    "loss_tokens",
    "bytes",
    "checksum",
    "index_bytes",
    "index_checksum",
)
# Optional: the projection of a projected dataset (format version 4, `shards/projection.py`).
PROJECTION_KEY = "projection"
PROJECTION_ENTRY_KEYS = ("file", "bytes", "checksum", "in_width", "out_width")


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def json_normalized(obj: Any, what: str) -> Any:
    """`obj` as it will read back from JSON (tuples become lists); ValueError if it is not JSON."""
    try:
        return json.loads(json.dumps(obj, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be JSON-serializable: {err}") from None


def hidden_split_of(manifest: dict) -> int:
    """The dataset's `hidden_split` (manifests before format version 3 have none: 1)."""
    return manifest.get("hidden_split", 1)


def layout_of(manifest: dict) -> dict:
    """The dataset's layout as keyword arguments (encoding, hidden_width, topk, hidden_split)."""
    return {
        "encoding": manifest["encoding"],
        "hidden_width": manifest["hidden_width"],
        "topk": manifest["topk"],
        "hidden_split": hidden_split_of(manifest),
    }


def projection_of(manifest: dict) -> dict | None:
    """The dataset's projection entry (file, checksum, widths, ...), None for unprojected features."""
    return manifest.get(PROJECTION_KEY)


def new_manifest(
    *,
    provenance: dict,
    encoding: str,
    hidden_width: int,
    topk: int,
    hidden_split: int = 1,
    projection: dict | None = None,
) -> dict:
    """An empty manifest (no shards) for a dataset of this layout."""
    manifest = {
        "format": FORMAT_NAME,
        "format_version": format_version_for(encoding, projection is not None),
        "complete": False,
        "provenance": json_normalized(provenance, "provenance"),
        "encoding": check_encoding(encoding),
        "hidden_width": int(hidden_width),
        "topk": int(topk),
        "hidden_split": check_hidden_split(hidden_split, int(hidden_width)),
        "checksum_algo": CHECKSUM_ALGO,
        "counts": {key: 0 for key in RESERVED_COUNTS},
        "shards": [],
        "stage_state": {},
        "writer": {"tool_version": tool_version(), "git_sha": git_sha(), "created": now_iso(), "updated": now_iso()},
    }
    if projection is not None:
        manifest[PROJECTION_KEY] = json_normalized(projection, "projection")
    return manifest


def check_manifest(manifest: Any, where: str) -> dict:
    """Raise ShardFormatError (naming `where`) unless `manifest` is a manifest this code can read."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ShardFormatError(
            f"{where}: not a {FORMAT_NAME} manifest (field 'format' is "
            f"{manifest.get('format') if isinstance(manifest, dict) else None!r})"
        )
    version = manifest.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise ShardFormatError(
            f"{where}: format_version {version!r} is not supported by this code (it reads "
            f"{list(SUPPORTED_FORMAT_VERSIONS)}); "
            "use a newer tool version"
        )
    for key in ("encoding", "hidden_width", "topk", "counts", "shards", "provenance"):
        if key not in manifest:
            raise ShardFormatError(f"{where}: manifest has no field {key!r}")
    try:
        check_encoding(manifest["encoding"])
    except ValueError:
        raise ShardFormatError(f"{where}: unknown hidden encoding {manifest['encoding']!r}") from None
    tier = parse_encoding(manifest["encoding"]) is not None or PROJECTION_KEY in manifest
    if tier and version < TIER_FORMAT_VERSION:
        raise ShardFormatError(
            f"{where}: encoding {manifest['encoding']!r} / projection in a format_version {version} manifest "
            f"(storage tiers are version {TIER_FORMAT_VERSION})"
        )
    projection = manifest.get(PROJECTION_KEY)
    if projection is not None:
        missing = [key for key in PROJECTION_ENTRY_KEYS if not isinstance(projection, dict) or key not in projection]
        if missing:
            raise ShardFormatError(f"{where}: projection entry has no field(s) {missing}")
        if projection["out_width"] != manifest["hidden_width"]:
            raise ShardFormatError(
                f"{where}: projection out_width {projection['out_width']} != hidden_width {manifest['hidden_width']}"
            )
    split = hidden_split_of(manifest)
    try:
        check_hidden_split(split, manifest["hidden_width"])
    except ValueError as err:
        raise ShardFormatError(f"{where}: {err}") from None
    if split != 1 and version < FIRST_SPLIT_VERSION:
        raise ShardFormatError(
            f"{where}: hidden_split {split} in a format_version {version} manifest (split hidden columns are version 3)"
        )
    for position, entry in enumerate(manifest["shards"]):
        missing = [key for key in SHARD_ENTRY_KEYS if key not in entry]
        if missing:
            raise ShardFormatError(f"{where}: shards[{position}] ({entry.get('file', '?')}) has no field(s) {missing}")
    return manifest


def manifest_checksum(manifest: dict) -> str:
    """xxh3-128 of the manifest's content (canonical JSON, without its `manifest_checksum`)."""
    content = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM_KEY}
    return text_digest(json.dumps(content, sort_keys=True))


def seal(manifest: dict) -> dict:
    """Set `manifest_checksum` to the digest of the content (done by every save)."""
    manifest[MANIFEST_CHECKSUM_KEY] = manifest_checksum(manifest)
    return manifest


def manifest_path(root: str, name: str) -> str:
    return io.join(root, check_prefix(name, "manifest_name"))


def load_manifest(fs: pafs.FileSystem, root: str, name: str = MANIFEST_NAME) -> dict:
    """The checked manifest `root/name`; FileNotFoundError / ShardFormatError naming the file otherwise."""
    path = manifest_path(root, name)
    if not io.exists(fs, path):
        raise FileNotFoundError(f"{path}: no manifest; not a shard dataset, or no writer has opened it yet")
    try:
        manifest = io.read_json(fs, path)
    except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        raise ShardFormatError(f"{path}: manifest is not valid JSON ({err})") from None
    if (
        isinstance(manifest, dict)
        and MANIFEST_CHECKSUM_KEY in manifest
        and manifest[MANIFEST_CHECKSUM_KEY] != manifest_checksum(manifest)
    ):
        raise ShardFormatError(
            f"{path}: manifest content does not match its manifest_checksum (corrupted, or edited by hand)"
        )
    return check_manifest(manifest, path)


def save_manifest(fs: pafs.FileSystem, root: str, name: str, manifest: dict) -> None:
    manifest["writer"]["updated"] = now_iso()
    io.atomic_write_json(manifest_path(root, name), seal(manifest), fs)


def first_difference(expected: Any, actual: Any, path: str) -> str | None:
    """The dotted path of the first place two JSON values differ, with both values; None if equal."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual), key=str):
            if key not in expected or key not in actual:
                return f"{path}.{key}: {expected.get(key, '<absent>')!r} vs {actual.get(key, '<absent>')!r}"
            diff = first_difference(expected[key], actual[key], f"{path}.{key}")
            if diff:
                return diff
        return None
    return None if expected == actual else f"{path}: {expected!r} vs {actual!r}"


def _projection_identity(projection: dict | None) -> dict | None:
    return None if projection is None else {key: projection[key] for key in PROJECTION_ENTRY_KEYS}


def layout_difference(
    manifest: dict,
    *,
    provenance: dict,
    encoding: str,
    hidden_width: int,
    topk: int,
    hidden_split: int = 1,
    projection: dict | None = None,
) -> str | None:
    """The first field in which a dataset's layout and provenance differ from the given ones, or None."""
    layout = layout_of(manifest)
    for key, value in (
        ("encoding", encoding),
        ("hidden_width", hidden_width),
        ("topk", topk),
        ("hidden_split", hidden_split),
    ):
        if layout[key] != value:
            return f"{key}: {layout[key]!r} vs {value!r}"
    ours, theirs = _projection_identity(projection_of(manifest)), _projection_identity(projection)
    if ours != theirs:
        return (
            first_difference(ours, theirs, "projection") if ours and theirs else f"projection: {ours!r} vs {theirs!r}"
        )
    return first_difference(
        comparable_provenance(manifest["provenance"]),
        comparable_provenance(json_normalized(provenance, "provenance")),
        "provenance",
    )


def extra_counts_of(manifest: dict) -> dict:
    return {k: v for k, v in manifest["counts"].items() if k not in RESERVED_COUNTS}


def read_index(fs: pafs.FileSystem, root: str, entry: dict, *, check_checksum: bool = False) -> pa.Table:
    """The index sidecar of one manifest shard entry (small, uncompressed; never opens the shard).

    `check_checksum`: compare the file's xxh3-128 with the entry's `index_checksum` first (cheap:
    the whole file is read anyway). The table has the per-sample checksum columns when the entry's
    `sample_checksum_algo` says so (format version 2), and lacks them for older shards."""
    path = io.join(root, entry["index_file"])
    if not objstore.retrying(
        lambda: io.exists(fs, path), where=objstore.store_uri(fs, path), clock=objstore.outage_clock(fs)
    ):
        raise ShardFormatError(f"{path}: index file listed in the manifest is missing")
    algo = entry.get(SAMPLE_CHECKSUM_ALGO_KEY)
    if algo is not None and algo not in SAMPLE_CHECKSUM_ALGOS:
        raise ShardFormatError(
            f"{path}: unknown per-sample checksum algorithm {algo!r} in the manifest (this code knows "
            f"{list(SAMPLE_CHECKSUM_ALGOS)})"
        )
    try:
        data = objstore.retrying(
            lambda: io.read_bytes(fs, path), where=objstore.store_uri(fs, path), clock=objstore.outage_clock(fs)
        )
    except objstore.StoreUnreachable:
        raise
    except OSError as err:
        raise ShardFormatError(f"{path}: unreadable index file ({err})") from None
    if check_checksum and bytes_digest(data) != entry["index_checksum"]:
        raise ShardFormatError(
            f"{path}: index file checksum does not match the manifest's {entry['index_checksum']} (corrupted file)"
        )
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        table.validate(full=True)  # offsets and UTF-8 of the ids: Arrow does not check them on read
    except (pa.ArrowException, OSError) as err:  # pyarrow raises OSError for damaged data too
        raise ShardFormatError(f"{path}: unreadable index file ({err})") from None
    expected = index_schema(sample_checksums=algo is not None)
    if not table.schema.equals(expected, check_metadata=False):
        raise ShardFormatError(
            f"{path}: index schema {table.schema.names} does not match the format (expected {expected.names})"
        )
    if table.num_rows != entry["samples"]:
        raise ShardFormatError(f"{path}: index has {table.num_rows} rows, manifest says {entry['samples']} samples")
    return table


def _merged_counts(manifests: list[dict]) -> dict:
    counts: dict = {}
    for manifest in manifests:
        for key, value in manifest["counts"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                counts[key] = counts.get(key, 0) + value
    return counts


def _refuse_duplicates(fs, root, names, manifests) -> None:
    seen: dict[str, str] = {}
    duplicates = []
    for name, manifest in zip(names, manifests, strict=True):
        for entry in manifest["shards"]:
            for sid in read_index(fs, root, entry).column("sample_id").to_pylist():
                where = f"{name}:{entry['file']}"
                if sid in seen:
                    duplicates.append(f"{sid} in {seen[sid]} and {where}")
                else:
                    seen[sid] = where
    if duplicates:
        shown = "; ".join(duplicates[:10])
        raise ValueError(
            f"merge: {len(duplicates)} sample ids are listed twice (shard them by sample id across ranks): {shown}"
        )


def lock_manifest(fs: pafs.FileSystem, root: str, manifest_name: str, *, wait_seconds: float = 0.0):
    """The exclusive lock every writer of manifest `manifest_name` in `root` holds: a second writer
    stops at once, naming the first. A local directory: `flock` on `.<name>.lock`; S3: the lock
    object `.<name>.lock` (`common.locks.ObjectLock`, conditional writes); another object store
    is refused unless DFLASH_UNLOCKED_WRITES=1; other file systems are not locked."""
    hint = (
        "Two writers of one dataset would corrupt it: wait for the other to finish (or stop it), or write to "
        "another directory."
    )
    where = manifest_path(root, manifest_name)
    if not io.is_local(fs):
        where = objstore.store_uri(fs, where)
    return locks.writer_lock(
        fs, io.join(root, f".{manifest_name}.lock"), what=where, hint=hint, wait_seconds=wait_seconds
    )


def check_manifest_unlocked(fs: pafs.FileSystem, root: str, manifest_name: str) -> None:
    """LockedError now if another process writes manifest `manifest_name` in `root` (a check that
    takes nothing: a run makes it before slow work, then takes the lock itself)."""
    if io.is_local(fs):
        locks.check_unlocked(
            os.path.join(root, f".{manifest_name}.lock"),
            what=f"{manifest_path(root, manifest_name)}",
            hint=_LOCK_HINT,
        )


_LOCK_HINT = (
    "Two writers of one dataset would corrupt it: wait for the other to finish (or stop it), or write to "
    "another directory."
)


def merge_manifests(root: str, names: list[str], out_name: str = MANIFEST_NAME) -> dict:
    """Combine per-rank manifests in `root` into `out_name`; return the merged manifest.

    Refuses (ValueError naming the manifest and field) if the ranks' layout or provenance differ,
    a shard file is listed twice, or a sample id appears in more than one place. Counts are summed,
    `complete` is true only if every rank's is, and each rank's `stage_state` is kept by name.
    """
    if not names:
        raise ValueError("merge: no manifest names given")
    if out_name in names:
        raise ValueError(f"merge: output {out_name!r} is also an input")
    fs, root = io.resolve(root)
    with lock_manifest(fs, root, out_name, wait_seconds=MERGE_WAIT_SECONDS):
        return _merge_locked(fs, root, names, out_name)


# A merge takes seconds: a second merger (the last two ranks finishing together) waits this long.
MERGE_WAIT_SECONDS = 120.0


def _merge_locked(fs, root: str, names: list[str], out_name: str) -> dict:
    manifests = [load_manifest(fs, root, name) for name in names]
    first = manifests[0]
    for name, manifest in zip(names[1:], manifests[1:], strict=True):
        diff = layout_difference(
            manifest, provenance=first["provenance"], projection=projection_of(first), **layout_of(first)
        )
        if diff:
            raise ValueError(f"merge: {name} disagrees with {names[0]} in {diff}")
    files = [entry["file"] for manifest in manifests for entry in manifest["shards"]]
    repeated = sorted({f for f in files if files.count(f) > 1})
    if repeated:
        raise ValueError(
            f"merge: shard files listed by more than one manifest: {repeated[:10]} (give each rank its own "
            "shard_prefix)"
        )
    _refuse_duplicates(fs, root, names, manifests)
    merged = new_manifest(provenance=first["provenance"], projection=projection_of(first), **layout_of(first))
    merged["complete"] = all(m.get("complete", False) for m in manifests)
    merged["counts"] = _merged_counts(manifests)
    merged["shards"] = [entry for manifest in manifests for entry in manifest["shards"]]
    merged["stage_state"] = {
        "merged_from": {name: m.get("stage_state", {}) for name, m in zip(names, manifests, strict=True)}
    }
    save_manifest(fs, root, out_name, merged)
    return merged
