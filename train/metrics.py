"""`metrics.jsonl`: one JSON object per optimizer step, none skipped (docs/ARCHITECTURE.md).

The keys are exactly `STEP_KEYS` (a DFlash2 drafter's run also `SELECTOR_KEYS`), plus `SKIP_KEYS` on
skipped steps; `MetricsLog` refuses a record with other keys, so the report (`train/report/`) can
rely on them. Each line is flushed as it is
written; a resumed run first drops the lines after its checkpoint's step, so the file stays one
line per step with no gap and no duplicate. wandb, when configured, gets the same numbers.

Meanings that the table in ARCHITECTURE.md leaves open:
- `block_tokens`: kept blocks x block size (the drafter's query tokens, padding blocks excluded).
- `step_time`: wall clock from the end of the previous step to the end of this one, so fetch,
  step, logging and checkpoint hand-off all count and the times add up to the run's duration.
- `fetch_frac`: seconds blocked waiting for the batch / step_time.
- DFlash2: `loss` is the DFlash term alone, on the same scale as a DFlash run's; the objective is
  `loss + selector_weight * selector_loss` (train/selector_loss.py), and `acc` / `streak` / `tau` are
  the unary top-1's. `selector_acc` and `selector_streak` are the selector's teacher-forced accuracy
  per block position and its served (self-conditioned) walk's mean accepted length per block.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from common.io import atomic_write_text

__all__ = ["STEP_KEYS", "SELECTOR_KEYS", "SKIP_KEYS", "MetricsLog", "truncate_after", "read_metrics"]

log = logging.getLogger(__name__)

STEP_KEYS = (
    "step",
    "epoch",
    "time",
    "loss",
    "acc",
    "streak",
    "tau",
    "grad_norm",
    "clipped",
    "lr",
    "tokens",
    "batch_tokens",
    "batch_samples",
    "block_tokens",
    "tok_s",
    "step_time",
    "fetch_frac",
    "pad_eff",
    "bucket",
    "mean_len",
    "skipped",
    "ckpt",
)
SKIP_KEYS = ("skip_reason", "sample_ids")
# A DFlash2 drafter's run (docs/ARCHITECTURE.md, "metrics.jsonl").
SELECTOR_KEYS = ("selector_loss", "selector_weight", "selector_coverage", "selector_acc", "selector_streak")


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics.jsonl (a torn last line from a kill is ignored)."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("ignoring a torn line in %s", path)
    return records


def truncate_after(path: str | os.PathLike, step: int) -> int:
    """Keep only the records with step <= `step` (a resumed run re-does the later ones); returns how many were
    dropped."""
    records = read_metrics(path)
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    if Path(path).exists():  # rewrite even when nothing is dropped: it also removes a torn last line
        atomic_write_text(str(path), "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


class MetricsLog:
    """Appends step records to metrics.jsonl and mirrors them to wandb when enabled."""

    def __init__(self, path: str | os.PathLike, *, wandb_run=None, extra_keys: tuple[str, ...] = ()):
        self.path = Path(path)
        self.keys = set(STEP_KEYS) | set(extra_keys)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run; close())
        self._wandb = wandb_run

    def write(self, record: dict) -> None:
        expected = self.keys | (set(SKIP_KEYS) if record.get("skipped") else set())
        assert set(record) == expected, (
            f"metrics record keys differ from the contract: {sorted(set(record) ^ expected)}"
        )
        clean = {k: _finite_or_none(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._mirror_to_wandb(clean)

    def _mirror_to_wandb(self, record: dict) -> None:
        flat = {
            k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        for name in ("acc", "selector_acc"):
            flat.update({f"{name}/{k}": v for k, v in enumerate(record.get(name) or [], start=1) if v is not None})
        flat["skipped"] = int(bool(record["skipped"]))
        try:
            self._wandb.log(flat, step=record["step"])
        except Exception as exc:  # noqa: BLE001 - wandb trouble must never stop training
            log.warning("wandb logging failed, continuing without it: %s", exc)
            self._wandb = None

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as exc:  # noqa: BLE001
                log.warning("wandb finish failed: %s", exc)
