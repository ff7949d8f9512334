"""The end of a run, in numbers and in words: the coverage check (every owned record accounted for
exactly once), the log line of this rank's run, `summary.json` of a dataset (`summarize_dataset`,
`write_summary`) and the report printed at the end (`format_summary`, `no_samples_reason`).
"""

from __future__ import annotations

import logging

from common.io import atomic_write_json, join_uri
from extract.corpus.files import describe_skipped
from extract.ranks import FINAL_REJECTS, SUMMARY_FILE, Ranks
from shards.provenance import provenance_of

log = logging.getLogger("extract")


def check_coverage(manifest: dict, run_stats: dict) -> None:
    """Every record this rank owns is a committed sample, a reject or a duplicate, exactly once."""
    counts = manifest["counts"]
    accounted = (
        counts["samples"] + sum(v for k, v in counts.items() if k.startswith("rejected.")) + counts.get("duplicates", 0)
    )
    run_stats["coverage_ok"] = accounted == run_stats["records_owned"]
    if not run_stats["coverage_ok"]:
        log.error(
            "coverage mismatch: this rank owns %d records but the dataset accounts for %d (samples %d + rejects + "
            "duplicates); please report this",
            run_stats["records_owned"],
            accounted,
            counts["samples"],
        )


def log_run(ranks: Ranks, run_stats: dict) -> None:
    """One log line: what this rank wrote in this run, how fast, and how busy its write thread was."""
    log.info(
        "rank %d/%d: %s samples (%s tokens) written this run in %.1fs (%.0f tok/s); write thread busy %.0f%% of it "
        "(committing shards: fsync, index, rename, manifest %.0f%%)",
        ranks.rank,
        ranks.world,
        f"{run_stats['samples']:,}",
        f"{run_stats['tokens']:,}",
        run_stats["seconds"],
        run_stats["tokens"] / max(run_stats["seconds"], 1e-9),
        100 * run_stats.get("write_busy_seconds", 0.0) / max(run_stats["seconds"], 1e-9),
        100 * run_stats.get("commit_seconds", 0.0) / max(run_stats["seconds"], 1e-9),
    )


def write_summary(root: str, manifest: dict) -> dict:
    summary = summarize_dataset(root, manifest, this_run=None)
    atomic_write_json(join_uri(root, SUMMARY_FILE), summary)
    return summary


def summarize_dataset(root: str, manifest: dict, *, this_run: dict | None, partial: bool = False) -> dict:
    counts = manifest["counts"]
    rejects = {k.split(".", 1)[1]: v for k, v in counts.items() if k.startswith("rejected.")}
    nbytes = sum(e["bytes"] + e.get("index_bytes", 0) for e in manifest["shards"])
    summary = {
        "root": root,
        "complete": bool(manifest.get("complete")) and not partial,
        "partial": partial,
        "samples": counts["samples"],
        "tokens": counts["tokens"],
        "loss_tokens": counts["loss_tokens"],
        "duplicates": counts.get("duplicates", 0),
        "rejects": dict(sorted(rejects.items(), key=lambda kv: -kv[1])),
        "records": counts["samples"] + sum(rejects.values()) + counts.get("duplicates", 0),
        "input_lines": None if partial else provenance_of(manifest).corpus.records,
        "shards": len(manifest["shards"]),
        "bytes": nbytes,
        "bytes_per_token": nbytes / counts["tokens"] if counts["tokens"] else None,
        "skipped_files": list(provenance_of(manifest).corpus.skipped or []),
    }
    if this_run is not None:
        keys = (
            "rank",
            "world",
            "samples",
            "tokens",
            "seconds",
            "batches",
            "skipped_batches",
            "padded_tokens",
            "budget_tokens",
            "coverage_ok",
            "startup_seconds",
            "drain_seconds",
        )
        summary["this_run"] = {k: this_run[k] for k in keys if k in this_run}
        if this_run.get("seconds"):
            summary["this_run"]["tok_per_s"] = this_run["tokens"] / this_run["seconds"]
        if this_run.get("padded_tokens"):
            summary["this_run"]["pad_efficiency"] = this_run["tokens"] / this_run["padded_tokens"]
        if this_run.get("budget_tokens"):  # real tokens per forward against tokens_per_batch (packed rows too)
            summary["this_run"]["batch_fill"] = this_run["tokens"] / this_run["budget_tokens"]
        if this_run.get("seconds") and "write_busy_seconds" in this_run:
            summary["this_run"]["write_thread_busy"] = this_run["write_busy_seconds"] / this_run["seconds"]
            summary["this_run"]["commit_busy"] = this_run.get("commit_seconds", 0.0) / this_run["seconds"]
            summary["this_run"]["write_thread_cpu"] = this_run.get("write_cpu_seconds", 0.0) / this_run["seconds"]
            for key, value in this_run.get("writer_timings", {}).items():
                share = value if key.endswith("_calls") else value / this_run["seconds"]
                summary["this_run"]["writer_" + key.removesuffix("_seconds")] = share
    return summary


