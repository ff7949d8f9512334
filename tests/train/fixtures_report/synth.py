"""Synthetic run directories that follow the `metrics.jsonl` contract of docs/ARCHITECTURE.md.

`Synth()` is a healthy run: four length buckets interleaved by stride, a loss that falls and an
accuracy that keeps rising, accuracy that falls with the block position and rises with the
context length, grad norms that settle without collapsing, no gap, stall or skipped step. Each
field below switches on one pathology the previous team met; `write_run` writes metrics.jsonl,
config.json, data_plan.json and run.json into a directory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BLOCK_POSITIONS = 15
HEALTHY_SAMPLES = (4000, 3000, 2000, 1000)
HEALTHY_MEAN_LEN = (180, 380, 760, 1500)
EDGES = (0, 256, 512, 1024, 2048)
# The mix of the last team's runs: the longest bucket holds 20% of the samples but, under a
# token budget, gets about half of the batches.
SKEWED_SAMPLES = (4000, 3000, 1000, 2000)


@dataclass
class Synth:
    n_steps: int = 1000
    seed: int = 0
    samples: tuple[int, ...] = HEALTHY_SAMPLES
    mean_len: tuple[int, ...] = HEALTHY_MEAN_LEN
    edges: tuple[int, ...] = EDGES
    token_budget: int = 16384
    pad_eff: float = 0.9
    schedule: str = "interleaved"  # or "blocked": each bucket's batches in one run per epoch
    loss_offset: dict[int, float] = field(default_factory=dict)  # extra loss of a bucket
    grad_late_ratio: float = 0.7  # late median grad norm / early median
    drop_steps: tuple[int, ...] = ()  # steps absent from the log
    stall_seconds: float = 0.0  # extra wall-clock time after every checkpoint save
    nan_steps: tuple[int, ...] = ()  # skipped as non-finite
    acc_frozen_from: float | None = None  # share of the run after which accuracy stops changing
    position_decay: float = 8.0  # accuracy at position k ~ exp(-(k-1)/decay)
    length_effect: float = 0.02  # accuracy gain per bucket (longer context)
    reset_at: float | None = None  # share of the run where the loss jumps back up
    reset_height: float = 1.5
    ckpt_every: int = 200
    step_seconds: float = 0.5
    config_changes: dict[str, object] = field(default_factory=dict)  # dotted key -> value
    empty_plan_buckets: int = 0  # extra buckets at the top of the plan that hold no sample
    truncate_last_line: bool = False
    write_plan: bool = True

    # ------------------------------------------------------------------------------------------

    def batches_per_epoch(self) -> list[int]:
        tokens = [s * l for s, l in zip(self.samples, self.mean_len)]
        return [max(1, round(t / (self.token_budget * self.pad_eff))) for t in tokens]

    def schedule_ids(self, rng: np.random.Generator) -> list[int]:
        """Bucket id of every batch, epoch after epoch."""
        counts = self.batches_per_epoch()
        out: list[int] = []
        while len(out) < self.n_steps:
            if self.schedule == "interleaved":
                keyed = [((j + 0.5) / n, b) for b, n in enumerate(counts) for j in range(n)]
                out += [b for _, b in sorted(keyed)]
            else:
                for b in rng.permutation(len(counts)):
                    out += [int(b)] * counts[b]
        return out[: self.n_steps]

    def records(self) -> list[dict]:
        rng = np.random.default_rng(self.seed)
        n = self.n_steps
        buckets = self.schedule_ids(rng)
        per_epoch = sum(self.batches_per_epoch())
        warmup = max(1, int(0.04 * n))
        clock, tokens = 1.7e9, 0
        ckpt_pending = False
        out = []
        for step in range(1, n + 1):
            b = buckets[step - 1]
            t = step / n
            lr = 6e-4 * (step / warmup if step <= warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, n - warmup))))
            batch_tokens = int(self.token_budget * self.pad_eff * (1 + 0.02 * rng.standard_normal()))
            step_time = self.step_seconds * batch_tokens / self.token_budget * (1 + 0.03 * rng.standard_normal())
            clock += step_time + (self.stall_seconds if ckpt_pending else 0.0)
            tokens += batch_tokens
            ckpt_pending = step % self.ckpt_every == 0
            record = {
                "step": step, "epoch": step / per_epoch, "time": clock, "lr": lr, "tokens": tokens,
                "batch_tokens": batch_tokens, "batch_samples": max(1, batch_tokens // self.mean_len[b]),
                "block_tokens": 512 * 16, "tok_s": batch_tokens / step_time, "step_time": step_time,
                "fetch_frac": 0.01, "pad_eff": self.pad_eff + 0.01 * rng.standard_normal(), "bucket": b,
                "mean_len": float(self.mean_len[b]), "skipped": False, "ckpt": ckpt_pending,
            }
            if step in self.nan_steps:
                record.update(loss=None, grad_norm=None, acc=[None] * BLOCK_POSITIONS, streak=None, tau=None, clipped=False,
                              skipped=True, skip_reason="non-finite loss", sample_ids=[f"sample-{step}-{i}" for i in range(3)])
            else:
                record.update(self._learning(step, t, b, rng))
            if step not in self.drop_steps:
                out.append(record)
        return out

    def _learning(self, step: int, t: float, bucket: int, rng: np.random.Generator) -> dict:
        n = self.n_steps
        loss = 1.0 + 3.0 * math.exp(-step / (0.15 * n)) - 0.03 * bucket + self.loss_offset.get(bucket, 0.0)
        if self.reset_at is not None and t >= self.reset_at:
            loss += self.reset_height * math.exp(-(t - self.reset_at) / 0.05)
        loss *= 1 + 0.05 * rng.standard_normal()
        t_acc = min(t, self.acc_frozen_from) if self.acc_frozen_from is not None else t
        level = 0.35 + 0.45 * (1 - math.exp(-t_acc / 0.4)) + self.length_effect * bucket
        k = np.arange(BLOCK_POSITIONS)
        acc = np.clip(level * np.exp(-k / self.position_decay) + 0.01 * rng.standard_normal(BLOCK_POSITIONS), 0, 1)
        streak = float(np.cumprod(acc).sum())
        early = 1.0 / (1.0 + math.exp((t - 0.3) / 0.05))  # 1 early, 0 late
        grad = 0.5 * (self.grad_late_ratio + (1 - self.grad_late_ratio) * early) * math.exp(0.15 * rng.standard_normal())
        if step <= max(1, int(0.04 * n)):
            grad *= 3.0  # warm-up: large gradients, clipped
        return {"loss": loss, "acc": [float(a) for a in acc], "streak": streak, "tau": 1 + streak,
                "grad_norm": grad, "clipped": grad > 1.0}

    def config(self) -> dict:
        cfg = {
            "run_name": "synthetic", "seed": self.seed,
            "model": {"num_hidden_layers": 5, "block_size": 16},
            "data": {"token_budget": self.token_budget, "buckets": list(self.edges)},
            "loss": {"gamma": 7.0, "kl_weight": 0.0},
            "optim": {"lr": 6e-4, "warmup_frac": 0.04, "clip": 1.0},
            "checkpoint": {"every": self.ckpt_every, "keep": 3},
        }
        for key, value in self.config_changes.items():
            node = cfg
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        return cfg

    def data_plan(self) -> dict:
        """In the layout of `DataStream.data_plan()` (train/data.py): K-1 inner boundaries, the
        last bucket open-ended, one object per bucket."""
        batches = self.batches_per_epoch() + [0] * self.empty_plan_buckets
        samples = list(self.samples) + [0] * self.empty_plan_buckets
        tokens = [s * l for s, l in zip(self.samples, self.mean_len)] + [0] * self.empty_plan_buckets
        uppers = list(self.edges[1:]) + [self.edges[-1] * 2 ** (i + 1) for i in range(self.empty_plan_buckets)]
        lowers = [self.edges[0]] + uppers[:-1]
        first_epoch = np.array(self.schedule_ids(np.random.default_rng(self.seed))[: sum(batches)])
        runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[-1], first_epoch, [-1]])) != 0))
        rows = [
            {"bucket": b, "range": [lowers[b] + 1, uppers[b] if b < len(uppers) - 1 else None], "samples": samples[b],
             "tokens": tokens[b], "min_len": None, "max_len": None, "batch_size": 0, "batches_per_epoch": batches[b],
             "share_of_samples": samples[b] / sum(samples), "share_of_batches": batches[b] / sum(batches),
             "padding_efficiency": self.pad_eff if samples[b] else None}
            for b in range(len(batches))
        ]
        return {
            "version": 1, "shards": "shards/tiny", "samples": sum(samples), "tokens": sum(tokens), "excluded": {},
            "boundaries": uppers[:-1], "token_budget": self.token_budget, "steps_per_epoch": sum(batches),
            "planned_padding_efficiency": self.pad_eff, "longest_same_bucket_run": int(runs.max()), "buckets": rows,
        }


def write_run(directory: Path, spec: Synth | None = None) -> Path:
    """Write a synthetic run directory; returns it."""
    spec = spec or Synth()
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in spec.records()]
    text = "\n".join(lines) + "\n"
    if spec.truncate_last_line:
        text = text[: -len(lines[-1]) // 2 - 1]  # half of the last record, no newline: killed mid-write
    (directory / "metrics.jsonl").write_text(text)
    (directory / "config.json").write_text(json.dumps(spec.config(), indent=2))
    run_info = {"run_name": directory.name, "shards": "shards/tiny", "manifest_digest": "d1", "git_sha": "abc", "start_time": 1.7e9}
    (directory / "run.json").write_text(json.dumps(run_info))
    if spec.write_plan:
        (directory / "data_plan.json").write_text(json.dumps(spec.data_plan(), indent=2))
    return directory
