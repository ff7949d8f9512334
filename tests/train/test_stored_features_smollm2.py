"""Storage tiers on the real target SmolLM2-135M-Instruct (CPU): a drafter trained on a projected,
quantized tier of real tap features (five taps x 576, with the target's massive activations) is
exported with P folded into fc, reads the full features, and equals the trained model reading P·h
within fp32 tolerance; the same for a projection that keeps the largest channels exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from common.config import load_config
from shards import ShardDataset
from shards.projection import load_projection
from shards.transcode import TranscodeConfig, transcode
from tests.paths import REPO
from tests.recipes.smollm2.conftest import smollm2_dir  # noqa: F401  (the fixture)
from tests.recipes.smollm2.test_real_target import extracted  # noqa: F401  (the fixture)
from train.config import TrainConfig
from train.drafter_config import DrafterConfig
from train.export_format.layout import export_checkpoint, load_exported
from train.loop import train
from train.model import DFlashDrafter


def trained_on_tier(lossless_root: str, tmp_path, projection: str) -> tuple:
    tier = tmp_path / "tier"
    transcode(
        lossless_root,
        str(tier),
        load_config(TranscodeConfig, None, ["progress=false", "encoding=fp8", f"projection={projection}"]),
    )
    cfg = load_config(
        TrainConfig,
        str(REPO / "configs/smollm2-135m.toml"),
        [
            f"data.shards={tier}",
            f"out_dir={tmp_path / 'runs'}",
            "run_name=r",
            "device=cpu",
            "model.num_layers=2",
            "model.attention=sdpa",
            "data.token_budget=512",
            "data.num_buckets=1",
            "data.prefetch_threads=1",
            "data.prefetch_depth=1",
            "loss.num_anchors=4",
            "optim.max_steps=2",
            "checkpoint.every=2",
            "log.progress=false",
        ],
        section="train",
    )
    train(cfg)
    run = tmp_path / "runs" / "r"
    checkpoint = next((run / "checkpoints").iterdir())
    drafter_cfg = DrafterConfig.from_dict(json.loads((checkpoint / "drafter_config.json").read_text()))
    trained = DFlashDrafter(drafter_cfg).eval()
    trained.load_state_dict(load_file(str(checkpoint / "model.safetensors")))
    return trained, load_projection(str(tier), ShardDataset(str(tier)).projection), run


@pytest.mark.parametrize("projection", ["pca:rank=64", "pca:rank=64,keep=4"])
def test_export_of_a_drafter_trained_on_a_projected_real_tier_equals_it_on_full_features(
    extracted,  # noqa: F811
    tmp_path,
    projection,
):
    _, ds = extracted
    trained, p, run = trained_on_tier(ds.root, tmp_path, projection)
    assert trained.config.projection["in_width"] == 5 * 576 and p.out_width == 5 * 64
    exported = load_exported(export_checkpoint(run, tmp_path / "export", dtype="float32"))
    assert exported.fc.weight.shape == (576, 5 * 576)  # reads the full tap features
    h = ds.torch(0)["hidden"].float()[None]  # [1, T, 2880]
    T, block = h.shape[1], trained.config.block_size
    torch.manual_seed(0)
    noise = torch.randn(1, block, 576)
    positions = torch.arange(T + block)[None]
    with torch.no_grad():
        on_projected = trained(noise, p.apply(h), positions, None)
        served = exported(position_ids=positions, noise_embedding=noise, target_hidden=h)
    torch.testing.assert_close(served, on_projected, rtol=1e-4, atol=1e-4)
