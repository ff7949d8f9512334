"""verify finds, and names the file (and sample) of, every kind of damage; the CLI exits non-zero."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shards import ShardDataset, ShardFormatError, ShardWriter, verify_dataset
from shards.__main__ import main
from shards.manifest import seal
from tests.shards.synth import TOPK, WIDTH, make_sample, provenance


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "ds"
    with ShardWriter(
        root, provenance=provenance(), hidden_width=WIDTH, topk=TOPK, shard_bytes=6_000, reject_nonfinite=False
    ) as w:
        for i in range(12):
            w.write(make_sample(i))
    assert len(ShardDataset(str(root)).shards) >= 3
    assert verify_dataset(str(root)) == []
    return root


def shard_path(root, n=1):
    return root / ShardDataset(str(root)).shards[n]["file"]


def problems_text(root):
    return [str(p) for p in verify_dataset(str(root))]


def test_flipped_byte_in_a_shard_is_reported_with_the_file(dataset):
    path = shard_path(dataset)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    lines = problems_text(dataset)
    assert any(path.name in line and "checksum" in line for line in lines), lines


def test_truncated_shard_is_reported_with_the_file(dataset):
    path = shard_path(dataset)
    path.write_bytes(path.read_bytes()[:-100])
    lines = problems_text(dataset)
    assert lines and all(path.name in line for line in lines), lines
    assert any("truncated" in line for line in lines)


def test_missing_shard_is_reported_with_the_file(dataset):
    path = shard_path(dataset, 2)
    path.unlink()
    lines = problems_text(dataset)
    assert lines == [f"{path}: shard file listed in the manifest is missing"]


def test_missing_index_file_is_reported_with_the_file(dataset):
    path = dataset / ShardDataset(str(dataset)).shards[0]["index_file"]
    path.unlink()
    lines = problems_text(dataset)
    assert any(str(path) in line and "missing" in line for line in lines), lines


def edit_manifest(root, change):
    """A deliberate edit: the manifest's content checksum is recomputed (seal), so only `change` is wrong."""
    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(seal(manifest)))


def test_manifest_total_that_disagrees_is_reported(dataset):
    edit_manifest(dataset, lambda m: m["counts"].update(tokens=m["counts"]["tokens"] + 1))
    lines = problems_text(dataset)
    assert len(lines) == 1 and "manifest.json" in lines[0] and "counts.tokens" in lines[0], lines


def test_shard_entry_count_that_disagrees_is_reported_with_the_shard(dataset):
    def change(m):
        m["shards"][1]["samples"] += 1
        m["counts"]["samples"] += 1

    edit_manifest(dataset, change)
    lines = problems_text(dataset)
    name = ShardDataset(str(dataset)).shards[1]["file"]
    assert any(name in line and "manifest says" in line for line in lines), lines


def test_nan_in_hidden_is_reported_with_file_sample_and_row(tmp_path):
    root = tmp_path / "ds"
    bad = make_sample(1)
    hidden = bad.hidden.copy()
    hidden[2, 5] = 0x7FC0
    bad = dataclasses.replace(bad, hidden=hidden)
    with ShardWriter(root, provenance=provenance(), hidden_width=WIDTH, topk=TOPK, reject_nonfinite=False) as w:
        w.write(make_sample(0))
        w.write(bad)
    problems = verify_dataset(str(root))
    assert len(problems) == 1
    p = problems[0]
    assert p.file.endswith("shard-00000.arrow") and p.sample_id == bad.sample_id and p.row == 1
    assert "hidden has 1 NaN/Inf" in p.message


def test_missing_manifest_and_unknown_version(tmp_path, dataset):
    assert "no manifest" in problems_text(tmp_path / "nothing")[0]
    edit_manifest(dataset, lambda m: m.update(format_version=99))
    assert "format_version 99" in problems_text(dataset)[0]
    with pytest.raises(ShardFormatError, match="format_version 99"):
        ShardDataset(str(dataset))
    with pytest.raises(FileNotFoundError, match="no manifest"):
        ShardDataset(str(tmp_path / "nothing"))


def test_reader_with_checksums_refuses_a_corrupted_shard(dataset):
    path = shard_path(dataset, 0)
    data = bytearray(path.read_bytes())
    data[200] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match=path.name):
        ShardDataset(str(dataset), verify_checksums=True)[0]


def test_cli_verify_exit_code_and_one_line_per_problem(dataset, capsys):
    assert main(["verify", str(dataset)]) == 0
    shard_path(dataset, 0).unlink()
    shard_path(dataset, 1).write_bytes(b"garbage")
    assert main(["verify", str(dataset)]) != 0
    out = capsys.readouterr().out
    problem_lines = [line for line in out.splitlines() if ".arrow" in line]
    assert any("shard-00000.arrow" in line for line in problem_lines)
    assert any("shard-00001.arrow" in line for line in problem_lines)
