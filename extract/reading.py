"""Finding and reading a corpus: a path -> its files -> `RawRecord`s in a fixed order, each with its
position.

A corpus is a file, a directory, a glob, or a directory written by `datasets.Dataset.save_to_disk`.
Each file is read by its own format, told by its name: `.jsonl` (also `.jsonl.gz`, `.jsonl.bz2`,
`.jsonl.zst`) or `.parquet`, so one directory may mix them. `corpus_format = jsonl | parquet`
reads every file in that format (for names without a known suffix); a file whose name says the
other format is then refused rather than read as garbage.

JSONL is read line by line here (the `datasets` JSON loader fails a whole file on one bad line).
Text encodings: UTF-8 (a byte order mark at the start is skipped), UTF-16 and UTF-32 with a byte
order mark, and UTF-16 without one (told by the NUL bytes of its first characters). Lines end at
"\\n" only. A line that does not decode is one counted reject, never the whole file.

Parquet is read with pyarrow, one record batch at a time (constant memory, no cache copy). Saved
`datasets` directories are read with `datasets`, streamed by default. A file that cannot be read
as its format stops the run with an error naming the file.

A record's position is its 0-based index over all files in order: every JSONL line counts (blank
lines included), every Parquet row; a reject names `file:line` (JSONL, 1-based) or `file row N`
(Parquet, 0-based within the file) and resume recognises it by position.
"""

from __future__ import annotations

import bz2
import codecs
import dataclasses
import glob
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import xxhash

from extract.records import INVALID_JSON, INVALID_TEXT

JSONL_SUFFIXES = (
    ".jsonl",
    ".jsonl.gz",
    ".jsonl.zst",
    ".jsonl.bz2",
    ".ndjson",
    ".ndjson.gz",
    ".ndjson.zst",
    ".ndjson.bz2",
)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst")
PARQUET_BATCH_ROWS = 1024

# Bytes that fail to decode in a UTF-16/32 file become this lone surrogate, which no valid text
# decodes to: the line holding it is rejected, the rest of the file is read.
_UNDECODABLE = "\udfff"
codecs.register_error("dflash-undecodable", lambda err: (_UNDECODABLE, err.end))


class CorpusError(ValueError):
    """The corpus as a whole cannot be read as configured (not one bad record): stop the run."""


@dataclasses.dataclass
class RawRecord:
    """One input record, or the reason it could not even be parsed."""

    position: int
    source: str
    record: Any = None
    error: tuple[str, str] | None = None  # (reason, detail) when the input itself is broken


@dataclasses.dataclass
class CorpusFiles:
    format: str  # jsonl | parquet | mixed (both, each file by its name) | datasets
    files: list[str]  # the data files, in reading order (for `datasets`: the directory's files)
    root: str  # the path as given
    kinds: list[str] = dataclasses.field(default_factory=list)  # per file: jsonl | parquet (empty for `datasets`)
    # Files of a corpus directory that are not read, as {"name", "reason"} (listed in the provenance
    # and the summary: nothing is left out in silence).
    skipped: list[dict] = dataclasses.field(default_factory=list)
    # The extent read of each file: its size (and modification time) when it was found. Reading,
    # counting and checksumming stop there, so lines appended during a run are not read and the
    # fingerprint describes exactly what was (see `ExtentReader`).
    extents: list[int] = dataclasses.field(default_factory=list)
    mtimes: list[int] = dataclasses.field(default_factory=list)
    # xxh3-128 of each file's extent, once the fingerprint is taken: a file read to its end is
    # checked against it, so one rewritten while it was read stops the run.
    checksums: list[str] | None = None


# ----------------------------------------------------------------------------------------------
# Finding the files


def find_corpus(path: str, corpus_format: str = "auto") -> CorpusFiles:
    """Resolve a corpus path (file, directory, glob or saved `datasets` dir) into its files and the
    format of each; ValueError naming the path (or file) when that cannot be done."""
    from extract.regenerate.store import regeneration_of

    regenerated = regeneration_of(path)
    if regenerated is not None:  # a regeneration's output directory: its data file only, not its journals or rejects
        path = regenerated[0]
    skipped: list[dict] = []
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise ValueError(f"corpus: the pattern '{path}' matches no files")
    elif os.path.isdir(path):
        _refuse_dataset_dict(path)
        if corpus_format in ("auto", "datasets") and _is_saved_dataset(path):
            files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs)
            return CorpusFiles("datasets", files, path)
        if corpus_format == "datasets":
            raise ValueError(
                f"corpus: '{path}' is not a saved `datasets` directory (no dataset_info.json / state.json)"
            )
        files, skipped = _directory_files(path, corpus_format)
        if not files:
            listed = "; ".join(f"{s['name']} ({s['reason']})" for s in skipped[:5])
            raise ValueError(
                f"corpus: directory '{path}' holds no {' / '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} files"
                + (f" (skipped: {listed}{'; ...' if len(skipped) > 5 else ''})" if skipped else "")
            )
    elif os.path.isfile(path):
        files = [path]
    elif os.path.exists(path):
        raise ValueError(f"corpus: '{path}' is neither a file nor a directory")
    else:
        raise ValueError(f"corpus: '{path}' does not exist")
    if corpus_format == "datasets":
        raise ValueError(f"corpus: corpus_format = datasets needs a saved dataset directory, got '{path}'")
    for file in files:
        check_file_name(file)
    kinds = [_file_kind(f, path, corpus_format) for f in files]
    found = sorted(set(kinds))
    corpus = CorpusFiles(found[0] if len(found) == 1 else "mixed", files, path, kinds, skipped)
    for file in files:
        stat = os.stat(file)
        corpus.extents.append(stat.st_size)
        corpus.mtimes.append(stat.st_mtime_ns)
    for file, kind in zip(files, kinds):
        if kind == "parquet":
            parquet_file(file)  # the footer: a file that is no Parquet is named now, before any work
    return corpus


