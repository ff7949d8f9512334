"""Per-sample checksums (format version 2): the writer records every sample's record-batch byte range
and its xxh3-64 in the index; readers and `verify` check those bytes before decoding them.

What is proven here: the ranges tile the file's record-batch region exactly and decode to what the
file's footer gives; every flipped byte inside any sample's range is caught on read, naming the
file, the sample and the row (the property that failed before: zstd does not notice every flip);
untouched data reads clean; a damaged index is refused; version-1 datasets (no checksum columns)
still read, with one warning, and a resumed version-1 dataset gains checked shards.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import xxhash

from common.hashing import bytes_digest
from common.io import resolve
from shards import ShardDataset, ShardFormatError, ShardWriter, verify_dataset
from shards.__main__ import main
from shards.describe import inspect_lines
from shards.manifest import SAMPLE_CHECKSUM_ALGO_KEY, read_index, seal
from shards.schema import FORMAT_VERSION, encode_sample, index_schema, shard_schema
from tests.shards.synth import TOPK, WIDTH, assert_same, make_sample, provenance

N_SAMPLES = 10
EOS_MARKER = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # what pyarrow writes after the last record batch


def write_dataset(root: Path, encoding: str = "planes", indices=range(N_SAMPLES)) -> Path:
    with ShardWriter(
        root, provenance=provenance(), hidden_width=WIDTH, topk=TOPK, shard_bytes=6_000, hidden_encoding=encoding
    ) as w:
        for i in indices:
            w.write(make_sample(i))
    return root


@pytest.fixture
def dataset(tmp_path) -> Path:
    return write_dataset(tmp_path / "ds")


def manifest_of(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def save_manifest(root: Path, manifest: dict) -> None:
    (root / "manifest.json").write_text(json.dumps(seal(manifest)))


def index_of(root: Path, entry: dict) -> dict:
    return read_index(*resolve(str(root)), entry).to_pydict()


def samples_by_position(root: Path) -> list[tuple[dict, int, dict]]:
    """(shard entry, row, index row) of every sample, in dataset order."""
    out = []
    for entry in manifest_of(root)["shards"]:
        index = index_of(root, entry)
        out += [(entry, row, {k: v[row] for k, v in index.items()}) for row in range(entry["samples"])]
    return out


def flip(path: Path, at: int, mask: int) -> None:
    """XOR one byte in place (a reader's memory map of the file sees the change)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ mask]))


def rewrite_index(root: Path, manifest: dict, position: int, table: pa.Table) -> None:
    """Replace one shard's index file, keeping the manifest's size and checksum of it right."""
    entry = manifest["shards"][position]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    (root / entry["index_file"]).write_bytes(data)
    entry.update(index_bytes=len(data), index_checksum=bytes_digest(data))


def downgrade_to_version_1(root: Path) -> None:
    """Make a dataset exactly what the version-1 writer wrote: unsplit hidden columns, 5-column
    indexes, shard schemas that say version 1, no `sample_checksum_algo` in the shard entries and
    no `hidden_split` in the manifest, format_version 1."""
    manifest = manifest_of(root)
    samples = list(ShardDataset(str(root)))
    schema = shard_schema(manifest["encoding"], manifest["hidden_width"], manifest["topk"], format_version=1)
    first = 0
    for position, entry in enumerate(manifest["shards"]):
        old_schema = index_schema(sample_checksums=False)
        table = read_index(*resolve(str(root)), entry).select(old_schema.names).cast(old_schema)
        rewrite_index(root, manifest, position, table)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, schema, options=pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", 1))) as writer:
            for i in range(first, first + entry["samples"]):
                writer.write_batch(encode_sample(samples[i], schema, manifest["encoding"]))
        first += entry["samples"]
        data = sink.getvalue().to_pybytes()
        (root / entry["file"]).write_bytes(data)
        entry.update(bytes=len(data), checksum=bytes_digest(data))
        del entry[SAMPLE_CHECKSUM_ALGO_KEY]
    manifest["format_version"] = 1
    del manifest["hidden_split"]
    save_manifest(root, manifest)


# ----------------------------------------------------------------------------------------------
# What the writer records


@pytest.mark.parametrize("encoding", ["planes", "plain"])
def test_ranges_tile_the_record_batch_region_and_decode_like_the_footer(tmp_path, encoding):
    """Arrow IPC file: magic + schema message | record batch messages | end-of-stream marker | footer.
    The ranges must be exactly the record batch messages: consecutive, from the end of the schema
    message to the end-of-stream marker, each decoding to the batch the footer points at."""
    root = write_dataset(tmp_path / encoding, encoding)
    manifest = manifest_of(root)
    assert manifest["format_version"] == FORMAT_VERSION and len(manifest["shards"]) >= 3
    for entry in manifest["shards"]:
        assert entry[SAMPLE_CHECKSUM_ALGO_KEY] == "xxh3_64"
        data = (root / entry["file"]).read_bytes()
        header_end = 16 + int.from_bytes(data[12:16], "little")  # magic (8) + schema message (8 + metadata)
        footer_start = len(data) - 10 - int.from_bytes(data[-10:-6], "little")
        index = index_of(root, entry)
        offsets, lengths = index["offset"], index["length"]
        assert offsets[0] == header_end
        assert all(offsets[r + 1] == offsets[r] + lengths[r] for r in range(len(offsets) - 1))
        end = offsets[-1] + lengths[-1]
        assert data[end:footer_start] == EOS_MARKER
        reader = pa.ipc.open_file(pa.py_buffer(data))
        for row, (offset, length, checksum) in enumerate(zip(offsets, lengths, index["xxh3_64"], strict=True)):
            message = data[offset : offset + length]
            assert xxhash.xxh3_64_intdigest(message) == checksum
            batch = pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(message)), reader.schema)
            assert batch.equals(reader.get_batch(row))
        # `nbytes` (what the file grew by) is the same range, plus the file header for row 0.
        assert index["nbytes"] == [lengths[0] + header_end] + lengths[1:]


