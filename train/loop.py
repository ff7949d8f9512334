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

import torch

from common.config import config_digest, config_to_dict, save_config
from common.device import autocast_dtype, resolve_device
from common.hashing import json_digest, tokenizer_digest
from common.hf_target import text_config
from common.io import atomic_write_json, exists, join, resolve
from common.locks import exclusive_lock
from common.provenance import git_sha, tool_version
from train.attention import build_block_mask, build_dense_mask
from train.blocks import Blocks, make_blocks, step_generator
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
from train.data import Batch, DataStream
from train.loss import LossOutput, block_loss, chunk_loss_and_grad
from train.metrics import MetricsLog, truncate_after
from train.model import DFlashDrafter, DrafterConfig, TargetHead

__all__ = ["lr_at", "train", "train_step", "Run", "StepResult", "TrainingAborted", "resolve_mask_token", "build_drafter_config"]

log = logging.getLogger(__name__)


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row (or another condition that makes going on pointless)."""


# ----------------------------------------------------------------------------------------------
# Schedule


def lr_at(step: int, total_steps: int, warmup_steps: int, peak: float) -> float:
    """Learning rate of 1-based `step`: linear warmup to `peak` over `warmup_steps`, then cosine to 0 at `total_steps`."""
    done = step - 1
    if done < warmup_steps:
        return peak * (done + 1) / warmup_steps
    progress = (done - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


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
        found = (int(prov_id), "shards provenance tokenizer.mask_token_id")
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
        raise ValueError("config key 'model.target_layer_ids' is not set and the shards' provenance has no taps.layer_ids")
    m = cfg.model
    try:
        return DrafterConfig.from_target(
            target_cfg, layer_ids, num_layers=m.num_layers, block_size=m.block_size, mask_token_id=mask_token_id,
            hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, initializer_range=m.initializer_range,
        )
    except ValueError as exc:
        raise ValueError(f"config table 'model': {exc}") from None


def expected_fields(drafter_cfg: DrafterConfig, target_cfg: dict, tokenizer, topk_needed: int) -> dict:
    """What the shards' manifest must agree with (train.data.check_compatible)."""
    hidden = int(target_cfg["hidden_size"])
    expected = {
        "layer_ids": list(drafter_cfg.target_layer_ids),
        "hidden_size": hidden,
        "hidden_width": drafter_cfg.n_taps * hidden,
        "vocab_size": int(target_cfg["vocab_size"]),
        "topk": topk_needed,
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

    provenance = manifest.get("provenance") or {}
    path = cfg.model.target or (provenance.get("target") or {}).get("name_or_path")
    if not path or not Path(path, "config.json").is_file():
        raise ValueError(f"config key 'model.target': no target checkpoint directory at {path!r} (set model.target)")
    target_cfg = text_config(path)
    tokenizer = _load_tokenizer(path)
    mask_token_id, mask_source = resolve_mask_token(provenance, tokenizer, cfg.model.mask_token_id)
    drafter_cfg = build_drafter_config(cfg, target_cfg, provenance, mask_token_id)
    check_compatible(manifest, expected_fields(drafter_cfg, target_cfg, tokenizer, topk_needed=1))
    return Target(str(path), target_cfg, mask_source, drafter_cfg)


def _open_stream(cfg: TrainConfig) -> DataStream:
    fs, root = resolve(cfg.data.shards)
    if not exists(fs, join(root, cfg.data.manifest)):
        raise ValueError(
            f"config key 'data.shards': no shards dataset at '{cfg.data.shards}' (no {cfg.data.manifest}); "
            "for the tiny default run `make tiny` and `make extract` first"
        )
    return DataStream(cfg.data)


def _device_and_precision(cfg: TrainConfig) -> tuple[torch.device, torch.dtype | None]:
    """The device, and the autocast dtype (None = plain fp32)."""
    device = resolve_device(cfg.device)
    if cfg.model.attention == "flex" and device.type == "cpu":
        raise ValueError("config key 'model.attention': flex has no backward on CPU; use sdpa or auto")
    return device, autocast_dtype(cfg.precision, device)


# ----------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class StepResult:
    loss: float | None
    grad_norm: float | None
    lr: float
    skipped: bool
    skip_reason: str | None
    stats: LossOutput | None
    block_tokens: int
    blocks: Blocks | None = None  # the host-side blocks of the step (for FLOP counts and debugging)



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

@dataclasses.dataclass
class Run:
    """Everything the loop needs, built by `prepare` (and restored from a checkpoint when resuming)."""

    cfg: TrainConfig
    run_dir: Path
    device: torch.device
    autocast_dtype: torch.dtype | None
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

    @classmethod
    def prepare(cls, cfg: TrainConfig, *, stream: DataStream | None = None) -> "Run":
        device, autocast_dtype = _device_and_precision(cfg)
        stream = stream if stream is not None else _open_stream(cfg)
        target = resolve_target(cfg, stream.dataset.manifest)  # refuses incompatible shards
        torch.manual_seed(cfg.seed)
        with torch.device(device):  # initialize in place: a 27B-width drafter is 7 GB of fp32 on the host otherwise
            drafter = DFlashDrafter(target.drafter_cfg)
        head = TargetHead.from_pretrained(target.path, dtype=autocast_dtype or torch.float32).to(device)
        if head.hidden_size != target.drafter_cfg.hidden_size:
            raise ValueError(
                f"config key 'model.hidden_size': the drafter width {target.drafter_cfg.hidden_size} must equal the target "
                f"embedding width {head.hidden_size} (the frozen embedding and lm_head are the target's)"
            )
        optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay, fused=device.type == "cuda",
        )
        total = cfg.optim.max_steps or max(1, round(cfg.optim.epochs * stream.steps_per_epoch))
        forward, chunk_fn = compile_step_functions(drafter) if cfg.compile else (drafter, chunk_loss_and_grad)
        run = cls(
            cfg=cfg, run_dir=_make_run_dir(cfg), device=device, autocast_dtype=autocast_dtype, drafter_cfg=target.drafter_cfg,
            drafter=drafter, forward=forward, head=head, optimizer=optimizer, stream=stream,
            total_steps=total, warmup_steps=round(cfg.optim.warmup_ratio * total), chunk_fn=chunk_fn,
        )
        resumed_from = run._maybe_resume()
        run._write_run_files(target, resumed_from)
        return run

    # -- resume -------------------------------------------------------------------------------

    def _maybe_resume(self) -> Path | None:
        ckpt_root = self.run_dir / "checkpoints"
        remove_partial_checkpoints(ckpt_root)
        if self.cfg.resume == "never":
            if (self.run_dir / "metrics.jsonl").exists() or latest_checkpoint(ckpt_root):
                raise ValueError(f"config key 'resume': run directory '{self.run_dir}' already holds a run (resume=never); choose another run_name")
            return None
        path = latest_checkpoint(ckpt_root) if self.cfg.resume == "auto" else Path(self.cfg.resume)
        if path is None:
            if (self.run_dir / "metrics.jsonl").exists():
                truncate_after(self.run_dir / "metrics.jsonl", 0)  # a run killed before its first checkpoint starts over
            return None
        self.load(path)
        truncate_after(self.run_dir / "metrics.jsonl", self.step)
        log.info("resumed from %s at step %d", path, self.step)
        return path

    def load(self, path: Path) -> None:
        """Restore model, optimizer, step counters, RNG states and data position from a checkpoint."""
        ckpt = load_checkpoint(path, map_location="cpu")
        conflicts = resume_conflicts(ckpt["state"]["config"], config_to_dict(self.cfg))
        if conflicts:
            raise ValueError(f"checkpoint '{path}' was made with another config; differing keys:\n  " + "\n  ".join(conflicts))
        self.drafter.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.nonfinite_total, self.nonfinite_in_row = int(state["nonfinite_total"]), int(state["nonfinite_in_row"])
        restore_rng_state(state["rng"])
        self.stream.load_state_dict(state["data_state"])

    def snapshot(self, data_state: dict):
        state = {
            "step": self.step, "tokens": self.tokens, "nonfinite_total": self.nonfinite_total,
            "nonfinite_in_row": self.nonfinite_in_row, "data_state": data_state, "rng": rng_state(),
            "config": config_to_dict(self.cfg), "config_digest": config_digest(self.cfg),
            "total_steps": self.total_steps, "git_sha": git_sha(), "time": time.time(),
        }
        return take_snapshot(self.step, self.drafter, self.optimizer, state, self.drafter_cfg.to_dict())

    # -- run files ----------------------------------------------------------------------------

    def _write_run_files(self, target: Target, resumed_from: Path | None) -> None:
        save_config(self.cfg, self.run_dir / "config.json")
        atomic_write_json(str(self.run_dir / "data_plan.json"), self.stream.data_plan())
        info_path = self.run_dir / "run.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        manifest = self.stream.dataset.manifest
        info.update({
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
        })
        info.setdefault("start_time", time.time())
        info.setdefault("starts", []).append({
            "time": time.time(), "git_sha": git_sha(), "tool_version": tool_version(), "step": self.step,
            "resumed_from": str(resumed_from) if resumed_from else None, "torch": torch.__version__,
        })
        info["git_sha"] = git_sha()
        info["tool_version"] = tool_version()
        atomic_write_json(str(info_path), info)


