"""`verify_dataset`: check a dataset end to end and list every problem, each naming its file (and the
sample id and row where one sample is concerned).

Checks: the manifest (format version, counts equal the sum over shards, hidden width agrees with
the provenance's taps), every index file (present, size, checksum, schema, rows, token sums, the
per-sample byte ranges follow one another inside the shard), every shard file (present, size,
checksum, schema, number of samples), every sample (its bytes match their xxh3-64 in the index,
it decodes, its id and lengths match the index, field lengths agree, loss mask is 0/1, no NaN/Inf
in hidden states or log-probs; quantized hidden states are decoded, so a NaN code or scale shows as
NaN) and that no sample id appears twice; for storage tiers also that every shard has the dataset's
encoding and that the projection file matches the manifest. Shards written before format
version 2 have no per-sample checksums; their samples are decoded through the file's footer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from tqdm import tqdm

from common import io
from common.hashing import file_checksum
from shards.manifest import (
    MANIFEST_CHECKSUM_KEY,
    MANIFEST_NAME,
    RESERVED_COUNTS,
    SAMPLE_CHECKSUM_ALGO_KEY,
    layout_of,
    load_manifest,
    manifest_path,
    projection_of,
    read_index,
)
from shards.projection import load_projection
from shards.provenance import provenance_of
from shards.sample_checksums import SampleRanges, decode_message
from shards.schema import ShardFormatError, count_nonfinite_bf16, decode_sample, shard_schema, shard_schema_matches


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset."""

    file: str
    message: str
    sample_id: str | None = None
    row: int | None = None

    def __str__(self) -> str:
        where = self.file
        if self.row is not None:
            where += f" row {self.row}"
        if self.sample_id is not None:
            where += f" sample {self.sample_id}"
        return f"{where}: {self.message}"


def _check_manifest_counts(manifest: dict, path: str) -> list[Problem]:
    problems = []
    for key in RESERVED_COUNTS:
        listed = sum(entry.get(key, 0) for entry in manifest["shards"])
        if manifest["counts"].get(key) != listed:
            problems.append(
                Problem(path, f"counts.{key} is {manifest['counts'].get(key)} but the shard entries add up to {listed}")
            )
    prov = provenance_of(manifest)
    taps, hidden_size = prov.taps.layer_ids, prov.target.hidden_size
    projection = projection_of(manifest)
    width, what = (
        (projection["in_width"], "projection in_width") if projection else (manifest["hidden_width"], "hidden_width")
    )
    if taps is not None and hidden_size is not None and len(taps) * hidden_size != width:
        problems.append(Problem(path, f"{what} {width} != {len(taps)} taps x hidden_size {hidden_size}"))
    if prov.topk is not None and prov.topk != manifest["topk"]:
        problems.append(Problem(path, f"topk {manifest['topk']} != provenance topk {prov.topk}"))
    for entry in manifest["shards"]:
        if entry.get("encoding", manifest["encoding"]) != manifest["encoding"]:
            problems.append(
                Problem(
                    path,
                    f"shard {entry['file']} is {entry['encoding']} but the dataset is {manifest['encoding']} "
                    "(mixed encodings)",
                )
            )
    return problems


def _check_projection(fs, root: str, manifest: dict, checksums: bool) -> list[Problem]:
    """The projection file of a projected dataset: present, its size and (with `checksums`) content as listed."""
    entry = projection_of(manifest)
    if entry is None:
        return []
    path = io.join(root, entry["file"])
    problems = _check_file(fs, path, entry["bytes"], entry["checksum"], "projection file", checksums)
    if problems:
        return problems
    try:
        load_projection(root, entry)
    except (ValueError, FileNotFoundError) as err:
        return [Problem(path, str(err).removeprefix(path + ": "))]
    return []


def _check_file(fs, path: str, size: int, checksum: str, what: str, checksums: bool) -> list[Problem]:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return [Problem(path, f"{what} listed in the manifest is missing")]
    if info.size != size:
        return [Problem(path, f"{what} is {info.size} bytes, manifest says {size} (truncated or overwritten)")]
    if checksums and file_checksum(fs, path) != checksum:
        return [Problem(path, f"{what} checksum does not match the manifest (corrupted)")]
    return []


