"""Damage the reliability suite found unreported or reported with a traceback: a manifest value changed
by a flipped byte (the manifest checks its own content), a manifest that is not UTF-8, zstd data that
no longer decodes, an index whose ids are not UTF-8, and a failed shard write that named no file."""

from __future__ import annotations

import errno
import json

import pytest

from common.io import resolve
from shards import ShardDataset, ShardFormatError, ShardWriter, shard_file, verify_dataset
from shards.manifest import MANIFEST_CHECKSUM_KEY, read_index
from tests.shards.synth import TOPK, WIDTH, make_sample, provenance


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "ds"
    with ShardWriter(root, provenance=provenance(), hidden_width=WIDTH, topk=TOPK, shard_bytes=6_000) as w:
        for i in range(8):
            w.write(make_sample(i))
    return root


def test_a_flipped_byte_in_a_manifest_value_is_refused_naming_the_file(dataset):
    path = dataset / "manifest.json"
    text = path.read_text()
    assert '"samples": 8' in text
    path.write_text(text.replace('"samples": 8', '"samples": 9', 1))  # still valid JSON, one digit changed
    with pytest.raises(ShardFormatError, match=f"{path}.*manifest_checksum"):
        ShardDataset(str(dataset))
    assert any("manifest.json" in str(p) and MANIFEST_CHECKSUM_KEY in str(p) for p in verify_dataset(str(dataset)))


def test_a_manifest_that_is_not_utf8_is_refused_naming_the_file(dataset):
    path = dataset / "manifest.json"
    data = bytearray(path.read_bytes())
    data[40] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="not valid JSON"):
        ShardDataset(str(dataset))
    assert [str(p) for p in verify_dataset(str(dataset))][0].startswith(str(path))


def test_verify_reports_a_manifest_without_its_checksum(dataset):
    path = dataset / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest[MANIFEST_CHECKSUM_KEY]
    path.write_text(json.dumps(manifest))
    assert len(ShardDataset(str(dataset))) == 8  # readers accept manifests of older writers
    assert any(MANIFEST_CHECKSUM_KEY in str(p) for p in verify_dataset(str(dataset)))


def test_damaged_shard_bytes_give_problems_naming_the_file_never_a_traceback(dataset):
    """With every checksum off (the path of version-1 shards), a damaged byte reaches zstd and Arrow
    (which raise OSError): verify and the reader must turn whatever happens into a problem /
    ShardFormatError naming the shard. (With the per-sample checks, test_sample_checksums.py.)"""
    entry = ShardDataset(str(dataset)).shards[0]
    path = dataset / entry["file"]
    original = path.read_bytes()
    decode_errors = 0
    for at in range(0, len(original), max(1, len(original) // 60)):
        data = bytearray(original)
        data[at] ^= 0xA5
        path.write_bytes(bytes(data))
        problems = verify_dataset(str(dataset), checksums=False, sample_checksums=False)  # must not raise
        assert all(entry["file"] in p.file for p in problems), problems
        decode_errors += any("cannot be decoded" in p.message for p in problems)
        ds = ShardDataset(str(dataset), verify_samples=False)
        for i in range(entry["samples"]):
            try:
                ds[i]
            except ShardFormatError as err:
                assert entry["file"] in str(err)
    path.write_bytes(original)
    assert decode_errors > 0, "no damaged byte reached the decoder; the test exercised nothing"


def test_an_index_whose_ids_are_not_utf8_is_refused(dataset):
    entry = ShardDataset(str(dataset)).shards[0]
    path = dataset / entry["index_file"]
    data = bytearray(path.read_bytes())
    sid = read_index(*resolve(str(dataset)), entry).column("sample_id")[0].as_py()
    at = bytes(data).index(sid.encode())
    data[at] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match=entry["index_file"]):
        ShardDataset(str(dataset)).index  # noqa: B018 (reading the index is the check)
    assert any(entry["index_file"] in str(p) for p in verify_dataset(str(dataset), checksums=False))


def test_a_failed_shard_write_names_the_temporary_file_and_keeps_the_committed_shards(tmp_path, monkeypatch):
    root = tmp_path / "ds"
    writer = ShardWriter(root, provenance=provenance(), hidden_width=WIDTH, topk=TOPK, shard_bytes=6_000)
    for i in range(4):
        writer.write(make_sample(i))
    writer.flush()

    def full_disk(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")  # what pyarrow's writes raise: no file name

    monkeypatch.setattr(shard_file.HashingStream, "write", full_disk)
    with pytest.raises(OSError) as err:
        writer.write(make_sample(4))
    assert err.value.errno == errno.ENOSPC and err.value.filename and str(root) in err.value.filename
    monkeypatch.undo()
    writer.close(complete=False)
    assert len(ShardDataset(str(root))) == 4 and verify_dataset(str(root)) == []