def lock_run_dir(cfg: TrainConfig):
    """One training per run directory: a second one stops at once (the OS drops the lock of a killed one)."""
    run_dir = _make_run_dir(cfg)
    return exclusive_lock(str(run_dir / ".train.lock"), what=f"the run directory {run_dir}",
                          hint="Two trainings into one run would corrupt its checkpoints and metrics: wait for the other, or choose another run_name.")


def _make_run_dir(cfg: TrainConfig) -> Path:
    name = cfg.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    out = Path(cfg.out_dir).resolve()
    run_dir = (out / name).resolve()
    if run_dir.parent != out:  # run_name is a plain name, so only a symlink out_dir/NAME gets here
        raise ValueError(f"config key 'run_name': '{out / name}' leads to '{run_dir}', outside out_dir '{out}'; choose another run_name")
    if cfg.run_name is None:
        cfg.run_name = name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


# ----------------------------------------------------------------------------------------------
# One step


def _autocast(run: Run):
    if run.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(run.device.type, dtype=run.autocast_dtype)


def _attention_mask(run: Run, anchors_BN, keep_BN, context_len: int):
    kind = run.cfg.model.attention
    if kind == "flex" or (kind == "auto" and run.device.type == "cuda"):
        return build_block_mask(anchors_BN, keep_BN, context_len, run.drafter_cfg.block_size)
    return build_dense_mask(anchors_BN, keep_BN, context_len, run.drafter_cfg.block_size)


