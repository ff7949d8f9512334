"""The on-screen table of an evaluation report: a pure function of the report (`render_report`), so the
JSON holds everything the table shows. A DFlash2 checkpoint's rows are its selector's proposals (what
it serves); its unary proposals (the head's argmax and its tree) follow as `unary` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from target.identity_check import allowed_line

BASELINE_NAME = "most-frequent-label baseline"


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


def unary_rows(budgets: Sequence[int]) -> list[tuple[str, str, int | None]]:
    """(row label, summary key, list index or None) of a DFlash2 checkpoint's unary rows."""
    return [
        ("unary: tau chain", "tau", None),
        ("unary: tau chain surrogate", "surrogate_tau", None),
        ("unary: acc k=1", "position_acceptance", 0),
    ] + [(f"unary: tau DDTree-{b}", f"ddtree_tau_{b}", None) for b in budgets]


def baseline_rows(budgets: Sequence[int]) -> list[tuple[str, str, int | None]]:
    """(row label, summary key, list index or None) of the baseline's rows."""
    name = BASELINE_NAME
    return [(f"{name}: tau chain", "tau", None), (f"{name}: acc k=1", "position_acceptance", 0)] + [
        (f"{name}: tau DDTree-{b}", f"ddtree_tau_{b}", None) for b in budgets
    ]


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
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
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
        columns += [(b["label"], s) for b, s in zip(report["buckets"], ckpt["buckets"], strict=True)]
    header = ["metric"] + [name for name, _ in columns]
    specs = metric_rows(report["budgets"], n_draft)
    rows = [[label] + [_bucket_cell(s, key, index) for _, s in columns] for label, key, index in specs]
    baseline = report.get("baseline")  # absent from reports written before it existed
    if baseline:
        # Right after the drafter's headline rows, so the two read together.
        at = next(i for i, (_, key, _) in enumerate(specs) if key == "all_accepted") + 1
        summaries = [baseline["overall"]] + (baseline["buckets"] if len(columns) > 1 else [])
        rows[at:at] = [
            [label] + [_bucket_cell(s, key, index) for s in summaries]
            for label, key, index in baseline_rows(report["budgets"])
        ]
    unary = ckpt.get("unary")
    if unary:
        at = next(i for i, row in enumerate(rows) if row[0].startswith("acc k=1"))
        summaries = [unary["overall"]] + (unary["buckets"] if len(columns) > 1 else [])
        rows[at:at] = [
            [label] + [_bucket_cell(s, key, index) for s in summaries]
            for label, key, index in unary_rows(report["budgets"])
        ]
    return _grid(header, rows)


def _baseline_line(report: dict) -> list[str]:
    """The header line that says what the baseline is (and, with two checkpoints, its overall numbers)."""
    baseline = report.get("baseline")
    if not baseline or baseline.get("token") is None:
        return []
    line = (
        f"  baseline   {baseline['name']}: always token {baseline['token']} ({100 * baseline['token_share']:.1f}% of "
        f"these blocks' labels); DDTree over the label frequencies"
    )
    if len(report["checkpoints"]) == 1:
        return [line]
    overall = baseline["overall"]
    numbers = ", ".join(
        f"{label.split(': ', 1)[1]} {_cell(_value(overall, key, index))}"
        for label, key, index in baseline_rows(report["budgets"])
    )
    return [line, f"             on the same blocks for A and B: {numbers}"]


def _pair_table(first: dict, second: dict, ratio: dict, rows_spec, unary: tuple | None = None) -> str:
    """A beside B; `unary`: (their unary summaries, a DFlash2 checkpoint's or None; the rows), rows without a ratio."""
    header = ["metric", "A", "B", "B/A"]
    rows = [
        [label, _bucket_cell(first, key, index), _bucket_cell(second, key, index), _cell(_value(ratio, key, index))]
        for label, key, index in rows_spec
    ]
    if unary:
        pair, spec = unary
        rows += [
            [label] + [_cell(_value(s, key, index)) if s else "-" for s in pair] + ["-"] for label, key, index in spec
        ]
    return _grid(header, rows)


def _unary_pair(ckpts: list, budgets: Sequence[int], bucket: int | None = None) -> tuple | None:
    """(the two checkpoints' unary summaries, overall or of bucket `bucket`; their rows), or None if
    neither is DFlash2."""
    if not any(c.get("unary") for c in ckpts):
        return None
    pair = tuple(
        (c["unary"]["overall"] if bucket is None else c["unary"]["buckets"][bucket]) if c.get("unary") else None
        for c in ckpts
    )
    return pair, unary_rows(budgets)


def _target_lines(ckpt: dict) -> list[str]:
    """A line for each check of the target that differed and was allowed (`allow_target_mismatch`)."""
    checks = ckpt.get("target_check") or {}  # absent in reports of older versions
    lines = [allowed_line(checks.get(part), whose) for part, whose in (("run", "the run's"), ("data", "the shards'"))]
    return [f"  {line}" for line in lines if line]


def render_report(report: dict) -> str:
    """The on-screen table of a report (works on the report as loaded back from its JSON)."""
    data, ckpts = report["data"], report["checkpoints"]
    n_draft = report["block_size"] - 1
    lines = ["DFlash offline evaluation"]
    names = ["A", "B"] if len(ckpts) == 2 else [""]
    for name, ckpt in zip(names, ckpts, strict=True):
        own = ", DFlash2: the selector's proposals; its unary ones in the unary rows" if ckpt.get("unary") else ""
        lines.append(f"  checkpoint {name + ' ' if name else ''}{ckpt['path']} (step {ckpt['step']}{own})")
        lines += _target_lines(ckpt)
    lines.append(
        f"  data       {data['path']}: {data['samples']} of {data['samples_in_dataset']} samples, "
        f"{data['tokens']} tokens, {data['blocks']} blocks"
    )
    lines.append(
        f"  buckets    {data['boundaries_from']}: "
        + ", ".join(f"{b['label']} ({b['n_samples']} samples)" for b in report["buckets"])
    )
    kernels = report.get("kernels")  # absent in reports of older versions
    if kernels:
        lines.append(
            f"  kernels    {kernels['device']}, {kernels['precision']}, attention {kernels['attention']} "
            f"({kernels['reason']})"
        )
    lines += [f"  note       {note}" for note in report["notes"]]
    lines += _baseline_line(report)
    lines.append("")
    if len(ckpts) == 1:
        lines.append(_single_table(report))
    else:
        ratio = report["ratio"]
        lines.append("all lengths (B/A = second / first)")
        lines.append(
            _pair_table(
                ckpts[0]["overall"],
                ckpts[1]["overall"],
                ratio["overall"],
                metric_rows(report["budgets"], n_draft),
                _unary_pair(ckpts, report["budgets"]),
            )
        )
        if len(report["buckets"]) > 1:
            for i, bucket in enumerate(report["buckets"]):
                lines.append("")
                lines.append(f"bucket {bucket['bucket']}: length {bucket['label']}")
                lines.append(
                    _pair_table(
                        ckpts[0]["buckets"][i],
                        ckpts[1]["buckets"][i],
                        ratio["buckets"][i],
                        metric_rows(report["budgets"], n_draft, headline_only=True),
                        _unary_pair(ckpts, report["budgets"], i),
                    )
                )
    return "\n".join(lines)
