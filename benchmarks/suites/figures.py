"""The figures of a record, read out of the JSON the benchmark modules write (`benchmarks.extract`,
`benchmarks.train`, `benchmarks.spec_round`, `benchmarks.s3_ceiling`): the same functions read a suite's fresh
output and the earlier outputs kept in docs/results/, so an imported record holds exactly what those files say.

Keys are flat, `PREFIX.WHAT`; a value is a number, a string, a bool, or (a series) a list of flat rows.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path: str | Path) -> dict | list | None:
    """The JSON at `path`, or None where the part did not write it (cut short, failed)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def extract_figures(report: dict | None, prefix: str) -> dict:
    """One `benchmarks.extract` run (its first variant, all ranks): full and bare tok/s, full / bare, TFLOP/s,
    the untimed cold pass, bytes per token, peak GPU memory, tokens, GPUs."""
    if not report:
        return {}
    total, rank = report["total"], report["per_rank"][0]
    return {
        f"{prefix}.full_tok_s": total.get("full_tok_s"),
        f"{prefix}.bare_tok_s": total.get("bare_tok_s"),
        f"{prefix}.full_over_bare": total.get("full_over_bare"),
        f"{prefix}.full_tflops": total.get("full_tflops"),
        f"{prefix}.bare_tflops": total.get("bare_tflops"),
        f"{prefix}.cold_tok_s": rank.get("warmup_tok_s"),
        f"{prefix}.bytes_per_token": (report.get("dataset") or {}).get("bytes_per_token"),
        f"{prefix}.peak_gib": rank.get("peak_gpu_gib_full"),
        f"{prefix}.tokens": (report.get("settings") or {}).get("tokens"),
        f"{prefix}.gpus": report.get("world_size"),
        f"{prefix}.taps": len((report.get("settings") or {}).get("layer_ids") or []) or None,
        f"{prefix}.packing": report.get("packing"),
    }


def train_row(report: dict | None, phase: str) -> dict | None:
    """The row of `phase` in a `benchmarks.train` JSON ({"header", "results"}), None if absent or failed."""
    rows = (report or {}).get("results") or []
    return next((r for r in rows if r.get("phase") == phase and "error" not in r), None)


def train_figures(report: dict | None, phase: str, prefix: str) -> dict:
    """One training phase: median step, MFU, TFLOP/s, fetch fraction, peak memory, block tokens/s."""
    row = train_row(report, phase)
    if row is None:
        return {}
    return {
        f"{prefix}.step_s": row["step_s_median"],
        f"{prefix}.mfu": row["mfu"],
        f"{prefix}.tflop_s": row["tflop_s"],
        f"{prefix}.fetch_frac": row["fetch_frac"],
        f"{prefix}.peak_gib": row["peak_mem_gib"],
        f"{prefix}.block_tok_s": row["block_tok_s"],
        f"{prefix}.steps": row["steps"],
    }


def s3_train_figures(report: dict | None, prefix: str) -> dict:
    """The local-disk stream row and one row per S3 latency, each against local disk (a series), plus the
    shards' copy into the server and the server's own best GET rate."""
    local = train_row(report, "stream")
    if local is None:
        return {}
    rows = []
    for row in (report or {}).get("results") or []:
        if not row.get("phase", "").startswith("stream-s3-") or "error" in row:
            continue
        rows.append(
            {
                "latency_ms": row["s3_delay_ms"],
                "fetch_frac": row["fetch_frac"],
                "step_s": row["step_s_median"],
                "step_vs_local": row["step_s_median"] / local["step_s_median"],
                "requests_per_step": row.get("s3_requests_per_step"),
            }
        )
    ceiling = (report or {}).get("s3_ceiling") or {}
    uploads = list(((report or {}).get("s3_uploads") or {}).values())
    return {
        f"{prefix}.local_fetch_frac": local["fetch_frac"],
        f"{prefix}.local_step_s": local["step_s_median"],
        f"{prefix}.rows": rows or None,
        f"{prefix}.copy_MB_s": uploads[0].get("MB_per_s") if uploads else None,
        f"{prefix}.server_best_get_MB_s": best_of(ceiling.get("best") or {}, "get", "proxy"),
    }


def s3_extract_figures(report: dict | None, prefix: str) -> dict:
    """Extraction to local disk (the first variant) and into the S3 server (the second), in one run."""
    variants = (report or {}).get("variants") or []
    if len(variants) < 2:
        return {}
    local, s3 = variants[0]["total"], variants[1]["total"]
    rank = variants[1]["per_rank"][0]
    seconds, written = rank.get("full_seconds"), (report.get("dataset") or {}).get("bytes")
    return {
        f"{prefix}.local_tok_s": local["full_tok_s"],
        f"{prefix}.s3_tok_s": s3["full_tok_s"],
        f"{prefix}.s3_over_local": s3.get("full_over_first_variant"),
        f"{prefix}.s3_MB_s": written / seconds / 1e6 if written and seconds else None,
        f"{prefix}.commit_busy": rank.get("commit_busy"),
        f"{prefix}.tokens": (report.get("settings") or {}).get("tokens"),
    }


