"""Offline evaluation of DFlash drafters: per-position acceptance, chain τ and DDTree-B τ.

    python -m train.eval CHECKPOINT [CHECKPOINT2] --data SHARDS [--out PATH] [--config FILE] [key=value ...]
    make eval CKPT=runs/abl/checkpoints/step-00001000 DATA=artifacts/tiny/shards/heldout
    python -m train.eval --help                 # every key with its default and allowed values

CHECKPOINT is a checkpoint directory (`runs/NAME/checkpoints/step-XXXXXXXX`) or a run directory
(its latest checkpoint is taken). The frozen embedding / lm_head come from the target the run was
trained with (`target=` overrides). With two checkpoints both are evaluated on exactly the same
blocks (one pass over the data) and the table shows them side by side with the ratio second/first.

What is measured (`dflash.md` §4.3, §5.4). One block per anchor a: `[x_a, MASK x D]` at positions
a..a+D (D = block_size - 1 = 15), context = the target's tap features of positions < a, the same
inputs online decoding gives the drafter right after the target produced x_a. The target's
continuation y_k (k = 1..D) is its stored greedy token for position a+k, `topk_ids[a+k-1, 0]`.
Anchors: every response (loss-mask) position a whose next position is a response position too,
or `max_anchors` of them per sequence drawn deterministically from (seed, sample id). A block's
valid length L is the number of leading positions a+1, a+2, ... that are still inside the same
response (at most D): online, the response ends there, so such a round can accept at most L drafts
(`train.acceptance`, cut blocks). Metrics, overall and per sequence-length bucket:
  - per-position acceptance k = 1..D, unconditional and conditional on reaching k;
  - chain τ = 1 + leading accepted drafts (the bonus token included) and its surrogate;
  - DDTree-B τ for each budget (best-first tree over the drafter's top-B log-probs per depth,
    walked by the target's tokens; `train.ddtree`) and its surrogate expectation;
  - the fraction of blocks with all D drafts accepted (a cut block never is).
These are averages over blocks (anchors), not the per-response mean of per-round τ that online
benchmarks report, and the labels are the target's greedy tokens *given the data prefix*: they equal
online greedy decoding only where the data is the target's own greedy output (§4.3).

Most-frequent-label baseline, on the same blocks (JSON `baseline`, rows `most-frequent-label
baseline: ...`): a draft-free "drafter" whose distribution at every depth of every block is the
frequency of the labels at the valid positions of these very blocks. Its chain drafts the most
frequent label everywhere, its DDTree holds the most frequent labels at every depth. A drafter is
only worth its margin over this.

Data. If `--data` is the dataset the run trained on (same manifest digest as in run.json, or the
same path), only its held-out split is evaluated (`is_holdout` with the run's
`data.holdout_fraction`; with two runs the smaller fraction, so no sample either run trained on is
used); any other dataset is evaluated whole (`split=` overrides). Shards that do not fit the
drafter are refused (`train.data.check_compatible`). Buckets: the run's `data_plan.json` boundaries
unless `boundaries=` is set; an empty bucket is reported as empty.

Output: a table on stdout (a pure function of the JSON: `render_report`) and a JSON file (`--out`,
default `eval_<data-name>.json` inside the first checkpoint directory, `<data-name>` being the
dataset directory's name plus `-holdout` for a held-out split, and `_vs_<run>-<step>` with a second
checkpoint) holding the resolved eval config, the checkpoint paths, the data manifest digest, a
digest of the exact blocks, and every number the table shows.

Batching: the anchors of a sequence are evaluated many blocks per forward with the training mask
(`train.attention`), several short sequences per forward, context trimmed to the last anchor of
the forward. Logits exist for `chunk_rows` block tokens at a time; only the top-max(budgets)
log-probs per depth are kept. Works on CPU (fp32, dense mask + SDPA) and CUDA (bf16 autocast, flex
attention where its kernel fits the head dim: `train.kernels`, the trainer's own choice); DDTree
scoring runs on the CPU (in a background thread when the drafter is on CUDA).

Shape legend: T tokens of a sample, F tap feature width, A anchors of a piece, D draft positions
(block_size - 1), K block size, R rows of a forward, N blocks per row, S context, Q = N*K, P = S+Q,
M kept blocks of a forward, k kept top-k per depth, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch
import xxhash
from torch import Tensor, nn

from common.config import ConfigError, config_to_dict, describe, fail, knob, load_config
from common.hashing import json_digest
from train.acceptance import ChainBlocks, chain_blocks, summarize_blocks, summarize_by_group, valid_mask
from train.ddtree import ddtree_taus, draft_topk
from train.kernels import EVAL_KEYS, KernelPlan, OnKernels, choose_kernels

__all__ = [
    "EvalConfig",
    "CheckpointInfo",
    "EvalModel",
    "EvalData",
    "Runtime",
    "BlockTable",
    "DraftScores",
    "read_checkpoint",
    "resolve_checkpoint_dir",
    "load_eval_model",
    "select_eval_data",
    "response_run_lengths",
    "block_anchors",
    "block_targets",
    "run_blocks",
    "summarize_model",
    "label_frequency_topk",
    "label_baseline",
    "metric_ratios",
    "bucket_table",
    "evaluate_checkpoints",
    "render_report",
    "main",
]

REPORT_KIND = "dflash-offline-eval"
REPORT_VERSION = 1
_SUBSET_SALT = b"dflash-eval-subset:"
_ANCHOR_SALT = b"dflash-eval-anchors:"
# Forwards whose DDTree scoring may still be queued behind the GPU (each holds its top-k tensors).
_SCORING_BACKLOG = 4
BASELINE_NAME = "most-frequent-label baseline"
# Blocks per scoring call of the baseline (its per-depth top-k is the same for every block).
_BASELINE_CHUNK = 4096
# Metrics whose second/first ratio is reported (counts and histograms are the same blocks for both).
_NOT_RATIOED = ("n_blocks", "n_cut", "n_samples", "position_count", "conditional_count", "tau_histogram")


# ----------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass
class EvalConfig:
    """Every knob of `python -m train.eval` (the `[eval]` table of a config file)."""

    data: str | None = knob(None, help="shards dataset root to evaluate on (also --data)")
    manifest: str = knob("manifest.json", help="manifest file name inside the shards root")
    out: str | None = knob(
        None, help="JSON output path (also --out); none = eval_<data-name>.json inside the first checkpoint directory"
    )
    split: Literal["auto", "holdout", "all"] = knob(
        "auto", help="auto: the held-out split if --data is the dataset a run trained on, else every sample; holdout: only is_holdout samples; all: every sample"
    )
    holdout_fraction: float | None = knob(
        None, help="fraction for split=holdout; none = the run's data.holdout_fraction (the smaller one of two runs trained on this data)", min=0.0, max=1.0
    )
    max_samples: int | None = knob(None, help="evaluate at most this many samples (a fixed, uniformly spread subset by sample-id hash); none = all", min=1)
    max_anchors: int | None = knob(
        None, help="anchors per sequence; none = every eligible position; fewer are drawn uniformly without replacement, seeded by (seed, sample id)", min=1
    )
    min_valid_len: int = knob(
        1, help="skip anchors whose block has fewer target tokens than this (block_size-1 = only full blocks); 1 keeps every block, cut ones included, as online decoding meets them", min=1
    )
    seed: int = knob(0, help="seed of the anchor subsample (max_anchors)", min=0)
    budgets: list[int] = knob(factory=lambda: [8, 16, 32, 64], help="DDTree node budgets; the drafter's top-max(budgets) log-probs per depth are kept", min=1, max=4096)
    boundaries: list[int] | None = knob(
        None, help="sequence-length bucket upper edges (inclusive, strictly increasing); none = the run's data_plan.json boundaries (one bucket if it has none)", min=1
    )
    target: str | None = knob(None, help="target checkpoint directory for the frozen embedding and lm_head; none = the one the run was trained with")
    projection: str | None = knob(None, help="a drafter trained on projected features, evaluated on full ones: the projection file to fold into fc; none = its training dataset's")
    device: Literal["auto", "cpu", "cuda"] = knob("auto", help="auto = cuda when available")
    precision: Literal["auto", "bf16", "fp32"] = knob("auto", help="bf16 autocast or fp32; auto = bf16 on CUDA, fp32 on CPU")
    attention: Literal["auto", "flex", "sdpa"] = knob(
        "auto", help="attention kernel for the many-block mask: auto = flex where its CUDA kernel works for the head dim (16..256, Triton), else sdpa with a dense mask (train.kernels)"
    )
    blocks_per_forward: int | None = knob(
        None, help="blocks per drafter forward (a long sequence is split, short ones share a forward); none = 128 on CPU (the dense mask's cost grows with it), 512 on CUDA", min=1
    )
    chunk_rows: int = knob(2048, help="block tokens per lm_head chunk: full-vocabulary logits exist for this many rows at once", min=1)
    load_threads: int = knob(2, help="background threads reading samples", min=1, max=64)
    progress: bool = knob(True, help="show a tqdm progress bar (on stderr)")

    def check(self) -> None:
        if not self.budgets:
            fail("budgets", "needs at least one DDTree budget")
        if len(set(self.budgets)) != len(self.budgets):
            fail("budgets", f"has duplicates: {self.budgets}")
        if self.boundaries is not None and any(a >= b for a, b in zip(self.boundaries, self.boundaries[1:])):
            fail("boundaries", f"must be strictly increasing, got {self.boundaries}")

    @property
    def topk(self) -> int:
        """Top-k log-probs kept per depth: the largest budget (a tree of B nodes uses <= B per depth)."""
        return max(self.budgets)


# ----------------------------------------------------------------------------------------------
# Checkpoints


@dataclasses.dataclass
class CheckpointInfo:
    """What a checkpoint and its run directory say, without loading any weights."""

    path: Path
    run_dir: Path | None
    step: int
    train_config: dict  # the resolved TrainConfig as saved in state.json
    drafter_config: Any  # train.model.DrafterConfig
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
    from train.checkpoint import STATE_FILE, latest_checkpoint

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
    from train.checkpoint import DRAFTER_CONFIG_FILE, MODEL_FILE, STATE_FILE, verify_checkpoint
    from train.model import DrafterConfig

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
        ("the eval shards' provenance target.name_or_path", ((manifest.get("provenance") or {}).get("target") or {}).get("name_or_path")),
    )
    for source, value in candidates:
        if value:
            if not Path(value, "config.json").is_file():
                raise ValueError(f"no target checkpoint directory at {value!r} (from {source}); set target=DIR")
            return str(value)
    raise ValueError("no target directory known for the frozen embedding / lm_head; set target=DIR")


@dataclasses.dataclass
class EvalModel:
    """One drafter ready to evaluate: the model, the target's frozen head, and its block layout."""

    model: nn.Module  # DFlashDrafter, or any module with its forward signature
    head: nn.Module  # TargetHead: .embed(ids), .logits(hidden)
    block_size: int
    mask_token_id: int
    mask_rules: dict | None = None  # {layer type: train.attention.MaskRule}; None = all full_attention


