"""One shard file on its way to disk, for `shards.writer.ShardWriter`: the stream that hashes and
counts the bytes pyarrow writes (the whole file for the manifest, each sample's record batch for
the index; `shards/sample_checksums.py`), early write-back of a local file while it is written, and
the shard being written with the index rows of its samples. The order of a commit (temporary name,
fsync, rename or single PUT, the manifest last) is the writer's.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import threading
import time

import pyarrow as pa
import xxhash

from shards.quant import ErrorSums
from shards.sample_checksums import HEADER_PROBE_BYTES, record_batches_start
from shards.sample_checksums import new_hasher as new_sample_hasher
from shards.schema import Sample, index_schema

log = logging.getLogger(__name__)
# Bytes of a local shard written between early write-back requests (see WriteBehind); None = off.
DEFAULT_WRITE_BEHIND_BYTES = 64 << 20


class WriteBehind:
    """Starts write-back of a local shard file while it is still being written.

    Without it the kernel keeps a shard's pages dirty (background write-back starts only at
    gigabytes of dirty memory) and the fsync at commit waits for the whole ~1 GiB shard on the write
    thread: seconds during which no sample is written. Here, every `every_bytes` written, a
    background thread fdatasyncs the file (through its own descriptor: on Linux that flushes every
    dirty page of the file), so the disk works while zstd does, and the fsync at commit finds little
    left. A write-back error is raised by the next write or at commit, never only logged: Linux
    reports it to one fsync, so the commit's own fsync would not see it again.
    """

    # errnos that mean "this file system does not do that", not "your data was lost"
    _UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS}

    def __init__(self, path: str, every_bytes: int):
        self.path, self.every_bytes = path, every_bytes
        self.syncs = 0
        self.enabled = hasattr(os, "fdatasync")
        self._since = 0
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def wrote(self, nbytes: int) -> None:
        self.raise_error()
        if not self.enabled:
            return
        self._since += nbytes
        if self._since < self.every_bytes or (self._thread is not None and self._thread.is_alive()):
            return  # one sync at a time: a slow disk is not asked again before the last one ends
        self._since = 0
        self._thread = threading.Thread(target=self._sync, name="shard-write-behind", daemon=True)
        self._thread.start()

    def _sync(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            self.syncs += 1
        except OSError as err:
            if err.errno in self._UNSUPPORTED:
                self.enabled = False
                log.info(
                    "early write-back is not supported for %s (%s); the fsync at commit does it all", self.path, err
                )
            else:
                self._error = err

    def raise_error(self) -> None:
        if self._error is not None:
            err = self._error
            raise OSError(err.errno, f"writing {self.path} back to disk failed: {err.strerror or err}", self.path)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Wait for a sync in progress; raise its error, if any."""
        self.join()
        self.raise_error()


class HashingStream:
    """A file-like sink for `pa.PythonFile` that hashes and counts bytes on their way to `raw`: the
    whole file (xxh3-128, for the manifest) and, between `begin_sample()` and `end_sample()`, the
    one record batch written in between (xxh3-64, for the index; see `shards/sample_checksums.py`)."""

    def __init__(self, raw, write_behind: WriteBehind | None = None, timings: collections.Counter | None = None):
        self.raw = raw
        self.write_behind = write_behind
        self.timings = timings if timings is not None else collections.Counter()
        self.hasher = xxhash.xxh3_128()
        self.nbytes = 0
        self.closed = False
        self._head = bytearray()  # the file's first bytes, until they tell where record batches start
        self.batches_start: int | None = None
        self._sample_hasher = new_sample_hasher()
        self._sample_from: int | None = None  # file offset where the sample being written started

    def write(self, data) -> int:
        started = time.perf_counter()
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        self._hash_sample_part(view)
        self.raw.write(view)
        self.nbytes += view.nbytes
        if self.write_behind is not None:
            self.write_behind.wrote(view.nbytes)
        self.timings["stream_calls"] += 1
        self.timings["stream_seconds"] += time.perf_counter() - started  # type: ignore[assignment]  # seconds
        return view.nbytes

    def _hash_sample_part(self, view: memoryview) -> None:
        """Feed the sample hasher the bytes of `view` (at file offset `self.nbytes`) that belong to a
        record batch: pyarrow writes the file header (magic + schema) together with the first batch."""
        if self.batches_start is None:
            self._head += view[: HEADER_PROBE_BYTES - len(self._head)]
            if len(self._head) == HEADER_PROBE_BYTES:
                self.batches_start = record_batches_start(bytes(self._head))
        if self._sample_from is None or self.batches_start is None:
            return  # outside a sample, or still inside the header (at least 16 bytes long)
        skip = max(0, self.batches_start - self.nbytes)
        if skip < view.nbytes:
            self._sample_hasher.update(view[skip:])

    def begin_sample(self) -> None:
        assert self._sample_from is None, "begin_sample twice"
        self._sample_hasher.reset()
        self._sample_from = self.nbytes

    def end_sample(self) -> tuple[int, int, int]:
        """(offset, length, xxh3-64) of the record batch written since `begin_sample()`."""
        assert self._sample_from is not None and self.batches_start is not None, "end_sample without a record batch"
        offset = max(self._sample_from, self.batches_start)
        self._sample_from = None
        assert self.nbytes > offset, "no record batch bytes were written"
        return offset, self.nbytes - offset, self._sample_hasher.intdigest()

    def tell(self) -> int:
        return self.nbytes

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self.raw.flush()

    def close(self, check: bool = True) -> None:
        """Close the file and wait for its write-back; `check`: raise a write-back error (not when
        the file is being thrown away)."""
        try:
            if not self.closed:
                self.raw.close()
                self.closed = True
        finally:
            if self.write_behind is not None:
                self.write_behind.wait() if check else self.write_behind.join()


@dataclasses.dataclass
class OpenShard:
    """The shard being written: its temporary file and the index rows of the samples in it."""

    number: int
    file: str
    tmp_path: str
    stream: HashingStream
    ipc_writer: pa.ipc.RecordBatchFileWriter
    sample_ids: list = dataclasses.field(default_factory=list)
    n_tokens: list = dataclasses.field(default_factory=list)
    n_loss_tokens: list = dataclasses.field(default_factory=list)
    nbytes: list = dataclasses.field(default_factory=list)
    offsets: list = dataclasses.field(default_factory=list)
    lengths: list = dataclasses.field(default_factory=list)
    checksums: list = dataclasses.field(default_factory=list)
    error: ErrorSums | None = None  # reconstruction error of a quantized / projected shard's samples

    def add(self, sample: Sample, nbytes: int, offset: int, length: int, checksum: int) -> None:
        """Record the index row of a sample just written."""
        self.sample_ids.append(sample.sample_id)
        self.n_tokens.append(sample.n_tokens)
        self.n_loss_tokens.append(sample.n_loss_tokens)
        self.nbytes.append(nbytes)
        self.offsets.append(offset)
        self.lengths.append(length)
        self.checksums.append(checksum)

    def index_table(self) -> pa.Table:
        columns = [
            self.sample_ids,
            self.n_tokens,
            self.n_loss_tokens,
            list(range(len(self.sample_ids))),
            self.nbytes,
            self.offsets,
            self.lengths,
            self.checksums,
        ]
        schema = index_schema()
        return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(columns, schema, strict=True)], schema=schema)