def train_step(run: Run, batch: Batch, step: int) -> StepResult:
    """One optimizer step on one batch (or a skipped one); see the module docstring."""
    cfg, K = run.cfg, run.drafter_cfg.block_size
    lr = lr_at(step, run.total_steps, run.warmup_steps, cfg.optim.lr)
    blocks = make_blocks(
        batch.input_ids, batch.loss_mask, batch.lengths, batch.topk_ids,
        block_size=K, num_anchors=cfg.loss.num_anchors, gamma=cfg.loss.gamma, mask_token_id=run.drafter_cfg.mask_token_id,
        generator=step_generator(cfg.seed, step), labels=cfg.loss.labels,
        topk_logprobs_BSk=batch.topk_logprobs, soft_targets=cfg.loss.kl_weight > 0, max_blocks=cfg.loss.max_blocks,
    )
    host_blocks = blocks
    block_tokens = blocks.num_blocks * K
    if blocks.loss_rows_M.numel() == 0:
        return StepResult(None, None, lr, True, "no loss positions in batch", None, block_tokens, blocks)
    blocks = blocks.to(run.device, non_blocking=True)
    hidden_BSF = batch.hidden.to(run.device, non_blocking=True)
    mask = _attention_mask(run, blocks.anchors_BN, blocks.keep_BN, hidden_BSF.shape[1])
    with _autocast(run):
        out_BQD = run.forward(run.head.embed(blocks.block_ids_BQ), hidden_BSF, blocks.position_ids_BP, mask)
        stats = block_loss(
            out_BQD, run.head.lm_head_VD, blocks, chunk_rows=cfg.loss.chunk_rows,
            kl_weight=cfg.loss.kl_weight, kl_temperature=cfg.loss.kl_temperature, chunk_fn=run.chunk_fn,
        )
    stats.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.optim.grad_clip)
    loss_value, norm_value = float(stats.loss.detach()), float(grad_norm)  # the step's one host sync
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        run.optimizer.zero_grad(set_to_none=True)
        reason = "non-finite loss" if not math.isfinite(loss_value) else "non-finite gradient"
        return StepResult(loss_value, norm_value, lr, True, reason, stats, block_tokens, host_blocks)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_value, norm_value, lr, False, None, stats, block_tokens, host_blocks)


# ----------------------------------------------------------------------------------------------
# The loop


