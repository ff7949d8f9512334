"""The data stream over real shards: coverage, batch contents, exact resume, refusals, holdout,
corrupt shards, prefetch, and the data plan. A small dataset (W = 8, k = 4) is written once with
`shards.ShardWriter`; sample `n` starts with token `n`, so every sample is distinguishable."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from common.config import ConfigError, load_config
from common.hashing import sample_id as make_sample_id
from shards import TAP_MEANING, Sample, ShardDataset, ShardWriter
from train.data import Batch, DataConfig, DataLoadError, DataStream, collate
from train.samples import holdout_mask, is_holdout

W, K, VOCAB, N_SAMPLES = 8, 4, 1000, 150


def provenance() -> dict:
    return {
        "target": {
            "name_or_path": "tiny-target",
            "revision": "r1",
            "config_hash": "cfg123",
            "architecture": "Qwen3ForCausalLM",
            "model_type": "qwen3",
            "num_layers": 4,
            "hidden_size": 4,
            "vocab_size": VOCAB,
        },
        "tokenizer": {
            "hash": "tok123",
            "chat_template_hash": "tpl",
            "mask_token_id": 999,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
        "taps": {"layer_ids": [1, 2], "meaning": TAP_MEANING},
        "dtype": "bfloat16",
        "topk": K,
        "max_len": 300,
    }


def make_sample(n: int, T: int, rng: np.random.Generator) -> Sample:
    input_ids = rng.integers(0, VOCAB, T).astype(np.int32)
    input_ids[0] = n
    loss_mask = (np.arange(T) >= T // 3).astype(np.uint8)
    hidden = (rng.integers(0, 1 << 16, (T, W)) & 0x3FFF).astype(np.uint16)  # finite bf16 bit patterns
    topk_logprobs = -np.sort(rng.random((T, K)).astype(np.float32), axis=1)
    return Sample(
        make_sample_id(input_ids, loss_mask),
        input_ids,
        loss_mask,
        hidden,
        rng.integers(0, VOCAB, (T, K)).astype(np.int32),
        topk_logprobs,
    )


def write_dataset(root, n_samples=N_SAMPLES, seed=0) -> None:
    rng = np.random.default_rng(seed)
    # A skewed mix like the real one: mostly short, a tail of long samples.
    lengths = np.where(rng.random(n_samples) < 0.75, rng.integers(2, 60, n_samples), rng.integers(120, 300, n_samples))
    with ShardWriter(str(root), provenance=provenance(), hidden_width=W, topk=K, shard_bytes=40_000) as writer:
        for n, T in enumerate(lengths):
            writer.write(make_sample(n, int(T), rng))


@pytest.fixture(scope="module")
def shards_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_dataset(root)
    return str(root)


def config(root, **overrides) -> DataConfig:
    values = dict(
        shards=root,
        holdout_fraction=0.1,
        boundaries=[30, 100],
        token_budget=1200,
        seed=3,
        prefetch_threads=2,
        prefetch_depth=3,
    )
    values.update(overrides)
    return DataConfig(**values)


def take(stream, n) -> list[Batch]:
    return [next(stream) for _ in range(n)]


def assert_same_batches(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.sample_ids == y.sample_ids and x.bucket == y.bucket and x.epoch == y.epoch and x.state == y.state
        for name in Batch.TENSOR_FIELDS:
            assert torch.equal(getattr(x, name), getattr(y, name)), name


# ----------------------------------------------------------------------------------------------
# Coverage and contents


def test_one_epoch_yields_every_training_sample_once(shards_root):
    ds = ShardDataset(shards_root)
    all_ids = ds.index.column("sample_id").to_pylist()
    expected = {s for s in all_ids if not is_holdout(s, 0.1)}
    assert 0 < len(expected) < len(all_ids)  # the holdout takes some
    with DataStream(config(shards_root)) as stream:
        batches = take(stream, stream.steps_per_epoch)
        seen = [s for b in batches for s in b.sample_ids]
        assert len(seen) == len(set(seen)) and set(seen) == expected
        assert {b.epoch for b in batches} == {0}
        assert [b.state["batch"] for b in batches[:-1]] == list(range(1, stream.steps_per_epoch))
        assert batches[-1].state["epoch"] == 1 and batches[-1].state["batch"] == 0
        assert next(stream).epoch == 1


def test_batches_hold_the_samples_padded_on_the_right(shards_root):
    ds = ShardDataset(shards_root)
    position = {s: i for i, s in enumerate(ds.index.column("sample_id").to_pylist())}
    budget = 1200
    with DataStream(config(shards_root, token_budget=budget)) as stream:
        for batch in take(stream, stream.steps_per_epoch):
            B, S = batch.input_ids.shape
            assert budget >= B * S
            assert batch.input_ids.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool
            assert batch.hidden.dtype == torch.bfloat16 and batch.hidden.shape == (B, S, W)
            assert batch.topk_ids.dtype == torch.int64 and batch.topk_logprobs.dtype == torch.float32
            assert batch.lengths.dtype == torch.int64 and int(batch.lengths.max()) == S
            for row, sid in enumerate(batch.sample_ids):
                sample, T = ds.torch(position[sid]), int(batch.lengths[row])
                assert torch.equal(batch.input_ids[row, :T], sample["input_ids"].long())
                assert torch.equal(batch.loss_mask[row, :T], sample["loss_mask"])
                assert torch.equal(batch.hidden[row, :T], sample["hidden"])
                assert torch.equal(batch.topk_ids[row, :T], sample["topk_ids"].long())
                assert torch.equal(batch.topk_logprobs[row, :T], sample["topk_logprobs"])
                assert not batch.input_ids[row, T:].any() and not batch.loss_mask[row, T:].any()
                assert not batch.hidden[row, T:].any() and not batch.topk_ids[row, T:].any()


def test_lengths_come_from_the_index_not_the_hidden_states(shards_root):
    class NoReads(ShardDataset):
        def torch(self, i):
            raise AssertionError("planning must not read samples")

        def __getitem__(self, i):
            raise AssertionError("planning must not read samples")

    stream = DataStream(config(shards_root), NoReads(shards_root))
    plan = stream.data_plan()
    assert plan["steps_per_epoch"] == stream.steps_per_epoch > 0


def test_an_incompatible_dataset_is_refused_before_planning(shards_root):
    with pytest.raises(
        ValueError, match=r"provenance.target.vocab_size' = 1000 but the drafter config expects vocab_size=248320"
    ):
        DataStream(config(shards_root), expected={"layer_ids": [1, 2], "vocab_size": 248320})
    DataStream(
        config(shards_root), expected={"layer_ids": [1, 2], "vocab_size": VOCAB, "hidden_width": W, "topk": K}
    ).close()


def test_prefetch_settings_do_not_change_the_stream(shards_root):
    with (
        DataStream(config(shards_root, prefetch_threads=1, prefetch_depth=1)) as one,
        DataStream(config(shards_root, prefetch_threads=4, prefetch_depth=8)) as many,
    ):
        n = one.steps_per_epoch + 3
        assert_same_batches(take(one, n), take(many, n))


def test_another_epoch_or_seed_gives_another_order(shards_root):
    with DataStream(config(shards_root)) as a, DataStream(config(shards_root, seed=4)) as b:
        n = a.steps_per_epoch
        first = take(a, n)
        second = take(a, n)
        other_seed = take(b, n)

        def ids(batches):
            return [s for x in batches for s in x.sample_ids]

        assert sorted(ids(first)) == sorted(ids(second)) and ids(first) != ids(second)
        assert ids(first) != ids(other_seed)


# ----------------------------------------------------------------------------------------------
# Resume


@pytest.mark.parametrize("consumed", ["mid", "end"])
def test_resume_gives_exactly_the_next_batches(shards_root, consumed):
    with DataStream(config(shards_root)) as original:
        steps = original.steps_per_epoch
        m = 3 if consumed == "mid" else steps - 2  # "end": the next batches cross into epoch 1
        state = take(original, m)[-1].state
        assert state == original.state_dict()
        expected = take(original, 5)
    saved = json.loads(json.dumps(state))  # what a checkpoint stores
    with DataStream(config(shards_root)) as resumed:
        resumed.load_state_dict(saved)
        assert_same_batches(take(resumed, 5), expected)
    if consumed == "end":
        assert [b.epoch for b in expected] == [0, 0, 1, 1, 1]


def test_resume_after_iterating_and_in_the_same_stream(shards_root):
    with DataStream(config(shards_root)) as stream:
        start = stream.state_dict()
        first = take(stream, 4)
        stream.load_state_dict(start)  # rewinding drops whatever was prefetched
        assert_same_batches(take(stream, 4), first)
        assert stream.progress() == pytest.approx(4 / stream.steps_per_epoch)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(seed=4), "seed"),
        (dict(token_budget=1500), "token_budget"),
        (dict(boundaries=[40, 100]), "boundaries"),
        (dict(max_batch_samples=3), "max_batch_samples"),
        (dict(holdout_fraction=0.2), "selection_digest"),
    ],
)
def test_a_state_from_another_schedule_is_refused(shards_root, change, field):
    with DataStream(config(shards_root)) as stream:
        state = take(stream, 2)[-1].state
    with (
        DataStream(config(shards_root, **change)) as other,
        pytest.raises(ValueError, match=f"data state: field '{field}'"),
    ):
        other.load_state_dict(state)


def test_a_state_from_another_dataset_is_refused(shards_root, tmp_path):
    write_dataset(tmp_path, n_samples=40, seed=1)
    with DataStream(config(shards_root)) as stream:
        state = stream.state_dict()
    with DataStream(config(str(tmp_path))) as other, pytest.raises(ValueError, match="another dataset"):
        other.load_state_dict(state)


def test_malformed_states_are_refused(shards_root):
    with DataStream(config(shards_root)) as stream:
        good = stream.state_dict()
        with pytest.raises(ValueError, match="version"):
            stream.load_state_dict({**good, "version": 99})
        with pytest.raises(ValueError, match="outside"):
            stream.load_state_dict({**good, "batch": stream.steps_per_epoch})
        with pytest.raises(ValueError, match="plan of epoch 0"):
            stream.load_state_dict({**good, "plan_digest": "0" * 16})
        with pytest.raises(ValueError, match="field 'seed' is missing"):
            stream.load_state_dict({k: v for k, v in good.items() if k != "seed"})


# ----------------------------------------------------------------------------------------------
# Selection: holdout, oversize, max_samples


def test_holdout_is_a_stable_hash_of_the_id():
    ids = [f"id-{n}" for n in range(20_000)]
    small, large = holdout_mask(ids, 0.05), holdout_mask(ids, 0.10)
    assert abs(small.mean() - 0.05) < 0.01 and abs(large.mean() - 0.10) < 0.01
    assert not (small & ~large).any()  # a larger fraction holds out a superset
    assert [is_holdout(s, 0.05) for s in ids[:200]] == small[:200].tolist()
    assert not holdout_mask(ids, 0.0).any() and holdout_mask(ids, 1.0).all()


def test_oversize_samples_fail_or_are_skipped(shards_root):
    with pytest.raises(ValueError, match=r"longer than data.token_budget=200 .*data.oversize='skip'"):
        DataStream(config(shards_root, token_budget=200, boundaries=[30]))
    with DataStream(config(shards_root, token_budget=200, boundaries=[30], oversize="skip")) as stream:
        plan = stream.data_plan()
        assert plan["excluded"]["oversize"] > 0 and int(stream.lengths.max()) <= 200
        batches = take(stream, stream.steps_per_epoch)
        assert max(b.padded_tokens for b in batches) <= 200


def test_max_samples_takes_a_nested_subset(shards_root):
    with (
        DataStream(config(shards_root, max_samples=40)) as small,
        DataStream(config(shards_root, max_samples=60)) as large,
    ):
        assert len(small.sample_ids) == 40 and len(large.sample_ids) == 60
        assert set(small.sample_ids) < set(large.sample_ids)
        assert small.data_plan()["excluded"]["max_samples"] > 0


def test_min_loss_tokens_leaves_out_short_responses(shards_root):
    ds = ShardDataset(shards_root)
    with DataStream(config(shards_root, min_loss_tokens=20)) as stream:
        loss_tokens = dict(
            zip(ds.index.column("sample_id").to_pylist(), ds.index.column("n_loss_tokens").to_pylist(), strict=True)
        )
        assert min(loss_tokens[s] for s in stream.sample_ids) >= 20
        assert stream.data_plan()["excluded"]["min_loss_tokens"] > 0


# ----------------------------------------------------------------------------------------------
# Corrupt shards and errors in the threads


@pytest.fixture
def corrupt_root(shards_root, tmp_path):
    shutil.copytree(shards_root, tmp_path, dirs_exist_ok=True)
    ds = ShardDataset(str(tmp_path))
    entry = ds.manifest["shards"][1]
    path = os.path.join(str(tmp_path), entry["file"])
    with open(path, "r+b") as f:
        f.truncate(entry["bytes"] // 2)
    ids_in_shard = [
        s
        for s, shard in zip(ds.index.column("sample_id").to_pylist(), ds.index.column("shard").to_pylist(), strict=True)
        if shard == 1
    ]
    return str(tmp_path), entry["file"], set(ids_in_shard)


def test_a_corrupt_shard_fails_naming_sample_and_file(corrupt_root):
    root, shard_file, bad_ids = corrupt_root
    with DataStream(config(root, holdout_fraction=0.0)) as stream, pytest.raises(DataLoadError) as err:
        take(stream, stream.steps_per_epoch)
    message = str(err.value)
    assert shard_file in message and any(s in message for s in bad_ids)
    # Damage is a data error (the commands' one line, exit 2) that says how to see all of it.
    assert isinstance(err.value, ValueError) and f"python -m shards verify {root}" in message
    assert "\n" not in message and err.value.__cause__ is None


def test_missing_index_files_are_damage_named_at_start(shards_root, tmp_path):
    shutil.copytree(shards_root, tmp_path, dirs_exist_ok=True)
    for index in tmp_path.glob("*.index.arrow"):
        index.unlink()
    with pytest.raises(DataLoadError, match="index file listed in the manifest is missing; `python -m shards verify"):
        DataStream(config(str(tmp_path)))


def test_a_corrupt_shard_is_skipped_counted_and_logged(corrupt_root, caplog):
    root, shard_file, bad_ids = corrupt_root
    caplog.set_level(logging.WARNING, logger="train.data")
    # One sample per batch, so some batches consist only of unreadable samples.
    with DataStream(config(root, holdout_fraction=0.0, on_corrupt="skip", max_batch_samples=1)) as stream:
        seen = []
        for _ in range(stream.steps_per_epoch):  # batches of only unreadable samples are skipped
            batch = next(stream)
            if batch.epoch == 0:
                seen += batch.sample_ids
            if batch.state["epoch"] == 1:
                break
        else:
            pytest.fail("epoch 0 did not end within steps_per_epoch batches")
        assert len(seen) == len(set(seen)) and set(seen) == set(stream.sample_ids) - bad_ids
        assert stream.corrupt_samples == {shard_file: bad_ids}
    assert any(shard_file in r.getMessage() for r in caplog.records)


def test_a_bug_in_a_thread_is_not_taken_for_corruption(shards_root):
    class Buggy(ShardDataset):
        def torch(self, i):
            raise RuntimeError("boom")

    ds = Buggy(shards_root)
    with DataStream(config(shards_root, on_corrupt="skip"), ds) as stream:
        first_id = stream.sample_ids[int(stream.plan(0).batches[0][0])]
        with pytest.raises(RuntimeError, match="boom") as err:
            next(stream)
    note = " ".join(getattr(err.value, "__notes__", []))
    assert first_id in note and "shard-" in note and not stream.corrupt_samples


def test_wait_time_covers_blocking_reads(shards_root):
    gate = threading.Event()

    class Slow(ShardDataset):
        def torch(self, i):
            gate.wait()
            return super().torch(i)

    with DataStream(config(shards_root), Slow(shards_root)) as stream:
        threading.Timer(0.2, gate.set).start()
        next(stream)
        assert stream.last_wait >= 0.2  # a lower bound set by the gate, not a speed claim
        next(stream)
        assert stream.total_wait >= stream.last_wait + 0.2


# ----------------------------------------------------------------------------------------------
# Data plan, collate, config


def test_data_plan_describes_the_epoch(shards_root):
    with DataStream(config(shards_root)) as stream:
        plan = json.loads(json.dumps(stream.data_plan()))
        rows = plan["buckets"]
        assert plan["boundaries"] == [30, 100] and len(rows) == 3 and plan["token_budget"] == 1200
        assert sum(r["samples"] for r in rows) == plan["samples"] == len(stream.sample_ids)
        assert sum(r["tokens"] for r in rows) == plan["tokens"] == int(stream.lengths.sum())
        assert sum(r["batches_per_epoch"] for r in rows) == plan["steps_per_epoch"] == stream.steps_per_epoch
        assert 0 < plan["planned_padding_efficiency"] <= 1 and 0 < plan["planned_budget_use"] <= 1
        batches = take(stream, stream.steps_per_epoch)
        per_bucket = np.bincount([b.bucket for b in batches], minlength=3).tolist()
        assert per_bucket == [r["batches_per_epoch"] for r in rows]
        real = sum(b.real_tokens for b in batches)
        padded = sum(b.padded_tokens for b in batches)
        assert plan["planned_padding_efficiency"] == pytest.approx(real / padded)


def test_quantile_boundaries_when_none_are_configured(shards_root):
    with DataStream(config(shards_root, boundaries=None, num_buckets=4)) as stream:
        plan = stream.data_plan()
        assert plan["boundaries_from"] == "quantiles of 4" and len(plan["boundaries"]) == 3
        assert max(r["samples"] for r in plan["buckets"]) <= 0.4 * plan["samples"]


def test_collate_pads_right_with_zeros():
    def sample(T, value):
        return {
            "input_ids": torch.full((T,), value, dtype=torch.int32),
            "loss_mask": torch.ones(T, dtype=torch.bool),
            "hidden": torch.full((T, 3), float(value), dtype=torch.bfloat16),
            "topk_ids": torch.full((T, 2), value, dtype=torch.int32),
            "topk_logprobs": torch.full((T, 2), -1.0),
        }

    batch = collate([sample(2, 5), sample(4, 7)], ["a", "b"], bucket=1, epoch=0, state={}, pin=False)
    assert batch.input_ids.tolist() == [[5, 5, 0, 0], [7, 7, 7, 7]]
    assert batch.loss_mask.tolist() == [[True, True, False, False], [True] * 4]
    assert batch.hidden[0, 2:].abs().sum() == 0 and batch.hidden[1].float().mean() == 7
    assert batch.lengths.tolist() == [2, 4] and batch.real_tokens == 6 and batch.padded_tokens == 8


def test_data_config_as_a_nested_table():
    from dataclasses import dataclass

    from common.config import knob

    @dataclass
    class Train:
        data: DataConfig = knob(factory=DataConfig, help="data")

    cfg = load_config(Train, None, ["data.boundaries=[512,1024]", "data.on_corrupt=skip", "data.token_budget=8192"])
    assert cfg.data.boundaries == [512, 1024] and cfg.data.on_corrupt == "skip" and cfg.data.token_budget == 8192
    with pytest.raises(ConfigError, match="data.boundaries"):
        load_config(Train, None, ["data.boundaries=[1024,512]"])
    with pytest.raises(ConfigError, match="data.prefetch_depth"):
        load_config(Train, None, ["data.prefetch_threads=8", "data.prefetch_depth=2"])
    with pytest.raises(ConfigError, match="data.on_corrupt"):
        load_config(Train, None, ["data.on_corrupt=ignore"])


# ----------------------------------------------------------------------------------------------
# The mask token never occurs in the data


def test_a_mask_token_the_shards_hold_is_refused_unless_their_provenance_vouches_for_it(shards_root):
    from train.mask_token import MaskOrigin, MaskTokenChoice, check_mask_token_absent

    ds = ShardDataset(shards_root)
    held = int(ds[3].input_ids[1])
    with pytest.raises(ValueError, match=f"config key 'model.mask_token_id' = {held} occurs in the shards") as err:
        check_mask_token_absent(ds, MaskTokenChoice(held, MaskOrigin.CONFIG))
    assert ds[3].sample_id in str(err.value)
    with pytest.raises(ValueError, match="the target tokenizer's mask_token"):
        check_mask_token_absent(ds, MaskTokenChoice(held, MaskOrigin.TOKENIZER))
    check_mask_token_absent(ds, MaskTokenChoice(VOCAB + 5, MaskOrigin.CONFIG))  # no sample holds it
    check_mask_token_absent(ds, MaskTokenChoice(held, MaskOrigin.SHARDS))  # extraction rejected holders
    everyone = [ds[i].sample_id for i in range(len(ds)) if (ds[i].input_ids == held).any()]
    assert ds.samples_holding(held, limit=len(ds)) == everyone  # exact, in dataset order
