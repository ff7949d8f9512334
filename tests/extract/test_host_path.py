"""The extraction's host path (`extract.host_path.HostPath`: byte planes laid out on the device, samples
handed to the writer as views of the pinned buffer, the hidden NaN/Inf scan left to the device's
flags) stores exactly the bytes of the plain path: a synchronous `capture` of the same
micro-batches, each sample copied out as uint16, and `ShardWriter.write` scanning and splitting on
the host. Non-finite samples are still rejected, counted and never handed to the writer. A buffer
goes back to the pool once, only after its samples are written, also when the writer fails."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from common.hashing import sample_id
from extract import corpus as C
from extract.batching import BufferPool, collate_right_padded, plan_micro_batches
from extract.capture import InFlight, capture
from extract.corpus.windows import read_windows
from extract.host_path import HostPath
from extract.ranks import Ranks
from extract.sink import Progress, RejectLog
from shards import HiddenPlanes, ShardDataset, ShardWriter, verify_dataset
from target.load import reach_text_parts
from tests.extract.conftest import build_model, mixed_corpus, write_lines
from tests.extract.test_pipeline import make_config, run


def plain_path_dataset(cfg, target, root) -> dict:
    """What the plain path stores for the pipeline's own micro-batches (same windows, same plan,
    same padding, same order of writes), under rank 0's file names; returns its manifest."""
    builder = C.SampleBuilder(
        target.tokenizer,
        C.SamplePolicy(
            cfg.max_len, cfg.length_policy, cfg.min_loss_tokens, cfg.chat_template_kwargs, target.vocab_size
        ),
    )
    tokenizer = target.tokenizer
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    names = Ranks().names
    from shards import Sample

    with ShardWriter(
        root,
        provenance={},
        hidden_width=len(cfg.layer_ids) * target.hidden_size,
        topk=cfg.topk,
        shard_bytes=cfg.shard_bytes,
        hidden_encoding=cfg.hidden_encoding,
        manifest_name=names["manifest"],
        shard_prefix=names["prefix"],
        hidden_split=len(cfg.layer_ids),
    ) as writer:  # extract's default: one piece per tap
        for window in read_windows(cfg, C.find_corpus(cfg.corpus), builder, Ranks()):
            lengths = [s.n_tokens for s in window.samples]
            for plan in plan_micro_batches(lengths, cfg.tokens_per_batch):
                samples = [window.samples[i] for i in plan]
                ids_BT, batch_lengths = collate_right_padded([torch.from_numpy(s.input_ids) for s in samples], pad_id)
                got = capture(target, ids_BT, batch_lengths, cfg.layer_ids, cfg.topk, cfg.logits_chunk)
                offset = 0
                for b, s in enumerate(samples):
                    L = s.n_tokens
                    hidden = (
                        torch.cat([tap[b, :L] for tap in got.taps], dim=-1)
                        .to(torch.bfloat16)
                        .view(torch.uint16)
                        .numpy()
                        .copy()
                    )
                    ids, logprobs = (
                        got.topk_ids[offset : offset + L].numpy(),
                        got.topk_logprobs[offset : offset + L].numpy(),
                    )
                    writer.write(Sample(s.sample_id, s.input_ids, s.loss_mask, hidden, ids.copy(), logprobs.copy()))
                    offset += L
    return json.load(open(os.path.join(root, names["manifest"])))


def files_of(root, manifest) -> dict:
    return {
        e[k]: open(os.path.join(root, e[k]), "rb").read() for e in manifest["shards"] for k in ("file", "index_file")
    }


@pytest.mark.parametrize("encoding", ["planes", "plain"])
def test_pipeline_stores_the_bytes_of_the_plain_path(tmp_path, loaded_target, encoding):
    corpus, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    cfg = make_config(tmp_path / "out", corpus, hidden_encoding=encoding, inflight_batches=2)
    summary = run(cfg, loaded_target)
    assert summary["samples"] == 24
    ours = json.loads((tmp_path / "out" / Ranks().names["manifest"]).read_text())
    plain = plain_path_dataset(cfg, loaded_target, str(tmp_path / "plain"))
    assert len(ours["shards"]) > 1, "the test should span several shards"
    strip = lambda m: [{k: v for k, v in e.items() if k != "written"} for e in m["shards"]]  # noqa: E731
    assert strip(ours) == strip(plain)  # sizes and xxh3 of every shard and index file
    assert files_of(str(tmp_path / "out"), ours) == files_of(str(tmp_path / "plain"), plain)