def _record(run: Run, step: int, batch: Batch, result: StepResult, step_time: float, wait: float, ckpt: bool) -> dict:
    real = int(batch.lengths.sum())
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
        "batch_samples": len(batch.sample_ids),
        "block_tokens": result.block_tokens,
        "tok_s": real / step_time if step_time > 0 else None,
        "step_time": step_time,
        "fetch_frac": wait / step_time if step_time > 0 else 0.0,
        "pad_eff": real / batch.input_ids.numel(),
        "bucket": batch.bucket,
        "mean_len": real / len(batch.sample_ids),
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
        return wandb.init(project=cfg.log.wandb_project, name=run_dir.name, id=run_dir.name, dir=str(run_dir),
                          mode=cfg.log.wandb_mode, config=config_to_dict(cfg), resume="allow")
    except Exception as exc:  # noqa: BLE001 - the run works without wandb
        log.warning("wandb.init failed, logging to metrics.jsonl only: %s", exc)
        return None


def _progress_bar(run: Run):
    from tqdm import tqdm

    return tqdm(total=run.total_steps, initial=run.step, disable=not run.cfg.log.progress, unit="step", dynamic_ncols=True)


def train(cfg: TrainConfig, *, stream: DataStream | None = None) -> dict:
    """Train (or resume) the run `cfg` describes; returns a summary. See the module docstring."""
    fresh = not (Path(cfg.out_dir) / cfg.run_name).exists() if cfg.run_name else True
    lock = lock_run_dir(cfg)
    try:
        run = Run.prepare(cfg, stream=stream)
    except BaseException:
        lock.release()
        if fresh:  # a refused start leaves no empty run directory behind
            with contextlib.suppress(OSError):
                (Path(cfg.out_dir) / cfg.run_name).rmdir()
        raise
    last = min(run.total_steps, cfg.stop_after or run.total_steps)
    metrics = MetricsLog(run.run_dir / "metrics.jsonl", wandb_run=_wandb_run(cfg, run.run_dir))
    saver = CheckpointWriter(run.run_dir / "checkpoints", cfg.checkpoint.keep_last)
    bar = _progress_bar(run)
    log.info("run %s: %d steps (%d per epoch), drafter %.1fM parameters, device %s",
             run.run_dir, run.total_steps, run.stream.steps_per_epoch, run.drafter.num_parameters() / 1e6, run.device)
    step_end = time.perf_counter()
    try:
        while run.step < last:
            step = run.step + 1
            batch = next(run.stream)
            wait = run.stream.last_wait
            result = train_step(run, batch, step)
            run.step = step
            run.tokens += int(batch.lengths.sum())
            run.nonfinite_in_row = run.nonfinite_in_row + 1 if result.skipped and result.stats is not None else 0
            run.nonfinite_total += int(result.skipped and result.stats is not None)
            save_now = step % cfg.checkpoint.every == 0 or step == last
            if save_now:
                saver.save(run.snapshot(batch.state))
            now = time.perf_counter()
            record = _record(run, step, batch, result, now - step_end, wait, save_now)
            step_end = now
            metrics.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}" if record["loss"] is not None else "skip",
                            tau=f"{record['tau']:.2f}" if record["tau"] is not None else "-",
                            tok_s=f"{record['tok_s']:.0f}" if record["tok_s"] else "-", refresh=False)
            if result.skipped:
                log.warning("step %d skipped (%s); samples %s", step, result.skip_reason, batch.sample_ids)
            if run.nonfinite_in_row >= cfg.optim.max_nonfinite_in_row:
                raise TrainingAborted(
                    f"{run.nonfinite_in_row} non-finite steps in a row (last at step {step}: {result.skip_reason}); "
                    f"aborting. Skipped steps and their sample ids are in {run.run_dir / 'metrics.jsonl'}. "
                    f"Usual causes: corrupt hidden states in the shards, a learning rate too high, or fp16 overflow."
                )
        saver.wait()
    finally:
        bar.close()
        metrics.close()
        run.stream.close()
        with contextlib.suppress(RuntimeError):
            saver.wait()
        lock.release()
    # data.on_corrupt=skip: unreadable samples skipped by this process, per shard file.
    corrupt = {shard: len(ids) for shard, ids in sorted(getattr(run.stream, "corrupt_samples", {}).items())}
    if corrupt:
        log.warning("skipped %d unreadable samples (data.on_corrupt=skip), per shard file: %s", sum(corrupt.values()), corrupt)
    return {
        "run_dir": str(run.run_dir),
        "steps": run.step,
        "total_steps": run.total_steps,
        "tokens": run.tokens,
        "nonfinite_total": run.nonfinite_total,
        "corrupt_samples": corrupt,
        "last_checkpoint": str(saver.last_saved) if saver.last_saved else None,
    }