def _check_index(fs, root: str, entry: dict, checksums: bool) -> tuple[list[Problem], pa.Table | None]:
    path = io.join(root, entry["index_file"])
    problems = _check_file(fs, path, entry["index_bytes"], entry["index_checksum"], "index file", checksums)
    if problems and "missing" in problems[0].message:
        return problems, None
    try:
        table = read_index(fs, root, entry)
    except (ShardFormatError, FileNotFoundError) as err:
        return problems + [Problem(path, str(err).removeprefix(path + ": "))], None
    if table.column("row").to_pylist() != list(range(table.num_rows)):
        problems.append(Problem(path, "rows are not 0..n-1 in order"))
    for column, key in (("n_tokens", "tokens"), ("n_loss_tokens", "loss_tokens")):
        total = int(pc.sum(table.column(column)).as_py() or 0)
        if total != entry[key]:
            problems.append(Problem(path, f"{column} add up to {total}, manifest says {key}={entry[key]}"))
    return problems, table


def _sample_ranges(entry: dict, index: pa.Table | None, path: str) -> tuple[list[Problem], SampleRanges | None]:
    """The shard's per-sample ranges (None for a version-1 shard or an unreadable index)."""
    if index is None or SAMPLE_CHECKSUM_ALGO_KEY not in entry:
        return [], None
    try:
        return [], SampleRanges.from_index(index, entry["bytes"], path)
    except ShardFormatError as err:
        return [Problem(path, str(err).removeprefix(path + ": "))], None


def _open_shard(fs, root: str, entry: dict, manifest: dict, checksums: bool) -> tuple[list[Problem], tuple | None]:
    """Problems found opening a shard file, and (source, IPC reader) when it opens."""
    path = io.join(root, entry["file"])
    problems = _check_file(fs, path, entry["bytes"], entry["checksum"], "shard file", checksums)
    if problems and "missing" in problems[0].message:
        return problems, None
    try:
        source = pa.memory_map(path, "r") if io.is_local(fs) else fs.open_input_file(path)
        reader = pa.ipc.open_file(source)
    except (pa.ArrowException, OSError) as err:
        return problems + [Problem(path, f"cannot be opened as an Arrow IPC file: {err}")], None
    if not shard_schema_matches(reader.schema, **layout_of(manifest)):
        return problems + [
            Problem(path, f"schema does not match the manifest's layout: {_field_names(reader.schema)}")
        ], None
    if reader.num_record_batches != entry["samples"]:
        problems.append(Problem(path, f"holds {reader.num_record_batches} samples, manifest says {entry['samples']}"))
    return problems, (source, reader)


def _field_names(schema: pa.Schema) -> str:
    """The schema's field names for a message (a damaged name may not even be UTF-8)."""
    try:
        return str(schema.names)
    except UnicodeDecodeError:
        return "(field names are not valid UTF-8: damaged)"


def _column_length_problems(batch: pa.RecordBatch) -> list[str]:
    """Fields whose number of positions differs from input_ids' (the writer never stores such a sample)."""
    T = len(batch.column("input_ids").flatten())
    messages = []
    for name in batch.schema.names[2:]:
        values = batch.column(name).flatten()
        if len(values) != T:
            messages.append(f"field {name!r} has {len(values)} positions but input_ids has {T}")
    return messages


def _read_batch(source, reader, ranges: SampleRanges | None, row: int, manifest: dict, path: str) -> pa.RecordBatch:
    """Sample `row`'s record batch: from the index's byte range once its checksum matches (ShardFormatError
    naming the sample otherwise), or through the file's footer for a version-1 shard."""
    if ranges is None:
        return reader.get_batch(row)
    data = ranges.read(source, row, path)
    ranges.check(data, row, path)
    return decode_message(data, shard_schema(**layout_of(manifest)))


