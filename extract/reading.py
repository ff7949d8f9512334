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
from collections.abc import Generator, Iterable, Iterator
from typing import Any

from extract.records import INVALID_JSON, INVALID_TEXT

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2")
PARQUET_SUFFIXES = (".parquet",)
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


# ----------------------------------------------------------------------------------------------
# Finding the files


def find_corpus(path: str, corpus_format: str = "auto") -> CorpusFiles:
    """Resolve a corpus path (file, directory, glob or saved `datasets` dir) into its files and the
    format of each; ValueError naming the path (or file) when that cannot be done."""
    from extract.regenerate.store import regeneration_of

    regenerated = regeneration_of(path)
    if regenerated is not None:  # a regeneration's output directory: its data file only, not its journals or rejects
        path = regenerated[0]
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        if not files:
            raise ValueError(f"corpus: the pattern '{path}' matches no files")
    elif os.path.isdir(path):
        if corpus_format in ("auto", "datasets") and _is_saved_dataset(path):
            files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs)
            return CorpusFiles("datasets", files, path)
        if corpus_format == "datasets":
            raise ValueError(
                f"corpus: '{path}' is not a saved `datasets` directory (no dataset_info.json / state.json)"
            )
        files = sorted(
            os.path.join(path, f)
            for f in os.listdir(path)
            if data_kind(f) is not None and os.path.isfile(os.path.join(path, f))
        )
        if not files:
            raise ValueError(
                f"corpus: directory '{path}' holds no {' / '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} files"
            )
    elif os.path.isfile(path):
        files = [path]
    elif os.path.exists(path):
        raise ValueError(f"corpus: '{path}' is neither a file nor a directory")
    else:
        raise ValueError(f"corpus: '{path}' does not exist")
    if corpus_format == "datasets":
        raise ValueError(f"corpus: corpus_format = datasets needs a saved dataset directory, got '{path}'")
    kinds = [_file_kind(f, path, corpus_format) for f in files]
    found = sorted(set(kinds))
    corpus = CorpusFiles(found[0] if len(found) == 1 else "mixed", files, path, kinds)
    for file, kind in zip(files, kinds):
        if kind == "parquet":
            parquet_file(file)  # the footer: a file that is no Parquet is named now, before any work
    return corpus


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
    """jsonl | parquet from a file name, or None."""
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
    for path, kind in zip(corpus.files, corpus.kinds):
        read = _iter_jsonl_file if kind == "jsonl" else _iter_parquet_file
        position = yield from read(path, position)  # each reader returns where the next file starts


def _open_binary(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


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


def _text_lines(path: str) -> Iterator[bytes | str]:
    """The lines of a JSONL file: UTF-8 files as raw bytes (decoded per line, so one bad line is one
    reject), other encodings as decoded text. The byte order mark is dropped."""
    with _open_binary(path) as f:
        codec, bom = sniff_encoding(f.peek(4)[:4] if hasattr(f, "peek") else b"")
        f.read(bom)
        if codec == "utf-8":
            yield from f
            return
        yield from io.TextIOWrapper(f, encoding=codec, errors="dflash-undecodable", newline="\n")


def _iter_jsonl_file(path: str, first_position: int) -> Generator[RawRecord, None, int]:
    """The records of one JSONL file; returns the position after its last line (blank lines count)."""
    name = os.path.basename(path)
    position = first_position
    for line_no, raw in enumerate(_text_lines(path), start=1):
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


def count_jsonl_lines(path: str) -> int:
    """Lines of one JSONL file (what positions count), read fast in binary blocks for UTF-8."""
    total = 0
    with _open_binary(path) as f:
        codec, bom = sniff_encoding(f.peek(4)[:4] if hasattr(f, "peek") else b"")
        f.read(bom)
        if codec == "utf-8":
            blocks: Iterable = iter(lambda: f.read(1 << 22), b"")
            newline, last = b"\n", b"\n"
        else:
            text = io.TextIOWrapper(f, encoding=codec, errors="dflash-undecodable", newline="\n")
            blocks = iter(lambda: text.read(1 << 20), "")
            newline, last = "\n", "\n"
        for block in blocks:
            total += block.count(newline)
            last = block[-1:]
        if last != newline:
            total += 1
    return total


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
        return sum(
            count_jsonl_lines(f) if kind == "jsonl" else parquet_file(f).metadata.num_rows
            for f, kind in zip(corpus.files, corpus.kinds)
        )
    try:
        import datasets

        return len(datasets.load_from_disk(corpus.root))
    except Exception:  # noqa: BLE001 - a count is only for the progress bar
        return None
