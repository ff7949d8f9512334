"""What the loop writes and shows about each step: the metrics.jsonl record, wandb and the progress
bar.

`step_record` is one line of metrics.jsonl (docs/ARCHITECTURE.md, "metrics.jsonl"): the step's
`StepResult` with its timing, the run's cumulative tokens and the epoch as a fraction of the data
stream's position after the batch. A skipped step's record carries its reason and the batch's
sample ids; the loop logs the same, and stops the run after too many in a row (`train.loop`).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from common.config import config_to_dict
from train.config import TrainConfig
from train.data import Batch, Share
from train.loss import LossOutput
from train.metrics import SELECTOR_KEYS
from train.prepare import Run
from train.step import StepResult

__all__ = ["step_record", "selector_record", "wandb_run", "progress_bar", "show_progress"]

log = logging.getLogger(__name__)


def step_record(run: Run, step: int, batch: Batch | Share, result: StepResult, step_time: float, ckpt: bool) -> dict:
    """One metrics.jsonl line for `step`; `ckpt`: a checkpoint save started after it."""
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
    if run.drafter_cfg.arch == "dflash2":
        record.update(selector_record(stats))
        if stats is not None:
            record["loss"] = float(stats.selector.unary_loss)  # the DFlash term: comparable with a DFlash run's
    if result.skipped:
        record["skip_reason"] = result.skip_reason
        record["sample_ids"] = list(batch.sample_ids)
    return record


def selector_record(stats: LossOutput | None) -> dict:
    """A DFlash2 step's `SELECTOR_KEYS` (train.metrics); None where the loss was not finite."""
    if stats is None:
        return dict.fromkeys(SELECTOR_KEYS)
    selector = stats.selector
    return {
        "selector_loss": float(selector.loss),
        "selector_weight": selector.weight,
        "selector_coverage": float(selector.coverage),
        "selector_acc": stats.accuracy(selector.correct_K),
        "selector_streak": stats.mean_streak(selector.streak_sum),
    }


def wandb_run(cfg: TrainConfig, run_dir: Path):
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


def progress_bar(run: Run):
    from tqdm import tqdm

    return tqdm(
        total=run.total_steps,
        initial=run.step,
        disable=not (run.cfg.log.progress and run.dist.is_main),
        unit="step",
        dynamic_ncols=True,
    )


def show_progress(bar, record: dict) -> None:
    """One step on the progress bar, with its loss, τ and throughput."""
    bar.update(1)
    bar.set_postfix(
        loss=f"{record['loss']:.3f}" if record["loss"] is not None else "skip",
        tau=f"{record['tau']:.2f}" if record["tau"] is not None else "-",
        tok_s=f"{record['tok_s']:.0f}" if record["tok_s"] else "-",
        refresh=False,
    )