def load_eval_model(info: CheckpointInfo, target_dir: str, device: torch.device, head_dtype: torch.dtype) -> EvalModel:
    """The drafter's weights (model.safetensors only, never the optimizer state) and the target head."""
    from safetensors.torch import load_file

    from train.checkpoint import MODEL_FILE
    from train.model import DFlashDrafter, TargetHead

    cfg = info.drafter_config
    drafter = DFlashDrafter(cfg)
    try:
        state = load_file(str(info.path / MODEL_FILE))
        if info.fold is not None:  # trained on projected features, evaluated on full ones: fc = fc'·P
            state["fc.weight"] = info.fold.fold(state["fc.weight"]).to(state["fc.weight"].dtype)
        drafter.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"'{info.path / MODEL_FILE}' does not match its drafter_config.json: {exc}") from None
    head = TargetHead.from_pretrained(target_dir, dtype=head_dtype)
    if head.hidden_size != cfg.hidden_size or head.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"target '{target_dir}' has embedding [{head.vocab_size}, {head.hidden_size}] but the drafter of '{info.path}' "
            f"needs [vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}]; set target= to the run's target"
        )
    return EvalModel(drafter.to(device).eval(), head.to(device), cfg.block_size, cfg.mask_token_id, cfg.mask_rules)


# ----------------------------------------------------------------------------------------------
# Data selection


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


