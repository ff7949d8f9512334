"""The training loop end to end: a tiny target saved by transformers and tiny synthetic shards
written with `shards.ShardWriter` (no trained model needed).

Proves: every step is logged with exactly the contract's keys; N steps == K steps + stop + resume
(new objects) to N, bit for bit (on the CPU); a planted NaN batch is skipped and logged, N in a row
abort; resume and shard mismatches are refused by name; the run directory holds what the contract
says; the kernel choice is logged once and saved, and an explicit kernel that cannot work is refused.

Device: most tests use device=auto, so on a GPU host they run the CUDA path (bf16 autocast, and
attention=auto must pick sdpa there: the tiny drafter's head_dim 8 is below what flex's CUDA kernel
takes). Tests of properties that hold on one device only say so and pin device=cpu; the CUDA
counterparts are in tests/gpu.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math

import numpy as np
import pytest
import torch

from common.config import load_config
from common.hashing import sample_id, tokenizer_digest
from shards import Sample, ShardWriter
from shards.provenance import Provenance
from train.checkpoint import list_checkpoints, load_checkpoint
from train.config import TrainConfig
from train.loop import TrainingAborted, train
from train.mask_token import MaskOrigin, resolve_mask_token
from train.metrics import SKIP_KEYS, STEP_KEYS, read_metrics
from train.step import lr_at

V, H, LAYERS, TAPS, TOPK = 64, 32, 4, [0, 2], 4
MASK_ID = V - 1


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V - 1)} | {"<|MASK|>": MASK_ID}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, mask_token="<|MASK|>", unk_token="t0")


def write_shards(
    root, target_dir, *, n=24, seed=0, tokenizer_hash="t0", mask_token_id=MASK_ID, nan_at=None, bigram=False
):
    """n tiny samples; `nan_at`: the index of one whose hidden states are all NaN (written unchecked);
    `bigram`: each token follows from the one before by a fixed permutation (else tokens are independent)."""
    prov = {
        "target": {"name_or_path": str(target_dir), "num_layers": LAYERS, "hidden_size": H, "vocab_size": V},
        "tokenizer": {"hash": tokenizer_hash, "mask_token_id": mask_token_id},
        "taps": {"layer_ids": TAPS, "meaning": "id i = output of decoder layer i = hidden_states[i+1]"},
        "dtype": "bfloat16",
        "topk": TOPK,
    }
    rng = np.random.default_rng(seed)
    # Its own generator, so that the samples without `bigram` stay as they were.
    successor = np.random.default_rng(seed + 1).permutation(V - 1)
    with ShardWriter(
        str(root),
        provenance=prov,
        hidden_width=len(TAPS) * H,
        topk=TOPK,
        shard_bytes=1 << 15,
        reject_nonfinite=nan_at is None,
    ) as writer:
        for index in range(n):
            T = int(rng.integers(12, 41))
            ids = rng.integers(0, V - 1, T).astype(np.int32)
            for t in range(1, T if bigram else 0):
                ids[t] = successor[ids[t - 1]]
            lm = (np.arange(T) >= T // 4).astype(np.uint8)
            hidden = (rng.normal(0, 1, (T, len(TAPS) * H)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            if index == nan_at:
                hidden[:] = 0x7FC0  # bf16 NaN
            top1 = np.roll(ids, -1)  # a learnable "target": the next data token
            topk = np.stack([top1] + [rng.integers(0, V - 1, T) for _ in range(TOPK - 1)], 1).astype(np.int32)
            logprobs = -np.sort(rng.exponential(1.0, (T, TOPK)).astype(np.float32), 1)
            writer.write(Sample(sample_id(ids, lm), ids, lm, hidden, topk, logprobs))
    return root


def make_tiny(root, head_dim: int = 8):
    """A tiny Qwen3 target (with tokenizer) under root/target and synthetic shards for it under root/shards."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    _tokenizer().save_pretrained(root / "target")
    digest = tokenizer_digest(AutoTokenizer.from_pretrained(root / "target"))
    write_shards(root / "shards", root / "target", tokenizer_hash=digest)
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def tiny_run_args(tiny, out_dir) -> list[str]:
    """The small training run these tests share (6 steps, a checkpoint every 2), as command-line
    words; later words override earlier ones."""
    return [
        f"out_dir={out_dir}",
        f"data.shards={tiny / 'shards'}",
        "data.token_budget=200",
        "data.num_buckets=2",
        "data.holdout_fraction=0",
        "data.prefetch_threads=1",
        "data.prefetch_depth=2",
        "model.num_layers=1",
        "model.intermediate_size=32",
        "loss.num_anchors=6",
        "optim.max_steps=6",
        "checkpoint.every=2",
        "log.progress=false",
        "optim.lr=3e-3",
    ]


