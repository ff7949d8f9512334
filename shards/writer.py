"""`ShardWriter`: append validated samples to a dataset, one shard file at a time, so that a kill at
any moment leaves a dataset whose manifest lists only complete, checksummed shards.

Commit protocol for one shard (see FORMAT.md): the shard and its index are written under `*.tmp`
names, fsynced and renamed; then the manifest is rewritten atomically. On an object store (no
rename; a PUT is atomic per object) both are written once under their final names, the shard as a
multipart upload, and the manifest, written last, is what makes them part of the dataset. A shard whose rename
happened but whose manifest update did not is not part of the dataset and is deleted when the
next writer opens the dataset. Every sample's record batch is also hashed on its way to the file:
its byte range and xxh3-64 go into the index, and readers check them on every read
(`shards/sample_checksums.py`).

    with ShardWriter(root, provenance=prov, hidden_width=W, topk=k) as w:
        done = w.committed_ids()
        for sample in samples:
            if sample.sample_id not in done:
                w.write(sample)
                w.stage_state["position"] = ...   # saved with the next commit

A shard that reached `shard_bytes` is committed at the start of the next `write()` (or at
`flush()`/`close()`), so `extra_counts` and `stage_state` updated after a `write()` are saved
together with the samples they describe.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from common import io
from common.hashing import bytes_digest
from common.objstore import abort_uploads
from common.provenance import git_sha, tool_version
from shards.manifest import (
    MANIFEST_NAME,
    RESERVED_COUNTS,
    SAMPLE_CHECKSUM_ALGO_KEY,
    extra_counts_of,
    hidden_split_of,
    json_normalized,
    layout_difference,
    load_manifest,
    lock_manifest,
    manifest_path,
    new_manifest,
    now_iso,
    read_index,
    save_manifest,
)
from shards.provenance import Provenance
from shards.quant import (
    ErrorSums,
    QuantizedHidden,
    canonical_encoding,
    error_sums_of,
    parse_encoding,
    quantize_bf16_bits,
)
from shards.sample_checksums import SAMPLE_CHECKSUM_ALGO
from shards.schema import (
    DEFAULT_ENCODING,
    DEFAULT_SHARD_BYTES,
    DEFAULT_ZSTD_LEVEL,
    INDEX_SUFFIX,
    SHARD_SUFFIX,
    HiddenPlanes,
    Sample,
    check_encoding,
    check_hidden_split,
    check_prefix,
    encode_sample,
    format_version_for,
    index_file_name,
    index_schema,
    shard_file_name,
    shard_number,
    shard_schema,
)
from shards.shard_file import DEFAULT_WRITE_BEHIND_BYTES, HashingStream, OpenShard, WriteBehind
from shards.validate import validate_sample

log = logging.getLogger(__name__)


def _check_layout_args(provenance: Provenance, hidden_width, topk, shard_bytes, zstd_level, projection=None) -> None:
    for name, value in (("hidden_width", hidden_width), ("topk", topk), ("shard_bytes", shard_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if not isinstance(zstd_level, int) or not 1 <= zstd_level <= 22:
        raise ValueError(f"zstd_level: expected an integer in 1..22, got {zstd_level!r}")
    if provenance.topk is not None and provenance.topk != topk:
        raise ValueError(f"topk: {topk} but provenance says topk={provenance.topk}")
    taps, hidden_size = provenance.taps.layer_ids, provenance.target.hidden_size
    feature_width = hidden_width
    if projection is not None:
        if projection.get("out_width") != hidden_width:
            raise ValueError(
                f"hidden_width: {hidden_width} but the projection maps to {projection.get('out_width')} features"
            )
        feature_width = projection.get("in_width")
    if taps is not None and hidden_size is not None and len(taps) * hidden_size != feature_width:
        what = "the projection's in_width" if projection is not None else "hidden_width"
        raise ValueError(
            f"{what}: {feature_width} but provenance has {len(taps)} taps x hidden_size {hidden_size} = "
            f"{len(taps) * hidden_size}"
        )


def default_hidden_split(provenance: Provenance, hidden_width: int) -> int:
    """One piece per tap when the provenance names the taps (their statistics differ with depth, so
    per-tap zstd frames are smaller, and pyarrow compresses the pieces in parallel), else 1."""
    taps = provenance.n_taps
    if taps and hidden_width % taps == 0:
        return taps
    return 1


def provenance_record(provenance: Provenance | dict) -> dict:
    """The record a manifest stores: a `Provenance` in today's layout, a dict (a stored record passed
    through, a test's or benchmark's own) as given; ValueError for anything else."""
    if isinstance(provenance, Provenance):
        return provenance.to_dict()
    if not isinstance(provenance, dict):
        raise ValueError(f"provenance: expected a Provenance or a dict, got {type(provenance).__name__}")
    return provenance


class ShardWriter:
    """Writes samples into zstd Arrow IPC shards under `root` and commits them through the manifest.

    `hidden_split`: column pieces per hidden plane (FORMAT.md, "Column pieces"); None = the dataset's
    own when resuming one, else one per tap when the provenance names the taps, else 1.

    Storage tiers (format version 4): `hidden_encoding` may be a quantized encoding (`fp8`,
    `int4-gG`, `nf4-gG`; `shards/quant.py`): samples are then given as `QuantizedHidden` (quantized
    by the caller, e.g. on the GPU) or as bf16 bits, which the writer quantizes itself (refusing
    NaN/Inf). `projection`: the manifest entry of the dataset's projection (`shards/projection.py`,
    whose file the caller has written into `root`): the stored features are P·h, `hidden_width` is
    P's output width. Where the original values are at hand (the writer quantized them, or the
    caller passed `hidden_error`), each shard entry records the reconstruction error per tap."""

    def __init__(
        self,
        root: str,
        *,
        provenance: Provenance | dict,
        hidden_width: int,
        topk: int,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        zstd_level: int = DEFAULT_ZSTD_LEVEL,
        hidden_encoding: str = DEFAULT_ENCODING,
        reject_nonfinite: bool = True,
        manifest_name: str = MANIFEST_NAME,
        shard_prefix: str = "shard",
        use_threads: bool = True,
        write_behind_bytes: int | None = DEFAULT_WRITE_BEHIND_BYTES,
        hidden_split: int | None = None,
        projection: dict | None = None,
    ):
        record = provenance_record(provenance)
        typed = Provenance.from_dict(record)
        _check_layout_args(typed, hidden_width, topk, shard_bytes, zstd_level, projection)
        if hidden_split is not None:
            check_hidden_split(hidden_split, hidden_width)
        self.encoding = check_encoding(canonical_encoding(hidden_encoding))
        self.quant = parse_encoding(self.encoding)
        self.projection = projection
        self.format_version = format_version_for(self.encoding, projection is not None)
        taps = typed.n_taps
        feature_width = projection["in_width"] if projection is not None else hidden_width
        # Reconstruction errors are summarized per tap (or per column piece when the taps are unknown).
        self._error_groups = taps if taps and feature_width % taps == 0 else None
        self.hidden_width, self.topk = hidden_width, topk
        self.shard_bytes, self.zstd_level = shard_bytes, zstd_level
        if write_behind_bytes is not None and (
            not isinstance(write_behind_bytes, int) or isinstance(write_behind_bytes, bool) or write_behind_bytes < 1
        ):
            raise ValueError(f"write_behind_bytes: expected a positive integer or None, got {write_behind_bytes!r}")
        self.write_behind_bytes = write_behind_bytes
        self.reject_nonfinite = reject_nonfinite
        self.manifest_name = check_prefix(manifest_name, "manifest_name")
        self.shard_prefix = check_prefix(shard_prefix, "shard_prefix")
        self.fs, self.root = io.resolve(root)
        self._vocab_size = typed.target.vocab_size
        self.hidden_split: int = hidden_split  # type: ignore[assignment]  # None until _open_dataset settles it
        self._ipc_options = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", zstd_level), use_threads=use_threads)
        self._open_shard: OpenShard | None = None
        self._closed = False
        # Seconds spent committing shards (close, fsync, index, rename, manifest): with `write` the
        # caller can tell a writer bound by compression from one bound by the disk's flushes.
        self.commit_seconds = 0.0
        # Where `write` spends its time: all of it (`write_seconds`), of it in the record batch's
        # zstd and file write (`batch_seconds`), of that in the Python file stream (`stream_seconds`:
        # hashing and the file write, `stream_calls` calls; the rest is zstd and waits).
        self.timings: collections.Counter = collections.Counter()
        self.write_behind_syncs = 0  # early write-back requests that completed (local shards only)
        self.fs.create_dir(self.root, recursive=True)
        self._lock = lock_manifest(self.fs, self.root, self.manifest_name)
        try:
            is_new = not io.exists(self.fs, manifest_path(self.root, self.manifest_name))
            self._manifest, self._committed_ids = self._open_dataset(record, typed, is_new)
            if self.quant is not None:
                self.quant.check_piece_width(hidden_width // self.hidden_split)
            self._schema = shard_schema(self.encoding, hidden_width, topk, self.format_version, self.hidden_split)
            self._refuse_shared_prefix()
            self._remove_leftovers()  # only now: while another writer held the lock, its temporaries were live
            if is_new:  # an empty dataset exists (and reads as such) from the moment a writer opens it
                save_manifest(self.fs, self.root, self.manifest_name, self._manifest)
        except BaseException:
            self._lock.release()
            raise
        self._ids = set(self._committed_ids)  # committed + in the open shard, to refuse duplicates
        self._next_number = self._first_free_number()
        self.extra_counts: collections.Counter = collections.Counter(extra_counts_of(self._manifest))
        # Called before every manifest save: what the caller's stage_state points at must be durable
        # first (extract: the rejects object on an object store).
        self.before_save: list = []
        self.stage_state: dict = dict(self._manifest.get("stage_state") or {})

    # ------------------------------------------------------------------ opening / resuming

    def _open_dataset(self, provenance: dict, typed: Provenance, is_new: bool) -> tuple[dict, set[str]]:
        """The existing manifest (checked against the given settings) and its sample ids, or a new
        manifest (saved by the caller once the other checks pass). Settles `hidden_split`: the
        dataset's when resuming one and none was given, else one piece per tap (`default_hidden_split`)."""
        if is_new:
            if self.hidden_split is None:
                self.hidden_split = default_hidden_split(typed, self.hidden_width)
            layout: dict[str, Any] = dict(
                encoding=self.encoding, hidden_width=self.hidden_width, topk=self.topk, hidden_split=self.hidden_split
            )
            return new_manifest(provenance=provenance, projection=self.projection, **layout), set()
        manifest = load_manifest(self.fs, self.root, self.manifest_name)
        if self.hidden_split is None:
            self.hidden_split = hidden_split_of(manifest)
        diff = layout_difference(
            manifest,
            provenance=provenance,
            encoding=self.encoding,
            hidden_width=self.hidden_width,
            topk=self.topk,
            hidden_split=self.hidden_split,
            projection=self.projection,
        )
        if diff:
            raise ValueError(
                f"{manifest_path(self.root, self.manifest_name)}: cannot resume, the dataset differs in {diff} "
                "(dataset value vs value given); write to a new directory or pass the dataset's settings"
            )
        ids: set[str] = set()
        for entry in manifest["shards"]:
            ids.update(read_index(self.fs, self.root, entry).column("sample_id").to_pylist())
        assert len(ids) == sum(e["samples"] for e in manifest["shards"]), "duplicate sample ids in a committed dataset"
        return manifest, ids

    def _refuse_shared_prefix(self) -> None:
        """Refuse a prefix whose shards another manifest in this directory lists (and ours does not):
        we would renumber over, or clean up, that dataset's files. A merged manifest lists ours too."""
        ours = {entry["file"] for entry in self._manifest["shards"]}
        for info in self.fs.get_file_info(pafs.FileSelector(self.root, recursive=False)):
            if (
                not info.base_name.endswith(".json")
                or info.base_name == self.manifest_name
                or info.type != pafs.FileType.File
            ):
                continue
            try:
                other = load_manifest(self.fs, self.root, info.base_name)
            except (ValueError, FileNotFoundError, OSError):
                continue  # not a shard manifest
            theirs = [
                e["file"]
                for e in other["shards"]
                if shard_number(self.shard_prefix, e["file"]) is not None and e["file"] not in ours
            ]
            if theirs:
                raise ValueError(
                    f"shard_prefix: {self.shard_prefix!r} is used by {info.path} (e.g. {theirs[0]}); "
                    "give each manifest in a directory its own shard_prefix"
                )

    def _remove_leftovers(self) -> None:
        removed = io.remove_temp_files(self.fs, self.root, prefixes=(f"{self.shard_prefix}-", f"{self.manifest_name}."))
        if io.in_place(self.fs):  # a killed writer's half-done multipart uploads (invisible, but billed)
            removed += abort_uploads(self.fs, self.root, (f"{self.shard_prefix}-",))
        if removed:
            log.info("removed %d leftover temporary files from a killed writer: %s", len(removed), removed)

    def _first_free_number(self) -> int:
        listed = [shard_number(self.shard_prefix, entry["file"]) for entry in self._manifest["shards"]]
        next_number = max([n for n in listed if n is not None], default=-1) + 1
        self._remove_uncommitted_shards(next_number)
        return next_number

    def _remove_uncommitted_shards(self, next_number: int) -> None:
        """Delete this prefix's shard/index files numbered past the last committed one: a killed
        writer renamed them but never listed them, so they are not part of the dataset."""
        selector = pafs.FileSelector(self.root, recursive=False)
        for info in self.fs.get_file_info(selector):
            name = info.base_name
            shard_name = name[: -len(INDEX_SUFFIX)] + SHARD_SUFFIX if name.endswith(INDEX_SUFFIX) else name
            number = shard_number(self.shard_prefix, shard_name)
            if info.type == pafs.FileType.File and number is not None and number >= next_number:
                log.warning("deleting %s: written by a killed writer but never committed to the manifest", info.path)
                self.fs.delete_file(info.path)

    # ------------------------------------------------------------------ public API

    @property
    def manifest(self) -> dict:
        """The manifest as last committed (a copy is not made; do not modify)."""
        return self._manifest

    @property
    def bytes_written(self) -> int:
        """Bytes of committed shard and index files plus the shard being written (for progress bars)."""
        committed = sum(e["bytes"] + e["index_bytes"] for e in self._manifest["shards"])
        return committed + (self._open_shard.stream.nbytes if self._open_shard is not None else 0)

    def committed_ids(self) -> set[str]:
        """Sample ids already listed in the manifest (skip these when resuming)."""
        return set(self._committed_ids)

    def write(
        self, sample: Sample, *, hidden_known_finite: bool = False, hidden_error: ErrorSums | None = None
    ) -> None:
        """Validate `sample` and append it to the open shard (ValueError, and nothing written, if invalid).

        `sample.hidden` may be uint16 or `HiddenPlanes` (stored as is by the `planes` encoding), or,
        for a quantized encoding, `QuantizedHidden` (stored as is; uint16 input is quantized here).
        `hidden_known_finite=True`: the caller has checked these exact hidden values for NaN/Inf
        (extract does, on the GPU), so the writer skips its own scan of them; all other checks run.
        `hidden_error`: the caller's reconstruction error sums of this sample (quantized or projected
        features whose originals only the caller had)."""
        self._check_usable()
        started = time.perf_counter()
        try:
            self._write(sample, hidden_known_finite, hidden_error)
        finally:
            self.timings["write_seconds"] += time.perf_counter() - started  # type: ignore[assignment]  # seconds

    def _to_stored_hidden(self, sample: Sample) -> tuple[Sample, ErrorSums | None]:
        """`sample` with its hidden states in the form this dataset's encoding stores, quantizing
        bf16 bits here (with their reconstruction error) when the encoding is quantized."""
        hidden = getattr(sample, "hidden", None)
        if self.quant is None or not isinstance(sample, Sample):
            if isinstance(hidden, QuantizedHidden):
                raise ValueError(
                    f"sample {sample.sample_id!r}: field 'hidden': quantized ({hidden.encoding}) but the dataset "
                    f"is {self.encoding}"
                )
            return sample, None
        if isinstance(hidden, QuantizedHidden):
            if hidden.encoding != self.encoding or len(hidden.codes) != self.hidden_split:
                raise ValueError(
                    f"sample {sample.sample_id!r}: field 'hidden': {hidden.encoding} in {len(hidden.codes)} pieces, "
                    f"the dataset stores {self.encoding} in {self.hidden_split}"
                )
            return sample, None
        if isinstance(hidden, HiddenPlanes):
            hidden = hidden.join()
        if not isinstance(hidden, np.ndarray) or hidden.dtype != np.uint16 or hidden.ndim != 2:
            return sample, None  # validate_sample names what is wrong
        if hidden.shape[1] != self.hidden_width or hidden.shape[0] != sample.n_tokens:
            return sample, None
        quantized = quantize_bf16_bits(
            hidden, self.encoding, self.hidden_split, what=f"sample {sample.sample_id!r}: field 'hidden'"
        )
        import torch

        original = torch.from_numpy(np.ascontiguousarray(hidden)).view(torch.bfloat16)
        error = error_sums_of(original, quantized.dequantize(torch.float32)) if self.projection is None else None
        return dataclasses.replace(sample, hidden=quantized), error  # type: ignore[arg-type]  # the codes, written as such

    def _write(self, sample: Sample, hidden_known_finite: bool, hidden_error: ErrorSums | None) -> None:
        sample, own_error = self._to_stored_hidden(sample)
        for measured in (own_error, getattr(getattr(sample, "hidden", None), "error", None)):
            hidden_error = hidden_error if hidden_error is not None else measured
        validate_sample(
            sample,
            hidden_width=self.hidden_width,
            topk=self.topk,
            vocab_size=self._vocab_size,
            reject_nonfinite=self.reject_nonfinite,
            hidden_known_finite=hidden_known_finite,
        )
        if sample.sample_id in self._ids:
            raise ValueError(
                f"sample {sample.sample_id!r}: field 'sample_id': duplicate, this id is already in the dataset"
            )
        batch = encode_sample(sample, self._schema, self.encoding, self.hidden_split)
        if self._open_shard is not None and self._open_shard.stream.nbytes >= self.shard_bytes:
            self._commit_open_shard()
        shard = self._open_shard or self._start_shard()
        try:
            before = shard.stream.nbytes
            shard.stream.begin_sample()
            batch_started = time.perf_counter()
            shard.ipc_writer.write_batch(batch)
            self.timings["batch_seconds"] += time.perf_counter() - batch_started  # type: ignore[assignment]
            offset, length, checksum = shard.stream.end_sample()
            shard.add(sample, shard.stream.nbytes - before, offset, length, checksum)
            if hidden_error is not None:
                if shard.error is None:
                    shard.error = ErrorSums.zeros(hidden_error.sq.size)
                shard.error.add(hidden_error)
        except BaseException as err:
            # The file may now hold a partial record batch: drop the whole uncommitted shard.
            self._abandon_open_shard()
            if isinstance(err, OSError) and not err.filename:  # pyarrow's write errors do not name the file
                if err.errno:
                    raise io.named_os_error(err, shard.tmp_path) from err
                raise OSError(err.errno, err.strerror or str(err), shard.tmp_path) from err
            raise
        self._ids.add(sample.sample_id)

    def flush(self) -> None:
        """Commit the open shard now (if any) and save `extra_counts` / `stage_state` in the manifest."""
        self._check_usable()
        if self._open_shard is not None:
            self._commit_open_shard()
        else:
            self._save_manifest()

    def close(self, complete: bool = True) -> None:
        """Commit what is open and mark the dataset `complete` (or not). Idempotent."""
        if self._closed:
            return
        self.flush()
        self._manifest["complete"] = bool(complete)
        self._save_manifest()
        self._closed = True
        self._lock.release()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close(complete=True)
            return
        # Samples already written are whole and valid: keep them, but do not mask the original error.
        try:
            self.close(complete=False)
        except Exception as err:  # noqa: BLE001 - the original error is what the user must see
            # One line, no traceback: on a full disk this second failure is the first one again.
            log.warning(
                "%s: the manifest was not updated after the error (%s); it lists every committed shard, and a rerun "
                "resumes",
                self.root,
                err,
            )
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ shards

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError(f"ShardWriter for {self.root} is closed")

    def _start_shard(self) -> OpenShard:
        file = shard_file_name(self.shard_prefix, self._next_number)
        # An object store has no rename: the shard is uploaded under its final name (unlisted until committed).
        final = io.join(self.root, file)
        tmp_path = final if io.in_place(self.fs) else io.temp_name(final)
        raw = self.fs.open_output_stream(tmp_path, buffer_size=1 << 20)
        write_behind = (
            WriteBehind(tmp_path, self.write_behind_bytes) if self.write_behind_bytes and io.is_local(self.fs) else None
        )
        stream = HashingStream(raw, write_behind, self.timings)
        ipc_writer = pa.ipc.new_file(pa.PythonFile(stream, mode="w"), self._schema, options=self._ipc_options)
        self._open_shard = OpenShard(self._next_number, file, tmp_path, stream, ipc_writer)
        self._next_number += 1
        return self._open_shard

    def _abandon_open_shard(self) -> None:
        shard, self._open_shard = self._open_shard, None
        if shard is None:
            return
        self._ids.difference_update(shard.sample_ids)
        log.error("dropping uncommitted shard %s (%d samples) after a failed write", shard.file, len(shard.sample_ids))
        with contextlib.suppress(Exception):  # on a full disk the close's flush fails too: the file goes anyway
            shard.stream.close(check=False)
        try:
            if io.exists(self.fs, shard.tmp_path):
                self.fs.delete_file(shard.tmp_path)
        except OSError as err:
            log.warning("could not delete %s (%s); the next writer will", shard.tmp_path, err)

    def _write_index(self, shard: OpenShard) -> tuple[str, int, str]:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, index_schema()) as writer:  # uncompressed: tiny and read often
            writer.write_table(shard.index_table())
        data = sink.getvalue().to_pybytes()
        file = index_file_name(shard.file)
        io.atomic_write_bytes(io.join(self.root, file), data, self.fs)
        return file, len(data), bytes_digest(data)

    def _commit_open_shard(self) -> None:
        started = time.perf_counter()
        try:
            self._commit_open_shard_now()
        finally:
            self.commit_seconds += time.perf_counter() - started

    def _commit_open_shard_now(self) -> None:
        self._check_user_state()  # before any rename, so a bad counter cannot strand a renamed shard
        shard, self._open_shard = self._open_shard, None
        assert shard is not None and shard.sample_ids, "committing an empty shard"
        try:
            shard.ipc_writer.close()
            shard.stream.close()
            self.write_behind_syncs += shard.stream.write_behind.syncs if shard.stream.write_behind else 0
            index_file, index_bytes, index_checksum = self._write_index(shard)
            if not io.in_place(self.fs):
                io.commit(self.fs, shard.tmp_path, io.join(self.root, shard.file))
        except BaseException as err:
            # Not committed: these samples are not in the dataset and may be written again, and
            # the half-written file goes now (a full disk keeps no multi-MB temporary until a rerun;
            # on an object store, no manifest lists the object).
            self._ids.difference_update(shard.sample_ids)
            with contextlib.suppress(Exception):
                shard.stream.close(check=False)
            io.discard(self.fs, shard.tmp_path)
            if isinstance(err, OSError) and not err.filename:
                raise io.named_os_error(err, io.join(self.root, shard.file)) from err
            raise
        entry = {
            "file": shard.file,
            "index_file": index_file,
            "samples": len(shard.sample_ids),
            "tokens": int(sum(shard.n_tokens)),
            "loss_tokens": int(sum(shard.n_loss_tokens)),
            "bytes": shard.stream.nbytes,
            "checksum": shard.stream.hasher.hexdigest(),
            "index_bytes": index_bytes,
            "index_checksum": index_checksum,
            SAMPLE_CHECKSUM_ALGO_KEY: SAMPLE_CHECKSUM_ALGO,
            "zstd_level": self.zstd_level,
            "encoding": self.encoding,
            "written": now_iso(),
            "git_sha": git_sha(),
        }
        if shard.error is not None:
            groups = self._error_groups or self.hidden_split
            entry["reconstruction"] = {"tokens": shard.error.tokens, "taps": shard.error.summary(groups)}
        counts = self._manifest["counts"]
        counts["samples"] += entry["samples"]
        counts["tokens"] += entry["tokens"]
        counts["loss_tokens"] += entry["loss_tokens"]
        self._manifest["shards"].append(entry)
        # A version-1 dataset being resumed now holds a version-2 index: readers that predate
        # per-sample checksums must refuse it by its version, not stumble on the new columns.
        self._manifest["format_version"] = self.format_version
        self._manifest["hidden_split"] = self.hidden_split  # absent before version 3
        self._manifest["complete"] = False
        self._committed_ids.update(shard.sample_ids)
        self._save_manifest()

    def _check_user_state(self) -> dict:
        """`stage_state` as it will be saved; ValueError naming the key if it or `extra_counts` is invalid."""
        for key, value in self.extra_counts.items():
            if not isinstance(key, str) or key in RESERVED_COUNTS:
                raise ValueError(f"extra_counts: key {key!r} must be a string other than {RESERVED_COUNTS}")
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"extra_counts[{key!r}]: expected an integer, got {value!r}")
        return json_normalized(self.stage_state, "stage_state")

    def _save_manifest(self) -> None:
        stage_state = self._check_user_state()
        counts = {key: self._manifest["counts"][key] for key in RESERVED_COUNTS}
        counts.update(sorted(self.extra_counts.items()))
        self._manifest["counts"] = counts
        self._manifest["stage_state"] = stage_state
        self._manifest["writer"].update(tool_version=tool_version(), git_sha=git_sha())
        for hook in self.before_save:
            hook()
        self._lock.check()  # an object store's lock lease: never commit once another writer may hold it
        save_manifest(self.fs, self.root, self.manifest_name, self._manifest)