def select_eval_data(dataset, root: str, *, split: str, holdout_fraction: float | None, max_samples: int | None,
                     split_reason: str = "") -> EvalData:
    """The samples of `dataset` to evaluate: all, or its `is_holdout(id, holdout_fraction)` split."""
    from train.data import holdout_mask, spread_subset

    index = dataset.index
    all_ids = [str(s) for s in index.column("sample_id").to_pylist()]
    all_lengths = np.asarray(index.column("n_tokens").to_numpy(), dtype=np.int64)
    if split == "holdout":
        if holdout_fraction is None or holdout_fraction <= 0.0:
            raise ValueError(
                f"split=holdout needs a positive holdout fraction, got {holdout_fraction!r}: the run held nothing out, so every "
                f"sample of '{root}' was trained on; evaluate held-out shards with --data, or pass split=all to measure the "
                f"training samples on purpose"
            )
        chosen = np.flatnonzero(holdout_mask(all_ids, holdout_fraction)).astype(np.int64)
    elif split == "all":
        chosen = np.arange(len(all_ids), dtype=np.int64)
    else:
        raise AssertionError(split)
    chosen = spread_subset(all_ids, chosen, max_samples, _SUBSET_SALT)
    if chosen.size == 0:
        raise ValueError(f"no samples to evaluate in '{root}' (split={split}, holdout_fraction={holdout_fraction}, {len(all_ids)} in the dataset)")
    name = Path(str(root).rstrip("/")).name or "data"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ("-holdout" if split == "holdout" else "")
    return EvalData(
        dataset=dataset, root=str(root), name=name, indices=chosen, sample_ids=[all_ids[i] for i in chosen],
        lengths=all_lengths[chosen], split=split, split_reason=split_reason,
        holdout_fraction=holdout_fraction if split == "holdout" else None, samples_in_dataset=len(all_ids),
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


def choose_split(cfg: EvalConfig, infos: Sequence[CheckpointInfo], root: str, manifest: dict) -> tuple[str, float | None, str]:
    """(split, holdout fraction, reason in words) for `cfg.split`, see the module docstring."""
    trained = [info for info in infos if trained_on(info, root, manifest)]
    names = ", ".join(info.label for info in trained)
    split = cfg.split
    if split == "auto":
        split = "holdout" if trained else "all"
    if split == "all":
        if trained:
            return "all", None, f"every sample, although {names} trained on this dataset (split=all): partly training data"
        why = "auto: no run trained on this dataset" if cfg.split == "auto" else "split=all"
        return "all", None, f"every sample ({why})"
    fractions = [info.train_value("data.holdout_fraction") for info in (trained or infos[:1])]
    if cfg.holdout_fraction is not None:
        fraction, source = cfg.holdout_fraction, "config key 'holdout_fraction'"
    else:
        if any(f is None for f in fractions):
            raise ValueError("split=holdout: the run's train config has no data.holdout_fraction; set holdout_fraction=")
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
    provenance = (train_manifest or {}).get("provenance") or {}
    tokenizer_hash = (provenance.get("tokenizer") or {}).get("hash")
    config_hash = (provenance.get("target") or {}).get("config_hash")
    if tokenizer_hash is not None:
        expected["tokenizer_hash"] = tokenizer_hash
    if config_hash is not None:
        expected["target_config_hash"] = config_hash
    return expected


def _training_manifest(info: CheckpointInfo, root: str, manifest: dict) -> dict | None:
    """The manifest of the dataset the run trained on (None if it cannot be read)."""
    from common.io import join, read_json, resolve

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
    from train.data import check_compatible

    expected = expected_manifest_fields(info, _training_manifest(info, root, manifest))
    try:
        check_compatible(manifest, expected)
    except ValueError as exc:
        raise ValueError(f"'{root}' cannot evaluate checkpoint '{info.path}': {exc}") from None
    return sorted(expected)


# ----------------------------------------------------------------------------------------------
# Buckets


def bucket_table(boundaries: Sequence[int], lengths: np.ndarray) -> tuple[list[dict], np.ndarray]:
    """(one descriptor per bucket, bucket id per sample) for inclusive upper edges `boundaries`."""
    from train.buckets import assign_buckets

    edges = [int(b) for b in boundaries]
    bucket_of_sample = assign_buckets(lengths, edges) if edges else np.zeros(len(lengths), dtype=np.int64)
    counts = np.bincount(bucket_of_sample, minlength=len(edges) + 1)
    table = []
    for i in range(len(edges) + 1):
        lo = edges[i - 1] + 1 if i > 0 else 1
        hi = edges[i] if i < len(edges) else None
        if hi is None:
            label = f">{lo - 1}" if i > 0 else "all lengths"
        else:
            label = f"<={hi}" if i == 0 else f"{lo}-{hi}"
        table.append({"bucket": i, "lo": lo, "hi": hi, "label": label, "n_samples": int(counts[i])})
    return table, bucket_of_sample


def choose_boundaries(cfg: EvalConfig, infos: Sequence[CheckpointInfo]) -> tuple[list[int], str]:
    if cfg.boundaries is not None:
        return list(cfg.boundaries), "config key 'boundaries'"
    plan = infos[0].data_plan
    if plan is not None and isinstance(plan.get("boundaries"), list):
        return [int(b) for b in plan["boundaries"]], f"data_plan.json of run '{infos[0].run_dir}'"
    return [], "none (the run has no data_plan.json and boundaries is not set): one bucket"


# ----------------------------------------------------------------------------------------------
# Anchors and targets


def response_run_lengths(loss_mask_T: Tensor) -> Tensor:
    """int64 [T]: how many consecutive response positions start at t (0 where t is not one)."""
    mask_T = loss_mask_T.bool()
    T = mask_T.numel()
    position_T = torch.arange(T)
    breaks_T = torch.where(mask_T, T, position_T)
    first_break_at_or_after_T = breaks_T.flip(0).cummin(0).values.flip(0)
    return first_break_at_or_after_T - position_T


def _anchor_generator_seed(seed: int, sample_id: str) -> int:
    return xxhash.xxh3_64_intdigest(_ANCHOR_SALT + f"{seed}:{sample_id}".encode("utf-8")) & (2**63 - 1)


def block_anchors(loss_mask_T: Tensor, n_draft: int, *, min_valid_len: int = 1, max_anchors: int | None = None,
                  seed: int = 0, sample_id: str = "") -> tuple[Tensor, Tensor]:
    """(anchors_A sorted, valid_len_A): response positions a with >= min_valid_len response tokens
    right after them (valid length L = that count, at most n_draft); at most `max_anchors` of them,
    drawn uniformly without replacement from a generator fixed by (seed, sample id)."""
    run_T = response_run_lengths(loss_mask_T)
    next_run_T = torch.zeros_like(run_T)
    next_run_T[:-1] = run_T[1:]
    valid_len_T = next_run_T.clamp(max=n_draft)
    eligible_T = loss_mask_T.bool() & (valid_len_T >= max(1, min_valid_len))
    anchors_A = eligible_T.nonzero().view(-1)
    if max_anchors is not None and anchors_A.numel() > max_anchors:
        generator = torch.Generator().manual_seed(_anchor_generator_seed(seed, sample_id))
        pick = torch.randperm(anchors_A.numel(), generator=generator)[:max_anchors]
        anchors_A = anchors_A[pick].sort().values
    return anchors_A, valid_len_T[anchors_A]


def block_targets(top1_T: Tensor, anchors_A: Tensor, n_draft: int) -> Tensor:
    """int64 [A, D]: y_k = the target's greedy token for position a+k = top1[a+k-1] (0 past the end)."""
    T = top1_T.numel()
    row_AD = anchors_A[:, None] + torch.arange(n_draft)  # row a+k-1 for k = 1..D
    inside_AD = row_AD < T
    return torch.where(inside_AD, top1_T.long()[row_AD.clamp(max=T - 1)], 0)


# ----------------------------------------------------------------------------------------------
# Batched drafting


@dataclasses.dataclass
class Runtime(OnKernels):
    kernels: KernelPlan  # device, autocast dtype and attention kernel, chosen as the trainer chooses them
    # DDTree scoring in a CPU thread while the device drafts the next forward (the default on CUDA).
    score_in_background: bool = False

    @classmethod
    def from_config(cls, cfg: EvalConfig, head_dims: Sequence[int]) -> "Runtime":
        """The runtime for drafters of these head dims (flex only if it works for all of them)."""
        kernels = choose_kernels(cfg.device, cfg.precision, cfg.attention, False, head_dims, training=False, keys=EVAL_KEYS)
        return cls(kernels, score_in_background=kernels.device.type == "cuda")

    @property
    def attention(self) -> str:
        return self.kernels.attention

    def blocks_per_forward(self, cfg: EvalConfig) -> int:
        if cfg.blocks_per_forward is not None:
            return cfg.blocks_per_forward
        return 512 if self.device.type == "cuda" else 128

    @property
    def head_dtype(self) -> torch.dtype:
        return self.autocast_dtype or torch.float32

    def autocast(self):
        return self.kernels.autocast()


@dataclasses.dataclass
class Piece:
    """Some anchors of one sample: one row of a forward."""

    sample: int  # position in EvalData
    input_ids_T: Tensor
    hidden_TF: Tensor
    anchors_A: Tensor
    valid_len_A: Tensor
    target_ids_AD: Tensor

    @property
    def n_blocks(self) -> int:
        return int(self.anchors_A.numel())


def split_pieces(piece: Piece, max_blocks: int) -> list[Piece]:
    """The piece in consecutive runs of at most `max_blocks` anchors (each keeps only the context it needs)."""
    parts = []
    for start in range(0, piece.n_blocks, max_blocks):
        rows = slice(start, start + max_blocks)
        parts.append(dataclasses.replace(piece, anchors_A=piece.anchors_A[rows], valid_len_A=piece.valid_len_A[rows],
                                         target_ids_AD=piece.target_ids_AD[rows]))
    return parts


def pack_pieces(pieces: Iterable[Piece], max_blocks: int) -> Iterator[list[Piece]]:
    """Consecutive pieces grouped into forwards of at most `max_blocks` blocks (pieces are never split here)."""
    group: list[Piece] = []
    total = 0
    for piece in pieces:
        assert 0 < piece.n_blocks <= max_blocks, (piece.n_blocks, max_blocks)
        if group and total + piece.n_blocks > max_blocks:
            yield group
            group, total = [], 0
        group.append(piece)
        total += piece.n_blocks
    if group:
        yield group


@dataclasses.dataclass
class ForwardInputs:
    hidden_RSF: Tensor
    block_ids_RQ: Tensor
    position_ids_RP: Tensor
    anchors_RN: Tensor
    keep_RN: Tensor


def forward_inputs(pieces: Sequence[Piece], block_size: int, mask_token_id: int) -> ForwardInputs:
    """The rows of one forward: context features up to the last anchor, one block per anchor."""
    R, K = len(pieces), block_size
    N = max(p.n_blocks for p in pieces)
    # Blocks see context positions < their anchor only, so nothing at or after the last anchor is needed.
    S = max(1, max(int(p.anchors_A.max()) for p in pieces))
    F = pieces[0].hidden_TF.shape[1]
    hidden_RSF = torch.zeros(R, S, F, dtype=pieces[0].hidden_TF.dtype)
    anchors_RN = torch.zeros(R, N, dtype=torch.long)
    keep_RN = torch.zeros(R, N, dtype=torch.bool)
    block_ids_RNK = torch.full((R, N, K), int(mask_token_id), dtype=torch.long)
    for r, piece in enumerate(pieces):
        n, t = piece.n_blocks, min(S, piece.hidden_TF.shape[0])
        hidden_RSF[r, :t] = piece.hidden_TF[:t]
        anchors_RN[r, :n] = piece.anchors_A
        keep_RN[r, :n] = True
        block_ids_RNK[r, :n, 0] = piece.input_ids_T.long()[piece.anchors_A]
    block_pos_RQ = (anchors_RN[:, :, None] + torch.arange(K)).view(R, N * K)
    position_ids_RP = torch.cat((torch.arange(S).expand(R, S), block_pos_RQ), dim=1)
    return ForwardInputs(hidden_RSF, block_ids_RNK.view(R, N * K), position_ids_RP, anchors_RN, keep_RN)


@torch.no_grad()
def draft_topk_for_pieces(model: EvalModel, pieces: Sequence[Piece], runtime: Runtime, topk: int, chunk_rows: int
                          ) -> tuple[Tensor, Tensor]:
    """The drafter's top-k log-probs (float32) and ids (int64), each [M, D, k] on the CPU, for every
    block of the pieces in order. Full-vocabulary logits exist for ~chunk_rows block tokens at a time."""
    K = model.block_size
    inputs = forward_inputs(pieces, K, model.mask_token_id)
    device = runtime.device
    moved = ForwardInputs(*(getattr(inputs, f.name).to(device, non_blocking=True) for f in dataclasses.fields(inputs)))
    mask = runtime.kernels.mask(moved.anchors_RN, moved.keep_RN, moved.hidden_RSF.shape[1], K, model.mask_rules)
    R, N = moved.anchors_RN.shape
    with runtime.autocast():
        hidden_RQD = model.model(model.head.embed(moved.block_ids_RQ), moved.hidden_RSF, moved.position_ids_RP, mask)
        # Block position 0 (the anchor) predicts nothing; keep positions 1..K-1 of the real blocks.
        drafts_MDH = hidden_RQD.view(R, N, K, -1)[:, :, 1:][moved.keep_RN]
        chunk_blocks = max(1, chunk_rows // (K - 1))
        k = min(topk, int(model.head.vocab_size))
        values, ids = [], []
        for start in range(0, drafts_MDH.shape[0], chunk_blocks):
            logits_CDV = model.head.logits(drafts_MDH[start:start + chunk_blocks])
            lp_CDk, ids_CDk = draft_topk(logits_CDV, k)
            values.append(lp_CDk.cpu())
            ids.append(ids_CDk.cpu())
    return torch.cat(values), torch.cat(ids)


# ----------------------------------------------------------------------------------------------
# Scoring


@dataclasses.dataclass
class DraftScores:
    """One drafter's per-block results (rows aligned with a `BlockTable`)."""

    draft_ids_ND: Tensor  # int64: the drafter's argmax per block position 1..D
    top1_logprob_ND: Tensor  # float32: log q_k(argmax)
    ddtree_tau: dict[int, Tensor]  # budget -> int64 [N]
    ddtree_surrogate_tau: dict[int, Tensor]  # budget -> float64 [N]

    def extra_metrics(self) -> dict[str, Tensor]:
        """The DDTree per-block values under the names the summaries use."""
        out = {}
        for b in sorted(self.ddtree_tau):
            out[f"ddtree_tau_{b}"] = self.ddtree_tau[b]
        for b in sorted(self.ddtree_surrogate_tau):
            out[f"ddtree_surrogate_tau_{b}"] = self.ddtree_surrogate_tau[b]
        return out

    def chain(self, table: "BlockTable") -> ChainBlocks:
        return chain_blocks(self.draft_ids_ND, table.target_ids_ND, table.valid_len_N, self.top1_logprob_ND)

    @staticmethod
    def concat(parts: Sequence["DraftScores"], n_draft: int, budgets: Sequence[int]) -> "DraftScores":
        if not parts:
            empty_long, empty_float = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
            return DraftScores(torch.zeros(0, n_draft, dtype=torch.long), torch.zeros(0, n_draft),
                               {b: empty_long for b in budgets}, {b: empty_float for b in budgets})
        return DraftScores(
            torch.cat([p.draft_ids_ND for p in parts]), torch.cat([p.top1_logprob_ND for p in parts]),
            {b: torch.cat([p.ddtree_tau[b] for p in parts]) for b in budgets},
            {b: torch.cat([p.ddtree_surrogate_tau[b] for p in parts]) for b in budgets},
        )

    def take(self, order_N: Tensor) -> "DraftScores":
        return DraftScores(self.draft_ids_ND[order_N], self.top1_logprob_ND[order_N],
                           {b: t[order_N] for b, t in self.ddtree_tau.items()},
                           {b: t[order_N] for b, t in self.ddtree_surrogate_tau.items()})


def score_drafts(topk_logprobs_NDk: Tensor, topk_ids_NDk: Tensor, target_ids_ND: Tensor, valid_len_N: Tensor,
                 budgets: Sequence[int], what: str) -> DraftScores:
    """Chain inputs and DDTree τ of a batch of blocks from the drafter's per-depth top-k."""
    if not torch.isfinite(topk_logprobs_NDk[..., 0]).all():
        raise ValueError(f"the drafter produced non-finite logits ({what})")
    taus = ddtree_taus(topk_logprobs_NDk, topk_ids_NDk, target_ids_ND, valid_len_N, budgets)
    return DraftScores(
        draft_ids_ND=topk_ids_NDk[..., 0].clone(), top1_logprob_ND=topk_logprobs_NDk[..., 0].clone(),
        ddtree_tau={b: t.tau_N for b, t in taus.items()},
        ddtree_surrogate_tau={b: t.surrogate_tau_N for b, t in taus.items()},
    )


@dataclasses.dataclass
class BlockTable:
    """The evaluated blocks (shared by every drafter), sorted by (sample, anchor)."""

    sample_N: Tensor  # int64: position of the block's sample in EvalData
    anchor_N: Tensor  # int64
    valid_len_N: Tensor  # int64, 1..D
    target_ids_ND: Tensor  # int64: y_1..y_D
    bucket_N: Tensor  # int64

    @property
    def n_blocks(self) -> int:
        return int(self.sample_N.numel())

    def digest(self, sample_ids: Sequence[str]) -> str:
        """Identifies the exact blocks: which samples, which anchors, which valid lengths."""
        h = xxhash.xxh3_64()
        h.update("\n".join(sample_ids).encode("utf-8"))
        for t in (self.sample_N, self.anchor_N, self.valid_len_N):
            h.update(t.numpy().astype(np.int64).tobytes())
        return h.hexdigest()


def _sample_pieces(data: EvalData, order: np.ndarray, cfg: EvalConfig, n_draft: int) -> Iterator[Piece]:
    """Pieces of the samples at EvalData positions `order`, read in background threads."""
    dataset = data.dataset

    def load(position: int):
        i = int(data.indices[position])
        try:
            return dataset.torch(i)
        except (OSError, ValueError, pa.ArrowException) as exc:  # what unreadable or inconsistent data raises
            raise ValueError(f"cannot read sample {data.sample_ids[position]} (dataset index {i}) of '{data.root}': "
                             f"{type(exc).__name__}: {exc}") from exc

    with ThreadPoolExecutor(max_workers=cfg.load_threads, thread_name_prefix="eval-data") as pool:
        window: list[tuple[int, Future]] = []
        queue = iter(order.tolist())
        for position in queue:
            window.append((position, pool.submit(load, position)))
            if len(window) >= 2 * cfg.load_threads:
                break
        while window:
            position, future = window.pop(0)
            nxt = next(queue, None)
            if nxt is not None:
                window.append((nxt, pool.submit(load, nxt)))
            sample = future.result()
            anchors_A, valid_len_A = block_anchors(
                sample["loss_mask"], n_draft, min_valid_len=cfg.min_valid_len, max_anchors=cfg.max_anchors,
                seed=cfg.seed, sample_id=data.sample_ids[position])
            yield Piece(position, sample["input_ids"], sample["hidden"], anchors_A, valid_len_A,
                        block_targets(sample["topk_ids"][:, 0], anchors_A, n_draft))


def _progress(cfg: EvalConfig, total: int):
    from tqdm import tqdm

    return tqdm(total=total, disable=not cfg.progress, unit="sample", dynamic_ncols=True, file=sys.stderr)


def run_blocks(models: Sequence[EvalModel], data: EvalData, cfg: EvalConfig, runtime: Runtime,
               bucket_of_sample: np.ndarray) -> tuple[BlockTable, list[DraftScores]]:
    """Draft every block of `data` with every model (one pass over the data) and score the drafts."""
    block_sizes = {m.block_size for m in models}
    if len(block_sizes) != 1:
        raise ValueError(f"checkpoints have different block sizes {sorted(block_sizes)}; per-position metrics need one")
    n_draft = block_sizes.pop() - 1
    budgets = sorted(set(cfg.budgets))
    # Longest first: similar lengths share forwards, and an out-of-memory shows up at once.
    order = np.argsort(-data.lengths, kind="stable")
    blocks: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # per forward: sample, anchor, valid length, targets
    parts: list[list[Future | DraftScores]] = [[] for _ in models]
    scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-score") if runtime.score_in_background else None
    bar = _progress(cfg, data.n_samples)
    per_forward = runtime.blocks_per_forward(cfg)
    n_blocks = 0
    try:
        def pieces() -> Iterator[Piece]:
            for piece in _sample_pieces(data, order, cfg, n_draft):
                bar.update(1)
                if piece.n_blocks:
                    yield from split_pieces(piece, per_forward)

        for group in pack_pieces(pieces(), per_forward):
            # Only the per-block fields are kept: a piece holds its whole sample's hidden states.
            blocks.append((torch.cat([torch.full((p.n_blocks,), p.sample, dtype=torch.long) for p in group]),
                           torch.cat([p.anchors_A for p in group]), torch.cat([p.valid_len_A for p in group]),
                           torch.cat([p.target_ids_AD for p in group])))
            _, _, valid_len, target_ids = blocks[-1]
            what = f"samples {sorted({data.sample_ids[p.sample] for p in group})[:3]}"
            for m, model in enumerate(models):
                lp, ids = draft_topk_for_pieces(model, group, runtime, cfg.topk, cfg.chunk_rows)
                args = (lp, ids, target_ids, valid_len, budgets, what)
                parts[m].append(scorer.submit(score_drafts, *args) if scorer else score_drafts(*args))
                if scorer and len(parts[m]) > _SCORING_BACKLOG:
                    # One worker finishes in order: waiting here bounds the top-k tensors still queued.
                    parts[m][-_SCORING_BACKLOG - 1].result()
            n_blocks += len(valid_len)
            bar.set_postfix(blocks=n_blocks, refresh=False)
        scores = [DraftScores.concat([p.result() if isinstance(p, Future) else p for p in ps], n_draft, budgets)
                  for ps in parts]
    finally:
        bar.close()
        if scorer is not None:
            scorer.shutdown(wait=True, cancel_futures=True)

    columns = [torch.cat(c) for c in zip(*blocks)] if blocks else [
        torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
        torch.zeros(0, n_draft, dtype=torch.long)]
    sample_N, anchor_N, valid_len_N, target_ids_ND = columns
    # Back to (sample, anchor) order, so the result does not depend on the processing order.
    order_N = torch.from_numpy(np.lexsort((anchor_N.numpy(), sample_N.numpy())))
    sample_N = sample_N[order_N]
    table = BlockTable(
        sample_N=sample_N, anchor_N=anchor_N[order_N], valid_len_N=valid_len_N[order_N], target_ids_ND=target_ids_ND[order_N],
        bucket_N=torch.from_numpy(np.asarray(bucket_of_sample, dtype=np.int64))[sample_N],
    )
    return table, [s.take(order_N) for s in scores]


# ----------------------------------------------------------------------------------------------
# Summaries


def summarize_model(table: BlockTable, scores: DraftScores, buckets: Sequence[dict]) -> dict:
    """{'overall': summary, 'buckets': [summary per bucket]}; summaries as `summarize_blocks` plus
    the DDTree means and n_samples (samples with at least one block)."""
    chain = scores.chain(table)
    extra = scores.extra_metrics()
    overall = summarize_blocks(chain, extra)
    overall["n_samples"] = int(table.sample_N.unique().numel())
    ids = [int(b["bucket"]) for b in buckets]
    per_bucket = summarize_by_group(chain, table.bucket_N, ids, extra)
    out_buckets = []
    for b in buckets:
        summary = per_bucket[int(b["bucket"])]
        summary["n_samples"] = int(table.sample_N[table.bucket_N == int(b["bucket"])].unique().numel())
        out_buckets.append(summary)
    return {"overall": overall, "buckets": out_buckets}


def label_frequency_topk(table: BlockTable, k: int) -> tuple[Tensor, Tensor]:
    """(log-frequency float32, id int64), each [min(k, distinct labels)], of the labels at the valid
    positions of the blocks, most frequent first (ties: the smaller id first)."""
    n_draft = table.target_ids_ND.shape[1]
    if table.n_blocks == 0:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long)
    labels = table.target_ids_ND[valid_mask(table.valid_len_N, n_draft)]
    counts = torch.bincount(labels)
    ids = counts.nonzero().view(-1)  # ascending, so the stable sort breaks ties by id
    ids = ids[torch.sort(counts[ids], descending=True, stable=True).indices[:k]]
    return (counts[ids].double() / labels.numel()).log().float(), ids


def label_baseline(table: BlockTable, budgets: Sequence[int], topk: int) -> DraftScores:
    """Scores of the draft-free baseline on the blocks of `table`: at every depth of every block,
    the label frequency of these blocks (see the module docstring)."""
    n_draft = table.target_ids_ND.shape[1]
    budgets = sorted(set(budgets))
    lp_k, ids_k = label_frequency_topk(table, topk)
    parts = []
    for start in range(0, table.n_blocks, _BASELINE_CHUNK):
        rows = slice(start, start + _BASELINE_CHUNK)
        n = table.target_ids_ND[rows].shape[0]
        # The same top-k at every depth of every block: a broadcast view, not n x D copies.
        parts.append(score_drafts(lp_k.expand(n, n_draft, -1), ids_k.expand(n, n_draft, -1), table.target_ids_ND[rows],
                                  table.valid_len_N[rows], budgets, BASELINE_NAME))
    return DraftScores.concat(parts, n_draft, budgets)


def baseline_report(table: BlockTable, budgets: Sequence[int], topk: int, buckets: Sequence[dict]) -> dict:
    """The JSON `baseline` entry: what it is, its token, and its summaries like a checkpoint's."""
    lp_k, ids_k = label_frequency_topk(table, topk)
    return {
        "name": BASELINE_NAME,
        "token": int(ids_k[0]) if ids_k.numel() else None,
        "token_share": float(lp_k[0].exp()) if lp_k.numel() else None,
        "description": "chain: always the most frequent label of these blocks; DDTree: the label frequencies at every depth",
        **summarize_model(table, label_baseline(table, budgets, topk), buckets),
    }


def _ratio(a: Any, b: Any) -> Any:
    if isinstance(a, list) and isinstance(b, list):
        return [_ratio(x, y) for x, y in zip(a, b)]
    if a is None or b is None or isinstance(a, (list, dict)) or a == 0:
        return None
    return float(b) / float(a)


def metric_ratios(first: dict, second: dict) -> dict:
    """second / first for every metric of two summaries (None where undefined); counts are left out."""
    return {key: _ratio(first[key], second.get(key)) for key in first if key not in _NOT_RATIOED and key in second}


# ----------------------------------------------------------------------------------------------
# Report


def _notes(data: EvalData, n_draft: int, cfg: EvalConfig) -> list[str]:
    anchors = "every response position with a response token after it" if cfg.max_anchors is None else (
        f"at most {cfg.max_anchors} per sequence, drawn with seed {cfg.seed}")
    notes = [
        f"split: {data.split_reason}",
        f"anchors: {anchors}" + (f"; blocks with fewer than {cfg.min_valid_len} target tokens skipped" if cfg.min_valid_len > 1 else ""),
        f"cut blocks: a block near a response end has L < {n_draft} target tokens, accepts at most L and is never 'all accepted'",
        "labels: the target's greedy token given the data prefix (equal to online greedy decoding only where the data is the target's greedy output)",
        "averages are over blocks (anchors), not per-response means of per-round tau",
    ]
    return notes


def evaluate_checkpoints(checkpoints: Sequence[str], cfg: EvalConfig) -> tuple[dict, Path]:
    """Evaluate one or two checkpoints on `cfg.data`; returns (report, JSON path written)."""
    from common.provenance import git_sha, tool_version
    from shards import ShardDataset
    from train.tiers import for_data

    started = time.time()
    if not 1 <= len(checkpoints) <= 2:
        raise ValueError(f"give one or two checkpoints, got {len(checkpoints)}")
    if not cfg.data:
        raise ValueError("no data to evaluate on: pass --data SHARDS (config key 'data')")
    infos = [read_checkpoint(c) for c in checkpoints]
    block_sizes = sorted({info.drafter_config.block_size for info in infos})
    if len(block_sizes) > 1:
        raise ValueError(f"the checkpoints have block sizes {block_sizes}; a side-by-side comparison needs one block size")
    try:
        dataset = ShardDataset(cfg.data, manifest_name=cfg.manifest)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot open the shards dataset '{cfg.data}' (config key 'data'): {exc}") from None
    manifest = dataset.manifest
    infos = [for_data(info, manifest, cfg.projection) for info in infos]  # storage tiers: fold P where the data is full
    checked = [check_data_fits(info, cfg.data, manifest) for info in infos]
    split, fraction, reason = choose_split(cfg, infos, cfg.data, manifest)
    data = select_eval_data(dataset, cfg.data, split=split, holdout_fraction=fraction, max_samples=cfg.max_samples, split_reason=reason)
    boundaries, boundaries_from = choose_boundaries(cfg, infos)
    buckets, bucket_of_sample = bucket_table(boundaries, data.lengths)

    runtime = Runtime.from_config(cfg, [info.drafter_config.head_dim for info in infos])
    cfg = resolved_config(cfg, runtime, split, fraction, boundaries)
    targets = [target_dir_for(info, cfg.target, manifest) for info in infos]
    models = [load_eval_model(info, target, runtime.device, runtime.head_dtype) for info, target in zip(infos, targets)]
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
            {"path": str(info.path), "label": info.label, "run_dir": str(info.run_dir) if info.run_dir else None,
             "step": info.step, "target": target, "checked_fields": fields, **summarize_model(table, s, buckets)}
            for info, target, fields, s in zip(infos, targets, checked, scores)
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
        first, second = report["checkpoints"]
        report["ratio"] = {
            "overall": metric_ratios(first["overall"], second["overall"]),
            "buckets": [metric_ratios(a, b) for a, b in zip(first["buckets"], second["buckets"])],
        }
    from common.io import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(str(out), json.dumps(report, indent=1, sort_keys=False) + "\n")
    return report, out


def resolved_config(cfg: EvalConfig, runtime: Runtime, split: str, fraction: float | None, boundaries: list[int]) -> EvalConfig:
    """`cfg` with every automatic choice replaced by what is used, as saved in the report."""
    return dataclasses.replace(
        cfg, split=split, holdout_fraction=fraction, boundaries=list(boundaries), device=runtime.device.type,
        precision="bf16" if runtime.autocast_dtype is not None else "fp32", attention=runtime.attention,
        blocks_per_forward=runtime.blocks_per_forward(cfg),
    )


def default_out_path(infos: Sequence[CheckpointInfo], data_name: str) -> Path:
    name = f"eval_{data_name}"
    if len(infos) == 2:
        second = infos[1]
        name += "_vs_" + re.sub(r"[^A-Za-z0-9._-]+", "_", second.label.replace("/", "-"))
    return infos[0].path / f"{name}.json"


# ----------------------------------------------------------------------------------------------
# Rendering (a pure function of the report, so the JSON holds everything the table shows)


def metric_rows(budgets: Sequence[int], n_draft: int, headline_only: bool = False) -> list[tuple[str, str, int | None]]:
    """(row label, summary key, list index or None) in table order."""
    rows: list[tuple[str, str, int | None]] = [
        ("samples with blocks", "n_samples", None),
        ("blocks", "n_blocks", None),
        (f"cut blocks (L<{n_draft})", "n_cut", None),
        ("tau chain", "tau", None),
        ("tau chain surrogate", "surrogate_tau", None),
    ]
    rows += [(f"tau DDTree-{b}", f"ddtree_tau_{b}", None) for b in budgets]
    rows += [(f"tau DDTree-{b} surrogate", f"ddtree_surrogate_tau_{b}", None) for b in budgets]
    rows.append((f"all {n_draft} accepted", "all_accepted", None))
    if not headline_only:
        rows += [(f"acc k={k}", "position_acceptance", k - 1) for k in range(1, n_draft + 1)]
        rows += [(f"acc k={k} | reached", "conditional_acceptance", k - 1) for k in range(1, n_draft + 1)]
    return rows


def baseline_rows(budgets: Sequence[int]) -> list[tuple[str, str, int | None]]:
    """(row label, summary key, list index or None) of the baseline's rows."""
    name = BASELINE_NAME
    return ([(f"{name}: tau chain", "tau", None), (f"{name}: acc k=1", "position_acceptance", 0)]
            + [(f"{name}: tau DDTree-{b}", f"ddtree_tau_{b}", None) for b in budgets])


def _value(summary: dict, key: str, index: int | None) -> Any:
    value = summary.get(key)
    if index is not None and isinstance(value, list):
        return value[index] if index < len(value) else None
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.3f}"


