"""Round trip: what the writer stores, the reader returns bit-exactly, by position, by id and in
iteration order, for both hidden encodings; the length index matches without opening shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shards import ShardDataset, ShardWriter, sample_from_torch
from shards.schema import join_planes, split_planes
from tests.shards.synth import TOPK, WIDTH, assert_same, make_sample, provenance


def write_dataset(root, n, encoding="planes", shard_bytes=1 << 20, **kwargs):
    with ShardWriter(
        root,
        provenance=provenance(),
        hidden_width=WIDTH,
        topk=TOPK,
        hidden_encoding=encoding,
        shard_bytes=shard_bytes,
        **kwargs,
    ) as w:
        for i in range(n):
            w.write(make_sample(i))
    return root


@pytest.mark.parametrize("encoding", ["plain", "planes"])
def test_round_trip_is_bit_exact_for_every_field(tmp_path, encoding):
    root = write_dataset(tmp_path / "ds", 12, encoding, shard_bytes=20_000)
    ds = ShardDataset(str(root))
    assert len(ds) == 12 and ds.encoding == encoding
    assert len(ds.shards) > 1, "the test should span several shards"
    for i in range(12):
        assert_same(ds[i], make_sample(i))


def test_byte_planes_are_lossless_on_every_bf16_pattern():
    every_pattern = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    hi, lo = split_planes(every_pattern)
    assert hi.dtype == lo.dtype == np.uint8
    assert np.array_equal(join_planes(hi, lo), every_pattern)


def test_random_access_by_position_and_id(tmp_path):
    root = write_dataset(tmp_path / "ds", 30, shard_bytes=8_000)
    ds = ShardDataset(str(root))
    order = np.random.default_rng(1).permutation(30)
    for i in order:
        assert_same(ds[int(i)], make_sample(int(i)))
    assert_same(ds[-1], make_sample(29))
    wanted = make_sample(17)
    assert_same(ds.get(wanted.sample_id), wanted)
    with pytest.raises(KeyError, match="not-an-id"):
        ds.get("not-an-id")
    with pytest.raises(IndexError):
        ds[30]


def test_iteration_order_is_stable_and_matches_indexing(tmp_path):
    root = write_dataset(tmp_path / "ds", 25, shard_bytes=6_000)
    first = [s.sample_id for s in ShardDataset(str(root))]
    second = [s.sample_id for s in ShardDataset(str(root))]
    assert first == second == [make_sample(i).sample_id for i in range(25)]
    assert ShardDataset(str(root)).index.column("sample_id").to_pylist() == first


def test_index_and_lengths_come_from_index_files_only(tmp_path):
    root = write_dataset(tmp_path / "ds", 20, shard_bytes=6_000)
    for shard in root.glob("shard-*[0-9].arrow"):
        shard.unlink()  # the index must not need the shard files
    ds = ShardDataset(str(root))
    expected = [make_sample(i) for i in range(20)]
    assert ds.n_tokens.dtype == np.int32
    assert ds.n_tokens.tolist() == [s.n_tokens for s in expected]
    index = ds.index
    assert index.column_names == ["sample_id", "n_tokens", "n_loss_tokens", "shard", "row"]
    assert index.column("n_loss_tokens").to_pylist() == [s.n_loss_tokens for s in expected]
    locations = list(zip(index.column("shard").to_pylist(), index.column("row").to_pylist(), strict=True))
    assert locations == [ds.locate(i) for i in range(20)]
    with pytest.raises(FileNotFoundError, match="shard-00000.arrow"):
        ds[0]


@pytest.mark.parametrize("encoding", ["plain", "planes"])
def test_torch_view_has_contract_dtypes_and_values(tmp_path, encoding):
    root = write_dataset(tmp_path / "ds", 3, encoding)
    ds = ShardDataset(str(root))
    t = ds.torch(1)
    sample = make_sample(1)
    assert t["input_ids"].dtype == torch.int32 and t["topk_ids"].dtype == torch.int32
    assert t["loss_mask"].dtype == torch.bool and t["topk_logprobs"].dtype == torch.float32
    assert t["hidden"].dtype == torch.bfloat16 and tuple(t["hidden"].shape) == sample.hidden.shape
    assert np.array_equal(t["hidden"].view(torch.uint16).numpy(), sample.hidden)
    assert np.array_equal(t["loss_mask"].numpy(), sample.loss_mask.astype(bool))
    # The bf16 values are the float32 values the bit patterns were cut from.
    expected = torch.from_numpy((sample.hidden.astype(np.uint32) << 16).view(np.float32))
    assert torch.equal(t["hidden"].float(), expected)


def test_sample_from_torch_round_trips_bf16_bits(tmp_path):
    hidden = torch.randn(5, WIDTH).to(torch.bfloat16)
    sample = sample_from_torch(
        "s0",
        torch.arange(5),
        torch.ones(5, dtype=torch.bool),
        hidden,
        torch.zeros(5, TOPK, dtype=torch.int64),
        torch.zeros(5, TOPK),
    )
    with ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK) as w:
        w.write(sample)
    back = ShardDataset(str(tmp_path / "ds")).torch(0)["hidden"]
    assert torch.equal(back, hidden)
    with pytest.raises(ValueError, match="'hidden'.*bfloat16"):
        sample_from_torch(
            "s1", torch.arange(5), torch.ones(5), hidden.float(), torch.zeros(5, TOPK), torch.zeros(5, TOPK)
        )


def test_empty_dataset_reads_as_empty(tmp_path):
    with ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK):
        pass
    ds = ShardDataset(str(tmp_path / "ds"))
    assert len(ds) == 0 and list(ds) == [] and ds.index.num_rows == 0 and ds.n_tokens.size == 0
    assert ds.manifest["complete"] is True


@pytest.mark.parametrize("encoding", ["plain", "planes"])
def test_torch_decodes_hidden_straight_into_a_batch_buffer(tmp_path, encoding):
    root = write_dataset(tmp_path / "ds", 4, encoding)
    ds = ShardDataset(str(root))
    batch_BSW = torch.full((2, 50, WIDTH), 7.0, dtype=torch.bfloat16)
    t = ds.torch(2, hidden_out=batch_BSW[1])
    T = make_sample(2).n_tokens
    assert t["hidden"].data_ptr() == batch_BSW[1].data_ptr() and t["hidden"].shape == (T, WIDTH)
    assert np.array_equal(batch_BSW[1, :T].view(torch.uint16).numpy(), make_sample(2).hidden)
    assert bool((batch_BSW[1, T:] == 7.0).all()) and bool((batch_BSW[0] == 7.0).all()), "wrote outside its rows"
    with pytest.raises(ValueError, match="hidden_out"):
        ds.torch(2, hidden_out=torch.zeros(3, WIDTH, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="hidden_out"):
        ds.torch(2, hidden_out=torch.zeros(50, WIDTH))


def test_tensors_from_torch_are_private_to_the_caller(tmp_path):
    root = write_dataset(tmp_path / "ds", 2, "plain")
    ds = ShardDataset(str(root))
    t = ds.torch(0)
    t["hidden"].fill_(0)
    t["topk_ids"].fill_(0)
    assert_same(ds[0], make_sample(0))


def test_dataset_survives_pickling_for_worker_processes(tmp_path):
    import pickle

    root = write_dataset(tmp_path / "ds", 5, shard_bytes=3_000)
    ds = ShardDataset(str(root), verify_checksums=True)
    assert_same(ds[1], make_sample(1))  # opens a reader and a lock that must not be pickled
    clone = pickle.loads(pickle.dumps(ds))
    for i in range(5):
        assert_same(clone[i], make_sample(i))
    assert clone.index.num_rows == 5
