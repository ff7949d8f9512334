"""The training loop: `train(cfg)` sets a run up, runs its steps, and says how it ended.

    summary = train(cfg)       # = Run.prepare + the loop; returns a summary dict

The trainer's parts, in the order a run goes through them:

    train.prepare     Run.prepare: run directory (train.run_dir), target, drafter, data stream,
                      optimizer, resume from a checkpoint
    train.step        train_step: one optimizer step on one global batch (or a skipped one)
    train.step_log    the metrics.jsonl record, wandb, progress bar and log lines of each step
    train.loop        this loop: counters, when to checkpoint (written in the background by
                      train.checkpoint, which keeps the last checkpoint.keep_last), stopping on
                      non-finite steps, closing down

Every step writes one metrics.jsonl line; a checkpoint is snapshotted after every
`checkpoint.every`-th step and after the last one. A step skipped for a non-finite loss or
gradient is logged with the batch's sample ids; `optim.max_nonfinite_in_row` in a row abort the
run (`TrainingAborted`). Data parallel: every rank runs this loop; rank 0 alone writes the run
files, metrics.jsonl (values reduced over ranks) and checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import time

from train.checkpoint import CheckpointWriter
from train.config import TrainConfig
from train.data import Batch, DataStream, Share
from train.distributed import Dist
from train.metrics import SELECTOR_KEYS, MetricsLog
from train.prepare import Run
from train.step import StepResult, train_step
from train.step_log import progress_bar, show_progress, step_record, wandb_run

__all__ = ["train", "TrainingAborted"]

log = logging.getLogger(__name__)


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row (or another condition that makes going on pointless)."""


def train(cfg: TrainConfig, *, stream: DataStream | None = None, dist: Dist | None = None) -> dict:
    """Train (or resume) the run `cfg` describes; returns a summary. See the module docstring.

    Started by torchrun / accelerate launch, every process calls this; `dist` defaults to the
    process group the environment describes (`Dist.from_env`), or to one plain process."""
    run = Run.prepare(cfg, stream=stream, dist=dist)
    cfg = run.cfg  # with the run name it got
    main = run.dist.is_main
    last = min(run.total_steps, cfg.stop_after or run.total_steps)
    extra = SELECTOR_KEYS if run.drafter_cfg.arch == "dflash2" else ()
    metrics = (
        MetricsLog(run.run_dir / "metrics.jsonl", wandb_run=wandb_run(cfg, run.run_dir), extra_keys=extra)
        if main
        else None
    )
    saver = CheckpointWriter(run.run_dir / "checkpoints", cfg.checkpoint.keep_last) if main else None
    bar = progress_bar(run)
    if main:
        _announce(run)
    step_end = time.perf_counter()
    step = run.step
    try:
        while run.step < last:
            step = run.step + 1
            batch = next(run.stream)
            result = train_step(run, batch, step, wait=run.stream.last_wait)
            _count_step(run, step, result)
            save_now = _save_if_due(run, saver, batch, step, last)
            now = time.perf_counter()
            record = step_record(run, step, batch, result, now - step_end, save_now)
            step_end = now
            if main:
                metrics.write(record)
            show_progress(bar, record)
            if result.skipped and main:
                log.warning("step %d skipped (%s); samples %s", step, result.skip_reason, batch.sample_ids)
            _stop_on_nonfinite_streak(run, step, result)
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
    return _summary(run, saver)


def _announce(run: Run) -> None:
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


def _count_step(run: Run, step: int, result: StepResult) -> None:
    """The run's counters after `step` (a checkpoint of this step stores them)."""
    run.step = step
    run.tokens += result.tokens
    # A step skipped with no loss positions is not a non-finite one.
    run.nonfinite_in_row = run.nonfinite_in_row + 1 if result.skipped and result.stats is not None else 0
    run.nonfinite_total += int(result.skipped and result.stats is not None)


def _save_if_due(run: Run, saver: CheckpointWriter | None, batch: Batch | Share, step: int, last: int) -> bool:
    """Snapshot a checkpoint after every `checkpoint.every`-th step and the last one (rank 0 writes it
    in the background); whether one was started."""
    if not (step % run.cfg.checkpoint.every == 0 or step == last):
        return False
    positions = run.dist.check_in_step(batch.state, run.drafter)  # every rank's data position, checked equal
    if run.dist.is_main:
        saver.save(run.snapshot(batch.state, positions))
    return True


def _stop_on_nonfinite_streak(run: Run, step: int, result: StepResult) -> None:
    if run.nonfinite_in_row >= run.cfg.optim.max_nonfinite_in_row:
        raise TrainingAborted(
            f"{run.nonfinite_in_row} non-finite steps in a row (last at step {step}: {result.skip_reason}); "
            f"aborting. Skipped steps and their sample ids are in {run.run_dir / 'metrics.jsonl'}. "
            f"Usual causes: corrupt hidden states in the shards, a learning rate too high, or fp16 overflow."
        )


def _summary(run: Run, saver: CheckpointWriter | None) -> dict:
    """`train`'s return value; logs the samples skipped as unreadable first."""
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
