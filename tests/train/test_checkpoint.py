"""Checkpoints: safe formats, atomic directories (a save killed mid-write leaves the previous one
loadable), pruning, background errors surfacing, snapshots isolated from later updates, RNG round trip."""

from __future__ import annotations

import json
import os
import random
import signal

import numpy as np
import pytest
import torch

from train import checkpoint as ck
from train.drafter_config import DrafterConfig
from train.model import DFlashDrafter


def tiny_model():
    cfg = DrafterConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=20,
        target_layer_ids=[0],
        num_target_layers=2,
        mask_token_id=19,
        block_size=4,
    )
    model = DFlashDrafter(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(1, 4, 16), torch.randn(1, 3, 16), torch.arange(7)[None]).sum().backward()
    optimizer.step()
    return model, optimizer


def snap(model, optimizer, step):
    return ck.take_snapshot(
        step, model, optimizer, {"step": step, "data_state": {"epoch": 0, "batch": step}}, model.config.to_dict()
    )


def test_round_trip_with_safe_loaders(tmp_path):
    model, optimizer = tiny_model()
    path = ck.write_checkpoint(tmp_path, snap(model, optimizer, 5))
    assert path.name == "step-00000005"
    assert sorted(p.name for p in path.iterdir()) == [
        "drafter_config.json",
        "model.safetensors",
        "optimizer.pt",
        "state.json",
    ]
    loaded = ck.load_checkpoint(path)  # safetensors + torch.load(weights_only=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["model"][name], tensor)
    fresh_model, _ = tiny_model()
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(loaded["optimizer"])
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert loaded["state"]["data_state"] == {"epoch": 0, "batch": 5}
    assert DrafterConfig.from_dict(loaded["drafter_config"]) == model.config
    torch.load(path / "optimizer.pt", weights_only=True)


def test_keep_last_prunes_oldest(tmp_path):
    model, optimizer = tiny_model()
    for step in (1, 2, 3, 4):
        ck.write_checkpoint(tmp_path, snap(model, optimizer, step), keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4]
    assert ck.latest_checkpoint(tmp_path).name == "step-00000004"


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    model, optimizer = tiny_model()
    ck.write_checkpoint(tmp_path, snap(model, optimizer, 1), keep_last=1)
    pid = os.fork()
    if pid == 0:  # child: start the next save and die (SIGKILL) after the weights file is written
        original = ck._write_files

        def dying(snapshot, directory):
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in snapshot.model.items()}, str(directory / ck.MODEL_FILE))
            os.kill(os.getpid(), signal.SIGKILL)
            original(snapshot, directory)

        ck._write_files = dying
        ck.write_checkpoint(tmp_path, snap(model, optimizer, 2), keep_last=1)
        os._exit(0)  # never reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [1]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000002")]
    assert leftovers and all(".tmp-" in p.name for p in leftovers)
    loaded = ck.load_checkpoint(ck.latest_checkpoint(tmp_path))
    assert loaded["state"]["step"] == 1
    assert ck.remove_partial_checkpoints(tmp_path) == leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_background_writer_saves_and_surfaces_errors(tmp_path, monkeypatch):
    model, optimizer = tiny_model()
    writer = ck.CheckpointWriter(tmp_path, keep_last=3)
    writer.save(snap(model, optimizer, 1))
    writer.wait()
    assert writer.last_saved.name == "step-00000001"

    def broken(snapshot, directory):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "_write_files", broken)
    writer.save(snap(model, optimizer, 2))
    with pytest.raises(RuntimeError, match="disk full"):
        writer.wait()
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [1]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the failed save cleaned up after itself


def test_snapshot_is_isolated_from_later_updates(tmp_path):
    model, optimizer = tiny_model()
    snapshot = snap(model, optimizer, 1)
    before = model.fc.weight.detach().clone()
    avg_before = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    with torch.no_grad():
        model.fc.weight.add_(1.0)
        optimizer.state_dict()["state"][0]["exp_avg"].add_(1.0)  # the live optimizer state
    assert torch.equal(snapshot.model["fc.weight"], before)
    assert torch.equal(snapshot.optimizer["state"][0]["exp_avg"], avg_before)
    path = ck.write_checkpoint(tmp_path, snapshot)
    assert torch.equal(ck.load_checkpoint(path)["model"]["fc.weight"], before)


def test_rng_state_round_trip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = json.loads(json.dumps(ck.rng_state()))
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    ck.restore_rng_state(state)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_loading_a_non_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        ck.load_checkpoint(tmp_path)
