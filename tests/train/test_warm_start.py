"""Warm start (`model.init_from`): export -> init_from gives the same drafter (the same forward) in a
new run; a drafter directory that differs in any field that matters, or whose weight file holds a
tensor too many or too few, stops the run naming what differs, before a run directory exists."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.train.test_loop import config, tiny  # noqa: F401  (tiny is a fixture)
from train.export_format.layout import drafter_config_from_export, export_checkpoint, load_exported
from train.loop import train
from train.model import DFlashDrafter
from train.prepare import Run
from train.warm_start import warm_start

LAYOUT = ["model.num_layers=3", "model.layer_types=sliding_then_full", "model.sliding_window=8"]


@pytest.fixture(scope="module")
def exported_run(tiny, tmp_path_factory):  # noqa: F811
    """A 3-layer sliding_then_full drafter trained for 2 steps, exported in float32."""
    root = tmp_path_factory.mktemp("warm")
    train(config(tiny, root, *LAYOUT, "optim.max_steps=2", "run_name=a"))
    return export_checkpoint(root / "runs" / "a", root / "exports" / "a", dtype="float32")


def test_export_then_init_from_is_the_same_forward(tiny, exported_run, tmp_path):  # noqa: F811
    # Checked on CPU, on every host: bit-exactness against the exported code holds where both run the
    # same kernels (on a GPU host `device=auto` would put the run's drafter on CUDA and the exported
    # model stays on the CPU). The exported model on CUDA is covered by tests/gpu (lossless decoding).
    run = Run.prepare(config(tiny, tmp_path, *LAYOUT, f"model.init_from={exported_run}", "run_name=b", "device=cpu"))
    try:
        exported = load_exported(exported_run, trust_remote_code=True)
        cfg = run.drafter_cfg
        torch.manual_seed(0)
        S, K = 20, cfg.block_size  # a context longer than the window (8)
        hidden, noise = torch.randn(2, S, cfg.feature_width), torch.randn(2, K, cfg.hidden_size)
        positions = torch.arange(S + K).expand(2, S + K)
        with torch.no_grad():
            ours = run.drafter(noise, hidden, positions)
            theirs = exported(position_ids=positions, noise_embedding=noise, target_hidden=hidden)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        loaded = load_file(str(exported_run / "model.safetensors"))
        assert all(torch.equal(run.drafter.state_dict()[k], v) for k, v in loaded.items())
        info = json.loads((run.run_dir / "run.json").read_text())
        assert info["init_from"]["path"] == str(exported_run.resolve()) and info["init_from"]["tensors"] == len(loaded)
    finally:
        run.stream.close()
    # The run trains from there (and a fresh drafter would not have been these weights).
    summary = train(
        config(tiny, tmp_path, *LAYOUT, f"model.init_from={exported_run}", "run_name=c", "optim.max_steps=1")
    )
    assert summary is not None


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["model.layer_types=sliding"], ["layer_types"]),
        (["model.sliding_window=16"], ["sliding_window: 8 in init_from, 16 here (model.sliding_window)"]),
        (["model.sliding_in_block=bidirectional"], ["sliding_in_block"]),
        (["model.block_size=8"], ["block_size"]),
        (["model.partial_rotary_factor=0.5"], ["partial_rotary_factor: 1.0 in init_from, 0.5 here"]),
        (["model.rope_theta=5000", "model.head_dim=4"], ["rope_theta", "head_dim"]),
    ],
)
def test_a_different_drafter_is_refused_by_name(tiny, exported_run, tmp_path, overrides, needles):  # noqa: F811
    cfg = config(tiny, tmp_path, *LAYOUT, f"model.init_from={exported_run}", *overrides)
    with pytest.raises(ValueError, match="model.init_from") as info:
        Run.prepare(cfg)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_taps_and_mask_id_must_be_the_shards(tiny, exported_run, tmp_path):  # noqa: F811
    """A drafter of the same shape for other taps or another mask token: refused, naming the shards as the source."""
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((exported_run / "config.json").read_text())
    config["dflash_config"].update(target_layer_ids=[0, 1], mask_token_id=5)
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").write_bytes((exported_run / "model.safetensors").read_bytes())
    with pytest.raises(ValueError) as info:
        Run.prepare(config_for(tiny, tmp_path, other))
    message = str(info.value)
    assert "target_layer_ids: [0, 1] in init_from, [0, 2] here (the shards' taps" in message
    assert "mask_token_id: 5 in init_from, 63 here (the shards' provenance" in message


def config_for(tiny, tmp_path, init_from):  # noqa: F811
    return config(tiny, tmp_path, *LAYOUT, f"model.init_from={init_from}")


def test_the_weight_file_must_be_exactly_the_drafter(exported_run, tmp_path):
    state = load_file(str(exported_run / "model.safetensors"))
    config_json = (exported_run / "config.json").read_text()
    variants = {
        "extra": {**state, "lm_head.weight": torch.zeros(4, 4)},
        "missing": {k: v for k, v in state.items() if k != "norm.weight"},
        "shape": {**state, "norm.weight": torch.ones(3)},
    }
    drafter_cfg = drafter_config_from_export(json.loads(config_json))
    for name, tensors in variants.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(config_json)
        save_file(tensors, str(bad / "model.safetensors"))
        before = {k: v.clone() for k, v in DFlashDrafter(drafter_cfg).state_dict().items()}
        drafter = DFlashDrafter(drafter_cfg)
        drafter.load_state_dict(before)
        with pytest.raises(ValueError, match="model.init_from"):
            warm_start(drafter, bad)
        assert all(torch.equal(drafter.state_dict()[k], v) for k, v in before.items()), name  # nothing half-loaded
    # A `model.` prefix on every name (some trainers save so) is the same drafter.
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "config.json").write_text(config_json)
    save_file({f"model.{k}": v for k, v in state.items()}, str(prefixed / "model.safetensors"))
    drafter = DFlashDrafter(drafter_cfg)
    warm_start(drafter, prefixed)
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in state.items())


def test_a_missing_directory_is_named(tiny, tmp_path):  # noqa: F811
    cfg = config(tiny, tmp_path, f"model.init_from={tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="no config.json in"):
        Run.prepare(cfg)


# ----------------------------------------------------------------------------------------------
# Resuming a run made before these knobs existed

NEW_MODEL_KEYS = (
    "layer_types",
    "sliding_window",
    "sliding_in_block",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "init_from",
)


def test_a_checkpoint_from_before_the_layout_knobs_resumes_only_as_the_drafter_it_holds(tiny, tmp_path):  # noqa: F811
    """An older checkpoint lacks the new config keys and its drafter_config.json the new fields; its
    drafter's rope took the target's partial factor. Resuming is refused naming that field, and
    allowed once the config builds exactly that drafter again."""
    from train import checkpoint as ck
    from train.checkpoint import latest_checkpoint, load_checkpoint
    from train.config import resume_conflicts
    from train.model import DrafterConfig

    train(config(tiny, tmp_path, "optim.max_steps=2"))
    ckpt_root = tmp_path / "runs" / "r" / "checkpoints"
    data = load_checkpoint(latest_checkpoint(ckpt_root))
    state, drafter_config = data["state"], data["drafter_config"]
    for key in NEW_MODEL_KEYS:
        state["config"]["model"].pop(key)
    for key in ("layer_types", "sliding_window", "sliding_in_block"):  # the new DrafterConfig fields
        drafter_config.pop(key)
    drafter_config["partial_rotary_factor"] = 0.5  # what from_target used to copy from the target
    model = DFlashDrafter(DrafterConfig.from_dict(drafter_config))
    model.load_state_dict(data["model"])
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(data["optimizer"])
    ck.write_checkpoint(ckpt_root, ck.take_snapshot(state["step"], model, optimizer, state, drafter_config))

    with pytest.raises(ValueError, match="partial_rotary_factor: 0.5 in the checkpoint, 1.0 here"):
        Run.prepare(config(tiny, tmp_path, "optim.max_steps=2"))
    run = Run.prepare(config(tiny, tmp_path, "optim.max_steps=2", "model.partial_rotary_factor=0.5"))
    run.stream.close()
    assert run.step == 2
    # Knobs outside `model` that the checkpoint lacks are fine at their default only.
    saved = {"loss": {"gamma": 7.0}}
    assert resume_conflicts(saved, {"loss": {"gamma": 7.0, "kl_weight": 0.0}}) == []
    assert resume_conflicts(saved, {"loss": {"gamma": 7.0, "kl_weight": 0.5}}) == [
        "loss.kl_weight: checkpoint '<absent>' vs now 0.5"
    ]