def test_the_writer_stream_finds_the_ranges_whatever_the_write_sizes(dataset):
    """pyarrow writes the file header with the first batch in pieces of its choosing: the writer's
    stream must find the same ranges and checksums when the same bytes come in any pieces."""
    from shards.shard_file import HashingStream

    rng = random.Random(2)
    entry = manifest_of(dataset)["shards"][0]
    data = (dataset / entry["file"]).read_bytes()
    index = index_of(dataset, entry)
    ends = [o + n for o, n in zip(index["offset"], index["length"], strict=True)]
    for max_piece in (1, 5, 64, 100_000):
        stream = HashingStream(io.BytesIO())
        start = 0
        for row, end in enumerate(ends):
            stream.begin_sample()
            while start < end:
                piece = min(end - start, rng.randint(1, max_piece))
                stream.write(data[start : start + piece])
                start += piece
            assert stream.end_sample() == (index["offset"][row], index["length"][row], index["xxh3_64"][row]), (
                max_piece,
                row,
            )


# ----------------------------------------------------------------------------------------------
# Reading


def test_an_untouched_dataset_reads_clean(dataset, caplog):
    with caplog.at_level(logging.WARNING, logger="shards"):
        ds = ShardDataset(str(dataset))
        for i in range(N_SAMPLES):
            assert_same(ds[i], make_sample(i))
        hidden_out = torch.zeros(64, WIDTH, dtype=torch.bfloat16)
        assert (
            ds.torch(3, hidden_out=hidden_out)["hidden"].view(torch.uint16).numpy().tobytes()
            == make_sample(3).hidden.tobytes()
        )
    assert not caplog.records
    assert verify_dataset(str(dataset)) == []


def test_every_flipped_byte_in_a_sample_is_caught_naming_file_sample_and_row(dataset):
    """Every byte of two samples, and the first, last and 30 random bytes of every other sample:
    flipped one at a time under an open reader, each must make reading that sample fail with the
    file, sample id and row in the message, while the shard's other samples still read."""
    rng = random.Random(0)
    ds = ShardDataset(str(dataset))
    located = samples_by_position(dataset)
    exhaustive = {0, len(located) - 1}
    tried, missed = 0, []
    for position, (entry, row, index_row) in enumerate(located):
        path = dataset / entry["file"]
        start, length = index_row["offset"], index_row["length"]
        if position in exhaustive:
            spots = range(start, start + length)
        else:
            spots = [start, start + length - 1] + [rng.randrange(start, start + length) for _ in range(30)]
        for at in spots:
            mask = rng.randint(1, 255)
            flip(path, at, mask)
            try:
                ds[position]
                missed.append(f"{entry['file']} byte {at}")
            except ShardFormatError as err:
                message = str(err)
                assert str(path) in message and index_row["sample_id"] in message and f"row {row}" in message, message
            finally:
                flip(path, at, mask)
            tried += 1
        neighbour = position + 1 if row + 1 < entry["samples"] else position - 1
        assert_same(ds[neighbour], make_sample(neighbour))  # the damage stays with its sample
    assert not missed, f"{len(missed)} of {tried} flipped bytes were read without an error: {missed[:10]}"
    assert tried > 2000  # two whole samples and 32 bytes of each other sample