def _directory_files(path: str, corpus_format: str) -> tuple[list[str], list[dict]]:
    """The files of a corpus directory that are read (its own regular files, not hidden, whose name
    says their format, or all of them under an explicit corpus_format) and the others with the
    reason each is skipped. Subdirectories are not entered: a glob names deeper files."""
    files, skipped = [], []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        check_file_name(full)
        if name.startswith("."):
            skipped.append({"name": name, "reason": "hidden (its name starts with '.')"})
        elif os.path.isdir(full):
            skipped.append(
                {
                    "name": name + "/",
                    "reason": "a subdirectory (only the directory's own files are read; "
                    f"name deeper files with a glob such as '{os.path.join(path, '**', '*.jsonl')}')",
                }
            )
        elif not os.path.isfile(full):
            skipped.append({"name": name, "reason": "not a regular file"})
        elif corpus_format == "auto" and data_kind(name) is None:
            skipped.append(
                {
                    "name": name,
                    "reason": "its name has no known suffix (set corpus_format = jsonl or parquet to read "
                    "every file of the directory in that format)",
                }
            )
        else:
            files.append(full)
    return files, skipped


def check_file_name(path: str) -> None:
    """ValueError unless the file's name is valid text (it is recorded in the provenance and in
    every reject's source)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(path)
        raise ValueError(
            f"corpus: the file name {raw!r} is not valid UTF-8 (it is recorded in the dataset's provenance and "
            "rejects); rename it"
        ) from None


def _refuse_dataset_dict(path: str) -> None:
    """A `DatasetDict.save_to_disk` directory holds one directory per split: name one of them."""
    marker = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(marker):
        return
    try:
        with open(marker, encoding="utf-8") as f:
            splits = ", ".join(json.load(f).get("splits", [])) or "unknown"
    except (OSError, ValueError, AttributeError):
        splits = "unknown"
    raise ValueError(
        f"corpus: '{path}' is a `datasets` DatasetDict with several splits ({splits}); point `corpus` at one "
        f"split's directory, e.g. '{os.path.join(path, splits.split(', ')[0])}'"
    )


def _file_kind(file: str, path: str, corpus_format: str) -> str:
    named = data_kind(os.path.basename(file))
    if corpus_format == "auto":
        if named is None:
            raise ValueError(
                f"corpus: cannot tell the format of '{file}' from its name (known: "
                f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}); "
                "set corpus_format = jsonl or parquet"
            )
        return named
    if named is not None and named != corpus_format:
        raise ValueError(
            f"corpus: corpus_format = {corpus_format}, but '{file}' is a {named} file by its name; "
            f"use corpus_format = auto to read each file of '{path}' by its own format"
        )
    return corpus_format


def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def data_kind(name: str) -> str | None:
    """jsonl | parquet from a file name (its suffix in any case), or None."""
    name = name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


# ----------------------------------------------------------------------------------------------
# Reading


def iter_records(corpus: CorpusFiles, *, streaming: bool = True, max_records: int | None = None) -> Iterator[RawRecord]:
    """Every record of the corpus in a fixed order, with its position; bad lines come as errors."""
    if corpus.format == "datasets":
        records = _iter_datasets(_load_saved(corpus.root, streaming), corpus.root)
    else:
        records = _iter_files(corpus)
    for record in records:
        if max_records is not None and record.position >= max_records:
            return
        yield record


def _iter_files(corpus: CorpusFiles) -> Iterator[RawRecord]:
    position = 0
    for i, (path, kind) in enumerate(zip(corpus.files, corpus.kinds)):
        extent = corpus.extents[i] if corpus.extents else None
        checksum = corpus.checksums[i] if corpus.checksums else None
        if kind == "jsonl":
            position = yield from _iter_jsonl_file(path, position, extent=extent, checksum=checksum)
        else:
            position = yield from _iter_parquet_file(path, position)
            if corpus.mtimes:
                _check_unchanged(path, extent, corpus.mtimes[i])


def token_id_lists(corpus: CorpusFiles) -> Iterator[Any]:
    """The `input_ids` value of every record that has one (ready-tokenized records), cheaply: a JSONL
    line is parsed only if its text holds "input_ids", a Parquet file is read only if its schema has
    that column (that column alone). Bad lines and records are skipped: extraction rejects them."""
    if corpus.format == "datasets":
        for raw in iter_records(corpus):
            if isinstance(raw.record, dict) and raw.record.get("input_ids") is not None:
                yield raw.record["input_ids"]
        return
    for i, (path, kind) in enumerate(zip(corpus.files, corpus.kinds)):
        extent = corpus.extents[i] if corpus.extents else None
        if kind == "jsonl":
            for line in _text_lines(path, extent, corpus.checksums[i] if corpus.checksums else None):
                if ("input_ids" if isinstance(line, str) else b"input_ids") in line:
                    record = parse_json_line(line, 0, path).record
                    if isinstance(record, dict) and record.get("input_ids") is not None:
                        yield record["input_ids"]
        elif "input_ids" in parquet_file(path).schema_arrow.names:
            for batch in parquet_file(path).iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["input_ids"]):
                yield from (ids for ids in batch.column(0).to_pylist() if ids is not None)


class ExtentReader(io.RawIOBase):
    """The first `extent` bytes of a file (all of it for None), hashed (xxh3-128, as
    `common.hashing.file_checksum`) as they are read. Lines appended to the file while it is read
    lie past the extent and are never seen."""

    def __init__(self, path: str, extent: int | None = None):
        self.path, self.extent = path, extent
        self._file = open(path, "rb")
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


def _check_read_whole(path: str, raw: ExtentReader, checksum: str | None) -> None:
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


def _check_unchanged(path: str, extent: int | None, mtime: int) -> None:
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


def _text_lines(path: str, extent: int | None = None, checksum: str | None = None) -> Iterator[bytes | str]:
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
        _check_read_whole(path, raw, checksum)


def _decoded(stream, codec: str):
    return io.TextIOWrapper(stream, encoding=codec, errors="dflash-undecodable", newline="\n")


def _iter_jsonl_file(
    path: str, first_position: int, *, extent: int | None = None, checksum: str | None = None
) -> Generator[RawRecord, None, int]:
    """The records of one JSONL file; returns the position after its last line (blank lines count)."""
    name = os.path.basename(path)
    position = first_position
    for line_no, raw in enumerate(_text_lines(path, extent, checksum), start=1):
        if raw.strip():
            yield parse_json_line(raw, position, f"{name}:{line_no}")
        position += 1
    return position


def parse_json_line(raw: bytes | str, position: int, source: str) -> RawRecord:
    """One JSONL line (UTF-8 bytes, or text decoded from another encoding) -> a record or an error."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return RawRecord(position, source, error=(INVALID_JSON, f"not UTF-8: {err}"))
    else:
        text = raw
        if _UNDECODABLE in text:
            return RawRecord(
                position,
                source,
                error=(INVALID_JSON, "bytes that are not valid text in the file's encoding (UTF-16/32)"),
            )
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return RawRecord(position, source, error=(INVALID_JSON, f"{err.msg} at column {err.colno}"))
    except RecursionError:
        return RawRecord(position, source, error=(INVALID_JSON, "nested too deeply"))
    surrogate = _LONE_SURROGATE_ESCAPE.search(text)
    if surrogate and _holds_lone_surrogate(record):
        # JSON's \udXXX escapes can spell half of a UTF-16 pair, which is no text: tokenizers fail on it.
        return RawRecord(
            position,
            source,
            error=(
                INVALID_TEXT,
                f"a string holds a lone UTF-16 surrogate ({surrogate.group(0)}), which is not valid Unicode text",
            ),
        )
    return RawRecord(position, source, record)


_LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _holds_lone_surrogate(record: Any) -> bool:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


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


def _iter_parquet_file(path: str, first_position: int) -> Generator[RawRecord, None, int]:
    """The rows of one Parquet file; returns the position after its last row."""
    import pyarrow as pa

    name = os.path.basename(path)
    row = 0
    try:
        for batch in parquet_file(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for record in batch.to_pylist():
                yield RawRecord(first_position + row, f"{name} row {row}", record)
                row += 1
    except (pa.ArrowException, OSError) as err:
        raise CorpusError(f"corpus: reading '{path}' failed after row {row}: {err}") from None
    return first_position + row


def _load_saved(path: str, streaming: bool):
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(
            f"corpus: '{path}' holds several splits ({', '.join(ds)}); point `corpus` at one split's directory"
        )
    return ds.to_iterable_dataset() if streaming else ds


def _iter_datasets(ds: Iterable[dict], root: str) -> Iterator[RawRecord]:
    name = os.path.basename(root.rstrip("/")) or root
    for position, record in enumerate(ds):
        yield RawRecord(position, f"{name} row {position}", record)


def count_records(corpus: CorpusFiles) -> int | None:
    """How many records (positions) the corpus holds, or None if unknown (only for `datasets`)."""
    if corpus.format != "datasets":
        extents = corpus.extents or [None] * len(corpus.files)
        return sum(
            count_jsonl_lines(f, extent) if kind == "jsonl" else parquet_file(f).metadata.num_rows
            for f, kind, extent in zip(corpus.files, corpus.kinds, extents)
        )
    try:
        import datasets

        return len(datasets.load_from_disk(corpus.root))
    except Exception:  # noqa: BLE001 - a count is only for the progress bar
        return None
