"""Hidden columns split into column pieces (`hidden_split`, format version 3): every split reads back
bit-exactly, in both encodings and through every read path; the pieces may be handed over whole or
already cut (extract's way) and give the same bytes; the writer defaults to one piece per tap and
keeps a resumed dataset's split; bad splits and a manifest that disagrees with its shards are
refused naming the field."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pyarrow as pa
import pytest

from shards import HiddenPlanes, ShardDataset, ShardWriter, verify_dataset
from shards.manifest import seal
from shards.schema import FORMAT_VERSION, shard_schema
from tests.shards.synth import N_TAPS, TOPK, WIDTH, assert_same, make_sample, provenance

N = 7


def write(root, samples, *, encoding="planes", hidden_split=None, prov=None):
    with ShardWriter(
        root,
        provenance=prov or provenance(),
        hidden_width=WIDTH,
        topk=TOPK,
        hidden_encoding=encoding,
        shard_bytes=5_000,
        hidden_split=hidden_split,
    ) as w:
        for sample in samples:
            w.write(sample)
    return json.load(open(os.path.join(root, "manifest.json")))


def files(root, manifest) -> dict:
    return {
        e[k]: open(os.path.join(root, e[k]), "rb").read() for e in manifest["shards"] for k in ("file", "index_file")
    }


def cut(sample, split: int):
    """The sample's planes as `split` column pieces each, as extract hands them over (made here by
    plain slicing, independently of the writer's own cutting)."""
    width = WIDTH // split
    hi = (sample.hidden >> 8).astype(np.uint8)
    lo = (sample.hidden & 0xFF).astype(np.uint8)
    pieces = lambda plane: tuple(np.ascontiguousarray(plane[:, j * width : (j + 1) * width]) for j in range(split))  # noqa: E731
    return dataclasses.replace(sample, hidden=HiddenPlanes(pieces(hi), pieces(lo)))


@pytest.mark.parametrize("encoding", ["planes", "plain"])
@pytest.mark.parametrize("split", [1, 2, 4, 16])
def test_every_split_reads_back_bit_exactly(tmp_path, encoding, split):
    samples = [make_sample(i) for i in range(N)]
    manifest = write(tmp_path / "ds", samples, encoding=encoding, hidden_split=split)
    assert manifest["hidden_split"] == split and manifest["format_version"] == FORMAT_VERSION
    ds = ShardDataset(str(tmp_path / "ds"))
    assert ds.hidden_split == split
    for i, sample in enumerate(samples):
        assert_same(ds[i], sample)
        out = np.full((50, WIDTH), 0xFFFF, dtype=np.uint16)  # decoded straight into a batch row
        got = ds._read(*ds.locate(i), hidden_out=out)
        assert np.shares_memory(got.hidden, out) and np.array_equal(out[: sample.n_tokens], sample.hidden)
        assert (out[sample.n_tokens :] == 0xFFFF).all()  # nothing past the sample's rows is touched
    assert verify_dataset(str(tmp_path / "ds")) == []
    schema = pa.ipc.open_file(str(tmp_path / "ds" / manifest["shards"][0]["file"])).schema
    hidden_columns = [n for n in schema.names if n.startswith("hidden")]
    assert len(hidden_columns) == split * (1 if encoding == "plain" else 2)
    assert all(schema.field(n).type.value_type.list_size == WIDTH // split for n in hidden_columns)


@pytest.mark.parametrize("split", [2, 4])
def test_pieces_handed_over_cut_store_the_same_bytes_as_whole_arrays(tmp_path, split):
    samples = [make_sample(i) for i in range(N)]
    whole = write(tmp_path / "whole", samples, hidden_split=split)
    pieces = write(tmp_path / "pieces", [cut(s, split) for s in samples], hidden_split=split)
    other_cut = write(
        tmp_path / "other", [cut(s, 2 if split == 4 else 4) for s in samples], hidden_split=split
    )  # re-cut by the writer
    assert (
        files(tmp_path / "whole", whole) == files(tmp_path / "pieces", pieces) == files(tmp_path / "other", other_cut)
    )


def test_the_default_is_one_piece_per_tap_and_one_without_taps(tmp_path):
    assert write(tmp_path / "taps", [make_sample(0)])["hidden_split"] == N_TAPS
    no_taps = {k: v for k, v in provenance().items() if k != "taps"}
    assert write(tmp_path / "none", [make_sample(0)], prov=no_taps)["hidden_split"] == 1


def test_a_resumed_dataset_keeps_its_split_and_refuses_another(tmp_path):
    root = tmp_path / "ds"
    write(root, [make_sample(i) for i in range(3)], hidden_split=1)
    manifest = write(root, [make_sample(i) for i in range(3, 6)])  # no split given: the dataset's
    assert manifest["hidden_split"] == 1
    with pytest.raises(ValueError, match="hidden_split: 1 vs 2"):
        write(root, [make_sample(9)], hidden_split=2)
    ds = ShardDataset(str(root))
    for i in range(6):
        assert_same(ds[i], make_sample(i))


@pytest.mark.parametrize("split", [0, 3, -2, 2.0, True])
def test_a_bad_split_is_refused_naming_it(tmp_path, split):
    with pytest.raises(ValueError, match="hidden_split"):
        write(tmp_path / "ds", [make_sample(0)], hidden_split=split)


def test_pieces_of_the_wrong_shape_are_refused_before_anything_is_written(tmp_path):
    sample = cut(make_sample(0), 2)
    short = dataclasses.replace(
        sample, hidden=HiddenPlanes((sample.hidden.hi[0], sample.hidden.hi[1][:-1]), sample.hidden.lo)
    )
    wrong_type = dataclasses.replace(
        sample, hidden=HiddenPlanes((sample.hidden.hi[0], sample.hidden.hi[1].astype(np.uint16)), sample.hidden.lo)
    )
    whole_hi, whole_lo = np.concatenate(sample.hidden.hi, axis=1), np.concatenate(sample.hidden.lo, axis=1)
    narrow = dataclasses.replace(
        sample, hidden=HiddenPlanes((whole_hi[:, :3], whole_hi[:, 3:]), (whole_lo[:, :3], whole_lo[:, 3:]))
    )
    with ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK) as w:
        with pytest.raises(ValueError, match="column pieces differ in length"):
            w.write(short)
        with pytest.raises(ValueError, match="column pieces differ in width"):
            w.write(narrow)
        with pytest.raises(ValueError, match=r"hidden.hi\[1\].*uint8"):
            w.write(wrong_type)
        w.write(sample)
    assert len(ShardDataset(str(tmp_path / "ds"))) == 1