def test_verify_names_file_sample_and_row_of_a_flipped_byte(dataset, capsys):
    entry, row, index_row = samples_by_position(dataset)[4]
    path = dataset / entry["file"]
    flip(path, index_row["offset"] + index_row["length"] // 2, 0x10)
    problems = verify_dataset(str(dataset), checksums=False)
    assert len(problems) == 1, problems
    problem = problems[0]
    assert (problem.file, problem.sample_id, problem.row) == (str(path), index_row["sample_id"], row)
    assert "xxh3-64" in problem.message
    assert main(["verify", str(dataset), "--no-checksums", "--no-progress"]) == 1
    assert f"{path} row {row} sample {index_row['sample_id']}" in capsys.readouterr().out


def test_a_damaged_index_file_is_refused_naming_it(dataset):
    """The index holds the checksums, so it is checked against the manifest whenever it is loaded."""
    shards = manifest_of(dataset)["shards"]
    path = dataset / shards[1]["index_file"]
    first_of_shard_1 = shards[0]["samples"]
    rng = random.Random(1)
    for at in [rng.randrange(path.stat().st_size) for _ in range(20)]:
        mask = rng.randint(1, 255)
        flip(path, at, mask)
        with pytest.raises(ShardFormatError, match=re.escape(str(path))):
            ShardDataset(str(dataset)).index  # noqa: B018 (reading the index is the check)
        with pytest.raises(ShardFormatError, match=re.escape(str(path))):
            ShardDataset(str(dataset))[first_of_shard_1]  # a read without the full index loads that shard's
        flip(path, at, mask)


def test_verify_samples_off_reads_without_the_check(dataset):
    """Wrong checksums in an otherwise consistent dataset: refused by default, read with the knob off."""
    manifest = manifest_of(dataset)
    entry = manifest["shards"][0]
    table = read_index(*resolve(str(dataset)), entry)
    wrong = pa.array(np.asarray(table.column("xxh3_64").to_numpy()) ^ np.uint64(1), pa.uint64())
    rewrite_index(
        dataset,
        manifest,
        0,
        table.set_column(table.schema.get_field_index("xxh3_64"), index_schema().field("xxh3_64"), wrong),
    )
    save_manifest(dataset, manifest)
    with pytest.raises(ShardFormatError, match=f"sample {table.column('sample_id')[0]} \\(row 0\\)"):
        ShardDataset(str(dataset))[0]
    ds = ShardDataset(str(dataset), verify_samples=False)
    for i in range(N_SAMPLES):
        assert_same(ds[i], make_sample(i))


def test_an_index_that_lost_its_checksum_columns_is_refused(dataset):
    """The manifest says which shards have per-sample checksums: an index without them is not taken
    for a version-1 one (the checks cannot be switched off by damage)."""
    manifest = manifest_of(dataset)
    entry = manifest["shards"][0]
    old = index_schema(sample_checksums=False)
    rewrite_index(dataset, manifest, 0, read_index(*resolve(str(dataset)), entry).select(old.names).cast(old))
    save_manifest(dataset, manifest)
    with pytest.raises(ShardFormatError, match=f"{re.escape(entry['index_file'])}: index schema"):
        ShardDataset(str(dataset))[0]


def test_a_sample_other_than_the_index_says_is_refused(dataset):
    """Ranges and checksums intact but the ids of rows 0 and 1 swapped: the right bytes of the wrong sample."""
    manifest = manifest_of(dataset)
    table = read_index(*resolve(str(dataset)), manifest["shards"][0])
    ids = table.column("sample_id").to_pylist()
    swapped = pa.array([ids[1], ids[0], *ids[2:]], pa.string())
    rewrite_index(dataset, manifest, 0, table.set_column(0, index_schema().field("sample_id"), swapped))
    save_manifest(dataset, manifest)
    with pytest.raises(ShardFormatError, match=f"row 0 holds sample {ids[0]}, the index says {ids[1]}"):
        ShardDataset(str(dataset))[0]


# ----------------------------------------------------------------------------------------------
# Version-1 datasets


def test_a_version_1_dataset_still_reads_with_one_warning(dataset, caplog, capsys):
    downgrade_to_version_1(dataset)
    manifest = manifest_of(dataset)
    assert manifest["format_version"] == 1 and not any(SAMPLE_CHECKSUM_ALGO_KEY in e for e in manifest["shards"])
    with caplog.at_level(logging.WARNING, logger="shards"):
        ds = ShardDataset(str(dataset))
        for i in range(N_SAMPLES):
            assert_same(ds[i], make_sample(i))
        assert len(ds.index) == N_SAMPLES
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "before per-sample checksums" in warnings[0] and "manifest.json" in warnings[0], (
        warnings
    )
    assert verify_dataset(str(dataset)) == []
    assert any("written before per-sample checksums" in line for line in inspect_lines(ds))
    assert main(["verify", str(dataset), "--no-progress"]) == 0
    assert "written before per-sample checksums" in capsys.readouterr().out


def test_resuming_a_version_1_dataset_adds_checked_shards(dataset):
    downgrade_to_version_1(dataset)
    old_shards = len(manifest_of(dataset)["shards"])
    write_dataset(dataset, indices=range(N_SAMPLES, N_SAMPLES + 6))
    manifest = manifest_of(dataset)
    assert (
        manifest["format_version"] == FORMAT_VERSION and manifest["hidden_split"] == 1
    )  # the dataset's layout is kept
    checked = [SAMPLE_CHECKSUM_ALGO_KEY in e for e in manifest["shards"]]
    assert checked == [False] * old_shards + [True] * (len(checked) - old_shards), checked
    ds = ShardDataset(str(dataset))
    for i in range(N_SAMPLES + 6):
        assert_same(ds[i], make_sample(i))
    assert verify_dataset(str(dataset)) == []
    entry, row, index_row = samples_by_position(dataset)[-1]
    flip(dataset / entry["file"], index_row["offset"] + 3, 0x01)
    with pytest.raises(ShardFormatError, match=f"sample {index_row['sample_id']} \\(row {row}\\)"):
        ShardDataset(str(dataset))[-1]
