"""Warm start (`model.init_from=DIR`): a DFlash drafter directory's weights as the run's first weights.

DIR holds `config.json` in the published DFlash format (what `train.serve.export` writes and z-lab
publishes) and `model.safetensors`, or is a training checkpoint (`drafter_config.json` and
`model.safetensors`) or a run directory (its latest checkpoint). Nothing from DIR is executed. The
start is strict:

- the drafter DIR describes must be the drafter this run builds from its config, the target and the
  shards: taps, mask token id, block size, layer types, sliding window and in-block semantics,
  widths, heads, rope (theta, scaling, partial factor), norm eps, vocabulary; any difference stops
  the run with a ValueError that lists every differing field, its value in DIR and here, and the
  config key or source of the value here;
- every tensor of the drafter is loaded and no tensor of the file is left over (names and shapes).

The shards are checked against the run's drafter config separately (`train.samples.check_compatible`),
so a DIR that passes here also fits the shards' taps and widths.

DFlash to DFlash2: a DFlash drafter of the same widths starts a DFlash2 run. Every DFlash tensor
loads; the block convolutions keep their initial identity and the selector its fresh initialization
(a zero successor codebook, so it proposes the unary argmax): the first forward is the DFlash
drafter's, and so are its first proposals. The block size may differ (DFlash's 16, DFlash2's 8): no
weight depends on it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from common.hashing import file_checksum
from common.io import resolve
from train.checkpoint import DRAFTER_CONFIG_FILE, latest_checkpoint
from train.drafter_config import DFLASH2_FIELDS, DrafterConfig
from train.export_format.layout import check_weights, drafter_config_from_export
from train.model import DFlashDrafter

__all__ = ["read_drafter_config", "read_drafter_dir", "config_differences", "check_init_from", "warm_start"]

CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"

# Where each compared field of the run's drafter comes from (named in the error).
SOURCES = {
    "target_layer_ids": "the shards' taps / model.target_layer_ids",
    "num_target_layers": "the target's num_hidden_layers",
    "mask_token_id": "the shards' provenance / model.mask_token_id",
    "block_size": "model.block_size",
    "arch": "model.arch (a DFlash drafter can start a DFlash2 run; the other way round cannot)",
    "conv_kernel_size": "model.conv_kernel_size",
    "conv_group_size": "model.conv_group_size",
    "selector_rank": "model.selector_rank",
    "selector_top_k": "model.selector_top_k",
    "num_hidden_layers": "model.num_layers",
    "layer_types": "model.layer_types",
    "sliding_window": "model.sliding_window",
    "sliding_in_block": "model.sliding_in_block",
    "hidden_size": "model.hidden_size / the target",
    "intermediate_size": "model.intermediate_size / the target",
    "num_attention_heads": "model.num_attention_heads / the target",
    "num_key_value_heads": "model.num_key_value_heads / the target",
    "head_dim": "model.head_dim / the target",
    "target_hidden_size": "the target's hidden_size",
    "vocab_size": "the target's vocab_size",
    "rope_theta": "model.rope_theta / the target",
    "rope_scaling": "the target's rope scaling",
    "partial_rotary_factor": "model.partial_rotary_factor",
    "max_position_embeddings": "the target's max_position_embeddings",
    "rms_norm_eps": "the target's rms_norm_eps",
    "attention_bias": "(always false here)",
    "hidden_act": "the target's hidden_act",
    # A DFlash drafter directory reads full tap features (an export folds any projection into fc).
    "projection": "the shards' projection / model.projection; a drafter directory reads full tap features",
}


def drafter_dir(path: str | os.PathLike) -> Path:
    """The directory holding the weights: DIR itself, or the latest checkpoint of a run directory DIR."""
    p = Path(path)
    if not (p / MODEL_FILE).is_file() and (p / "checkpoints").is_dir():  # a run directory (its config.json: train's)
        latest = latest_checkpoint(p / "checkpoints")
        if latest is None:
            raise ValueError(f"config key 'model.init_from': run directory '{p}' has no complete checkpoint")
        return latest
    return p


def read_drafter_dir(path: str | os.PathLike) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(drafter config, weights) of a DFlash drafter directory; ValueError naming the file on bad input."""
    from safetensors.torch import load_file

    path = drafter_dir(path)
    cfg = read_drafter_config(path)
    model_path = Path(path) / MODEL_FILE
    if not model_path.is_file():
        raise ValueError(f"config key 'model.init_from': no {MODEL_FILE} in '{path}'")
    state = load_file(str(model_path))
    if state and all(name.startswith("model.") for name in state):  # some trainers save under a `model.` prefix
        state = {name[len("model.") :]: tensor for name, tensor in state.items()}
    return cfg, state


