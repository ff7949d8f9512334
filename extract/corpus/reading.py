"""Reading a corpus: its files (`files.CorpusFiles`) -> `RawRecord`s in a fixed order, each with
its position; how many there are and the fingerprint a dataset records of them.

JSONL is read line by line here (the `datasets` JSON loader fails a whole file on one bad line); a
line that does not decode or parse is one counted reject, never the whole file (the bytes and their
text encoding: `streams`). Parquet is read with pyarrow, one record batch at a time (constant
memory, no cache copy). Saved `datasets` directories are read with `datasets`, streamed by
default. A file that cannot be read as its format stops the run with an error naming the file.

A record's position is its 0-based index over all files in order: every JSONL line counts (blank
lines included), every Parquet row; a reject names `file:line` (JSONL, 1-based) or `file row N`
(Parquet, 0-based within the file) and resume recognises it by position.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Generator, Iterable, Iterator
from typing import Any

from common.hashing import json_digest
from extract.corpus.files import CorpusFiles
from extract.corpus.records import INVALID_JSON, INVALID_TEXT
from extract.corpus.streams import (
    UNDECODABLE,
    CorpusError,
    check_unchanged,
    count_jsonl_lines,
    extent_checksum,
    parquet_file,
    scan_jsonl,
    text_lines,
)

PARQUET_BATCH_ROWS = 1024


@dataclasses.dataclass
class RawRecord:
    """One input record, or the reason it could not even be parsed."""

    position: int
    source: str
    record: Any = None
    error: tuple[str, str] | None = None  # (reason, detail) when the input itself is broken


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
    for i, (path, kind) in enumerate(zip(corpus.files, corpus.kinds, strict=True)):
        extent = corpus.extents[i] if corpus.extents else None
        checksum = corpus.checksums[i] if corpus.checksums else None
        if kind == "jsonl":
            position = yield from _iter_jsonl_file(path, position, extent=extent, checksum=checksum)
        else:
            position = yield from _iter_parquet_file(path, position)
            if corpus.mtimes:
                check_unchanged(path, extent, corpus.mtimes[i])


def token_id_lists(corpus: CorpusFiles) -> Iterator[Any]:
    """The `input_ids` value of every record that has one (ready-tokenized records), cheaply: a JSONL
    line is parsed only if its text holds "input_ids", a Parquet file is read only if its schema has
    that column (that column alone). Bad lines and records are skipped: extraction rejects them."""
    if corpus.format == "datasets":
        for raw in iter_records(corpus):
            if isinstance(raw.record, dict) and raw.record.get("input_ids") is not None:
                yield raw.record["input_ids"]
        return
    for i, (path, kind) in enumerate(zip(corpus.files, corpus.kinds, strict=True)):
        extent = corpus.extents[i] if corpus.extents else None
        if kind == "jsonl":
            for line in text_lines(path, extent, corpus.checksums[i] if corpus.checksums else None):
                if ("input_ids" if isinstance(line, str) else b"input_ids") in line:
                    record = parse_json_line(line, 0, path).record
                    if isinstance(record, dict) and record.get("input_ids") is not None:
                        yield record["input_ids"]
        elif "input_ids" in parquet_file(path).schema_arrow.names:
            for batch in parquet_file(path).iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["input_ids"]):
                yield from (ids for ids in batch.column(0).to_pylist() if ids is not None)


def _iter_jsonl_file(
    path: str, first_position: int, *, extent: int | None = None, checksum: str | None = None
) -> Generator[RawRecord, None, int]:
    """The records of one JSONL file; returns the position after its last line (blank lines count)."""
    name = os.path.basename(path)
    position = first_position
    for line_no, raw in enumerate(text_lines(path, extent, checksum), start=1):
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
        if UNDECODABLE in text:
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
            for f, kind, extent in zip(corpus.files, corpus.kinds, extents, strict=True)
        )
    try:
        import datasets

        return len(datasets.load_from_disk(corpus.root))
    except Exception:  # noqa: BLE001 - a count is only for the progress bar
        return None


def corpus_fingerprint(corpus: CorpusFiles, max_records: int | None) -> dict:
    """Content checksums of the corpus files (what a resume compares) and the record count, of the
    extent of each file found at the start (a JSONL file in one pass for both). The checksums are
    also kept in `corpus`, so that reading checks each file it reads to its end against them."""
    files, lines = [], 0
    for i, f in enumerate(corpus.files):
        extent = corpus.extents[i] if corpus.extents else os.path.getsize(f)
        if corpus.format != "datasets" and corpus.kinds[i] == "jsonl":
            count, checksum = scan_jsonl(f, extent)
            lines += count
        else:
            checksum = extent_checksum(f, extent)
        name = os.path.relpath(f, corpus.root) if corpus.format == "datasets" else os.path.basename(f)
        files.append({"name": name, "bytes": extent, "checksum": checksum})
    if corpus.format != "datasets":
        corpus.checksums = [f["checksum"] for f in files]
        records = lines + sum(
            parquet_file(f).metadata.num_rows
            for f, kind in zip(corpus.files, corpus.kinds, strict=True)
            if kind != "jsonl"
        )
    else:
        records = count_records(corpus)
    if records is not None and max_records is not None:
        records = min(records, max_records)
    fingerprint = {
        "files": files,
        "hash": json_digest([[f["bytes"], f["checksum"]] for f in files]),
        "records": records,
    }
    if corpus.skipped:
        fingerprint["skipped"] = list(corpus.skipped)
    return fingerprint
