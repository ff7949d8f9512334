"""Setting a run up: `Run.prepare(cfg)` builds everything the loop needs, in this order.

    run = Run.prepare(cfg)     # run dir, data stream, target and drafter config, kernels, drafter,
                               # frozen head, optimizer, step functions, resume, run files

1. The run directory is claimed (`train.run_dir`: one training per directory).
2. The data stream is opened and the target found, refused unless it is the one the shards were
   extracted from (`target.identity`; `model.allow_target_mismatch`); the drafter config is
   derived from the target and the shards' provenance (`resolve_target`: taps, mask token, a
   storage tier's projection), and shards that do not fit it are refused, naming the field. A mask
   token the shards' provenance does not vouch for is looked for in every sample's input_ids
   (`check_mask_token_absent`, reading only that column).
3. The kernel plan (device, autocast, attention, compile) is chosen, one for every rank (refused on
   all if one rank cannot run it), and `model.init_from` is checked against the drafter config.
4. The drafter (seeded), the target's frozen embedding and lm_head, AdamW and the step functions
   (`train.step.step_functions`) are built; the schedule spans `optim.max_steps` or the epochs.
5. Resume: rank 0 picks the checkpoint (`resume=auto|never|DIR`) and every rank loads it
   (weights, optimizer, counters, RNG states, data position); metrics.jsonl is cut back to it.
   Otherwise `model.init_from` warm-starts the weights (`train.warm_start`).
6. Rank 0 writes config.json, data_plan.json and run.json.

`Run.snapshot` is the other half of resume: the state a checkpoint stores.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from common.config import config_digest, config_to_dict, save_config
from common.device import resolve_device
from common.hashing import json_digest, tokenizer_digest
from common.io import atomic_write_json, exists, join, resolve
from common.provenance import git_sha, tool_version
from shards.provenance import Provenance, provenance_of
from target.checkpoint import text_config
from target.identity import StoredHead, read_stored_head, target_identity
from target.identity_check import OVERRIDE_KEY, check_target
from train.blocks import Blocks, BlockSpec
from train.buckets import RankSplit, split_summary
from train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_partial_checkpoints,
    restore_rng_state,
    rng_state,
    take_snapshot,
)
from train.config import TrainConfig, parse_init_rule, resume_conflicts
from train.data import Batch, DataStream
from train.dflash2 import build_drafter
from train.distributed import Dist
from train.drafter_config import DrafterConfig, dflash2_fields, target_rope
from train.kernels import TRAIN_KEYS, KernelPlan, OnKernels, choose_kernels
from train.mask_token import MaskTokenChoice, check_mask_token_absent, resolve_mask_token
from train.metrics import truncate_after
from train.model import DFlashDrafter, TargetHead
from train.run_dir import claim_run_dir, release_run_dir
from train.samples import check_compatible
from train.step import make_part_blocks, step_functions
from train.stored_features import drafter_projection
from train.target_init import init_from_target
from train.warm_start import check_init_from, config_differences, warm_start

__all__ = [
    "Run",
    "ResolvedTarget",
    "resolve_target",
    "resolve_mask_token",
    "check_mask_token_absent",
    "build_drafter_config",
    "expected_fields",
    "choose_run_kernels",
]

log = logging.getLogger(__name__)


def _load_tokenizer(target_dir: str):
    """The target's tokenizer, or None when the directory has none."""
    if not any((Path(target_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    # trust_remote_code=False, not the default None: None asks on the terminal (and hangs a batch job)
    return AutoTokenizer.from_pretrained(target_dir, trust_remote_code=False)


def build_drafter_config(
    cfg: TrainConfig, target_cfg: dict, provenance: Provenance, mask_token_id: int
) -> DrafterConfig:
    """The drafter's config from the target's text config, the shards' taps and the model table."""
    taps = None if provenance.taps.layer_ids is None else list(provenance.taps.layer_ids)
    layer_ids = cfg.model.target_layer_ids if cfg.model.target_layer_ids is not None else taps
    if layer_ids is None:
        raise ValueError(
            "config key 'model.target_layer_ids' is not set and the shards' provenance has no taps.layer_ids"
        )
    m = cfg.model
    why = target_rope(target_cfg)[2]
    if why and m.rope_theta is None and m.rope_scaling is None:
        log.info("drafter rope: %s (model.rope_theta / model.rope_scaling override it)", why)
    if m.arch == "dflash2":  # the DFlash2 fields' reasons (and a group size that does not divide, by its key)
        log.info("DFlash2 drafter: %s", dflash2_fields(m, m.hidden_size or int(target_cfg["hidden_size"]))[1])
    try:
        return DrafterConfig.from_target(target_cfg, m, layer_ids=layer_ids, mask_token_id=mask_token_id)
    except ValueError as exc:
        raise ValueError(f"config table 'model': {exc}") from None


def expected_fields(drafter_cfg: DrafterConfig, target_cfg: dict, tokenizer, topk_needed: int) -> dict:
    """What the shards' manifest must agree with (train.samples.check_compatible)."""
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
class ResolvedTarget:
    """The target as `resolve_target` found it: its checkpoint path, text config and identity, where
    the mask token id came from, and the drafter config derived from them (the loaded model is
    `target.load.Target`; training never loads more of it than the frozen head)."""

    path: str
    text_config: dict
    mask: MaskTokenChoice
    drafter_cfg: DrafterConfig
    identity: dict  # target.identity.target_identity of `path`
    check: dict  # how it compares with the shards' target (target.identity_check.check_target)
    stored_head: StoredHead | None  # the embedding and head the identity hashed, for TargetHead (None: no weights)


def resolve_target(cfg: TrainConfig, manifest: dict) -> ResolvedTarget:
    """Find the target, derive the drafter config, and refuse shards that do not fit it (naming the field)."""
    provenance = provenance_of(manifest)
    path = cfg.model.target or provenance.target.name_or_path
    if not path or not Path(path, "config.json").is_file():
        raise ValueError(f"config key 'model.target': no target checkpoint directory at {path!r} (set model.target)")
    # A family the drafter cannot share its embedding and head with is refused here, in one line; the two
    # tensors are read once, for the identity and the frozen head.
    stored_head = read_stored_head(path)
    identity = target_identity(path, stored_head)
    check = check_target(
        identity,
        provenance.target.identity(),
        made=f"the shards at '{cfg.data.shards}' were extracted from",
        key=f"model.{OVERRIDE_KEY}",
        allowed=cfg.model.allow_target_mismatch,
    )
    target_cfg = text_config(path)
    tokenizer = _load_tokenizer(path)
    mask = resolve_mask_token(provenance, tokenizer, cfg.model.mask_token_id)
    drafter_cfg = build_drafter_config(cfg, target_cfg, provenance, mask.token_id)
    # Storage tiers: fc reads the dataset's projected features when it has them (train.stored_features).
    drafter_cfg = dataclasses.replace(drafter_cfg, projection=drafter_projection(cfg.model.projection, manifest))
    check_compatible(manifest, expected_fields(drafter_cfg, target_cfg, tokenizer, topk_needed=1))
    return ResolvedTarget(str(path), target_cfg, mask, drafter_cfg, identity, check, stored_head)


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


@dataclasses.dataclass
class Run(OnKernels):
    """Everything the loop needs (a step reads it as a `train.step.StepRun`), built by `prepare` (and
    restored from a checkpoint when resuming)."""

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
    block_spec: BlockSpec = dataclasses.field(init=False)  # how a step builds its blocks, from drafter_cfg + cfg.loss

    def __post_init__(self) -> None:
        self.block_spec = BlockSpec.of(self.drafter_cfg, self.cfg.loss)

    @classmethod
    def prepare(cls, cfg: TrainConfig, *, stream: DataStream | None = None, dist: Dist | None = None) -> Run:
        # A missing GPU is reported before the data is opened; the process group needs the device type.
        dist = dist if dist is not None else Dist.from_env(cfg.distributed, resolve_device(cfg.device))
        run_dir, lock, created = claim_run_dir(cfg, dist)  # before anything is read or written
        if cfg.run_name is None:  # the run's config (saved with it) holds the name it got
            cfg = dataclasses.replace(cfg, run_name=run_dir.name)
        try:
            return cls._prepare_claimed(cfg, stream, dist, run_dir, lock)
        except BaseException:
            release_run_dir(run_dir, lock, created=created)
            raise

    @classmethod
    def _prepare_claimed(cls, cfg: TrainConfig, stream: DataStream | None, dist: Dist, run_dir: Path, lock) -> Run:
        stream = stream if stream is not None else _open_stream(cfg, dist.split)
        target = resolve_target(cfg, stream.dataset.manifest)  # refuses incompatible shards
        check_mask_token_absent(stream.dataset, target.mask)
        kernels = _agreed_kernels(
            cfg, target.drafter_cfg, dist
        )  # refuses a kernel that cannot work, before anything runs
        device, autocast_dtype = kernels.device, kernels.autocast_dtype  # this rank's own device under data parallelism
        if cfg.model.init_from and Path(cfg.model.init_from).exists():
            check_init_from(cfg.model.init_from, target.drafter_cfg)  # before the run directory exists
        torch.manual_seed(cfg.seed)
        with torch.device(device):  # initialize in place: a 27B-width drafter is 7 GB of fp32 on the host otherwise
            drafter = build_drafter(target.drafter_cfg)
        head = TargetHead.from_pretrained(
            target.path, dtype=autocast_dtype or torch.float32, stored=target.stored_head
        ).to(device)
        target.stored_head = None  # the host copy goes once the head is on its device (about 5 GB for a 27B)
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
        init_from, target_rule = None, parse_init_rule(cfg.model.init_from_target)
        if resumed_from is None and cfg.model.init_from:
            init_from = warm_start(drafter, cfg.model.init_from)
        elif resumed_from is None and target_rule is not None:
            init_from = init_from_target(drafter, target.path, target_rule)
            log.info(
                f"drafter layers start from target layers {init_from['target_layers']} "
                f"({init_from['copied']} tensors; fresh: {', '.join(init_from['left_at_init']) or 'none'})"
            )
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
            blocks = make_part_blocks(self, batch, keys_BS=torch.zeros(1, 1), quota_B=torch.zeros(1, dtype=torch.int64))
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

    def _write_run_files(
        self, target: ResolvedTarget, resumed_from: Path | None, init_from: dict | None = None
    ) -> None:
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
                "target_identity": target.identity,
                "target_check": target.check,
                "mask_token_source": target.mask.describe(),
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