def _comparable(cfg: DrafterConfig) -> dict:
    values = cfg.to_dict()
    values.pop("initializer_range")  # init only; no effect on a loaded drafter
    values["target_hidden_size"] = cfg.target_hidden_size or cfg.hidden_size
    if cfg.rope_scaling is None:  # only scaled rope reads it
        values.pop("max_position_embeddings")
    if cfg.sliding_window is None:  # without sliding layers the in-block semantics mean nothing
        values.pop("sliding_in_block")
    return values


def config_differences(found: DrafterConfig, expected: DrafterConfig, found_in: str = "init_from") -> list[str]:
    """'field: X in <found_in>, Y here (source)' for every field that changes what the drafter computes;
    for a DFlash drafter starting a DFlash2 one, the fields the two classes share except the block size."""
    a, b = _comparable(found), _comparable(expected)
    if backbone_start(found, expected):
        for values in (a, b):
            for key in ("arch", "block_size", *DFLASH2_FIELDS):
                values.pop(key, None)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(
                f"{key}: {a.get(key, '<absent>')!r} in {found_in}, {b.get(key, '<absent>')!r} here "
                f"({SOURCES.get(key, key)})"
            )
    return out


def backbone_start(found: DrafterConfig, expected: DrafterConfig) -> bool:
    """A DFlash drafter starting a DFlash2 one (its backbone; module docstring)."""
    return found.arch == "dflash" and expected.arch == "dflash2"


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """The drafter config of a DFlash drafter directory (config.json, or a checkpoint's drafter_config.json;
    ValueError naming the file)."""
    checkpoint_config = Path(path) / DRAFTER_CONFIG_FILE
    if checkpoint_config.is_file() and not (Path(path) / CONFIG_FILE).is_file():
        try:
            return DrafterConfig.from_dict(json.loads(checkpoint_config.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"config key 'model.init_from': '{checkpoint_config}': {exc}") from None
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(
            f"config key 'model.init_from': no {CONFIG_FILE} in '{path}' (a DFlash drafter directory has "
            "config.json and model.safetensors)"
        )
    try:
        return drafter_config_from_export(json.loads(config_path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"config key 'model.init_from': '{config_path}' is not a DFlash drafter config: {exc}"
        ) from None


def check_init_from(path: str | os.PathLike, expected: DrafterConfig) -> DrafterConfig:
    """The config of DIR if it describes exactly `expected` (or its DFlash backbone), else a ValueError listing
    every difference."""
    found = read_drafter_config(drafter_dir(path))
    differences = config_differences(found, expected)
    if differences:
        raise ValueError(
            f"config key 'model.init_from': the drafter in '{path}' is not the drafter this run trains:\n  "
            + "\n  ".join(differences)
        )
    return found


def warm_start(drafter: DFlashDrafter, path: str | os.PathLike) -> dict:
    """Load DIR's weights into `drafter` (strictly, see the module docstring); returns a record for run.json."""
    found = check_init_from(path, drafter.config)
    source = drafter_dir(path)
    _, state = read_drafter_dir(source)
    model_file = str(source / MODEL_FILE)
    try:
        check_weights(state, found, model_file)  # the drafter DIR describes, DFlash or DFlash2
        with torch.no_grad():
            missing, unexpected = drafter.load_state_dict(state, strict=False)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"config key 'model.init_from': '{model_file}': {exc}") from None
    fresh = [name for name in missing if not backbone_start(found, drafter.config) or not is_dflash2_only(name)]
    if fresh or unexpected:
        raise ValueError(
            f"config key 'model.init_from': '{model_file}' does not hold this drafter's weights: missing "
            f"{fresh[:5]}, unexpected {unexpected[:5]}"
        )
    fs, model_path = resolve(str(Path(model_file).resolve()))
    record = {"path": str(source.resolve()), "model_checksum": file_checksum(fs, model_path), "tensors": len(state)}
    if missing:
        record["left_at_init"] = ["block convolutions (the identity)", "candidate_selector (fresh)"]
        record["from_arch"] = found.arch
    return record


def is_dflash2_only(name: str) -> bool:
    """A tensor DFlash2 adds to DFlash: a block convolution's or the selector's."""
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name
