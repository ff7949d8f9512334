"""The training loop: one readable `train()` loop plus one `train_step()`.

    run = Run.prepare(cfg)          # run dir, drafter, frozen head, data stream, optimizer, resume
    train(cfg)                      # = Run.prepare + the loop; returns a summary dict

Per step: fetch a batch (timed), sample anchors and build blocks on the host (seeded by
(seed, step), so resume needs no generator state), forward through the drafter with the DFlash
mask, the chunked loss through the frozen lm_head, backward, grad norm before clipping, then
either an AdamW update or, if the loss or the gradient is not finite, a skipped step (no update,
logged with the batch's sample ids; `optim.max_nonfinite_in_row` in a row abort the run). Every
step writes one metrics.jsonl line; a checkpoint is snapshotted after the step and written in the
background.

Data parallel (`torchrun --nproc-per-node N -m train ...`, `train.distributed`): a step is one
global batch of the one global plan, split by tokens into world_size x accumulation parts; each
rank runs its parts as micro-steps (gradients all-reduced after the last), and every host-side
decision (anchors, loss normalization, skipping a non-finite step, resuming) is taken from values
that are the same on every rank, so the ranks stay in step and identical. Rank 0 alone writes
the run files, metrics.jsonl (values reduced over ranks) and checkpoints.

Schedules are plain functions of the step: `lr_at`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from common.config import config_digest, config_to_dict, save_config
from common.device import resolve_device
from common.hashing import json_digest, tokenizer_digest
from common.hf_target import text_config
from common.io import atomic_write_json, exists, join, resolve
from common.locks import LockedError, exclusive_lock
from common.provenance import git_sha, tool_version
from common.schedule import warmup_cosine
from train.blocks import Blocks, anchor_candidates, anchors_per_row, make_blocks, step_generator
from train.buckets import RankSplit, split_summary
from train.checkpoint import (
    CheckpointWriter,
    latest_checkpoint,
    load_checkpoint,
    remove_partial_checkpoints,
    restore_rng_state,
    rng_state,
    take_snapshot,
)
from train.config import TrainConfig, resume_conflicts
from train.data import Batch, DataStream, Share
from train.distributed import Dist
from train.kernels import TRAIN_KEYS, KernelPlan, OnKernels, choose_kernels
from train.loss import LossOutput, block_loss, chunk_loss_and_grad
from train.metrics import MetricsLog, truncate_after
from train.model import DFlashDrafter, DrafterConfig, TargetHead
from train.warm_start import check_init_from, config_differences, warm_start

__all__ = [
    "lr_at",
    "train",
    "train_step",
    "step_functions",
    "Run",
    "StepResult",
    "TrainingAborted",
    "resolve_mask_token",
    "build_drafter_config",
]

log = logging.getLogger(__name__)


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row (or another condition that makes going on pointless)."""


# ----------------------------------------------------------------------------------------------
# Schedule


def lr_at(step: int, total_steps: int, warmup_steps: int, peak: float) -> float:
    """Learning rate of 1-based `step`: linear warmup to `peak` over `warmup_steps`, then cosine to 0 at
    `total_steps`."""
    return warmup_cosine(step - 1, total_steps, warmup_steps, peak)


# ----------------------------------------------------------------------------------------------
# Setup helpers


