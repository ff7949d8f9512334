"""One evaluation from start to end (`evaluate_checkpoints`): checkpoints, data, runtime, the pass over
the blocks, the baseline, and the report written as JSON (every number the table shows).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.config import config_to_dict
from common.hashing import json_digest
from common.io import atomic_write_text
from common.provenance import git_sha, tool_version
from shards import ShardDataset
from target.identity import stored_head_or_none
from train.eval.baseline import baseline_report
from train.eval.checkpoints import CheckpointInfo, check_eval_target, load_eval_model, read_checkpoint, target_dir_for
from train.eval.config import EvalConfig
from train.eval.drafting import Runtime
from train.eval.scoring import run_blocks, summarize_model
from train.eval.selection import (
    EvalData,
    bucket_table,
    check_data_fits,
    choose_boundaries,
    choose_split,
    select_eval_data,
)
from train.stored_features import for_data

REPORT_KIND = "dflash-offline-eval"
REPORT_VERSION = 1


# Metrics whose second/first ratio is reported (counts and histograms are the same blocks for both).
_NOT_RATIOED = ("n_blocks", "n_cut", "n_samples", "position_count", "conditional_count", "tau_histogram")


def _ratio(a: Any, b: Any) -> Any:
    if isinstance(a, list) and isinstance(b, list):
        return [_ratio(x, y) for x, y in zip(a, b, strict=True)]
    if a is None or b is None or isinstance(a, (list, dict)) or a == 0:
        return None
    return float(b) / float(a)


def metric_ratios(first: dict, second: dict) -> dict:
    """second / first for every metric of two summaries (None where undefined); counts are left out."""
    return {key: _ratio(first[key], second.get(key)) for key in first if key not in _NOT_RATIOED and key in second}


def _notes(data: EvalData, n_draft: int, cfg: EvalConfig) -> list[str]:
    anchors = (
        "every response position with a response token after it"
        if cfg.max_anchors is None
        else (f"at most {cfg.max_anchors} per sequence, drawn with seed {cfg.seed}")
    )
    notes = [
        f"split: {data.split_reason}",
        f"anchors: {anchors}"
        + (f"; blocks with fewer than {cfg.min_valid_len} target tokens skipped" if cfg.min_valid_len > 1 else ""),
        f"cut blocks: a block near a response end has L < {n_draft} target tokens, accepts at most L and is never "
        "'all accepted'",
        "labels: the target's greedy token given the data prefix (equal to online greedy decoding only where the "
        "data is the target's greedy output)",
        "averages are over blocks (anchors), not per-response means of per-round tau",
    ]
    return notes


def evaluate_checkpoints(checkpoints: Sequence[str], cfg: EvalConfig) -> tuple[dict, Path]:
    """Evaluate one or two checkpoints on `cfg.data`; returns (report, JSON path written)."""
    started = time.time()
    if not 1 <= len(checkpoints) <= 2:
        raise ValueError(f"give one or two checkpoints, got {len(checkpoints)}")
    if not cfg.data:
        raise ValueError("no data to evaluate on: pass --data SHARDS (config key 'data')")
    infos = [read_checkpoint(c) for c in checkpoints]
    block_sizes = sorted({info.drafter_config.block_size for info in infos})
    if len(block_sizes) > 1:
        raise ValueError(
            f"the checkpoints have block sizes {block_sizes}; a side-by-side comparison needs one block size"
        )
    try:
        dataset = ShardDataset(cfg.data, manifest_name=cfg.manifest)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot open the shards dataset '{cfg.data}' (config key 'data'): {exc}") from None
    manifest = dataset.manifest
    infos = [for_data(info, manifest, cfg.projection) for info in infos]  # storage tiers: fold P where the data is full
    checked = [check_data_fits(info, cfg.data, manifest) for info in infos]
    split, fraction, reason = choose_split(cfg, infos, cfg.data, manifest)
    data = select_eval_data(
        dataset, cfg.data, split=split, holdout_fraction=fraction, max_samples=cfg.max_samples, split_reason=reason
    )
    boundaries, boundaries_from = choose_boundaries(cfg, infos)
    buckets, bucket_of_sample = bucket_table(boundaries, data.lengths)

    runtime = Runtime.from_config(cfg, [info.drafter_config.head_dim for info in infos])
    cfg = resolved_config(cfg, runtime, split, fraction, boundaries)
    targets, target_checks, models = _checked_models(infos, cfg, manifest, runtime)
    eval_start = time.perf_counter()
    table, scores = run_blocks(models, data, cfg, runtime, bucket_of_sample)
    seconds = time.perf_counter() - eval_start
    baseline = baseline_report(table, cfg.budgets, cfg.topk, buckets)
    n_draft = block_sizes[0] - 1
    out = Path(cfg.out) if cfg.out else default_out_path(infos, data.name)
    cfg = dataclasses.replace(cfg, out=str(out))

    report = {
        "kind": REPORT_KIND,
        "version": REPORT_VERSION,
        "config": config_to_dict(cfg),
        "data": {
            "path": data.root,
            "manifest": cfg.manifest,
            "manifest_digest": json_digest(manifest),
            "split": data.split,
            "split_reason": data.split_reason,
            "holdout_fraction": data.holdout_fraction,
            "samples_in_dataset": data.samples_in_dataset,
            "samples": data.n_samples,
            "tokens": int(data.lengths.sum()),
            "blocks": table.n_blocks,
            "blocks_digest": table.digest(data.sample_ids),
            "boundaries": boundaries,
            "boundaries_from": boundaries_from,
            "checked_fields": checked[0],
        },
        "block_size": block_sizes[0],
        "budgets": sorted(set(cfg.budgets)),
        "buckets": buckets,
        "checkpoints": [
            {
                "path": str(info.path),
                "label": info.label,
                "run_dir": str(info.run_dir) if info.run_dir else None,
                "step": info.step,
                "target": target,
                "target_check": target_check,
                "checked_fields": fields,
                **summarize_model(table, s, buckets),
            }
            for info, target, target_check, fields, s in zip(
                infos, targets, target_checks, checked, scores, strict=True
            )
        ],
        "baseline": baseline,
        "notes": _notes(data, n_draft, cfg),
        "device": str(runtime.device),
        "precision": str(runtime.autocast_dtype or torch.float32).replace("torch.", ""),
        "kernels": runtime.kernels.to_dict(),
        "seconds": seconds,
        "blocks_per_second": table.n_blocks * len(models) / seconds if seconds > 0 else None,
        "time": started,
        "git_sha": git_sha(),
        "tool_version": tool_version(),
    }
    if len(infos) == 2:
        report["ratio"] = _ratios(*report["checkpoints"])

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(str(out), json.dumps(report, indent=1, sort_keys=False) + "\n")
    return report, out


def _checked_models(
    infos: list[CheckpointInfo], cfg: EvalConfig, manifest: dict, runtime: Runtime
) -> tuple[list[str], list[dict], list]:
    """(each checkpoint's target directory, its target check, its model loaded for scoring)."""
    targets = [target_dir_for(info, cfg.target, manifest) for info in infos]
    # Each target's embedding and head are read once: hashed for every check, kept for every model.
    stored = {target: stored_head_or_none(target) for target in dict.fromkeys(targets)}
    target_checks = [
        check_eval_target(info, target, cfg.data, manifest, cfg.allow_target_mismatch, stored[target])
        for info, target in zip(infos, targets, strict=True)
    ]
    models = [
        load_eval_model(info, target, runtime.device, runtime.head_dtype, stored[target])
        for info, target in zip(infos, targets, strict=True)
    ]
    return targets, target_checks, models


def _ratios(first: dict, second: dict) -> dict:
    """The second checkpoint's metrics over the first's, overall and per bucket."""
    return {
        "overall": metric_ratios(first["overall"], second["overall"]),
        "buckets": [metric_ratios(a, b) for a, b in zip(first["buckets"], second["buckets"], strict=True)],
    }


def resolved_config(
    cfg: EvalConfig, runtime: Runtime, split: str, fraction: float | None, boundaries: list[int]
) -> EvalConfig:
    """`cfg` with every automatic choice replaced by what is used, as saved in the report."""
    return dataclasses.replace(
        cfg,
        split=split,
        holdout_fraction=fraction,
        boundaries=list(boundaries),
        device=runtime.device.type,
        precision="bf16" if runtime.autocast_dtype is not None else "fp32",
        attention=runtime.attention,
        blocks_per_forward=runtime.blocks_per_forward(cfg),
    )


def default_out_path(infos: Sequence[CheckpointInfo], data_name: str) -> Path:
    name = f"eval_{data_name}"
    if len(infos) == 2:
        second = infos[1]
        name += "_vs_" + re.sub(r"[^A-Za-z0-9._-]+", "_", second.label.replace("/", "-"))
    return infos[0].path / f"{name}.json"
