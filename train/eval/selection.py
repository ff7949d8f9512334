"""Which samples an evaluation reads: the whole dataset or the held-out split of the run that trained on
it (`choose_split`, `select_eval_data`), the check that the shards fit the drafter, and the
sequence-length buckets of the table (`bucket_table`, `choose_boundaries`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.hashing import json_digest
from common.io import join, read_json, resolve
from shards.provenance import provenance_of
from train.buckets import assign_buckets
from train.eval.checkpoints import CheckpointInfo
from train.eval.config import EvalConfig
from train.samples import check_compatible, holdout_mask, spread_subset

_SUBSET_SALT = b"dflash-eval-subset:"


@dataclasses.dataclass
class EvalData:
    """The samples to evaluate, in dataset index order, and how they were chosen."""

    dataset: Any  # shards.ShardDataset
    root: str
    name: str  # for the default output file name
    indices: np.ndarray  # int64 dataset indices
    sample_ids: list[str]
    lengths: np.ndarray  # int64 tokens per sample
    split: str  # "holdout" | "all"
    split_reason: str
    holdout_fraction: float | None
    samples_in_dataset: int

    @property
    def n_samples(self) -> int:
        return int(self.indices.size)


def select_eval_data(
    dataset, root: str, *, split: str, holdout_fraction: float | None, max_samples: int | None, split_reason: str = ""
) -> EvalData:
    """The samples of `dataset` to evaluate: all, or its `is_holdout(id, holdout_fraction)` split."""
    index = dataset.index
    all_ids = [str(s) for s in index.column("sample_id").to_pylist()]
    all_lengths = np.asarray(index.column("n_tokens").to_numpy(), dtype=np.int64)
    if split == "holdout":
        if holdout_fraction is None or holdout_fraction <= 0.0:
            raise ValueError(
                f"split=holdout needs a positive holdout fraction, got {holdout_fraction!r}: the run held nothing "
                "out, so every "
                f"sample of '{root}' was trained on; evaluate held-out shards with --data, or pass split=all to "
                "measure the "
                f"training samples on purpose"
            )
        chosen = np.flatnonzero(holdout_mask(all_ids, holdout_fraction)).astype(np.int64)
    elif split == "all":
        chosen = np.arange(len(all_ids), dtype=np.int64)
    else:
        raise AssertionError(split)
    chosen = spread_subset(all_ids, chosen, max_samples, _SUBSET_SALT)
    if chosen.size == 0:
        raise ValueError(
            f"no samples to evaluate in '{root}' (split={split}, holdout_fraction={holdout_fraction}, "
            f"{len(all_ids)} in the dataset)"
        )
    name = Path(str(root).rstrip("/")).name or "data"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ("-holdout" if split == "holdout" else "")
    return EvalData(
        dataset=dataset,
        root=str(root),
        name=name,
        indices=chosen,
        sample_ids=[all_ids[i] for i in chosen],
        lengths=all_lengths[chosen],
        split=split,
        split_reason=split_reason,
        holdout_fraction=holdout_fraction if split == "holdout" else None,
        samples_in_dataset=len(all_ids),
    )


def _same_path(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    if "://" in str(a) or "://" in str(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


def trained_on(info: CheckpointInfo, root: str, manifest: dict) -> bool:
    """Whether the checkpoint's run trained on this dataset (manifest digest from run.json, or path)."""
    digest = info.run_info.get("manifest_digest")
    if digest is not None and digest == json_digest(manifest):
        return True
    return _same_path(info.train_value("data.shards"), root)