def config(tiny, tmp_path, *overrides) -> TrainConfig:
    return load_config(TrainConfig, None, [*tiny_run_args(tiny, tmp_path / "runs"), "run_name=r", *overrides])


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def test_lr_schedule():
    total, warm = 100, 4
    lrs = [lr_at(s, total, warm, 1.0) for s in range(1, total + 1)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and all(a >= b for a, b in itertools.pairwise(lrs[4:]))
    assert abs(lrs[4 + 48] - 0.5) < 0.02  # halfway through the cosine
    assert 0 < lrs[-1] < 1e-3
    assert lr_at(1, 10, 0, 2.0) == 2.0


def test_every_step_logged_with_the_contract_keys_and_run_files(tiny, tmp_path, caplog):
    cfg = config(tiny, tmp_path)
    with caplog.at_level(logging.INFO, logger="train.kernels"):
        summary = train(cfg)
    run = tmp_path / "runs" / "r"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert set(r) == set(STEP_KEYS)
        assert len(r["acc"]) == 15 and r["tau"] == 1 + r["streak"] and not r["skipped"]
        assert 0 <= r["fetch_frac"] <= 1 and 0 < r["pad_eff"] <= 1 and r["block_tokens"] % 16 == 0
    assert [r["ckpt"] for r in records] == [False, True, False, True, False, True]
    epochs = [r["epoch"] for r in records]
    assert all(e > 0 for e in epochs) and epochs == sorted(epochs)
    assert records[-1]["tokens"] == sum(r["batch_tokens"] for r in records)
    assert [r["lr"] for r in records] == [lr_at(s, 6, round(0.04 * 6), cfg.optim.lr) for s in range(1, 7)]
    assert {p.name for p in run.iterdir()} >= {
        "config.json",
        "run.json",
        "data_plan.json",
        "metrics.jsonl",
        "checkpoints",
    }
    assert load_config(TrainConfig, run / "config.json") == cfg
    info = json.loads((run / "run.json").read_text())
    assert info["manifest_digest"] and info["git_sha"] and info["drafter_config"]["mask_token_id"] == MASK_ID
    assert info["mask_token_source"].startswith("shards provenance")
    # The kernel choice: one log line with its reason, the same in run.json. head_dim 8 rules flex out on both devices.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:")]
    assert len(lines) == 1 and info["kernels"]["attention"] == "sdpa" and info["kernels"]["reason"] in lines[0]
    assert info["kernels"]["device"] == info["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2, 4, 6][-cfg.checkpoint.keep_last :]
    ckpt = load_checkpoint(run / "checkpoints" / "step-00000006")
    assert set(ckpt["model"]) >= {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"}
    assert summary["steps"] == 6 and summary["nonfinite_total"] == 0


def test_resume_is_bit_identical(tiny, tmp_path):
    # On the CPU: bit-identity is a property of the kernels (CUDA reductions with atomics may differ in
    # the last bits between processes); tests/gpu/test_train_cuda.py checks resume on CUDA.
    full = config(tiny, tmp_path, "run_name=full", "device=cpu")
    train(full)
    split = config(tiny, tmp_path, "run_name=split", "stop_after=3", "device=cpu")
    train(split)
    assert len(losses(tmp_path / "runs" / "split")) == 3
    train(config(tiny, tmp_path, "run_name=split", "device=cpu"))  # new objects, resumes from step 3
    a, b = losses(tmp_path / "runs" / "full"), losses(tmp_path / "runs" / "split")
    assert len(a) == 6 and a == b  # exact float equality
    assert a[0] != a[-1]
    final_a = load_checkpoint(tmp_path / "runs" / "full" / "checkpoints" / "step-00000006")
    final_b = load_checkpoint(tmp_path / "runs" / "split" / "checkpoints" / "step-00000006")
    for name, tensor in final_a["model"].items():
        assert torch.equal(tensor, final_b["model"][name]), name
    assert final_a["state"]["data_state"] == final_b["state"]["data_state"]


def test_resume_refuses_another_config_naming_the_keys(tiny, tmp_path):
    train(config(tiny, tmp_path, "stop_after=2"))
    with pytest.raises(ValueError) as err:
        train(config(tiny, tmp_path, "loss.gamma=5", "optim.lr=1e-3"))
    assert "loss.gamma" in str(err.value) and "optim.lr" in str(err.value)
    with pytest.raises(ValueError, match="resume=never"):
        train(config(tiny, tmp_path, "resume=never"))


class Poisoned:
    """A data stream whose batches at the given (1-based) positions carry NaN hidden states."""

    def __init__(self, stream, bad):
        self.stream, self.bad, self.count = stream, set(bad), 0

    def __next__(self):
        batch = next(self.stream)
        self.count += 1
        if self.count in self.bad:
            batch = dataclasses.replace(batch, hidden=torch.full_like(batch.hidden, float("nan")))
        return batch

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _stream(cfg):
    from train.data import DataStream

    return DataStream(cfg.data)


def test_planted_nan_batch_is_skipped_and_logged(tiny, tmp_path):
    cfg = config(tiny, tmp_path)
    summary = train(cfg, stream=Poisoned(_stream(cfg), bad=[3]))
    records = read_metrics(tmp_path / "runs" / "r" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    bad = records[2]
    assert bad["skipped"] and set(bad) == set(STEP_KEYS) | set(SKIP_KEYS)
    assert (
        bad["skip_reason"] == "non-finite loss"
        and bad["loss"] is None
        and len(bad["sample_ids"]) == bad["batch_samples"]
    )
    assert not any(r["skipped"] for r in records if r["step"] != 3)
    assert all(math.isfinite(r["loss"]) for r in records if r["step"] != 3)
    assert summary["nonfinite_total"] == 1
    optimizer_state = load_checkpoint(tmp_path / "runs" / "r" / "checkpoints" / "step-00000006")["optimizer"]["state"]
    assert all(int(s["step"]) == 5 for s in optimizer_state.values())  # 6 steps, one without an update


def test_nonfinite_steps_in_a_row_abort(tiny, tmp_path):
    cfg = config(tiny, tmp_path, "optim.max_nonfinite_in_row=3")
    with pytest.raises(TrainingAborted, match="3 non-finite steps in a row"):
        train(cfg, stream=Poisoned(_stream(cfg), bad=[2, 3, 4, 5, 6]))
    records = read_metrics(tmp_path / "runs" / "r" / "metrics.jsonl")
    assert [r["skipped"] for r in records] == [False, True, True, True]


def test_an_explicit_flex_that_cannot_run_is_refused_before_training(tiny, tmp_path):
    # On the CPU flex has no backward; on CUDA its kernel needs head_dim >= 16 and this drafter has 8.
    with pytest.raises(ValueError, match="config key 'model.attention': flex cannot run here") as err:
        train(config(tiny, tmp_path, "model.attention=flex"))
    assert ("head_dim >= 16" if torch.cuda.is_available() else "no backward on CPU") in str(err.value)
    assert not (tmp_path / "runs" / "r").exists()  # refused before anything was written


def test_incompatible_shards_are_refused_by_field(tiny, tmp_path):
    with pytest.raises(ValueError, match="provenance.taps.layer_ids"):
        train(config(tiny, tmp_path, "model.target_layer_ids=[0,1]"))
    other = write_shards(tmp_path / "other", tiny / "target", n=4, tokenizer_hash="another-tokenizer")
    with pytest.raises(ValueError, match="provenance.tokenizer.hash"):
        train(config(tiny, tmp_path, f"data.shards={other}"))
    assert not (tmp_path / "runs" / "r").exists()  # refused before anything was written


def test_run_name_must_be_plain(tiny, tmp_path):
    from common.config import ConfigError

    for bad in ("../x", "a/b", ".."):
        with pytest.raises(ConfigError, match="run_name"):
            config(tiny, tmp_path, f"run_name={bad}")


def test_mask_token_resolution():
    class Tok:
        mask_token_id = 7

    def resolve(provenance: dict, tokenizer, configured):
        choice = resolve_mask_token(Provenance.from_dict(provenance), tokenizer, configured)
        return choice.token_id, choice.describe()

    assert resolve({"tokenizer": {"mask_token_id": 7}}, None, None) == (7, "shards provenance tokenizer.mask_token_id")
    recorded = {"mask_token_id": 7, "mask_token": {"token": "<m>", "source": "auto"}}
    assert resolve({"tokenizer": recorded}, None, None) == (7, "shards provenance tokenizer.mask_token_id (auto)")
    assert resolve_mask_token(Provenance.from_dict({"tokenizer": recorded}), None, None).origin is MaskOrigin.SHARDS
    assert resolve({}, Tok(), None) == (7, "target tokenizer mask_token")
    assert resolve({"tokenizer": {"mask_token_id": 3}}, Tok(), None)[0] == 3  # provenance first
    assert resolve({}, None, 5) == (5, "config model.mask_token_id")
    with pytest.raises(ValueError, match="model.mask_token_id' = 5 contradicts"):
        resolve({"tokenizer": {"mask_token_id": 7}}, None, 5)
    with pytest.raises(ValueError, match="no mask token id"):
        resolve({"tokenizer": {}}, None, None)


def test_cli_entry_point(tiny, tmp_path, capsys):
    from train.__main__ import main

    args = [
        f"out_dir={tmp_path / 'runs'}",
        "run_name=cli",
        f"data.shards={tiny / 'shards'}",
        "data.token_budget=200",
        "data.holdout_fraction=0",
        "model.num_layers=1",
        "loss.num_anchors=4",
        "optim.max_steps=2",
        "log.progress=false",
    ]
    assert main(args) == 0
    assert len(read_metrics(tmp_path / "runs" / "cli" / "metrics.jsonl")) == 2
    assert main(args[:-1] + ["optim.nope=1"]) == 2
    assert "optim.nope" in capsys.readouterr().err


def test_bf16_autocast_path_runs_on_cpu(tiny, tmp_path):
    """The GPU precision path (bf16 autocast, fp32 master weights, bf16 head) exercised on CPU."""
    summary = train(config(tiny, tmp_path, "device=cpu", "precision=bf16", "optim.max_steps=2", "loss.max_blocks=8"))
    records = read_metrics(tmp_path / "runs" / "r" / "metrics.jsonl")
    assert summary["steps"] == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    assert all(r["block_tokens"] <= 8 * 16 for r in records)
    ckpt = load_checkpoint(tmp_path / "runs" / "r" / "checkpoints" / "step-00000002")
    assert all(t.dtype == torch.float32 for t in ckpt["model"].values())  # master weights stay fp32


def _write_skip_one_dataset(tmp_path, vocab: int) -> None:
    """A target checkpoint and 64 samples with x[t] = x[t-2] + 1, whose tap features of position t
    encode x[t] (one fixed random vector per token)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab,
            hidden_size=H,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    ).save_pretrained(tmp_path / "target")
    prov = {
        "target": {
            "name_or_path": str(tmp_path / "target"),
            "num_layers": LAYERS,
            "hidden_size": H,
            "vocab_size": vocab,
        },
        "tokenizer": {"hash": "t0", "mask_token_id": vocab - 1},
        "taps": {"layer_ids": TAPS, "meaning": "x"},
        "dtype": "bfloat16",
        "topk": TOPK,
    }
    rng = np.random.default_rng(0)
    features = rng.normal(0, 1, (vocab, len(TAPS) * H)).astype(np.float32)
    with ShardWriter(
        str(tmp_path / "shards"), provenance=prov, hidden_width=len(TAPS) * H, topk=TOPK, shard_bytes=1 << 16
    ) as writer:
        for _ in range(64):
            T = int(rng.integers(24, 48))
            x = np.zeros(T, np.int32)
            x[:2] = rng.integers(0, vocab - 2, 2)
            for t in range(2, T):
                x[t] = (x[t - 2] + 1) % (vocab - 2)
            lm = (np.arange(T) >= 4).astype(np.uint8)
            hidden = (features[x].view(np.uint32) >> 16).astype(np.uint16)
            topk = np.stack([np.roll(x, -1)] + [rng.integers(0, vocab - 1, T) for _ in range(TOPK - 1)], 1).astype(
                np.int32
            )
            logprobs = -np.sort(rng.exponential(1.0, (T, TOPK)).astype(np.float32), 1)
            writer.write(Sample(sample_id(x, lm), x, lm, hidden, topk, logprobs))


def _position_one_accuracy(tmp_path, model, head, vocab: int) -> dict[str, float]:
    """Block position 1's accuracy over one epoch of the dataset: with the context features, and with
    them zeroed."""
    from train.attention import build_dense_mask
    from train.blocks import BlockSpec, make_blocks, step_generator
    from train.data import DataConfig, DataStream
    from train.loss import block_loss

    stream = DataStream(DataConfig(shards=str(tmp_path / "shards"), token_budget=512, holdout_fraction=0.0))
    accuracy = {}
    with torch.no_grad():
        for name in ("context", "zeroed"):
            stream.load_state_dict(
                {**stream.state_dict(), "epoch": 0, "batch": 0, "plan_digest": stream.plan(0).digest}
            )
            hits = count = 0.0
            for step in range(stream.steps_per_epoch):
                batch = next(stream)
                blocks = make_blocks(
                    batch.input_ids,
                    batch.loss_mask,
                    batch.lengths,
                    batch.topk_ids,
                    BlockSpec(block_size=16, mask_token_id=vocab - 1, num_anchors=64, gamma=7.0),
                    generator=step_generator(1, step),
                )
                hidden = batch.hidden if name == "context" else torch.zeros_like(batch.hidden)
                mask = build_dense_mask(blocks.anchors_BN, blocks.keep_BN, hidden.shape[1], 16)
                out = block_loss(
                    model(head.embed(blocks.block_ids_BQ), hidden, blocks.position_ids_BP, mask),
                    head.lm_head_VD,
                    blocks,
                )
                hits, count = hits + float(out.correct_K[1]), count + float(out.counted_K[1])
            accuracy[name] = hits / count
    stream.close()
    return accuracy


def test_drafter_learns_to_read_the_context(tmp_path):
    """Sequences with x[t+1] = x[t-1] + 1: block position 1 (token a+1) is predictable only from
    x[a-1], which the drafter sees only through the target features of position a-1 (the features
    of position t encode x[t]). Trained end to end, position 1 is learned; with the context
    features zeroed it falls to chance. Proves the context really flows in, strictly before the anchor.
    On the CPU in fp32, where the thresholds were set (bf16 autocast on CUDA follows another trajectory)."""
    from train.model import DFlashDrafter, DrafterConfig, TargetHead

    vocab, steps = 64, 200
    _write_skip_one_dataset(tmp_path, vocab)
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"out_dir={tmp_path / 'runs'}",
            "run_name=ctx",
            f"data.shards={tmp_path / 'shards'}",
            "data.token_budget=256",
            "data.num_buckets=2",
            "data.holdout_fraction=0",
            "model.num_layers=1",
            "loss.num_anchors=8",
            f"optim.max_steps={steps}",
            "optim.lr=3e-3",
            f"checkpoint.every={steps}",
            "log.progress=false",
            "device=cpu",
        ],
    )
    train(cfg)
    ckpt = load_checkpoint(tmp_path / "runs" / "ctx" / "checkpoints" / f"step-{steps:08d}")
    model = DFlashDrafter(DrafterConfig.from_dict(ckpt["drafter_config"]))
    model.load_state_dict(ckpt["model"])
    head = TargetHead.from_pretrained(str(tmp_path / "target"))
    accuracy = _position_one_accuracy(tmp_path, model, head, vocab)
    assert accuracy["context"] > 0.5, accuracy
    assert accuracy["zeroed"] < 0.15, accuracy


def test_wandb_configured_but_unavailable_still_trains(tiny, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    summary = train(config(tiny, tmp_path, "log.wandb=true", "optim.max_steps=2"))
    assert summary["steps"] == 2 and len(read_metrics(tmp_path / "runs" / "r" / "metrics.jsonl")) == 2


def test_metrics_log_contract_truncation_and_wandb_mirror(tmp_path):
    from train.metrics import MetricsLog, truncate_after

    class FakeWandb:
        def __init__(self):
            self.logged = []

        def log(self, data, step):
            self.logged.append((step, data))

        def finish(self):
            pass

    record = {key: 0.5 for key in STEP_KEYS} | {
        "step": 1,
        "skipped": False,
        "ckpt": False,
        "acc": [0.5, None],
        "loss": float("nan"),
    }
    fake = FakeWandb()
    log = MetricsLog(tmp_path / "metrics.jsonl", wandb_run=fake)
    log.write(record)
    log.write(record | {"step": 2})
    with pytest.raises(AssertionError, match="contract"):
        log.write(record | {"extra": 1})
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["loss"] is None and rows[0]["acc"] == [0.5, None]  # non-finite -> null
    assert fake.logged[0][0] == 1 and fake.logged[0][1]["acc/1"] == 0.5 and "acc/2" not in fake.logged[0][1]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a torn line from a kill
    assert truncate_after(tmp_path / "metrics.jsonl", 1) == 1
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