def test_nonfinite_samples_are_rejected_counted_and_never_written(tmp_path, loaded_target, chat_tokenizer, monkeypatch):
    model = build_model(loaded_target.model.config)
    poison = (
        chat_tokenizer.convert_tokens_to_ids("fox")
        if "fox" in chat_tokenizer.get_vocab()
        else chat_tokenizer.encode(" fox")[0]
    )
    model.model.embed_tokens.weight[poison] = float("nan")

    def record(user: str, assistant: str) -> dict:
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}

    records = [record(f"hello {i}", "the quick dog runs far over the green hill " * (2 + i)) for i in range(5)]
    records[1] = record("hi", "the fox runs far away " * 3)
    records[3] = record("a fox", "the dog runs far away " * 3)
    corpus = write_lines(tmp_path / "c.jsonl", records)
    written = []
    original = ShardWriter.write

    def spy(self, sample, **kwargs):
        written.append((sample.sample_id, isinstance(sample.hidden, HiddenPlanes), kwargs.get("hidden_known_finite")))
        return original(self, sample, **kwargs)

    monkeypatch.setattr(ShardWriter, "write", spy)
    summary = run(make_config(tmp_path / "out", corpus), reach_text_parts(model, chat_tokenizer, path=""))
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["position"] for r in rejects) == [1, 3] and {r["reason"] for r in rejects} == {"nonfinite_hidden"}
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["counts"]["rejected.nonfinite_hidden"] == 2 and manifest["counts"]["samples"] == 3
    assert summary["rejects"] == {"nonfinite_hidden": 2} and summary["this_run"]["coverage_ok"]
    assert {sid for sid, _, _ in written}.isdisjoint({r["sample_id"] for r in rejects})
    assert len(written) == 3 and all(planes and known for _, planes, known in written)  # the optimized path ran
    assert verify_dataset(str(tmp_path / "out")) == []  # decodes every stored value: none is NaN/Inf

    # Non-finite final logits (finite hidden states) are rejected under their own reason.
    model2 = build_model(loaded_target.model.config)
    model2.lm_head.weight[3] = float("inf")
    summary = run(make_config(tmp_path / "out2", corpus), reach_text_parts(model2, chat_tokenizer, path=""))
    assert summary["samples"] == 0 and summary["rejects"] == {"nonfinite_logits": 5}


# ----------------------------------------------------------------------------------------------
# Buffer loans


class Harness:
    """A HostPath over a real writer and a pool of `buffers` host buffers, fed synthetic batches."""

    W_TAPS, H, K = 2, 8, 3

    def __init__(self, root, buffers: int):
        self.writer = ShardWriter(
            root, provenance={}, hidden_width=self.W_TAPS * self.H, topk=self.K, hidden_split=self.W_TAPS
        )
        self.rejects = RejectLog(os.path.join(root, "rejects.jsonl"), 0)
        self.pool = BufferPool(
            buffers,
            n_taps=self.W_TAPS,
            hidden_size=self.H,
            token_budget=64,
            topk=self.K,
            pin=False,
            hidden_split=self.W_TAPS,
        )
        self.path = HostPath(
            self.writer,
            self.rejects,
            self.pool,
            Progress(None, "t", False),
            {"samples": 0, "tokens": 0},
            on_error="skip",
            depth=2,
        )
        self.rng = np.random.default_rng(0)
        self.expected: dict = {}

    def batch(self, position: int, lengths: list[int]):
        host = self.path.acquire()
        B, T = len(lengths), max(lengths)
        planes = host.hidden_view(B, T)
        samples, offset = [], 0
        for b, L in enumerate(lengths):
            ids = self.rng.integers(0, 100, L, dtype=np.int32)
            mask = np.ones(L, dtype=np.uint8)
            tokenized = C.TokenizedSample(position + b, f"t:{position + b}", sample_id(ids, mask), ids, mask)
            bits = self.rng.integers(0, 0x3F00, (L, self.W_TAPS * self.H), dtype=np.uint16)  # finite bf16 patterns
            for plane, values in enumerate(((bits >> 8).astype(np.uint8), (bits & 0xFF).astype(np.uint8))):
                planes[plane, :, b, :L] = torch.from_numpy(values).unflatten(-1, (self.W_TAPS, self.H)).transpose(0, 1)
            host.topk_ids[offset : offset + L] = 1
            host.topk_logprobs[offset : offset + L] = -1.0
            self.expected[tokenized.sample_id] = bits
            samples.append(tokenized)
            offset += L
        host.hidden_ok[:B] = True
        host.logits_ok[:B] = True
        self.path.put_batch(InFlight(host, lengths, T, [], []), samples, [True] * B, 0.0)

    def close(self) -> None:
        self.rejects.close()
        self.writer.close(complete=False)


def test_a_buffer_is_on_loan_until_its_samples_are_written(tmp_path, monkeypatch):
    h = Harness(str(tmp_path), buffers=1)
    free_while_writing = []
    original = ShardWriter.write

    def spy(self, sample, **kwargs):
        free_while_writing.append(h.pool.available())
        return original(self, sample, **kwargs)

    monkeypatch.setattr(ShardWriter, "write", spy)
    for i in range(4):  # with one buffer, each batch waits for the previous one to be written
        h.batch(10 * i, [5, 3])
    h.path.finish()
    h.close()
    assert free_while_writing == [0] * 8 and h.pool.available() == 1
    stored = {s.sample_id: s.hidden for s in ShardDataset(str(tmp_path))}
    assert stored.keys() == h.expected.keys()
    assert all(np.array_equal(stored[k], v) for k, v in h.expected.items())  # nothing overwritten while on loan


def test_every_buffer_comes_back_once_after_a_writer_error(tmp_path, monkeypatch):
    h = Harness(str(tmp_path), buffers=2)
    original, calls = ShardWriter.write, {"n": 0}

    def failing(self, sample, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return original(self, sample, **kwargs)

    monkeypatch.setattr(ShardWriter, "write", failing)
    with pytest.raises(OSError, match="disk full"):
        for i in range(6):
            h.batch(10 * i, [4, 4])
        h.path.finish()
    h.path.abandon()
    h.close()
    assert h.pool.available() == 2  # none lost, none given back twice
    held = [h.pool.acquire(timeout=1), h.pool.acquire(timeout=1)]
    assert held[0] is not held[1]
