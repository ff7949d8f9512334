"""What a checkpoint says (`read_checkpoint`, without loading weights) and the drafter it holds, loaded
with the target's frozen embedding and lm_head (`load_eval_model`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shards.provenance import provenance_of
from target.identity import StoredHead, target_identity
from target.identity_check import OVERRIDE_KEY, check_target
from train.checkpoint import DRAFTER_CONFIG_FILE, MODEL_FILE, STATE_FILE, latest_checkpoint, verify_checkpoint
from train.dflash2 import build_drafter
from train.drafter_config import DrafterConfig
from train.model import TargetHead


@dataclasses.dataclass
class CheckpointInfo:
    """What a checkpoint and its run directory say, without loading any weights."""

    path: Path
    run_dir: Path | None
    step: int
    train_config: dict  # the resolved TrainConfig as saved in state.json
    drafter_config: Any  # train.drafter_config.DrafterConfig
    run_info: dict  # run.json ({} if absent)
    data_plan: dict | None  # data_plan.json
    fold: Any = None  # shards.projection.Projection folded into fc at load (projected drafter, full-feature data)

    @property
    def label(self) -> str:
        run = self.run_dir.name if self.run_dir is not None else self.path.parent.name
        return f"{run}/{self.path.name}"

    def train_value(self, dotted: str) -> Any:
        """A key of the saved train config (None if absent)."""
        node: Any = self.train_config
        for part in dotted.split("."):
            if not isinstance(node, dict):
                return None
            node = node.get(part)
        return node


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory `path` names: itself, or the latest checkpoint of a run directory."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        return p
    if (p / "checkpoints").is_dir():
        latest = latest_checkpoint(p / "checkpoints")
        if latest is None:
            raise ValueError(f"run directory '{p}' has no complete checkpoint under checkpoints/")
        return latest
    raise ValueError(f"'{p}' is neither a checkpoint directory (no {STATE_FILE}) nor a run directory (no checkpoints/)")


def _read_json_file(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} '{path}' is not valid JSON: {exc}") from None


def read_checkpoint(path: str | Path) -> CheckpointInfo:
    """Metadata of a checkpoint (or of a run directory's latest one); ValueError naming the file."""
    ckpt = resolve_checkpoint_dir(path)
    # Names a damaged file before anything is loaded; returns state.json, already parsed.
    state = verify_checkpoint(ckpt, files=(MODEL_FILE, DRAFTER_CONFIG_FILE))
    config_file = ckpt / DRAFTER_CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"checkpoint '{ckpt}' has no {DRAFTER_CONFIG_FILE}")
    try:
        drafter_config = DrafterConfig.from_dict(_read_json_file(config_file, "drafter config"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"'{config_file}': {exc}") from None
    train_config = state.get("config")
    if not isinstance(train_config, dict):
        raise ValueError(f"'{ckpt / STATE_FILE}' has no 'config' table (the resolved train config)")
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    run_info, data_plan = {}, None
    if run_dir is not None and (run_dir / "run.json").is_file():
        run_info = _read_json_file(run_dir / "run.json", "run file")
    if run_dir is not None and (run_dir / "data_plan.json").is_file():
        data_plan = _read_json_file(run_dir / "data_plan.json", "data plan")
    return CheckpointInfo(ckpt, run_dir, int(state.get("step", 0)), train_config, drafter_config, run_info, data_plan)


def target_dir_for(info: CheckpointInfo, override: str | None, manifest: dict) -> str:
    """The target checkpoint directory whose embedding / lm_head the drafter was trained with."""
    candidates = (
        ("config key 'target'", override),
        (f"train config model.target of '{info.path}'", info.train_value("model.target")),
        (f"run.json 'target' of '{info.run_dir}'", info.run_info.get("target")),
        (
            "the eval shards' provenance target.name_or_path",
            provenance_of(manifest).target.name_or_path,
        ),
    )
    for source, value in candidates:
        if value:
            if not Path(value, "config.json").is_file():
                raise ValueError(f"no target checkpoint directory at {value!r} (from {source}); set target=DIR")
            return str(value)
    raise ValueError("no target directory known for the frozen embedding / lm_head; set target=DIR")


def check_eval_target(
    info: CheckpointInfo, target_dir: str, data: str, manifest: dict, allowed: bool, stored: StoredHead | None = None
) -> dict:
    """The target's identity checked against the run's (run.json) and the evaluated shards' (their
    manifest): ValueError naming both unless the same or `allowed` (target.identity); `stored`:
    its embedding and head already read, hashed instead of read again."""
    identity = target_identity(target_dir, stored)
    run = info.run_dir or info.path
    shards_target = provenance_of(manifest).target.identity()
    return {
        "identity": identity,
        "run": check_target(
            identity,
            info.run_info.get("target_identity"),
            made=f"run '{run}' trained with",
            key=OVERRIDE_KEY,
            allowed=allowed,
        ),
        "data": check_target(
            identity,
            shards_target,
            made=f"the shards at '{data}' were extracted from",
            key=OVERRIDE_KEY,
            allowed=allowed,
        ),
    }


@dataclasses.dataclass
class EvalModel:
    """One drafter ready to evaluate: the model, the target's frozen head, and its block layout."""

    model: nn.Module  # a DFlashDrafter (or DFlash2Drafter), or any module with its forward signature
    head: nn.Module  # TargetHead: .embed(ids), .logits(hidden)
    block_size: int
    mask_token_id: int
    mask_rules: dict | None = None  # {layer type: train.attention.MaskRule}; None = all full_attention


def load_eval_model(
    info: CheckpointInfo,
    target_dir: str,
    device: torch.device,
    head_dtype: torch.dtype,
    stored: StoredHead | None = None,
) -> EvalModel:
    """The drafter's weights (model.safetensors only, never the optimizer state) and the target head
    (from `stored` when the caller has read it: `target.identity.read_stored_head`)."""
    from safetensors.torch import load_file

    cfg = info.drafter_config
    drafter = build_drafter(cfg)
    try:
        state = load_file(str(info.path / MODEL_FILE))
        if info.fold is not None:  # trained on projected features, evaluated on full ones: fc = fc'·P
            state["fc.weight"] = info.fold.fold(state["fc.weight"]).to(state["fc.weight"].dtype)
        drafter.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"'{info.path / MODEL_FILE}' does not match its drafter_config.json: {exc}") from None
    head = TargetHead.from_pretrained(target_dir, dtype=head_dtype, stored=stored)
    if head.hidden_size != cfg.hidden_size or head.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"target '{target_dir}' has embedding [{head.vocab_size}, {head.hidden_size}] but the drafter of "
            f"'{info.path}' "
            f"needs [vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}]; set target= to the run's target"
        )
    return EvalModel(drafter.to(device).eval(), head.to(device), cfg.block_size, cfg.mask_token_id, cfg.mask_rules)