def no_samples_reason(summary: dict) -> str:
    """Why a finished dataset holds no sample, in one line (the extraction then exits non-zero)."""
    where = summary["root"]
    if not summary["records"]:
        lines = summary.get("input_lines")
        what = "the corpus holds no records" + (f" ({lines:,} blank lines)" if lines else " (it is empty)")
    else:
        rejects = ", ".join(f"{k} {v:,}" for k, v in summary["rejects"].items())
        dupes = f", duplicates {summary['duplicates']:,}" if summary["duplicates"] else ""
        what = (
            f"every one of its {summary['records']:,} records was rejected ({rejects}{dupes}); see "
            f"{join_uri(where, FINAL_REJECTS)}"
        )
    return (
        f"0 samples written to {where}: {what}. Fix the corpus or the settings, then delete {where} "
        "(it is a finished, empty dataset) or write to another out_dir."
    )


def format_summary(summary: dict) -> str:
    """The end-of-run report, in words; says so when a group is empty."""
    lines = [
        f"dataset   {summary['root']}"
        + (
            ""
            if summary["complete"]
            else "  (this rank's part; other ranks still running)"
            if summary.get("partial")
            else "  (incomplete)"
        )
    ]
    line = f"records   {summary['records']:,} accounted for = samples + rejects + duplicates"
    lines_in = summary.get("input_lines")
    if lines_in is not None and lines_in > summary["records"]:
        line += f" (of {lines_in:,} input lines; the other {lines_in - summary['records']:,} are blank)"
    elif lines_in is not None and lines_in < summary["records"]:
        line += f" (but the corpus was counted as {lines_in:,} input lines; please report this)"
    lines.append(line)
    if not summary["records"]:
        lines.append("samples   none: the corpus holds no records")
    elif summary["samples"]:
        lines.append(
            f"samples   {summary['samples']:,} in {summary['shards']} shards; {summary['tokens']:,} tokens, "
            f"{summary['loss_tokens']:,} loss tokens"
        )
        lines.append(f"bytes     {summary['bytes'] / 1e6:,.1f} MB on disk = {summary['bytes_per_token']:,.0f} B/token")
    else:
        lines.append("samples   none: every record was rejected or a duplicate (see rejects.jsonl)")
    lines.append(f"duplicates {summary['duplicates']:,}" if summary["duplicates"] else "duplicates none")
    skipped = summary.get("skipped_files") or []
    if skipped:
        lines.append(
            f"skipped   {len(skipped):,} files of the corpus directory, not read: " + describe_skipped(skipped)
        )
    if summary["rejects"]:
        lines.append(
            f"rejects   {sum(summary['rejects'].values()):,}: "
            + ", ".join(f"{k} {v:,}" for k, v in summary["rejects"].items())
        )
    else:
        lines.append("rejects   none")
    run = summary.get("this_run")
    if run is None:
        lines.append("this run  nothing to do (already complete)")
    else:
        who = f" (rank {run['rank']} of {run['world']})" if run.get("world", 1) > 1 else ""
        line = f"this run{who}  {run['samples']:,} samples, {run['tokens']:,} tokens in {run['seconds']:.1f}s"
        if run.get("tok_per_s"):
            line += f" = {run['tok_per_s']:,.0f} tok/s"
        if run.get("pad_efficiency"):
            line += f", padding efficiency {run['pad_efficiency']:.1%}"
        if run.get("batch_fill"):
            line += f", micro-batches {run['batch_fill']:.1%} full"
        if run.get("skipped_batches"):
            line += f"; {run['skipped_batches']} batches already committed"
        lines.append(line)
        if run.get("coverage_ok") is False:
            lines.append("WARNING   some records are not accounted for (coverage mismatch); see the log")
    return "\n".join(lines)