def _check_sample(
    opened: tuple[Any, Any], ranges: SampleRanges | None, row: int, manifest: dict, index_row: dict | None, path: str
) -> list[Problem]:
    expected_id = index_row["sample_id"] if index_row else None
    try:
        batch = _read_batch(*opened, ranges, row, manifest, path)
        batch.validate(full=True)  # damaged offsets would otherwise crash or mislead the decoding below
        sample_id = batch.column("sample_id")[0].as_py()
        length_problems = _column_length_problems(batch)
        if length_problems:
            return [Problem(path, m, sample_id, row) for m in length_problems]
        sample = decode_sample(batch, **layout_of(manifest))
    except ShardFormatError as err:  # a per-sample checksum mismatch; the Problem names the sample and row itself
        return [
            Problem(
                path,
                str(err).removeprefix(path + ": ").removeprefix(f"sample {expected_id} (row {row}): "),
                expected_id,
                row,
            )
        ]
    except (pa.ArrowException, OSError, ValueError, IndexError) as err:  # pyarrow raises OSError for zstd data errors
        return [Problem(path, f"cannot be decoded: {err}", expected_id, row)]
    problems = []

    def report(message):
        problems.append(Problem(path, message, sample.sample_id, row))

    if index_row is not None:
        if sample.sample_id != expected_id:
            report(f"sample id differs from the index's {expected_id}")
        if sample.n_tokens != index_row["n_tokens"]:
            report(f"{sample.n_tokens} tokens, index says {index_row['n_tokens']}")
        if sample.n_loss_tokens != index_row["n_loss_tokens"]:
            report(f"{sample.n_loss_tokens} loss tokens, index says {index_row['n_loss_tokens']}")
    if sample.n_tokens == 0:
        report("empty sequence")
    if np.any(sample.loss_mask > 1):
        report("loss_mask has values other than 0/1")
    bad = count_nonfinite_bf16(sample.hidden)
    if bad:
        report(f"hidden has {bad} NaN/Inf values")
    bad = int(np.count_nonzero(~np.isfinite(sample.topk_logprobs)))
    if bad:
        report(f"topk_logprobs has {bad} NaN/Inf values")
    return problems


def _check_shard(
    fs, root: str, entry: dict, manifest: dict, checksums: bool, decode: bool, sample_checksums: bool, bar
) -> tuple[list[Problem], list[str]]:
    """Problems of one shard and its index, and the sample ids the index lists."""
    problems, index = _check_index(fs, root, entry, checksums)
    range_problems, ranges = _sample_ranges(entry, index, io.join(root, entry["index_file"]))
    problems += range_problems
    shard_problems, opened = _open_shard(fs, root, entry, manifest, checksums)
    problems += shard_problems
    index_rows = index.to_pylist() if index is not None else []
    if opened is not None and decode:
        path = io.join(root, entry["file"])
        for row in range(opened[1].num_record_batches):
            index_row = index_rows[row] if row < len(index_rows) else None
            checked = ranges if sample_checksums and index_row is not None else None
            problems += _check_sample(opened, checked, row, manifest, index_row, path)
            bar.update(1)
    return problems, [r["sample_id"] for r in index_rows]


def verify_dataset(
    root: str,
    manifest_name: str = MANIFEST_NAME,
    *,
    checksums: bool = True,
    decode: bool = True,
    sample_checksums: bool = True,
    progress: bool = False,
) -> list[Problem]:
    """Every problem found in the dataset at `root` (empty list: the dataset is sound).

    `checksums`: hash every whole file against the manifest; `sample_checksums`: check each sample's
    bytes against its checksum in the index before decoding it (shards of format version 2)."""
    fs, root = io.resolve(root)
    path = manifest_path(root, manifest_name)
    try:
        manifest = load_manifest(fs, root, manifest_name)
    except (FileNotFoundError, ShardFormatError) as err:
        return [Problem(path, str(err).removeprefix(path + ": "))]
    problems = _check_manifest_counts(manifest, path)
    problems += _check_projection(fs, root, manifest, checksums)
    if MANIFEST_CHECKSUM_KEY not in manifest:  # every save writes it; without it, damage to the manifest goes unseen
        problems.append(
            Problem(
                path,
                f"manifest has no {MANIFEST_CHECKSUM_KEY}: written by an older version, or the field was damaged "
                "or removed",
            )
        )
    seen: dict[str, str] = {}
    total = sum(entry["samples"] for entry in manifest["shards"])
    with tqdm(total=total, unit="sample", desc="verify", disable=None if progress else True) as bar:
        for entry in manifest["shards"]:
            shard_problems, ids = _check_shard(fs, root, entry, manifest, checksums, decode, sample_checksums, bar)
            problems += shard_problems
            for row, sid in enumerate(ids):
                if sid in seen:
                    problems.append(
                        Problem(
                            io.join(root, entry["index_file"]), f"duplicate sample id, also in {seen[sid]}", sid, row
                        )
                    )
                seen.setdefault(sid, entry["file"])
    return problems
