"""DFlash2 as a training setting (`model.arch=dflash2`): its config keys and derived defaults; a run on the tiny
target whose tokens follow each other by a fixed permutation (learnable from the predecessor alone) lowers the
selector's loss per covered row and ends with a served streak above the unary one, logging the selector keys
and the weight's ramp; two processes train exactly like one with accumulation 2; a DFlash drafter warm-starts
a DFlash2 run whose first forward and proposals are the DFlash drafter's; a trained DFlash2 drafter's export
starts a DFlash2 run with every one of its tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from common.config import ConfigError, load_config
from common.hashing import tokenizer_digest
from tests.train.test_distributed import assert_close_steps, assert_same_steps, records, torchrun
from tests.train.test_distributed import overrides as ddp_overrides
from tests.train.test_loop import config, tiny, write_shards  # noqa: F401 - `tiny` is a fixture
from train.checkpoint import MODEL_FILE, latest_checkpoint
from train.config import TrainConfig
from train.dflash2 import DFlash2Drafter
from train.drafter_config import dflash2_fields
from train.export_format.layout import export_checkpoint, load_exported
from train.loop import train
from train.metrics import SELECTOR_KEYS, STEP_KEYS, read_metrics
from train.prepare import Run
from train.selector_loss import selector_weight_at


def test_block_size_follows_the_class_and_dflash2_keys_need_it(tmp_path):
    def cfg(*words):
        return load_config(TrainConfig, None, list(words))

    assert cfg().model.block_size == 16 and cfg().loss.gamma == 7.0
    assert cfg("model.arch=dflash2").model.block_size == 8 and cfg("model.arch=dflash2").loss.gamma == 4.0
    assert cfg("model.arch=dflash2", "model.block_size=16").model.block_size == 16
    for word in ("model.selector_top_k=8", "loss.selector_weight=0.5", "model.conv_group_size=8"):
        with pytest.raises(ConfigError, match=f"'{word.partition('=')[0]}'.*model.arch is dflash"):
            cfg(word)
    with pytest.raises(ConfigError, match="'model.conv_kernel_size'"):
        cfg("model.arch=dflash2", "model.block_size=2", "model.conv_kernel_size=3")


def test_derived_selector_rank_and_a_group_size_that_does_not_divide():
    model = load_config(TrainConfig, None, ["model.arch=dflash2"]).model
    assert dflash2_fields(model, 5120)[0]["selector_rank"] == 256
    fields, why = dflash2_fields(model, 128)
    assert fields["selector_rank"] == 128 and "rank 128" in why and "block size 8" in why
    with pytest.raises(ValueError, match=r"config key 'model.conv_group_size': 16 does not divide .* 200"):
        dflash2_fields(model, 200)


@pytest.fixture(scope="module")
def bigram(tiny, tmp_path_factory):  # noqa: F811
    """Shards for the tiny target whose token t+1 is a fixed permutation of token t."""
    root = tmp_path_factory.mktemp("bigram")
    digest = tokenizer_digest(AutoTokenizer.from_pretrained(tiny / "target"))
    return write_shards(root / "shards", tiny / "target", n=48, tokenizer_hash=digest, bigram=True)


def test_training_lowers_the_selector_loss_and_logs_its_keys(tiny, bigram, tmp_path):  # noqa: F811
    steps = 40
    words = ["model.arch=dflash2", "model.selector_top_k=64", f"data.shards={bigram}", f"optim.max_steps={steps}"]
    words += ["loss.selector_warmup_ratio=0.05", "loss.selector_ramp_ratio=0.1", "device=cpu", "checkpoint.every=40"]
    words += ["optim.lr=1e-2"]  # the selector's codes start at zero (as published) and need a few steps to grow
    train(config(tiny, tmp_path, *words))
    log = read_metrics(tmp_path / "runs" / "r" / "metrics.jsonl")
    assert len(log) == steps and all(set(r) == set(STEP_KEYS) | set(SELECTOR_KEYS) for r in log)
    assert [r["selector_weight"] for r in log] == [
        pytest.approx(selector_weight_at(s, steps, 1.0, 0.05, 0.1)) for s in range(1, steps + 1)
    ]
    assert log[0]["selector_weight"] == 0.0 and log[2]["selector_weight"] == pytest.approx(0.25)
    # Top-64 of a 64-token vocabulary: every label is a candidate, so the loss is the mean CE of the covered rows.
    assert all(r["selector_coverage"] == pytest.approx(1.0) for r in log)
    first, last = log[:5], log[-5:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "selector_loss") < 0.5 * mean(first, "selector_loss"), (first, last)
    # The next token follows from the one before: the selector's walk knows it, the unary top-1 does not.
    assert mean(last, "selector_streak") > mean(last, "streak") + 2.0
    assert len(log[-1]["selector_acc"]) == len(log[-1]["acc"]) == 7


def test_two_processes_train_a_dflash2_drafter_exactly_like_one_with_accumulation_two(tiny, tmp_path):  # noqa: F811
    extra = ("model.arch=dflash2", "optim.max_steps=3", "checkpoint.every=3")
    torchrun(2, ddp_overrides(tiny, tmp_path, "run_name=ddp", *extra))
    train(
        load_config(
            TrainConfig, None, ddp_overrides(tiny, tmp_path, "run_name=acc2", "distributed.accumulation=2", *extra)
        )
    )
    train(load_config(TrainConfig, None, ddp_overrides(tiny, tmp_path, "run_name=one", *extra)))
    a, b, one = records(tmp_path / "ddp"), records(tmp_path / "acc2"), records(tmp_path / "one")
    assert len(a) == 3 and a[0]["selector_loss"] > 0
    assert_same_steps(a, b, keys=("loss", "grad_norm", "acc", "streak", "batch_tokens", *SELECTOR_KEYS))
    # The parts' selector terms add up to the unsplit batch's (each over the global weight total).
    assert_close_steps(b, one, rel=1e-5)
    for x, y in zip(b, one, strict=True):
        for key in ("selector_loss", "selector_coverage", "selector_streak"):
            assert x[key] == pytest.approx(y[key], rel=1e-5), (x["step"], key)


def test_a_dflash_drafter_starts_a_dflash2_run_with_the_same_forward(tiny, tmp_path):  # noqa: F811
    train(config(tiny, tmp_path, "optim.max_steps=2", "run_name=dflash", "device=cpu"))
    export = export_checkpoint(tmp_path / "runs" / "dflash", tmp_path / "export", dtype="float32")
    exported = load_exported(export)
    for source in (export, tmp_path / "runs" / "dflash"):  # an export, and a run directory (its checkpoint)
        run = Run.prepare(
            config(
                tiny,
                tmp_path,
                "model.arch=dflash2",
                f"model.init_from={source}",
                "device=cpu",
                f"run_name=from-{source.name}",
            )
        )
        try:
            drafter = run.drafter
            assert isinstance(drafter, DFlash2Drafter) and run.drafter_cfg.block_size == 8
            torch.manual_seed(0)
            S, K = 12, 8
            hidden, noise = (
                torch.randn(2, S, run.drafter_cfg.feature_width),
                torch.randn(2, K, run.drafter_cfg.hidden_size),
            )
            positions = torch.arange(S + K).expand(2, S + K)
            with torch.no_grad():
                ours = drafter(noise, hidden, positions)
                theirs = exported(position_ids=positions, noise_embedding=noise, target_hidden=hidden)
                torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
                head = run.head.lm_head_VD
                proposal = drafter.propose(ours[:, 1:], head, torch.tensor([3, 5]))
                assert torch.equal(proposal, (ours[:, 1:] @ head.T).argmax(-1))
        finally:
            run.stream.close()
    with pytest.raises(ValueError, match="hidden_size"):
        Run.prepare(
            config(
                tiny,
                tmp_path,
                "model.arch=dflash2",
                f"model.init_from={export}",
                "model.hidden_size=48",
                "run_name=wider",
            )
        )


def test_a_dflash2_export_starts_a_dflash2_run_with_all_its_weights(tiny, tmp_path):  # noqa: F811
    train(config(tiny, tmp_path, "model.arch=dflash2", "optim.max_steps=2", "run_name=d2", "device=cpu"))
    trained = load_file(str(latest_checkpoint(tmp_path / "runs" / "d2" / "checkpoints") / MODEL_FILE))
    # Two steps moved the selector off its fresh state (zero successor codes), so a fresh one would differ.
    assert trained["candidate_selector.successor_codebook"].abs().max() > 0
    export = export_checkpoint(tmp_path / "runs" / "d2", tmp_path / "export", dtype="float32")
    run = Run.prepare(
        config(tiny, tmp_path, "model.arch=dflash2", f"model.init_from={export}", "device=cpu", "run_name=again")
    )
    try:
        state = run.drafter.state_dict()
        assert set(state) == set(trained)
        for name, tensor in trained.items():
            assert torch.equal(state[name], tensor), name
    finally:
        run.stream.close()