def choose_split(
    cfg: EvalConfig, infos: Sequence[CheckpointInfo], root: str, manifest: dict
) -> tuple[str, float | None, str]:
    """(split, holdout fraction, reason in words) for `cfg.split`, see the module docstring."""
    trained = [info for info in infos if trained_on(info, root, manifest)]
    names = ", ".join(info.label for info in trained)
    split = cfg.split
    if split == "auto":
        split = "holdout" if trained else "all"
    if split == "all":
        if trained:
            return (
                "all",
                None,
                f"every sample, although {names} trained on this dataset (split=all): partly training data",
            )
        why = "auto: no run trained on this dataset" if cfg.split == "auto" else "split=all"
        return "all", None, f"every sample ({why})"
    fractions = [info.train_value("data.holdout_fraction") for info in (trained or infos[:1])]
    if cfg.holdout_fraction is not None:
        fraction, source = cfg.holdout_fraction, "config key 'holdout_fraction'"
    else:
        if any(f is None for f in fractions):
            raise ValueError(
                "split=holdout: the run's train config has no data.holdout_fraction; set holdout_fraction="
            )
        fraction = float(min(fractions))
        source = "the run's data.holdout_fraction" + (" (the smaller of the two runs')" if len(fractions) > 1 else "")
    trained_note = f"this dataset trained {names}" if trained else "no run trained on this dataset"
    return "holdout", fraction, f"held-out split only ({trained_note}): is_holdout(sample id, {fraction:g}), {source}"


def expected_manifest_fields(info: CheckpointInfo, train_manifest: dict | None) -> dict:
    """What the eval shards must agree with: the drafter's taps and widths, and the training data's
    tokenizer and target config when the training manifest is readable."""
    cfg = info.drafter_config
    expected = {
        "layer_ids": list(cfg.target_layer_ids),
        "hidden_size": int(cfg.target_hidden_size or cfg.hidden_size),
        "hidden_width": int(cfg.feature_width),
        "vocab_size": int(cfg.vocab_size),
        "topk": 1,
        "projection": cfg.projection,
    }
    provenance = provenance_of(train_manifest or {})
    tokenizer_hash, config_hash = provenance.tokenizer.hash, provenance.target.config_hash
    if tokenizer_hash is not None:
        expected["tokenizer_hash"] = tokenizer_hash
    if config_hash is not None:
        expected["target_config_hash"] = config_hash
    return expected


def _training_manifest(info: CheckpointInfo, root: str, manifest: dict) -> dict | None:
    """The manifest of the dataset the run trained on (None if it cannot be read)."""
    if trained_on(info, root, manifest):
        return manifest
    shards = info.train_value("data.shards")
    if not shards:
        return None
    try:
        fs, path = resolve(shards)
        return read_json(fs, join(path, info.train_value("data.manifest") or "manifest.json"))
    except (OSError, ValueError):
        return None


def check_data_fits(info: CheckpointInfo, root: str, manifest: dict) -> list[str]:
    """Refuse shards that do not fit the drafter (ValueError naming the fields); returns what was checked."""
    expected = expected_manifest_fields(info, _training_manifest(info, root, manifest))
    try:
        check_compatible(manifest, expected)
    except ValueError as exc:
        raise ValueError(f"'{root}' cannot evaluate checkpoint '{info.path}': {exc}") from None
    return sorted(expected)


def bucket_table(boundaries: Sequence[int], lengths: np.ndarray) -> tuple[list[dict], np.ndarray]:
    """(one descriptor per bucket, bucket id per sample) for inclusive upper edges `boundaries`."""
    edges = [int(b) for b in boundaries]
    bucket_of_sample = assign_buckets(lengths, edges) if edges else np.zeros(len(lengths), dtype=np.int64)
    counts = np.bincount(bucket_of_sample, minlength=len(edges) + 1)
    table = []
    for i in range(len(edges) + 1):
        lo = edges[i - 1] + 1 if i > 0 else 1
        hi = edges[i] if i < len(edges) else None
        if hi is None and i == 0:
            label = "all lengths"
        elif hi is None:
            label = f">{lo - 1}"
        elif i == 0:
            label = f"<={hi}"
        else:
            label = f"{lo}-{hi}"
        table.append({"bucket": i, "lo": lo, "hi": hi, "label": label, "n_samples": int(counts[i])})
    return table, bucket_of_sample


def choose_boundaries(cfg: EvalConfig, infos: Sequence[CheckpointInfo]) -> tuple[list[int], str]:
    if cfg.boundaries is not None:
        return list(cfg.boundaries), "config key 'boundaries'"
    plan = infos[0].data_plan
    if plan is not None and isinstance(plan.get("boundaries"), list):
        return [int(b) for b in plan["boundaries"]], f"data_plan.json of run '{infos[0].run_dir}'"
    return [], "none (the run has no data_plan.json and boundaries is not set): one bucket"
