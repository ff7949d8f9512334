"""A corpus file's bytes: the extent found at the start, decompressed, hashed as read, decoded to
lines; a file that cannot be read to its end, or changed while it was read, named.

Every read stops at the file's extent (`ExtentReader`: its size when the corpus was found), so lines
appended during a run are never read, and hashes what it reads (xxh3-128), so a file read to its end
is checked against the fingerprint taken at the start (`check_read_whole`; a Parquet file, read
whole by pyarrow, by its size and modification time: `check_unchanged`). Compressed JSONL:
`.gz`, `.bz2`, `.zst` (zstd frames one after the other; a stream that ends inside a frame is an
error, not silently short). Text encodings: UTF-8 (a byte order mark at the start is skipped),
UTF-16 and UTF-32 with a byte order mark, and UTF-16 without one (told by the NUL bytes of its
first characters); lines end at "\\n" only. A damaged stream is a `CorpusError` naming the file and
how far it was read; an I/O error stays an OSError naming the file.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import os
import zlib
from collections.abc import Iterable, Iterator

import xxhash

# Bytes that fail to decode in a UTF-16/32 file become this lone surrogate, which no valid text
# decodes to: the line holding it is rejected, the rest of the file is read.
UNDECODABLE = "\udfff"
codecs.register_error("dflash-undecodable", lambda err: (UNDECODABLE, err.end))


class CorpusError(ValueError):
    """The corpus as a whole cannot be read as configured (not one bad record): stop the run."""


class ExtentReader(io.RawIOBase):
    """The first `extent` bytes of a file (all of it for None), hashed (xxh3-128, as
    `common.hashing.file_checksum`) as they are read. Lines appended to the file while it is read
    lie past the extent and are never seen."""

    def __init__(self, path: str, extent: int | None = None):
        self.path, self.extent = path, extent
        self._file = open(path, "rb")  # noqa: SIM115 (open for the reader's life; close())
        self._hash = xxhash.xxh3_128()
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        want = len(buffer) if self.extent is None else min(len(buffer), self.extent - self.bytes_read)
        if want <= 0:
            return 0
        view = memoryview(buffer).cast("B")[:want]
        got = self._file.readinto(view)
        self._hash.update(view[:got])
        self.bytes_read += got
        return got

    def drain(self) -> None:
        """Read (and hash) the rest of the extent."""
        while self.read(1 << 22):
            pass

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        self._file.close()
        super().close()


class _ZstdReader(io.RawIOBase):
    """Decompressed bytes of a zstd stream (frames one after the other), raising EOFError when the
    input ends inside a frame (`zstandard`'s stream reader returns a truncated stream's data, or
    none, without a word)."""

    def __init__(self, raw):
        import zstandard

        self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
        self._dobj, self._fed, self._out = self._new(), False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._fed:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                return 0
            self._out = self._feed(chunk)
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _feed(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            self._fed = True
            out.append(self._dobj.decompress(chunk))
            chunk = b""
            if self._dobj.eof:  # a frame ended: what follows is the next frame
                chunk, self._dobj, self._fed = self._dobj.unused_data, self._new(), False
        return b"".join(out)


def _open_binary(path: str, extent: int | None = None) -> tuple[io.BufferedIOBase, ExtentReader]:
    """(the decompressed byte stream of a corpus file, the reader of its raw extent)."""
    raw = ExtentReader(path, extent)
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if name.endswith(".bz2"):
        return bz2.BZ2File(raw, "rb"), raw
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(raw)), raw
    return io.BufferedReader(raw), raw


def _damaged(path: str, err: BaseException, lines: int, raw: ExtentReader) -> Exception:
    """The error for a corpus file whose bytes cannot be decoded to the end (a truncated or
    damaged compressed stream): names it and how far it was read. An I/O error (one with an errno)
    stays an OSError, naming the file."""
    if isinstance(err, OSError) and err.errno is not None:
        return OSError(err.errno, err.strerror, path)
    size = raw.extent if raw.extent is not None else os.path.getsize(path)
    return CorpusError(
        f"corpus: '{path}' is damaged ({type(err).__name__}: {err}): read {lines:,} lines, {raw.bytes_read:,} of "
        f"its {size:,} bytes; repair or replace the file (or remove it from the corpus) and rerun"
    )


_DECODE_ERRORS = (EOFError, OSError, zlib.error)


def _decode_errors() -> tuple:
    import zstandard

    return (*_DECODE_ERRORS, zstandard.ZstdError)


def check_read_whole(path: str, raw: ExtentReader, checksum: str | None) -> None:
    """After a file was read to its end: its bytes must be the ones fingerprinted at the start."""
    raw.drain()
    if raw.extent is not None and raw.bytes_read != raw.extent:
        raise CorpusError(
            f"corpus: '{path}' changed while it was read: it was {raw.extent:,} bytes when the run started and "
            f"ended after {raw.bytes_read:,}; the records read from it do not match the dataset's provenance. "
            "Extract a corpus that does not change (a copy), into a new out_dir"
        )
    if checksum is not None and raw.hexdigest() != checksum:
        raise CorpusError(
            f"corpus: '{path}' changed while it was read: its first {raw.bytes_read:,} bytes differ from the ones "
            "checksummed when the run started; the records read from it do not match the dataset's provenance. "
            "Extract a corpus that does not change (a copy), into a new out_dir"
        )


def check_unchanged(path: str, extent: int | None, mtime: int) -> None:
    """A Parquet file is read whole: it must still be the file found at the start (size, mtime)."""
    stat = os.stat(path)
    if (extent is not None and stat.st_size != extent) or stat.st_mtime_ns != mtime:
        raise CorpusError(
            f"corpus: '{path}' changed while it was read (size or modification time differ from the start of the "
            "run); the records read from it do not match the dataset's provenance. Extract a corpus that does not "
            "change (a copy), into a new out_dir"
        )


def sniff_encoding(head: bytes) -> tuple[str, int]:
    """(codec, length of its byte order mark) of a text file from its first bytes."""
    for bom, codec in (
        (codecs.BOM_UTF32_LE, "utf-32-le"),
        (codecs.BOM_UTF32_BE, "utf-32-be"),
        (codecs.BOM_UTF8, "utf-8"),
        (codecs.BOM_UTF16_LE, "utf-16-le"),
        (codecs.BOM_UTF16_BE, "utf-16-be"),
    ):
        if head.startswith(bom):
            return codec, len(bom)
    if len(head) >= 4:
        # JSON text starts with ASCII ('{', whitespace): in UTF-16 every other byte of it is NUL.
        if head[0] and not head[1] and head[2] and not head[3]:
            return "utf-16-le", 0
        if not head[0] and head[1] and not head[2] and head[3]:
            return "utf-16-be", 0
    return "utf-8", 0


def text_lines(path: str, extent: int | None = None, checksum: str | None = None) -> Iterator[bytes | str]:
    """The lines of a JSONL file's extent: UTF-8 files as raw bytes (decoded per line, so one bad
    line is one reject), other encodings as decoded text. The byte order mark is dropped. A damaged
    compressed stream is a CorpusError naming the file; so is a file that changed while it was read."""
    stream, raw = _open_binary(path, extent)
    lines = 0
    with stream:
        try:
            codec, bom = sniff_encoding(stream.peek(4)[:4] if hasattr(stream, "peek") else b"")
            stream.read(bom)
            source = stream if codec == "utf-8" else _decoded(stream, codec)
            for line in source:
                yield line
                lines += 1
        except _decode_errors() as err:
            raise _damaged(path, err, lines, raw) from None
        check_read_whole(path, raw, checksum)


def _decoded(stream, codec: str):
    return io.TextIOWrapper(stream, encoding=codec, errors="dflash-undecodable", newline="\n")


def count_jsonl_lines(path: str, extent: int | None = None) -> int:
    """Lines of one JSONL file (what positions count), read fast in binary blocks for UTF-8."""
    return scan_jsonl(path, extent)[0]


def scan_jsonl(path: str, extent: int | None = None) -> tuple[int, str]:
    """(lines, xxh3-128 of the raw bytes) of a JSONL file's extent, in one pass; a damaged
    compressed stream is a CorpusError naming the file and how far it was read."""
    total = 0
    stream, raw = _open_binary(path, extent)
    with stream:
        try:
            codec, bom = sniff_encoding(stream.peek(4)[:4] if hasattr(stream, "peek") else b"")
            stream.read(bom)
            if codec == "utf-8":
                blocks: Iterable = iter(lambda: stream.read(1 << 22), b"")
                newline, last = b"\n", b"\n"
            else:
                text = _decoded(stream, codec)
                blocks = iter(lambda: text.read(1 << 20), "")
                newline, last = "\n", "\n"
            for block in blocks:
                total += block.count(newline)
                last = block[-1:]
        except _decode_errors() as err:
            raise _damaged(path, err, total, raw) from None
        if last != newline:
            total += 1
        raw.drain()
        if raw.extent is not None and raw.bytes_read != raw.extent:
            raise CorpusError(f"corpus: '{path}' shrank to {raw.bytes_read:,} bytes while it was read")
    return total, raw.hexdigest()


def extent_checksum(path: str, extent: int | None = None) -> str:
    """xxh3-128 of a file's first `extent` bytes (equal to `file_checksum` of an unchanged file)."""
    with ExtentReader(path, extent) as raw:
        raw.drain()
        if extent is not None and raw.bytes_read != extent:
            raise CorpusError(f"corpus: '{path}' shrank to {raw.bytes_read:,} bytes while it was read")
        return raw.hexdigest()


def parquet_file(path: str):
    """`pyarrow.parquet.ParquetFile` of `path`; CorpusError naming the file if it is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise CorpusError(f"corpus: '{path}' is not a readable Parquet file: {err}") from None