def round_figures(report: dict | None, prefix: str) -> dict:
    """`benchmarks.spec_round`: per variant its costs, the ratios, the break-even τ, the projected speed-up at
    the anchor's τ, and the projection's rows (a series)."""
    if not report:
        return {}
    out = {f"{prefix}.dtype": report.get("dtype"), f"{prefix}.device": report.get("device")}
    for name, costs in (report.get("variants") or {}).items():
        if "error" in costs:
            out[f"{prefix}.{name}.error"] = costs["error"]
            continue
        projection = (report.get("projection") or {}).get(name) or {}
        verify = costs.get("verify_ms") or {}
        out |= {
            f"{prefix}.{name}.how": costs.get("how"),
            f"{prefix}.{name}.step_ms": _number(costs.get("step_ms")),
            f"{prefix}.{name}.verify16_ms": _number(verify.get("16")),
            f"{prefix}.{name}.propose_ms": _number(costs.get("propose_ms")),
            f"{prefix}.{name}.snapshot_ms": _number(costs.get("snapshot_ms")),
            f"{prefix}.{name}.verify_over_step": projection.get("verify_over_step"),
            f"{prefix}.{name}.propose_over_step": projection.get("propose_over_step"),
            f"{prefix}.{name}.break_even_tau": projection.get("break_even_tau"),
            f"{prefix}.{name}.speedup_at_anchor_tau": projection.get("at_anchor_tau"),
        }
        if "rollback_ms" in costs:
            out[f"{prefix}.{name}.rollback_ms"] = _number(costs.get("rollback_ms"))
            parts = [_number(verify.get("16")), _number(costs.get("rollback_ms")), _number(costs.get("step_ms"))]
            if None not in parts and parts[2] > 0:
                out[f"{prefix}.{name}.verify_rollback_over_step"] = (parts[0] + parts[1]) / parts[2]
        out |= step_figures(costs.get("breakdown") or {}, f"{prefix}.{name}")
    out[f"{prefix}.projection"] = projection_rows(report.get("projection") or {})
    return out


def step_figures(found: dict, prefix: str) -> dict:
    """`benchmarks.step_profile.breakdown`: the bound, the step over it, the kernels per layer kind (ms per
    step, on a GPU) and the launches and idle left in the graphed step."""
    if not found or "error" in found:
        return {}
    out = {f"{prefix}.bound_ms": found.get("bound_ms"), f"{prefix}.step_over_bound": found.get("step_over_bound")}
    out[f"{prefix}.launches_idle_ms"] = found.get("launches_idle_ms")
    if "all" in found.get("kinds", {}):  # kernel times (a GPU); a CPU's range times are no kernel figure
        for kind, got in found["kinds"].items():
            out[f"{prefix}.step_kernels.{kind.lower().replace(' ', '_')}_ms"] = got["ms"]
    return {k: v for k, v in out.items() if v is not None}


def projection_rows(projections: dict) -> list[dict] | None:
    """One row per τ with each variant's projected round and speed-up side by side."""
    by_tau: dict = {}
    for name, projection in projections.items():
        for r in projection.get("rows") or []:
            by_tau.setdefault(r["tau"], {"tau": r["tau"]}).update(
                {f"{name}_round_ms": r["round_ms"], f"{name}_speedup": r["speedup"]}
            )
    return [by_tau[tau] for tau in sorted(by_tau)] or None


def best_of(best: dict[str, float], op: str, how: str = "") -> float | None:
    """The highest of `benchmarks.s3_ceiling.summarize`'s rates whose group starts with `op` and ends with `how`."""
    rates = [rate for label, rate in best.items() if label.startswith(op) and label.endswith(how)]
    return max(rates) if rates else None


def ceiling_figures(report: dict | None, prefix: str) -> dict:
    """`benchmarks.s3_ceiling`: the server's best PUT (as the shard writer puts, and one PutObject per object)
    and ranged-GET (direct, and through the latency proxy) rates on this host, MB/s."""
    best = (report or {}).get("best") or {}
    return {
        f"{prefix}.put_shard_writer_MB_s": best.get("put as the shard writer"),
        f"{prefix}.put_object_MB_s": best.get("put botocore PutObject"),
        f"{prefix}.get_direct_MB_s": best_of(best, "get", "direct"),
        f"{prefix}.get_proxy_MB_s": best_of(best, "get", "proxy"),
    }


def _number(value):
    return value if isinstance(value, (int, float)) else None
