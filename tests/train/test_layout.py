"""Drafters in the published Qwen3.6 layout: per-layer attention types in the config and the training
model, the drop-in config against the published drafter's config, and the drafter's rope as the
export states it (docs/serving.md)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from common.config import ConfigError, load_config
from extract.config import ExtractConfig
from shards.provenance import Provenance
from tests.train.test_model import QWEN36_TEXT, tiny_config
from train.attention import build_dense_mask, build_layer_masks
from train.config import TrainConfig
from train.drafter_config import DrafterConfig
from train.export_format.layout import drafter_config_from_export, export_config
from train.layer_types import resolve_layer_types
from train.model import DFlashDrafter, RotaryEmbedding
from train.prepare import build_drafter_config
from train.warm_start import config_differences

ZLAB_TOML = "configs/qwen3.6-27b-zlab.toml"

# z-lab/Qwen3.6-27B-DFlash config.json as far as public sources show it (docs/serving.md, "The
# published drafter"): the Tenstorrent port that loads it (tt-metal models/demos/blackhole/qwen36:
# tt/dflash/config.py, tt/dflash/rope.py, DFLASH_DRAFTER_OP_MAPPING.md) and third-party config tests.
# Not seen verbatim: rms_norm_eps, max_position_embeddings, attention_bias, rope_scaling (inferred
# from the Qwen3.5/3.6 drafter family; none of them changes the weights' shapes).
ZLAB_QWEN36_DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "block_size": 16,
    "num_target_layers": 64,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000,
    "rope_scaling": None,
    "max_position_embeddings": 262144,
    "attention_bias": False,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "sliding_window": 2048,
    "use_sliding_window": True,
    "vocab_size": 248320,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def zlab_drafter_config() -> DrafterConfig:
    """What `python -m train configs/qwen3.6-27b-zlab.toml` builds for the Qwen3.6-27B target and 5-tap shards."""
    cfg = load_config(TrainConfig, ZLAB_TOML, section="train")
    provenance = Provenance.from_dict({"taps": {"layer_ids": [1, 16, 31, 46, 61]}})
    return build_drafter_config(cfg, QWEN36_TEXT, provenance, mask_token_id=248070)


# ----------------------------------------------------------------------------------------------
# Config


def test_presets_and_lists():
    assert resolve_layer_types("sliding_then_full", 5) == ["sliding_attention"] * 4 + ["full_attention"]
    assert resolve_layer_types("sliding", 2) == ["sliding_attention"] * 2
    assert resolve_layer_types(None, 3) == resolve_layer_types("full", 3) == ["full_attention"] * 3
    assert tiny_config().layer_types == ["full_attention"] * 2  # old drafter_config.json files read the same
    with pytest.raises(ValueError, match="preset"):
        resolve_layer_types("swa", 5)
    with pytest.raises(ValueError, match="3 entries"):
        resolve_layer_types(["full_attention"] * 3, 5)
    with pytest.raises(ValueError, match="unknown"):
        resolve_layer_types(["linear_attention"], 1)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.layer_types=sliding"], "model.sliding_window"),
        (["model.sliding_window=64"], "model.sliding_window"),
        (["model.layer_types=bogus"], "model.layer_types"),
        (["model.num_layers=3", 'model.layer_types=["full_attention"]'], "model.layer_types"),
        (["model.sliding_in_block=sideways"], "model.sliding_in_block"),
        (["model.partial_rotary_factor=1.5"], "model.partial_rotary_factor"),
    ],
)
def test_bad_layouts_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", "\\.")):
        load_config(TrainConfig, None, overrides)


def test_drafter_config_errors():
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(layer_types="sliding")
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(sliding_window=8)
    with pytest.raises(ValueError, match="sliding_in_block"):
        tiny_config(layer_types="sliding", sliding_window=8, sliding_in_block="both")
    cfg = tiny_config(num_hidden_layers=3, layer_types="sliding_then_full", sliding_window=8)
    assert cfg.layer_causal == [True, True, False]
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


# ----------------------------------------------------------------------------------------------
# The training model


def test_one_mask_for_mixed_layer_types_is_refused():
    cfg = tiny_config(layer_types="sliding_then_full", sliding_window=4)
    model = DFlashDrafter(cfg)
    S, K = 6, cfg.block_size
    anchors, keep = torch.tensor([[3]]), torch.tensor([[True]])
    positions = torch.cat([torch.arange(S), 3 + torch.arange(K)])[None]
    noise, hidden = torch.randn(1, K, 32), torch.randn(1, S, cfg.feature_width)
    with pytest.raises(AssertionError, match="one mask each"):
        model(noise, hidden, positions, build_dense_mask(anchors, keep, S, K))
    with pytest.raises(KeyError):
        model(noise, hidden, positions, {"full_attention": build_dense_mask(anchors, keep, S, K)})


@pytest.mark.parametrize("sliding_in_block", ["causal", "bidirectional"])
def test_flex_and_dense_masks_give_the_same_mixed_layout_drafter(sliding_in_block):
    """The whole drafter (3 layers: 2 sliding, 1 full) under flex BlockMasks and dense masks, with
    context lengths up to 10x the window; also: its blocks = each block alone with no mask."""
    torch.manual_seed(0)
    cfg = tiny_config(
        num_hidden_layers=3, layer_types="sliding_then_full", sliding_window=5, sliding_in_block=sliding_in_block
    )
    model = DFlashDrafter(cfg).eval()
    B, S, K = 2, 50, cfg.block_size
    anchors = torch.tensor([[4, 17, 33, 49], [12, 30, 48, 0]])
    keep = torch.tensor([[True] * 4, [True, True, True, False]])
    positions = torch.cat([torch.arange(S).expand(B, S), (anchors[:, :, None] + torch.arange(K)).view(B, -1)], 1)
    noise, hidden = torch.randn(B, 4 * K, 32), torch.randn(B, S, cfg.feature_width)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unfused flex on CPU
        dense = model(noise, hidden, positions, build_layer_masks("sdpa", anchors, keep, S, K, cfg.mask_rules))
        flex = model(noise, hidden, positions, build_layer_masks("flex", anchors, keep, S, K, cfg.mask_rules))
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
        for n, a in enumerate(anchors[0].tolist()):
            alone = model(noise[:1, n * K : (n + 1) * K], hidden[:1, :a], torch.arange(a + K)[None])
            torch.testing.assert_close(alone, dense[:1, n * K : (n + 1) * K], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# The drop-in config and the published drafter


def test_zlab_config_builds_the_published_drafter():
    ours = zlab_drafter_config()
    published = drafter_config_from_export(ZLAB_QWEN36_DFLASH)
    assert config_differences(published, ours) == []
    assert ours.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and ours.sliding_window == 2048
    assert (ours.target_layer_ids, ours.mask_token_id, ours.block_size) == ([1, 16, 31, 46, 61], 248070, 16)
    assert ours.feature_width == 5 * 5120
    with torch.device("meta"):
        params = DFlashDrafter(ours).num_parameters()
    assert round(params / 1e9, 2) == 1.73  # the published drafter's size (1.73 B, 3.5 GB in bf16)
    extract = load_config(ExtractConfig, ZLAB_TOML, section="extract")
    assert extract.layer_ids == [1, 16, 31, 46, 61] and extract.mask_token_id == 248070


def test_zlab_bench_shape_is_the_config():
    from benchmarks.train import SHAPES

    shape, ours = SHAPES["27b-zlab"], zlab_drafter_config()
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    built = DrafterConfig(
        num_hidden_layers=5, mask_token_id=248070, block_size=16, **{k: v for k, v in shape.items() if k in fields}
    )
    assert config_differences(built, ours) == []


# ----------------------------------------------------------------------------------------------
# Rope (docs/serving.md, "Rope")


def test_exported_rope_of_the_27b_drafter_is_what_training_applied(tmp_path):
    """The 27B drafter built from the Qwen3.6 target config: the export states theta 1e7, default
    rope, partial factor 1.0, neox rotation; transformers' own Qwen3 rope built from those fields and
    the export's dflash.py both compute exactly the rotary tables the training model used."""
    from transformers import AutoConfig, Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from train.export_format.dflash_hf import DFlashRotaryEmbedding

    cfg = zlab_drafter_config()
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor, cfg.head_dim) == (1e7, None, 1.0, 128)
    assert QWEN36_TEXT["partial_rotary_factor"] == 0.25  # the target's factor is not the drafter's
    config = export_config(cfg)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 1.0}
    assert (config["rope_theta"], config["rope_scaling"], config["partial_rotary_factor"], config["is_neox_style"]) == (
        1e7,
        None,
        1.0,
        True,
    )

    positions = torch.tensor([[0, 1, 7, 2047, 2048, 4095, 100_000]])
    trained_cos, trained_sin = RotaryEmbedding(cfg)(positions, torch.float32)
    assert trained_cos.shape[-1] == 128  # every head dim rotates

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(hf_config, Qwen3Config)
    hf_cos, hf_sin = Qwen3RotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(hf_cos, trained_cos)
    torch.testing.assert_close(hf_sin, trained_sin)
    export_cos, export_sin = DFlashRotaryEmbedding(hf_config)(positions, torch.float32)
    torch.testing.assert_close(export_cos, trained_cos)
    torch.testing.assert_close(export_sin, trained_sin)
    assert drafter_config_from_export(hf_config.to_dict()) == cfg

    # The leak this guards against: the target's factor would rotate 32 of 128 dims, another drafter.
    leaked = dataclasses.replace(cfg, partial_rotary_factor=0.25)
    assert RotaryEmbedding(leaked)(positions, torch.float32)[0].shape[-1] == 32
    assert "partial_rotary_factor: 0.25 in init_from" in " ".join(config_differences(leaked, cfg))
