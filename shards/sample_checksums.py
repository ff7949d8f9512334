"""Per-sample checksums (format version 2): the byte range of every sample's record batch in its
shard file and the xxh3-64 of those bytes, kept in the shard's index and checked on every read.

A sample's record batch is one encapsulated Arrow IPC message: continuation marker (4 bytes),
metadata length (int32), the metadata flatbuffer padded to 8 bytes, then the body (every buffer,
zstd-compressed, each padded to 8 bytes). `ShardWriter` records where each message starts and how
long it is; a reader hashes exactly those bytes and decodes the message from the same bytes, so
nothing that decoding a sample reads escapes the check. The whole-file checksum in the manifest
stays (`verify`, `verify_checksums=True`), since hashing a 1 GiB shard on first open is too slow
to leave on while training.

Why xxh3-64: the threat is random damage (bit rot, a bad disk or copy), against which a 64-bit
check misses with probability 2^-64; xxh3-128 takes the same time (`python -m benchmarks.shards`) but
would buy nothing more, and nobody who can rewrite a shard is kept out by either (they can rewrite
the index too).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import xxhash

from shards.schema import ShardFormatError

SAMPLE_CHECKSUM_ALGO = "xxh3_64"
SAMPLE_CHECKSUM_ALGOS = (SAMPLE_CHECKSUM_ALGO,)

# An Arrow IPC file starts with "ARROW1" and 2 bytes of padding, then the schema message; a message
# starts with this continuation marker and the int32 length of its padded metadata.
_FILE_MAGIC = b"ARROW1"
_CONTINUATION = b"\xff\xff\xff\xff"
HEADER_PROBE_BYTES = 16  # magic + padding + continuation + metadata length of the schema message


def sample_digest(data) -> int:
    """xxh3-64 of a sample's record batch bytes (anything with the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(data)


def new_hasher() -> xxhash.xxh3_64:
    return xxhash.xxh3_64()


def record_batches_start(head: bytes) -> int:
    """Offset of the first record batch in an Arrow IPC file, from the file's first 16 bytes: the
    magic and padding (8 bytes), then the schema message, whose length those bytes give (a schema
    message has no body). The file holds no dictionaries, so record batches follow directly."""
    assert len(head) >= HEADER_PROBE_BYTES, len(head)
    assert head[:6] == _FILE_MAGIC and head[8:12] == _CONTINUATION, (
        f"not the start of an Arrow IPC file: {bytes(head[:16])!r}"
    )
    metadata_length = int.from_bytes(head[12:16], "little")
    assert metadata_length > 0 and metadata_length % 8 == 0, metadata_length
    return HEADER_PROBE_BYTES + metadata_length


@dataclasses.dataclass(frozen=True)
class SampleRanges:
    """Where every sample of one shard lies in the shard file and the checksum of those bytes, from
    the shard's index (rows in shard order)."""

    ids: pa.ChunkedArray  # sample ids (kept in Arrow: millions of Python strings would cost far more)
    offset: np.ndarray  # int64 [n]
    length: np.ndarray  # int64 [n]
    checksum: np.ndarray  # uint64 [n], xxh3-64

    @classmethod
    def from_index(cls, table: pa.Table, shard_bytes: int, index_path: str) -> SampleRanges:
        """The ranges of an index table that has the checksum columns; ShardFormatError naming the
        index file if they are not consecutive, non-empty ranges inside the shard file."""
        offset = table.column("offset").to_numpy().astype(np.int64)
        length = table.column("length").to_numpy().astype(np.int64)
        ranges = cls(table.column("sample_id"), offset, length, table.column("xxh3_64").to_numpy())
        problem = ranges.layout_problem(shard_bytes)
        if problem:
            raise ShardFormatError(f"{index_path}: {problem}")
        return ranges

    def layout_problem(self, shard_bytes: int) -> str | None:
        """Why these ranges cannot be a shard's record batches (one after the other, inside the file), or None."""
        if self.offset.size == 0:
            return None
        if np.any(self.length <= 0) or self.offset[0] <= 0 or self.offset[-1] + self.length[-1] > shard_bytes:
            return f"sample byte ranges reach outside the shard file's {shard_bytes} bytes or are empty"
        if np.any(self.offset[1:] != self.offset[:-1] + self.length[:-1]):
            return "sample byte ranges are not consecutive (each record batch starts where the previous one ends)"
        return None

    def sample_id(self, row: int) -> str:
        return self.ids[row].as_py()

    def read(self, source: pa.NativeFile, row: int, shard_path: str) -> pa.Buffer:
        """The bytes of sample `row` (zero-copy from a memory map; one read from other files).
        `source` must not be shared between threads: this moves its position."""
        offset, length = int(self.offset[row]), int(self.length[row])
        source.seek(offset)
        data = source.read_buffer(length)
        if data.size != length:
            raise ShardFormatError(
                f"{shard_path}: sample {self.sample_id(row)} (row {row}): bytes {offset}..{offset + length} "
                "are past the end of the file (truncated)"
            )
        return data

    def read_at(self, source: pa.NativeFile, row: int, shard_path: str) -> pa.Buffer:
        """`read` without moving the file position, so threads may share `source` (a remote file:
        one ranged request per sample)."""
        offset, length = int(self.offset[row]), int(self.length[row])
        data = pa.py_buffer(source.read_at(length, offset))
        if data.size != length:
            raise ShardFormatError(
                f"{shard_path}: sample {self.sample_id(row)} (row {row}): bytes {offset}..{offset + length} "
                "are past the end of the file (truncated)"
            )
        return data

    def check(self, data, row: int, shard_path: str) -> None:
        """ShardFormatError naming the shard file, the sample and its row unless `data` hashes to the index's
        checksum."""
        actual, expected = sample_digest(data), int(self.checksum[row])
        if actual != expected:
            start = int(self.offset[row])
            raise ShardFormatError(
                f"{shard_path}: sample {self.sample_id(row)} (row {row}): bytes "
                f"{start}..{start + int(self.length[row])} "
                f"have xxh3-64 {actual:016x} but the index says {expected:016x} (corrupted shard data)"
            )


def decode_message(data: pa.Buffer, schema: pa.Schema) -> pa.RecordBatch:
    """The record batch held by one encapsulated IPC message, decoded with `schema` (the layout
    the manifest gives, not the file's footer): exactly the bytes that were checked are decoded."""
    return pa.ipc.read_record_batch(pa.ipc.read_message(data), schema)