def test_a_manifest_whose_split_disagrees_with_its_shards_is_refused(tmp_path):
    root = tmp_path / "ds"
    write(root, [make_sample(i) for i in range(3)], hidden_split=2)
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["hidden_split"] = 4
    path.write_text(json.dumps(seal(manifest)))
    problems = verify_dataset(str(root))
    assert problems and all("schema does not match" in p.message for p in problems), problems
    with pytest.raises(ValueError, match="schema does not match"):
        ShardDataset(str(root), verify_samples=False)[0]
    manifest["hidden_split"] = 2
    manifest["format_version"] = 2  # version 2 had no split columns
    path.write_text(json.dumps(seal(manifest)))
    with pytest.raises(ValueError, match="hidden_split 2 in a format_version 2 manifest"):
        ShardDataset(str(root))


def test_version_2_schemas_are_the_unsplit_layout():
    """A version-3 reader accepts the shard files older writers made: same fields, no split key."""
    old = shard_schema("planes", WIDTH, TOPK, format_version=2)
    new = shard_schema("planes", WIDTH, TOPK, hidden_split=1)
    assert (
        old.names == new.names
        and b"dflash.hidden_split" not in old.metadata
        and new.metadata[b"dflash.hidden_split"] == b"1"
    )


def test_joining_split_planes_in_row_blocks_covers_every_row(tmp_path, monkeypatch):
    """The reader joins split planes a few rows at a time; blocks that do not divide T must still
    cover every row exactly (forced here with a block of 5 rows)."""
    import shards.schema

    samples = [make_sample(i, n_tokens=n) for i, n in enumerate((1, 5, 6, 23))]
    write(tmp_path / "ds", samples, hidden_split=4)
    monkeypatch.setattr(shards.schema, "_JOIN_BLOCK_VALUES", 5 * WIDTH // 4)
    ds = ShardDataset(str(tmp_path / "ds"))
    for i, sample in enumerate(samples):
        assert_same(ds[i], sample)


@pytest.mark.parametrize("width", ["16", None])
def test_a_manifest_with_a_width_that_is_not_a_number_is_refused_naming_the_file(tmp_path, width):
    root = tmp_path / "ds"
    write(root, [make_sample(0)])
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["hidden_width"] = width
    path.write_text(json.dumps(seal(manifest)))
    with pytest.raises(ValueError, match="manifest.json.*hidden_split"):
        ShardDataset(str(root))