def _load_tokenizer(target_dir: str):
    """The target's tokenizer, or None when the directory has none."""
    if not any((Path(target_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    # trust_remote_code=False, not the default None: None asks on the terminal (and hangs a batch job)
    return AutoTokenizer.from_pretrained(target_dir, trust_remote_code=False)


def resolve_mask_token(provenance: dict, tokenizer, configured: int | None) -> tuple[int, str]:
    """(mask token id, where it came from): the shards' provenance, else the target tokenizer's
    mask token, else the config. A configured id that contradicts the chosen source is refused:
    the drafter must be trained with the id the serving side will put into its blocks.
    """
    prov_id = (provenance.get("tokenizer") or {}).get("mask_token_id")
    tok_id = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if prov_id is not None:
        how = ((provenance.get("tokenizer") or {}).get("mask_token") or {}).get("source")
        found = (int(prov_id), "shards provenance tokenizer.mask_token_id" + (f" ({how})" if how else ""))
    elif tok_id is not None:
        found = (int(tok_id), "target tokenizer mask_token")
    elif configured is not None:
        return configured, "config model.mask_token_id"
    else:
        raise ValueError(
            "no mask token id: the shards' provenance has no tokenizer.mask_token_id, the target tokenizer defines no "
            "mask_token, and config key 'model.mask_token_id' is not set"
        )
    if configured is not None and configured != found[0]:
        raise ValueError(f"config key 'model.mask_token_id' = {configured} contradicts the {found[1]} = {found[0]}")
    return found


def build_drafter_config(cfg: TrainConfig, target_cfg: dict, provenance: dict, mask_token_id: int) -> DrafterConfig:
    """The drafter's config from the target's text config, the shards' taps and the model table."""
    taps = (provenance.get("taps") or {}).get("layer_ids")
    layer_ids = cfg.model.target_layer_ids if cfg.model.target_layer_ids is not None else taps
    if layer_ids is None:
        raise ValueError(
            "config key 'model.target_layer_ids' is not set and the shards' provenance has no taps.layer_ids"
        )
    m = cfg.model
    try:
        return DrafterConfig.from_target(
            target_cfg,
            layer_ids,
            num_layers=m.num_layers,
            block_size=m.block_size,
            mask_token_id=mask_token_id,
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads,
            head_dim=m.head_dim,
            initializer_range=m.initializer_range,
            layer_types=m.layer_types,
            sliding_window=m.sliding_window,
            sliding_in_block=m.sliding_in_block,
            rope_theta=m.rope_theta,
            rope_scaling=m.rope_scaling,
            partial_rotary_factor=m.partial_rotary_factor,
        )
    except ValueError as exc:
        raise ValueError(f"config table 'model': {exc}") from None


def expected_fields(drafter_cfg: DrafterConfig, target_cfg: dict, tokenizer, topk_needed: int) -> dict:
    """What the shards' manifest must agree with (train.data.check_compatible)."""
    hidden = int(target_cfg["hidden_size"])
    expected = {
        "layer_ids": list(drafter_cfg.target_layer_ids),
        "hidden_size": hidden,
        "hidden_width": drafter_cfg.feature_width,
        "vocab_size": int(target_cfg["vocab_size"]),
        "topk": topk_needed,
        "projection": drafter_cfg.projection,
    }
    if tokenizer is not None:
        expected["tokenizer_hash"] = tokenizer_digest(tokenizer)
    return expected


@dataclasses.dataclass
class Target:
    """The target checkpoint the drafter is trained for, and the drafter config derived from it."""

    path: str
    text_config: dict
    mask_source: str
    drafter_cfg: DrafterConfig


def resolve_target(cfg: TrainConfig, manifest: dict) -> Target:
    """Find the target, derive the drafter config, and refuse shards that do not fit it (naming the field)."""
    from train.data import check_compatible
    from train.tiers import drafter_projection

    provenance = manifest.get("provenance") or {}
    path = cfg.model.target or (provenance.get("target") or {}).get("name_or_path")
    if not path or not Path(path, "config.json").is_file():
        raise ValueError(f"config key 'model.target': no target checkpoint directory at {path!r} (set model.target)")
    target_cfg = text_config(path)
    tokenizer = _load_tokenizer(path)
    mask_token_id, mask_source = resolve_mask_token(provenance, tokenizer, cfg.model.mask_token_id)
    drafter_cfg = build_drafter_config(cfg, target_cfg, provenance, mask_token_id)
    # Storage tiers: fc reads the dataset's projected features when it has them (train.tiers).
    drafter_cfg = dataclasses.replace(drafter_cfg, projection=drafter_projection(cfg.model.projection, manifest))
    check_compatible(manifest, expected_fields(drafter_cfg, target_cfg, tokenizer, topk_needed=1))
    return Target(str(path), target_cfg, mask_source, drafter_cfg)


def _open_stream(cfg: TrainConfig, split: RankSplit | None = None) -> DataStream:
    fs, root = resolve(cfg.data.shards)
    if not exists(fs, join(root, cfg.data.manifest)):
        raise ValueError(
            f"config key 'data.shards': no shards dataset at '{cfg.data.shards}' (no {cfg.data.manifest}); "
            "for the tiny default run `make tiny` and `make extract` first"
        )
    return DataStream(cfg.data, split=split)


def choose_run_kernels(cfg: TrainConfig, drafter_cfg: DrafterConfig, dist: Dist | None = None) -> KernelPlan:
    """Device, autocast, attention kernel and compilation for this run (train.kernels; logged once).

    Under data parallelism the plan runs on this rank's own device (`dist.device`, cuda:LOCAL_RANK)
    and only rank 0 logs it."""
    dist = dist or Dist.single()
    return choose_kernels(
        cfg.device,
        cfg.precision,
        cfg.model.attention,
        cfg.compile,
        [drafter_cfg.head_dim],
        training=True,
        keys=TRAIN_KEYS,
        rank_device=dist.device,
        announce=dist.is_main,
    )


def _agreed_kernels(cfg: TrainConfig, drafter_cfg: DrafterConfig, dist: Dist) -> KernelPlan:
    """`choose_run_kernels`, refused on every rank if any rank cannot run it (no rank is left
    waiting for one that stopped alone)."""
    try:
        kernels, problem = choose_run_kernels(cfg, drafter_cfg, dist), None
    except ValueError as exc:
        kernels, problem = None, str(exc)
    dist.agree(problem)
    return kernels


# ----------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class StepResult:
    """One optimizer step; sizes and statistics are of the whole global batch (summed over ranks)."""

    loss: float | None
    grad_norm: float | None
    lr: float
    skipped: bool
    skip_reason: str | None
    stats: LossOutput | None
    block_tokens: int
    blocks: list[Blocks] = dataclasses.field(
        default_factory=list
    )  # this rank's host-side blocks, one per part it ran (FLOP counts)
    tokens: int = 0  # real (unpadded) context tokens
    samples: int = 0
    padded_tokens: int = 0
    wait: float = 0.0  # the longest any rank waited for its data this step


def compile_step_functions(drafter: torch.nn.Module):
    """torch.compile the drafter and the loss chunk for training on batches of varying shape.

    Batches come from length buckets, so shapes change from step to step: compile with dynamic
    shapes from the first step (one compile instead of a static one followed by a dynamic one),
    and allow enough cached graphs for the few shape families that remain.
    """
    from torch._dynamo import config as dynamo_config
    from torch._inductor import config as inductor_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
    # torch 2.11's Inductor asserts in its memory-coalescing tiling analysis on some dynamic-shape
    # kernels of this model (seen on an H200: AssertionError in tiling_utils.get_pw_red_splits);
    # the analysis only picks tile shapes, so turning it off costs little and avoids the crash.
    if hasattr(inductor_config.triton, "coalesce_tiling_analysis"):
        inductor_config.triton.coalesce_tiling_analysis = False
    return torch.compile(drafter, dynamic=True), torch.compile(chunk_loss_and_grad, dynamic=True)


def step_functions(drafter: torch.nn.Module, dist: Dist, compile: bool, ddp_compile: str = "outer"):
    """(forward module, loss chunk function): the drafter in DDP when there is a process group (its
    weights broadcast from rank 0), compiled around or inside DDP (`distributed.ddp_compile`)."""
    if compile and ddp_compile == "inner":
        compiled, chunk_fn = compile_step_functions(drafter)
        return dist.wrap(compiled), chunk_fn
    module = dist.wrap(drafter)
    return compile_step_functions(module) if compile else (module, chunk_loss_and_grad)


@dataclasses.dataclass
class Run(OnKernels):
    """Everything the loop needs, built by `prepare` (and restored from a checkpoint when resuming)."""

    cfg: TrainConfig
    run_dir: Path
    kernels: KernelPlan  # device, autocast dtype, attention kernel, compile
    drafter_cfg: DrafterConfig
    drafter: DFlashDrafter
    forward: torch.nn.Module  # the drafter, or its torch.compile wrapper
    head: TargetHead
    optimizer: torch.optim.Optimizer
    stream: DataStream
    total_steps: int
    warmup_steps: int
    chunk_fn: object
    step: int = 0  # last completed step
    tokens: int = 0  # cumulative real tokens
    nonfinite_total: int = 0
    nonfinite_in_row: int = 0
    dist: Dist = dataclasses.field(default_factory=Dist.single)
    lock: object = None  # rank 0's lock on the run directory (common.locks), released by `release`
    _placeholder: tuple | None = None

    @classmethod
    def prepare(cls, cfg: TrainConfig, *, stream: DataStream | None = None, dist: Dist | None = None) -> "Run":
        # A missing GPU is reported before the data is opened; the process group needs the device type.
        dist = dist if dist is not None else Dist.from_env(cfg.distributed, resolve_device(cfg.device))
        run_dir, lock, created = _claim_run_dir(cfg, dist)  # before anything is read or written
        if cfg.run_name is None:  # the run's config (saved with it) holds the name it got
            cfg = dataclasses.replace(cfg, run_name=run_dir.name)
        try:
            return cls._prepare_claimed(cfg, stream, dist, run_dir, lock)
        except BaseException:
            _release_run_dir(run_dir, lock, created=created)
            raise

    @classmethod
    def _prepare_claimed(cls, cfg: TrainConfig, stream: DataStream | None, dist: Dist, run_dir: Path, lock) -> "Run":
        stream = stream if stream is not None else _open_stream(cfg, dist.split)
        target = resolve_target(cfg, stream.dataset.manifest)  # refuses incompatible shards
        kernels = _agreed_kernels(
            cfg, target.drafter_cfg, dist
        )  # refuses a kernel that cannot work, before anything runs
        device, autocast_dtype = kernels.device, kernels.autocast_dtype  # this rank's own device under data parallelism
        if cfg.model.init_from and Path(cfg.model.init_from).exists():
            check_init_from(cfg.model.init_from, target.drafter_cfg)  # before the run directory exists
        torch.manual_seed(cfg.seed)
        with torch.device(device):  # initialize in place: a 27B-width drafter is 7 GB of fp32 on the host otherwise
            drafter = DFlashDrafter(target.drafter_cfg)
        head = TargetHead.from_pretrained(target.path, dtype=autocast_dtype or torch.float32).to(device)
        if head.hidden_size != target.drafter_cfg.hidden_size:
            raise ValueError(
                f"config key 'model.hidden_size': the drafter width {target.drafter_cfg.hidden_size} must equal "
                "the target "
                f"embedding width {head.hidden_size} (the frozen embedding and lm_head are the target's)"
            )
        optimizer = torch.optim.AdamW(
            drafter.parameters(),
            lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas),
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
            fused=device.type == "cuda",
        )
        total = cfg.optim.max_steps or max(1, round(cfg.optim.epochs * stream.steps_per_epoch))
        forward, chunk_fn = step_functions(drafter, dist, kernels.compile, cfg.distributed.ddp_compile)
        run = cls(
            cfg=cfg,
            run_dir=run_dir,
            kernels=kernels,
            drafter_cfg=target.drafter_cfg,
            drafter=drafter,
            forward=forward,
            head=head,
            optimizer=optimizer,
            stream=stream,
            total_steps=total,
            warmup_steps=round(cfg.optim.warmup_ratio * total),
            chunk_fn=chunk_fn,
            dist=dist,
            lock=lock,
        )
        resumed_from = run._maybe_resume()
        # A resumed run has its weights from the checkpoint (init_from may be gone by then).
        init_from = warm_start(drafter, cfg.model.init_from) if cfg.model.init_from and resumed_from is None else None
        run._write_run_files(target, resumed_from, init_from)
        return run

    def release(self) -> None:
        """Let another training into this run directory."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def placeholder(self) -> tuple[Batch, Blocks]:
        """A one-token batch with one padding block and no loss row: a micro-step that runs the
        drafter forward and backward (DDP needs every rank's backward) and adds exactly zero gradient."""
        if self._placeholder is None:
            F = self.drafter_cfg.feature_width
            batch = Batch(
                input_ids=torch.zeros(1, 1, dtype=torch.int64),
                loss_mask=torch.zeros(1, 1, dtype=torch.bool),
                hidden=torch.zeros(1, 1, F, dtype=torch.bfloat16),
                topk_ids=torch.zeros(1, 1, 1, dtype=torch.int64),
                topk_logprobs=torch.zeros(1, 1, 1),
                lengths=torch.ones(1, dtype=torch.int64),
                sample_ids=[],
                bucket=-1,
                epoch=-1,
                state={},
            )
            blocks = _make_part_blocks(
                self, batch, keys_BS=torch.zeros(1, 1), quota_B=torch.zeros(1, dtype=torch.int64)
            )
            assert blocks.loss_rows_M.numel() == 0 and blocks.num_blocks == 0
            self._placeholder = (batch, blocks)
        return self._placeholder

    # -- resume -------------------------------------------------------------------------------

    def _maybe_resume(self) -> Path | None:
        # Rank 0 decides (and tidies the run directory); every rank then loads the same checkpoint.
        decision = None
        if self.dist.is_main:
            try:
                decision = ("ok", self._choose_checkpoint())
            except ValueError as exc:
                decision = ("error", str(exc))
        status, value = self.dist.broadcast(decision)
        if status == "error":
            raise ValueError(value)
        if value is None:
            return None
        path = Path(value)
        self.load(path)
        if self.dist.is_main:
            truncate_after(self.run_dir / "metrics.jsonl", self.step)
        log.info("resumed from %s at step %d", path, self.step)
        return path

    def _choose_checkpoint(self) -> str | None:
        ckpt_root = self.run_dir / "checkpoints"
        remove_partial_checkpoints(ckpt_root)
        if self.cfg.resume == "never":
            if (self.run_dir / "metrics.jsonl").exists() or latest_checkpoint(ckpt_root):
                raise ValueError(
                    f"config key 'resume': run directory '{self.run_dir}' already holds a run (resume=never); "
                    "choose another run_name"
                )
            return None
        path = latest_checkpoint(ckpt_root) if self.cfg.resume == "auto" else Path(self.cfg.resume)
        if path is None:
            if (self.run_dir / "metrics.jsonl").exists():
                truncate_after(
                    self.run_dir / "metrics.jsonl", 0
                )  # a run killed before its first checkpoint starts over
            return None
        return str(path)

    def load(self, path: Path) -> None:
        """Restore model, optimizer, step counters, RNG states and data position from a checkpoint."""
        ckpt = load_checkpoint(path, map_location="cpu")
        conflicts = resume_conflicts(ckpt["state"]["config"], config_to_dict(self.cfg))
        if conflicts:
            raise ValueError(
                f"checkpoint '{path}' was made with another config; differing keys:\n  " + "\n  ".join(conflicts)
            )
        differences = config_differences(
            DrafterConfig.from_dict(ckpt["drafter_config"]), self.drafter_cfg, "the checkpoint"
        )
        if differences:
            raise ValueError(
                f"checkpoint '{path}' holds another drafter than this config builds:\n  " + "\n  ".join(differences)
            )
        self.drafter.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.nonfinite_total, self.nonfinite_in_row = int(state["nonfinite_total"]), int(state["nonfinite_in_row"])
        restore_rng_state(state["rng"])
        self.stream.load_state_dict(state["data_state"])

    def snapshot(self, data_state: dict, data_state_by_rank: list[dict] | None = None):
        state = {
            "step": self.step,
            "tokens": self.tokens,
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_in_row": self.nonfinite_in_row,
            "data_state": data_state,
            "rng": rng_state(),
            "config": config_to_dict(self.cfg),
            "config_digest": config_digest(self.cfg),
            "total_steps": self.total_steps,
            "git_sha": git_sha(),
            "time": time.time(),
            "world_size": self.dist.world_size,
            "accumulation": self.dist.accumulation,
            "data_state_by_rank": data_state_by_rank or [],
        }
        return take_snapshot(self.step, self.drafter, self.optimizer, state, self.drafter_cfg.to_dict())

    # -- run files ----------------------------------------------------------------------------

    def _write_run_files(self, target: Target, resumed_from: Path | None, init_from: dict | None = None) -> None:
        if not self.dist.is_main:
            return
        save_config(self.cfg, self.run_dir / "config.json")
        atomic_write_json(str(self.run_dir / "data_plan.json"), self.stream.data_plan())
        info_path = self.run_dir / "run.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        manifest = self.stream.dataset.manifest
        info.update(
            {
                "run_name": self.run_dir.name,
                "shards": self.cfg.data.shards,
                "manifest_digest": json_digest(manifest),
                "target": target.path,
                "mask_token_source": target.mask_source,
                "drafter_config": self.drafter_cfg.to_dict(),
                "drafter_parameters": self.drafter.num_parameters(),
                "total_steps": self.total_steps,
                "steps_per_epoch": self.stream.steps_per_epoch,
                "device": str(self.device),
                "precision": str(self.autocast_dtype or torch.float32).replace("torch.", ""),
                "kernels": self.kernels.to_dict(),
                "world_size": self.dist.world_size,
                "accumulation": self.dist.accumulation,
                "distributed": self._split_record(),
            }
        )
        if init_from is not None:
            info.setdefault(
                "init_from", init_from
            )  # the weights the run started from (a resume keeps the first record)
        info.setdefault("start_time", time.time())
        info.setdefault("starts", []).append(
            {
                "time": time.time(),
                "git_sha": git_sha(),
                "tool_version": tool_version(),
                "step": self.step,
                "resumed_from": str(resumed_from) if resumed_from else None,
                "torch": torch.__version__,
                "world_size": self.dist.world_size,
                "accumulation": self.dist.accumulation,
                "ranks": [{k: p[k] for k in ("rank", "host", "pid", "device")} for p in self.dist.peers],
            }
        )
        info["git_sha"] = git_sha()
        info["tool_version"] = tool_version()
        atomic_write_json(str(info_path), info)

    def _split_record(self) -> dict:
        """run.json's `distributed`: the layout, every rank's host/pid/device/parts, and how
        epoch 0's global batches fall to the ranks (`buckets.split_summary`)."""
        record = self.dist.describe()
        if self.dist.num_parts > 1:
            record.update(
                split_summary(self.stream.lengths, self.stream.plan(0), self.dist.split, self.dist.world_size)
            )
        return record


def _claim_run_dir(cfg: TrainConfig, dist: Dist) -> tuple[Path, object, list[Path]]:
    """(run directory, its lock, the directories this start created): one training per run directory.
    Rank 0 holds the lock; a second training stops at once on every rank, naming the holder
    (the OS drops the lock of a killed one)."""
    lock, problem = None, None
    run_dir, created = _make_run_dir(cfg, dist)
    if dist.is_main:
        try:
            lock = exclusive_lock(
                str(run_dir / ".train.lock"),
                what=f"the run directory {run_dir}",
                hint="Two trainings into one run would corrupt its checkpoints and metrics: wait for the other, "
                "or choose another run_name.",
            )
        except LockedError as exc:
            if dist.world_size == 1:
                raise
            problem = str(exc)
    try:
        dist.agree(problem)
    except BaseException:
        _release_run_dir(run_dir, lock, created=[])  # the directory is the other training's
        raise
    return run_dir, lock, created


def _release_run_dir(run_dir: Path, lock, *, created: list[Path]) -> None:
    """Unlock; a refused start leaves none of the directories it created behind (only empty ones go)."""
    if lock is not None:
        lock.release()
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            directory.rmdir()


def _make_run_dir(cfg: TrainConfig, dist: Dist) -> tuple[Path, list[Path]]:
    """(the run directory, the directories rank 0 created for it now)."""
    # One name for every rank (a default name holds the time, which the ranks would read apart).
    name = dist.broadcast(cfg.run_name or time.strftime("run-%Y%m%d-%H%M%S"))
    out = Path(cfg.out_dir).resolve()
    run_dir = (out / name).resolve()
    if run_dir.parent != out:  # run_name is a plain name, so only a symlink out_dir/NAME gets here
        raise ValueError(
            f"config key 'run_name': '{out / name}' leads to '{run_dir}', outside out_dir '{out}'; choose another "
            "run_name"
        )
    # The directories this start creates (out_dir too, when new): a refused start removes them again.
    created = [d for d in (out, run_dir) if not d.exists()] if dist.is_main else []
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    if dist.world_size > 1:  # every rank reads rank 0's checkpoints: the run directory must be shared
        token = dist.broadcast(f".ranks-{time.time_ns()}-{dist.peers[0]['pid']}")
        if dist.is_main:
            (run_dir / token).touch()
        dist.gather_objects(None)  # a barrier over the host group
        seen = (run_dir / token).exists()
        problem = (
            None
            if seen
            else (
                f"config key 'out_dir': rank {dist.rank} on {dist.peers[dist.rank]['host']} does not see the run "
                "directory "
                f"'{run_dir}' that rank 0 created; out_dir must be on a filesystem every node shares"
            )
        )
        try:
            dist.agree(problem)
        finally:
            if dist.is_main:
                (run_dir / token).unlink(missing_ok=True)
    return run_dir, created


# ----------------------------------------------------------------------------------------------
# One step


def train_step(run: Run, batch: Batch | Share, step: int, wait: float = 0.0) -> StepResult:
    """One optimizer step on one global batch (or a skipped one); see the module docstring.

    `batch` is a whole batch (one process, no accumulation) or this rank's `Share` of the global
    batch; `wait` is how long this rank waited for it (reduced into the step's fetch time)."""
    cfg = run.cfg
    lr = lr_at(step, run.total_steps, run.warmup_steps, cfg.optim.lr)
    share = batch if isinstance(batch, Share) else Share.of_batch(batch)
    whole = len(share.parts) == 1 and run.dist.world_size == 1  # the global batch is one micro-batch: no reductions
    host_blocks = _share_blocks(run, share, step)
    ran = [b for b in host_blocks if b is not None]
    if whole:
        weight_total, has_loss = None, bool(ran) and ran[0].loss_rows_M.numel() > 0
    else:
        # Every part's loss is normalized by the global batch's weight, so the parts add up to its loss.
        total = float(run.dist.sum([sum(float(b.weights_BQ.double().sum()) for b in ran)])[0])
        weight_total, has_loss = torch.tensor(total, dtype=torch.float32, device=run.device), total > 0
    if not has_loss:
        sizes = _reduce_sizes(run, share, ran, wait, whole)
        return StepResult(None, None, lr, True, "no loss positions in batch", None, blocks=ran, **sizes)
    parts_stats = []
    for m, (part, blocks) in enumerate(zip(share.parts, host_blocks)):
        last = m == len(share.parts) - 1
        has_rows = blocks is not None and blocks.loss_rows_M.numel() > 0
        if not has_rows and not (last and run.dist.world_size > 1):
            continue
        if not has_rows:  # DDP's all-reduce needs every rank's backward: run one that contributes exactly zero
            part, blocks = run.placeholder()
        with run.dist.grad_sync(last):
            stats = _forward_backward(run, part, blocks, weight_total)
        if has_rows:
            parts_stats.append(stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.optim.grad_clip)
    if whole:
        stats = parts_stats[0]
        loss_value, norm_value = float(stats.loss.detach()), float(grad_norm)  # the step's one host sync
        sizes = _reduce_sizes(run, share, ran, wait, whole)
    else:
        stats, loss_value, norm_value, sizes = _reduce_step(run, share, ran, parts_stats, grad_norm, wait)
    # Every rank decides from the same reduced numbers, so a non-finite step is skipped on all of them.
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        run.optimizer.zero_grad(set_to_none=True)
        reason = "non-finite loss" if not math.isfinite(loss_value) else "non-finite gradient"
        return StepResult(loss_value, norm_value, lr, True, reason, stats, blocks=ran, **sizes)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_value, norm_value, lr, False, None, stats, blocks=ran, **sizes)


def _share_blocks(run: Run, share: Share, step: int) -> list[Blocks | None]:
    """The blocks of each of this rank's parts (None for an empty part), as rows of the global batch.

    Keys and anchor quotas are drawn for the whole global batch from (seed, step) and each part
    takes its rows, so a sample's anchors do not depend on the split; with one part this is exactly
    `make_blocks` on the whole batch. A block cap (`loss.max_blocks`) needs every row's candidate
    count: summed over ranks."""
    cfg = run.cfg
    B, S = len(share.global_lengths), int(share.global_lengths.max())
    counts_B = torch.zeros(B, dtype=torch.int64)
    for part, rows in zip(share.parts, share.rows):
        if part is not None:
            counts_B[torch.from_numpy(rows)] = anchor_candidates(part.loss_mask, part.lengths).sum(dim=1)
    if cfg.loss.max_blocks is not None and run.dist.world_size > 1:
        counts_B = torch.from_numpy(run.dist.sum(counts_B.numpy()).astype(np.int64))
    quota_B = anchors_per_row(counts_B, cfg.loss.num_anchors, cfg.loss.max_blocks)
    keys_BS = torch.rand((B, S), generator=step_generator(cfg.seed, step))
    out = []
    for part, rows in zip(share.parts, share.rows):
        if part is None:
            out.append(None)
            continue
        index = torch.from_numpy(rows)
        out.append(_make_part_blocks(run, part, keys_BS=keys_BS[index], quota_B=quota_B[index]))
    return out


def _make_part_blocks(run: Run, batch: Batch, **given) -> Blocks:
    cfg = run.cfg
    return make_blocks(
        batch.input_ids,
        batch.loss_mask,
        batch.lengths,
        batch.topk_ids,
        block_size=run.drafter_cfg.block_size,
        num_anchors=cfg.loss.num_anchors,
        gamma=cfg.loss.gamma,
        mask_token_id=run.drafter_cfg.mask_token_id,
        generator=None,
        labels=cfg.loss.labels,
        topk_logprobs_BSk=batch.topk_logprobs,
        soft_targets=cfg.loss.kl_weight > 0,
        max_blocks=cfg.loss.max_blocks,
        **given,
    )


def _forward_backward(run: Run, batch: Batch, blocks: Blocks, weight_total: torch.Tensor | None) -> LossOutput:
    blocks = blocks.to(run.device, non_blocking=True)
    hidden_BSF = batch.hidden.to(run.device, non_blocking=True)
    cfg, K = run.cfg, run.drafter_cfg.block_size
    mask = run.kernels.mask(blocks.anchors_BN, blocks.keep_BN, hidden_BSF.shape[1], K, run.drafter_cfg.mask_rules)
    with run.kernels.autocast():
        out_BQD = run.forward(run.head.embed(blocks.block_ids_BQ), hidden_BSF, blocks.position_ids_BP, mask)
        stats = block_loss(
            out_BQD,
            run.head.lm_head_VD,
            blocks,
            chunk_rows=cfg.loss.chunk_rows,
            kl_weight=cfg.loss.kl_weight,
            kl_temperature=cfg.loss.kl_temperature,
            chunk_fn=run.chunk_fn,
            weight_total=weight_total,
        )
    stats.loss.backward()
    return stats


def _local_sizes(share: Share, ran: list[Blocks], wait: float, K: int) -> list[float]:
    """[real tokens, samples, padded tokens, block tokens, wait] of this rank's parts."""
    parts = [p for p in share.parts if p is not None]
    return [
        float(sum(p.real_tokens for p in parts)),
        float(sum(len(p.sample_ids) for p in parts)),
        float(sum(p.padded_tokens for p in parts)),
        float(sum(b.num_blocks * K for b in ran)),
        float(wait),
    ]


def _sizes_from(rows_RN: np.ndarray) -> dict:
    """StepResult's size fields from the gathered `_local_sizes` of every rank (wait: the largest)."""
    tokens, samples, padded, block_tokens, _ = rows_RN.sum(axis=0)
    return {
        "tokens": int(tokens),
        "samples": int(samples),
        "padded_tokens": int(padded),
        "block_tokens": int(block_tokens),
        "wait": float(rows_RN[:, 4].max()),
    }


def _reduce_sizes(run: Run, share: Share, ran: list[Blocks], wait: float, whole: bool) -> dict:
    local = _local_sizes(share, ran, wait, run.drafter_cfg.block_size)
    return _sizes_from(np.asarray([local]) if whole else run.dist.gather(local))


def _reduce_step(run: Run, share: Share, ran: list[Blocks], parts_stats: list[LossOutput], grad_norm, wait: float):
    """(stats, loss, grad norm, sizes) of the global batch: one gather of every rank's sums."""
    K = run.drafter_cfg.block_size
    zeros_K = torch.zeros(K, dtype=torch.float64)
    loss = sum((s.loss.detach().double() for s in parts_stats), torch.zeros((), dtype=torch.float64, device=run.device))
    correct_K = sum((s.correct_K.double().cpu() for s in parts_stats), zeros_K)
    counted_K = sum((s.counted_K.double().cpu() for s in parts_stats), zeros_K)
    streak = sum(float(s.streak_sum) for s in parts_stats)
    blocks = sum(s.num_blocks for s in parts_stats)
    loss_value, norm_value = float(loss), float(grad_norm)
    local = [
        loss_value if math.isfinite(loss_value) else 0.0,
        float(not math.isfinite(loss_value)),
        float(not math.isfinite(norm_value)),
        streak,
        float(blocks),
        *correct_K.tolist(),
        *counted_K.tolist(),
        *_local_sizes(share, ran, wait, K),
    ]
    rows = run.dist.gather(local)
    summed = rows.sum(axis=0)
    loss_value = float(summed[0]) if rows[:, 1].max() == 0 else math.nan
    if rows[:, 2].max() > 0:
        norm_value = math.nan
    n = 5 + 2 * K
    stats = LossOutput(
        loss=torch.tensor(loss_value),
        correct_K=torch.from_numpy(summed[5 : 5 + K]),
        counted_K=torch.from_numpy(summed[5 + K : n]),
        streak_sum=torch.tensor(float(summed[3])),
        num_blocks=int(summed[4]),
    )
    return stats, loss_value, norm_value, _sizes_from(rows[:, n:])


# ----------------------------------------------------------------------------------------------
# The loop


def _record(run: Run, step: int, batch: Batch | Share, result: StepResult, step_time: float, ckpt: bool) -> dict:
    real, wait = result.tokens, result.wait
    # Accuracy is meaningful whenever the loss is finite (also on a step skipped for its gradient).
    stats = result.stats if result.loss is not None and math.isfinite(result.loss) else None
    streak = stats.mean_streak() if stats is not None else None
    record = {
        "step": step,
        "epoch": run.stream.progress(batch.state),
        "time": time.time(),
        "loss": result.loss,  # MetricsLog writes a non-finite value as null
        "acc": stats.accuracy() if stats is not None else None,
        "streak": streak,
        "tau": 1.0 + streak if streak is not None else None,
        "grad_norm": result.grad_norm,
        "clipped": bool(result.grad_norm is not None and result.grad_norm > run.cfg.optim.grad_clip),
        "lr": result.lr,
        "tokens": run.tokens,
        "batch_tokens": real,
        "batch_samples": result.samples,
        "block_tokens": result.block_tokens,
        "tok_s": real / step_time if step_time > 0 else None,
        "step_time": step_time,
        "fetch_frac": wait / step_time if step_time > 0 else 0.0,
        "pad_eff": real / result.padded_tokens if result.padded_tokens else 0.0,
        "bucket": batch.bucket,
        "mean_len": real / result.samples if result.samples else 0.0,
        "skipped": result.skipped,
        "ckpt": ckpt,
    }
    if result.skipped:
        record["skip_reason"] = result.skip_reason
        record["sample_ids"] = list(batch.sample_ids)
    return record


def _wandb_run(cfg: TrainConfig, run_dir: Path):
    if not cfg.log.wandb:
        return None
    try:
        import wandb
    except ImportError:
        log.warning("log.wandb is true but wandb is not installed; logging to metrics.jsonl only")
        return None
    try:
        return wandb.init(
            project=cfg.log.wandb_project,
            name=run_dir.name,
            id=run_dir.name,
            dir=str(run_dir),
            mode=cfg.log.wandb_mode,
            config=config_to_dict(cfg),
            resume="allow",
        )
    except Exception as exc:  # noqa: BLE001 - the run works without wandb
        log.warning("wandb.init failed, logging to metrics.jsonl only: %s", exc)
        return None


def _progress_bar(run: Run):
    from tqdm import tqdm

    return tqdm(
        total=run.total_steps,
        initial=run.step,
        disable=not (run.cfg.log.progress and run.dist.is_main),
        unit="step",
        dynamic_ncols=True,
    )


def train(cfg: TrainConfig, *, stream: DataStream | None = None, dist: Dist | None = None) -> dict:
    """Train (or resume) the run `cfg` describes; returns a summary. See the module docstring.

    Started by torchrun / accelerate launch, every process calls this; `dist` defaults to the
    process group the environment describes (`Dist.from_env`), or to one plain process."""
    run = Run.prepare(cfg, stream=stream, dist=dist)
    cfg = run.cfg  # with the run name it got
    main = run.dist.is_main
    last = min(run.total_steps, cfg.stop_after or run.total_steps)
    metrics = MetricsLog(run.run_dir / "metrics.jsonl", wandb_run=_wandb_run(cfg, run.run_dir)) if main else None
    saver = CheckpointWriter(run.run_dir / "checkpoints", cfg.checkpoint.keep_last) if main else None
    bar = _progress_bar(run)
    if main:
        log.info(
            "run %s: %d steps (%d per epoch), drafter %.1fM parameters, device %s, %d process(es) x %d "
            "micro-step(s) per step",
            run.run_dir,
            run.total_steps,
            run.stream.steps_per_epoch,
            run.drafter.num_parameters() / 1e6,
            run.device,
            run.dist.world_size,
            run.dist.accumulation,
        )
    step_end = time.perf_counter()
    step = run.step
    try:
        while run.step < last:
            step = run.step + 1
            batch = next(run.stream)
            result = train_step(run, batch, step, wait=run.stream.last_wait)
            run.step = step
            run.tokens += result.tokens
            run.nonfinite_in_row = run.nonfinite_in_row + 1 if result.skipped and result.stats is not None else 0
            run.nonfinite_total += int(result.skipped and result.stats is not None)
            save_now = step % cfg.checkpoint.every == 0 or step == last
            if save_now:
                positions = run.dist.check_in_step(
                    batch.state, run.drafter
                )  # every rank's data position, checked equal
                if main:
                    saver.save(run.snapshot(batch.state, positions))
            now = time.perf_counter()
            record = _record(run, step, batch, result, now - step_end, save_now)
            step_end = now
            if main:
                metrics.write(record)
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}" if record["loss"] is not None else "skip",
                tau=f"{record['tau']:.2f}" if record["tau"] is not None else "-",
                tok_s=f"{record['tok_s']:.0f}" if record["tok_s"] else "-",
                refresh=False,
            )
            if result.skipped and main:
                log.warning("step %d skipped (%s); samples %s", step, result.skip_reason, batch.sample_ids)
            if run.nonfinite_in_row >= cfg.optim.max_nonfinite_in_row:
                raise TrainingAborted(
                    f"{run.nonfinite_in_row} non-finite steps in a row (last at step {step}: {result.skip_reason}); "
                    f"aborting. Skipped steps and their sample ids are in {run.run_dir / 'metrics.jsonl'}. "
                    f"Usual causes: corrupt hidden states in the shards, a learning rate too high, or fp16 overflow."
                )
        if saver is not None:
            saver.wait()
    except Exception as exc:
        if run.dist.is_comm_failure(exc):
            raise run.dist.peer_lost(exc, f"at step {step}") from exc
        raise
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
        run.stream.close()
        if saver is not None:
            with contextlib.suppress(RuntimeError):
                saver.wait()
        run.release()
    if dist is None:
        run.dist.close()  # the group this call joined
    # data.on_corrupt=skip: unreadable samples skipped by this process, per shard file.
    corrupt = {shard: len(ids) for shard, ids in sorted(getattr(run.stream, "corrupt_samples", {}).items())}
    if corrupt:
        log.warning(
            "skipped %d unreadable samples (data.on_corrupt=skip), per shard file: %s", sum(corrupt.values()), corrupt
        )
    return {
        "run_dir": str(run.run_dir),
        "steps": run.step,
        "total_steps": run.total_steps,
        "tokens": run.tokens,
        "nonfinite_total": run.nonfinite_total,
        "corrupt_samples": corrupt,
        "last_checkpoint": str(saver.last_saved) if saver is not None and saver.last_saved else None,
        "world_size": run.dist.world_size,
        "accumulation": run.dist.accumulation,
    }