def _grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = []
    for j, row in enumerate([header] + rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _bucket_cell(summary: dict, key: str, index: int | None) -> str:
    if key == "n_blocks" and summary.get("n_blocks") == 0:
        return "empty"
    return _cell(_value(summary, key, index))


def _single_table(report: dict) -> str:
    ckpt = report["checkpoints"][0]
    n_draft = report["block_size"] - 1
    columns = [("all", ckpt["overall"])]
    if len(report["buckets"]) > 1:
        columns += [(b["label"], s) for b, s in zip(report["buckets"], ckpt["buckets"])]
    header = ["metric"] + [name for name, _ in columns]
    specs = metric_rows(report["budgets"], n_draft)
    rows = [[label] + [_bucket_cell(s, key, index) for _, s in columns] for label, key, index in specs]
    baseline = report.get("baseline")  # absent from reports written before it existed
    if baseline:
        # Right after the drafter's headline rows, so the two read together.
        at = next(i for i, (_, key, _) in enumerate(specs) if key == "all_accepted") + 1
        summaries = [baseline["overall"]] + (baseline["buckets"] if len(columns) > 1 else [])
        rows[at:at] = [[label] + [_bucket_cell(s, key, index) for s in summaries] for label, key, index in baseline_rows(report["budgets"])]
    return _grid(header, rows)


def _baseline_line(report: dict) -> list[str]:
    """The header line that says what the baseline is (and, with two checkpoints, its overall numbers)."""
    baseline = report.get("baseline")
    if not baseline or baseline.get("token") is None:
        return []
    line = (f"  baseline   {baseline['name']}: always token {baseline['token']} ({100 * baseline['token_share']:.1f}% of "
            f"these blocks' labels); DDTree over the label frequencies")
    if len(report["checkpoints"]) == 1:
        return [line]
    overall = baseline["overall"]
    numbers = ", ".join(f"{label.split(': ', 1)[1]} {_cell(_value(overall, key, index))}" for label, key, index in baseline_rows(report["budgets"]))
    return [line, f"             on the same blocks for A and B: {numbers}"]


def _pair_table(first: dict, second: dict, ratio: dict, rows_spec) -> str:
    header = ["metric", "A", "B", "B/A"]
    rows = [[label, _bucket_cell(first, key, index), _bucket_cell(second, key, index), _cell(_value(ratio, key, index))]
            for label, key, index in rows_spec]
    return _grid(header, rows)


def render_report(report: dict) -> str:
    """The on-screen table of a report (works on the report as loaded back from its JSON)."""
    data, ckpts = report["data"], report["checkpoints"]
    n_draft = report["block_size"] - 1
    lines = ["DFlash offline evaluation"]
    names = ["A", "B"] if len(ckpts) == 2 else [""]
    for name, ckpt in zip(names, ckpts):
        lines.append(f"  checkpoint {name + ' ' if name else ''}{ckpt['path']} (step {ckpt['step']})")
    lines.append(f"  data       {data['path']}: {data['samples']} of {data['samples_in_dataset']} samples, "
                 f"{data['tokens']} tokens, {data['blocks']} blocks")
    lines.append(f"  buckets    {data['boundaries_from']}: " + ", ".join(
        f"{b['label']} ({b['n_samples']} samples)" for b in report["buckets"]))
    kernels = report.get("kernels")  # absent in reports of older versions
    if kernels:
        lines.append(f"  kernels    {kernels['device']}, {kernels['precision']}, attention {kernels['attention']} ({kernels['reason']})")
    lines += [f"  note       {note}" for note in report["notes"]]
    lines += _baseline_line(report)
    lines.append("")
    if len(ckpts) == 1:
        lines.append(_single_table(report))
    else:
        ratio = report["ratio"]
        lines.append("all lengths (B/A = second / first)")
        lines.append(_pair_table(ckpts[0]["overall"], ckpts[1]["overall"], ratio["overall"], metric_rows(report["budgets"], n_draft)))
        if len(report["buckets"]) > 1:
            for i, bucket in enumerate(report["buckets"]):
                lines.append("")
                lines.append(f"bucket {bucket['bucket']}: length {bucket['label']}")
                lines.append(_pair_table(ckpts[0]["buckets"][i], ckpts[1]["buckets"][i], ratio["buckets"][i],
                                         metric_rows(report["budgets"], n_draft, headline_only=True)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# CLI

_USAGE = """usage: python -m train.eval CHECKPOINT [CHECKPOINT2] --data SHARDS [--out PATH] [--config FILE] [key=value ...]

CHECKPOINT: a checkpoint directory (runs/NAME/checkpoints/step-XXXXXXXX) or a run directory (its
latest checkpoint). With two, both are evaluated on the same blocks and compared (ratio second/first).
--config FILE reads the [eval] table of a TOML/JSON file; key=value overrides it.

keys:
"""


def parse_args(argv: Sequence[str]) -> tuple[list[str], EvalConfig]:
    """(checkpoints, config) from the command line; ConfigError (a ValueError) on bad input."""
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(_USAGE + describe(EvalConfig))
        raise SystemExit(0)
    checkpoints, overrides, values, config_file = [], [], {}, None
    flags = {"--data": "data", "--out": "out"}
    i = 0
    while i < len(argv):
        word = argv[i]
        flag, eq, inline = word.partition("=")
        if flag in flags or flag == "--config":
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise ConfigError(f"{flag} needs a value")
            if flag == "--config":
                config_file = value
            else:
                values[flags[flag]] = value  # a path exactly as given, whatever characters it holds
        elif word.startswith("--"):
            raise ConfigError(f"unknown option '{word}' (options: --data, --out, --config; other settings as key=value)")
        elif "=" in word and not os.path.exists(word):  # a checkpoint path may hold '='
            overrides.append(word)
        else:
            checkpoints.append(word)
        i += 1
    if not checkpoints:
        raise ConfigError("no checkpoint given (python -m train.eval CHECKPOINT --data SHARDS)")
    return checkpoints, load_config(EvalConfig, config_file, overrides, section="eval", values=values)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done, 2 a usage, config or data error (the message names the key, file or field)."""
    try:
        checkpoints, cfg = parse_args(sys.argv[1:] if argv is None else argv)
        report, out = evaluate_checkpoints(checkpoints, cfg)
    except ValueError as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    print(render_report(report))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
