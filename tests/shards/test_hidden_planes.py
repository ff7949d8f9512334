"""Hidden states handed to the writer already split into byte planes (`HiddenPlanes`, as extract
does) are stored byte for byte as the same values given as uint16; `hidden_known_finite` skips
only the hidden NaN/Inf scan; without it non-finite planes are refused; the blocked NaN/Inf count
equals its definition."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from shards import HiddenPlanes, ShardDataset, ShardWriter
from shards.schema import _SCAN_BLOCK, BF16_EXPONENT_MASK, count_nonfinite_bf16, count_nonfinite_planes, split_planes
from tests.shards.synth import TOPK, WIDTH, assert_same, make_sample, provenance

MANIFEST = "manifest.json"


def as_planes(sample):
    """The same sample with its hidden states as byte planes (made independently of split_planes)."""
    hi = (sample.hidden >> 8).astype(np.uint8)
    lo = (sample.hidden & 0xFF).astype(np.uint8)
    return dataclasses.replace(sample, hidden=HiddenPlanes(hi, lo))


def write_all(root, samples, encoding, *, planes=False, known_finite=False, **kwargs):
    with ShardWriter(
        root,
        provenance=provenance(),
        hidden_width=WIDTH,
        topk=TOPK,
        hidden_encoding=encoding,
        shard_bytes=12_000,
        **kwargs,
    ) as w:
        for sample in samples:
            w.write(as_planes(sample) if planes else sample, hidden_known_finite=known_finite)
    return json.load(open(os.path.join(root, MANIFEST)))


def stored_files(root, manifest) -> dict:
    names = [e[key] for e in manifest["shards"] for key in ("file", "index_file")]
    return {name: open(os.path.join(root, name), "rb").read() for name in names}


def shard_entries(manifest) -> list:
    return [{k: v for k, v in e.items() if k != "written"} for e in manifest["shards"]]


@pytest.mark.parametrize("encoding", ["planes", "plain"])
@pytest.mark.parametrize("known_finite", [False, True])
def test_planes_input_stores_the_same_bytes_as_uint16_input(tmp_path, encoding, known_finite):
    samples = [make_sample(i) for i in range(14)]
    reference = write_all(tmp_path / "u16", samples, encoding)
    planes = write_all(tmp_path / "planes", samples, encoding, planes=True, known_finite=known_finite)
    assert len(reference["shards"]) > 1, "the test should span several shards"
    assert shard_entries(planes) == shard_entries(reference) and planes["counts"] == reference["counts"]
    assert stored_files(tmp_path / "planes", planes) == stored_files(tmp_path / "u16", reference)
    ds = ShardDataset(str(tmp_path / "planes"))
    for i, sample in enumerate(samples):
        assert_same(ds[i], sample)


def test_every_bf16_pattern_survives_the_planes_input(tmp_path):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(-1, WIDTH)
    base = make_sample(0, n_tokens=every.shape[0])
    sample = dataclasses.replace(base, hidden=every)
    reference = write_all(tmp_path / "u16", [sample], "planes", reject_nonfinite=False)
    planes = write_all(tmp_path / "planes", [sample], "planes", planes=True, reject_nonfinite=False)
    assert stored_files(tmp_path / "planes", planes) == stored_files(tmp_path / "u16", reference)
    assert_same(ShardDataset(str(tmp_path / "planes"))[0], sample)


@pytest.mark.parametrize("pattern", [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x7F81])  # NaNs, +Inf, -Inf, signalling NaN
def test_nonfinite_planes_are_refused_and_nothing_is_written(tmp_path, pattern):
    good = make_sample(1)
    hidden = good.hidden.copy()
    hidden[2, 5] = pattern
    bad = as_planes(dataclasses.replace(good, hidden=hidden))
    with ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK) as w:
        with pytest.raises(ValueError, match=rf"{bad.sample_id}.*'hidden'.*1 NaN/Inf"):
            w.write(bad)
        w.write(as_planes(make_sample(2)))
    ds = ShardDataset(str(tmp_path / "ds"))
    assert len(ds) == 1 and ds[0].sample_id == make_sample(2).sample_id


def test_known_finite_skips_only_the_hidden_scan(tmp_path):
    sample = make_sample(3)
    logprobs = sample.topk_logprobs.copy()
    logprobs[0, -1] = np.nan
    hidden = sample.hidden.copy()
    hidden[0, 0] = 0x7FC0
    with ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK) as w:
        with pytest.raises(ValueError, match="'topk_logprobs'.*NaN/Inf"):
            w.write(as_planes(dataclasses.replace(sample, topk_logprobs=logprobs)), hidden_known_finite=True)
        with pytest.raises(ValueError, match="'topk_ids'"):
            w.write(as_planes(dataclasses.replace(sample, topk_ids=sample.topk_ids + 10_000)), hidden_known_finite=True)
        # The caller's word is taken for the hidden states (extract vouches with the GPU's flags).
        w.write(dataclasses.replace(sample, hidden=hidden), hidden_known_finite=True)
    [stored] = list(ShardDataset(str(tmp_path / "ds")))
    assert stored.hidden[0, 0] == 0x7FC0


@pytest.mark.parametrize(
    "make, field, words",
    [
        (lambda p: HiddenPlanes(p.hi.astype(np.uint16), p.lo), "hidden.hi", "dtype uint8"),
        (lambda p: HiddenPlanes(p.hi, p.lo[:-1]), "hidden", "differ in shape"),
        (lambda p: HiddenPlanes(p.hi[:, :-1], p.lo[:, :-1]), "hidden", "width"),
        (lambda p: HiddenPlanes(p.hi[:-1], p.lo[:-1]), "hidden", "positions"),
        (lambda p: HiddenPlanes(p.hi, p.lo.tolist()), "hidden.lo", "numpy array"),
    ],
)
def test_bad_planes_name_the_field(tmp_path, make, field, words):
    sample = as_planes(make_sample(4))
    bad = dataclasses.replace(sample, hidden=make(sample.hidden))
    with (
        ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK) as w,
        pytest.raises(ValueError, match=rf"field '{field}'.*{words}"),
    ):
        w.write(bad)
    assert len(ShardDataset(str(tmp_path / "ds"))) == 0


def test_blocked_nonfinite_count_equals_its_definition():
    rng = np.random.default_rng(0)
    hidden = rng.integers(0, 1 << 16, (3, _SCAN_BLOCK + 77), dtype=np.uint32).astype(np.uint16)
    hidden[hidden & BF16_EXPONENT_MASK == BF16_EXPONENT_MASK] = 0  # no accidental hits
    flat = hidden.reshape(-1)
    for i in (0, _SCAN_BLOCK - 1, _SCAN_BLOCK, 2 * _SCAN_BLOCK + 5, flat.size - 1):  # block edges
        flat[i] = 0x7FC0
    expected = int(np.count_nonzero((hidden & BF16_EXPONENT_MASK) == BF16_EXPONENT_MASK))
    assert expected == 5
    assert count_nonfinite_bf16(hidden) == expected
    assert count_nonfinite_bf16(hidden.T) == expected  # not contiguous
    assert count_nonfinite_bf16(hidden[:0]) == 0
    assert count_nonfinite_planes(*split_planes(hidden)) == expected
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert count_nonfinite_bf16(every) == count_nonfinite_planes(*split_planes(every)) == 256  # 2 signs x 128 mantissas
