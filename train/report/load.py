"""Reading a run directory for the training-health report, tolerantly.

A run may still be training (its last `metrics.jsonl` line half written), may have been killed,
may predate `data_plan.json`, or may come from a trainer that does not log every key yet. Nothing
here raises for that: each problem becomes a note in plain words that the report prints, and the
analyses that need the missing piece say they were skipped. Only a missing run directory or a
missing `metrics.jsonl` is a user error (`ValueError`).

Columns follow the `metrics.jsonl` contract in docs/ARCHITECTURE.md; a null or absent value is NaN
(floats), -1 (bucket) or False (flags).
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Metrics",
    "BucketPlan",
    "DataPlan",
    "RunRecord",
    "load_run",
    "resolve_run_dir",
    "parse_metrics_lines",
    "read_data_plan",
    "FLOAT_KEYS",
]

FLOAT_KEYS = (
    "epoch",
    "time",
    "loss",
    "streak",
    "tau",
    "grad_norm",
    "lr",
    "tokens",
    "batch_tokens",
    "batch_samples",
    "block_tokens",
    "tok_s",
    "step_time",
    "fetch_frac",
    "pad_eff",
    "mean_len",
    "selector_loss",  # the selector keys: a DFlash2 drafter's run only
    "selector_weight",
    "selector_coverage",
    "selector_streak",
)
FLAG_KEYS = ("clipped", "skipped", "ckpt")
# Keys whose absence disables a part of the report; the rest are merely shown as missing.
ESSENTIAL_KEYS = ("step", "loss", "acc", "grad_norm", "bucket", "time", "epoch", "tokens")


@dataclass
class Metrics:
    """One row per logged step, sorted by step, one record per step (the last one logged wins)."""

    step: np.ndarray  # int64 [N]
    cols: dict[str, np.ndarray]  # FLOAT_KEYS -> float64 [N], FLAG_KEYS -> bool [N]
    bucket: np.ndarray  # int64 [N], -1 where absent
    acc: np.ndarray  # float64 [N, P], P = block positions 1..P (NaN where absent)
    present: frozenset[str]  # keys seen in at least one record
    skips: list[dict[str, Any]]  # {step, reason, sample_ids} of skipped steps
    duplicates: list[int]  # steps logged more than once (a resume that re-ran them)
    backward_jumps: list[tuple[int, int]]  # (from step, to step) where the log went back
    selector_acc: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # as `acc`, of the selector

    @property
    def n(self) -> int:
        return int(self.step.size)

    def __getattr__(self, name: str) -> np.ndarray:
        cols = self.__dict__.get("cols")
        if cols is not None and name in cols:
            return cols[name]
        raise AttributeError(name)

    @property
    def acc_mean(self) -> np.ndarray:
        """Mean accuracy over block positions per step (NaN where no position has a value)."""
        if self.acc.shape[1] == 0:
            return np.full(self.n, np.nan)
        with np.errstate(all="ignore"):
            counts = np.isfinite(self.acc).sum(axis=1)
            sums = np.nansum(self.acc, axis=1)
            return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)

    @property
    def valid(self) -> np.ndarray:
        """Steps that trained: not skipped and with a finite loss."""
        return ~self.cols["skipped"] & np.isfinite(self.cols["loss"])


@dataclass
class BucketPlan:
    id: int
    lo: float | None = None
    hi: float | None = None
    samples: float | None = None
    tokens: float | None = None
    batches: float | None = None  # per epoch
    pad_eff: float | None = None

    @property
    def label(self) -> str:
        if self.lo is None and self.hi is None:
            return f"bucket {self.id}"
        lo = "?" if self.lo is None else f"{self.lo:g}"
        hi = "∞" if self.hi is None or math.isinf(self.hi) else f"{self.hi:g}"
        return f"bucket {self.id} ({lo}–{hi} tok)"


@dataclass
class DataPlan:
    buckets: list[BucketPlan]
    token_budget: float | None
    pad_eff: float | None
    not_found: list[str]  # fields the reader looked for and did not find
    longest_run: int | None = None  # longest same-bucket run of the planned first epoch
    excluded: dict[str, Any] = field(default_factory=dict)  # samples left out, by reason


@dataclass
class RunRecord:
    """What a run directory holds, as the report reads it back (not the live run: `train.prepare.Run`)."""

    name: str
    path: Path
    metrics: Metrics
    config: dict[str, Any] | None
    run_info: dict[str, Any] | None
    plan: DataPlan | None
    notes: list[str] = field(default_factory=list)  # problems met while reading, in plain words


# ----------------------------------------------------------------------------------------------
# Locating and loading


def resolve_run_dir(word: str) -> Path:
    """A run given as a path, or as a bare name under runs/ (what `make train RUN=name` creates)."""
    path = Path(word)
    if path.is_dir():
        return path
    under_runs = Path("runs") / word
    if not path.is_absolute() and under_runs.is_dir():
        return under_runs
    raise ValueError(
        f"run directory '{word}' does not exist" + (f" (nor does '{under_runs}')" if not path.is_absolute() else "")
    )


def load_run(word: str) -> RunRecord:
    path = resolve_run_dir(word)
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"run directory '{path}' has no metrics.jsonl (has training started there?)")
    notes: list[str] = []
    records = parse_metrics_lines(metrics_path.read_text(encoding="utf-8", errors="replace"), notes)
    metrics = build_metrics(records, notes)
    config = _read_optional_json(path / "config.json", notes, "config comparison between runs is skipped")
    run_info = _read_optional_json(path / "run.json", notes, "shards provenance is not compared")
    plan = None
    raw_plan = _read_optional_json(
        path / "data_plan.json",
        notes,
        "planned bucket shares, sample shares and planned padding efficiency are skipped; buckets are taken from "
        "the log alone",
    )
    if raw_plan is not None:
        plan = read_data_plan(raw_plan)
        if plan.not_found:
            notes.append(
                f"data_plan.json has no {', '.join(plan.not_found)}; the parts of the report that need them say so."
            )
    return RunRecord(
        name=path.name or str(path),
        path=path,
        metrics=metrics,
        config=config,
        run_info=run_info,
        plan=plan,
        notes=notes,
    )


def _read_optional_json(path: Path, notes: list[str], consequence: str) -> Any:
    if not path.is_file():
        notes.append(f"{path.name} is missing: {consequence}.")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        notes.append(f"{path.name} is not valid JSON ({exc}): {consequence}.")
        return None


# ----------------------------------------------------------------------------------------------
# metrics.jsonl


def parse_metrics_lines(text: str, notes: list[str]) -> list[dict[str, Any]]:
    """JSON objects of the log; a bad last line is a run killed (or still writing) mid-line."""
    lines = text.split("\n")
    records = []
    bad_middle = []
    last_index = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            if i == last_index:
                notes.append(
                    f"metrics.jsonl: the last line ({i + 1}) is incomplete (run killed or still writing); it is "
                    "ignored."
                )
            else:
                bad_middle.append(i + 1)
            continue
        records.append(record)
    if bad_middle:
        shown = ", ".join(map(str, bad_middle[:10])) + (" ..." if len(bad_middle) > 10 else "")
        notes.append(
            f"metrics.jsonl: {len(bad_middle)} unreadable line(s) in the middle of the log (lines {shown}); they "
            "are ignored."
        )
    return records


def build_metrics(records: list[dict[str, Any]], notes: list[str]) -> Metrics:
    """Columns from records; a step logged twice keeps its last record (the run that continued)."""
    by_step: dict[int, dict[str, Any]] = {}
    duplicates: list[int] = []
    backward: list[tuple[int, int]] = []
    previous = None
    for record in records:
        step = record["step"]
        if previous is not None and step <= previous:
            backward.append((previous, step))
        if step in by_step:
            duplicates.append(step)
        by_step[step] = record
        previous = step
    ordered = [by_step[s] for s in sorted(by_step)]
    present = frozenset(k for r in ordered for k in r)
    n = len(ordered)
    cols: dict[str, np.ndarray] = {}
    for key in FLOAT_KEYS:
        cols[key] = np.array([_as_float(r.get(key)) for r in ordered], dtype=np.float64)
    for key in FLAG_KEYS:
        cols[key] = np.array([r.get(key) is True for r in ordered], dtype=bool)
    bucket = np.array([r["bucket"] if isinstance(r.get("bucket"), int) else -1 for r in ordered], dtype=np.int64)
    acc = _acc_matrix(ordered, "acc")
    missing = [k for k in ESSENTIAL_KEYS if k not in present]
    if n and missing:
        notes.append(f"metrics.jsonl has no {', '.join(missing)}: the parts of the report that need them are skipped.")
    skips = [
        {"step": r["step"], "reason": r.get("skip_reason") or "not given", "sample_ids": r.get("sample_ids") or []}
        for r in ordered
        if r.get("skipped") is True
    ]
    return Metrics(
        step=np.array(sorted(by_step), dtype=np.int64).reshape(n),
        cols=cols,
        bucket=bucket,
        acc=acc,
        present=present,
        skips=skips,
        duplicates=sorted(set(duplicates)),
        backward_jumps=backward,
        selector_acc=_acc_matrix(ordered, "selector_acc"),
    )


def _as_float(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return math.nan


def _acc_matrix(records: list[dict[str, Any]], key: str) -> np.ndarray:
    width = max((len(r[key]) for r in records if isinstance(r.get(key), list)), default=0)
    acc = np.full((len(records), width), np.nan)
    for i, record in enumerate(records):
        values = record.get(key)
        if isinstance(values, list):
            acc[i, : len(values)] = [_as_float(v) for v in values]
    return acc


# ----------------------------------------------------------------------------------------------
# data_plan.json (its key names belong to the data stream; accept the plausible spellings)

_BUCKET_ALIASES = {
    "id": ("id", "bucket", "index"),
    "lo": ("lo", "min_len", "min_length", "low", "lower", "start", "min"),
    "hi": ("hi", "max_len", "max_length", "high", "upper", "end", "max"),
    "samples": ("samples", "n_samples", "num_samples", "sample_count", "count"),
    "tokens": ("tokens", "n_tokens", "num_tokens", "token_count"),
    "batches": ("batches_per_epoch", "batches", "n_batches", "num_batches", "batch_count"),
    "pad_eff": ("pad_eff", "padding_efficiency", "planned_pad_eff"),
}
_LIST_ALIASES = {
    "samples": ("samples_per_bucket", "bucket_samples", "samples"),
    "tokens": ("tokens_per_bucket", "bucket_tokens", "tokens"),
    "batches": ("batches_per_bucket", "batches_per_bucket_per_epoch", "bucket_batches", "batches_per_epoch", "batches"),
    "pad_eff": ("pad_eff_per_bucket", "bucket_pad_eff"),
}
_BOUNDARY_KEYS = ("boundaries", "bucket_boundaries", "edges", "bucket_edges")
_BUDGET_KEYS = ("token_budget", "tokens_per_batch", "batch_token_budget", "max_tokens")
_PAD_KEYS = ("pad_eff", "padding_efficiency", "planned_pad_eff", "planned_padding_efficiency")


def read_data_plan(raw: Any) -> DataPlan:
    """Normalise data_plan.json: per-bucket objects under `buckets`, or parallel per-bucket lists."""
    if not isinstance(raw, dict):
        return DataPlan(buckets=[], token_budget=None, pad_eff=None, not_found=["a JSON object at the top level"])
    if isinstance(raw.get("plan"), dict):
        raw = {**raw, **raw["plan"]}
    buckets = _buckets_from_objects(raw.get("buckets")) if raw.get("buckets") is not None else _buckets_from_lists(raw)
    _apply_boundaries(buckets, _first(raw, _BOUNDARY_KEYS))
    budget = _number(_first(raw, _BUDGET_KEYS))
    pad = _number(_first(raw, _PAD_KEYS))
    longest = _number(_first(raw, ("longest_same_bucket_run", "longest_run")))
    excluded = raw.get("excluded") if isinstance(raw.get("excluded"), dict) else {}
    not_found = []
    if not buckets:
        not_found.append("bucket list")
    for name, what in (
        ("samples", "samples per bucket"),
        ("tokens", "tokens per bucket"),
        ("batches", "batches per bucket per epoch"),
    ):
        if buckets and all(getattr(b, name) is None for b in buckets):
            not_found.append(what)
    if buckets and all(b.lo is None and b.hi is None for b in buckets):
        not_found.append("bucket boundaries")
    if budget is None:
        not_found.append("token budget")
    if pad is None and not any(b.pad_eff is not None for b in buckets):
        not_found.append("planned padding efficiency")
    return DataPlan(
        buckets=buckets,
        token_budget=budget,
        pad_eff=pad,
        not_found=not_found,
        longest_run=int(longest) if longest is not None else None,
        excluded=excluded,
    )


def _first(mapping: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in mapping:
            return mapping[key]
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _buckets_from_objects(items: Any) -> list[BucketPlan]:
    if isinstance(items, dict):  # {"0": {...}, "1": {...}}
        items = [
            {"id": int(k) if str(k).isdigit() else i, **v}
            for i, (k, v) in enumerate(items.items())
            if isinstance(v, dict)
        ]
    if not isinstance(items, list):
        return []
    buckets = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        values = {name: _number(_first(item, aliases)) for name, aliases in _BUCKET_ALIASES.items()}
        bounds = _first(item, ("range", "bounds", "length_range"))
        if isinstance(bounds, list) and len(bounds) == 2:
            # The bucket's range wins over min_len/max_len, which may be its members' actual lengths.
            values["lo"], values["hi"] = _number(bounds[0]), _number(bounds[1])
        bucket_id = int(values.pop("id")) if values["id"] is not None else i
        buckets.append(BucketPlan(id=bucket_id, **values))
    return buckets


def _buckets_from_lists(raw: dict[str, Any]) -> list[BucketPlan]:
    lists = {name: _first(raw, aliases) for name, aliases in _LIST_ALIASES.items()}
    lists = {name: value for name, value in lists.items() if isinstance(value, list)}
    n = max((len(v) for v in lists.values()), default=0)
    if n == 0:
        edges = _first(raw, _BOUNDARY_KEYS)
        n = max(len(edges) - 1, 0) if isinstance(edges, list) else 0
    return [
        BucketPlan(id=i, **{name: _number(v[i]) if i < len(v) else None for name, v in lists.items()}) for i in range(n)
    ]


def _apply_boundaries(buckets: list[BucketPlan], edges: Any) -> None:
    """K+1 edges, K-1 inner cut points, or K upper bounds: all three spellings occur in practice."""
    if not isinstance(edges, list) or not buckets or not all(_number(e) is not None for e in edges):
        return
    edges = [float(e) for e in edges]
    k = len(buckets)
    if len(edges) == k + 1:
        los, his = edges[:-1], edges[1:]
    elif len(edges) == k - 1:
        los, his = [0.0] + edges, edges + [math.inf]
    elif len(edges) == k:
        los, his = [0.0] + edges[:-1], edges
    else:
        return
    for bucket, lo, hi in zip(buckets, los, his, strict=True):
        bucket.lo = bucket.lo if bucket.lo is not None else lo
        bucket.hi = bucket.hi if bucket.hi is not None else hi


# ----------------------------------------------------------------------------------------------
# Configs


def matches_any(key: str, patterns: list[str]) -> bool:
    """A dotted key matches a pattern exactly, by wildcard, or as a table prefix (`loss` covers `loss.gamma`)."""
    return any(fnmatch.fnmatchcase(key, p) or key.startswith(p + ".") for p in patterns)
