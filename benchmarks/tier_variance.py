"""Variance kept against PCA rank, per tap, and the projection variants worth measuring (issue 26,
items 2 and 3; not a test): on a real target's lossless dataset and on the synthetic 27B-shape
features of `benchmarks/synthetic.py`, side by side.

    python -m benchmarks.tier_variance [--dataset artifacts/smollm2/shards/train] [--max-tokens 40000]
                                       [--synthetic-taps 4] [--synthetic-hidden 5120] [--synthetic-tokens 8192]
                                       [--out-dir out/tier_variance]

Tokens are split by sample: even samples fit the projection (their uncentered second moment, as
`shards.projection` fits it), odd samples measure it; every share below is measured on the odd
samples (a PCA fitted on few tokens keeps more of its own sample than of new ones). Reported:

- the curve: per tap, the share of the second moment kept by the top-r eigenvectors, for r from
  1/64 to 1/2 of the tap width;
- per tap against concatenated: one PCA per tap (`shards.projection`) against one PCA over all the
  taps at the same total rank, per tap relative RMS error (sqrt(1 - share kept));
- variance targets: the rank per tap that keeps 0.9 / 0.99 / 0.999 of the fit sample
  (`pca:variance=V` stores the largest), and what it keeps of the measured sample;
- massive activations: the share of each tap's energy in its top 1 / 4 / 16 channels, the channels
  that hold half and 90% of it, and a projection that keeps the top-k channels exactly beside a PCA of
  the rest at the same rank (so the same bytes) against the plain PCA;
- quantizers on projected coordinates: fp8 and nf4-g64 on the raw taps and on P·h (`shards.tiers`),
  relative RMS per tap against h.

Writes `tier_variance.json` and `tier_variance.png` (the curves) into --out-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import numpy as np
import torch

from benchmarks.synthetic import realistic_samples
from common.interrupts import run_main
from shards.projection import (
    Projection,
    SecondMoments,
    captured_shares,
    fit_projection,
    kept_channel_rows,
    parse_projection_spec,
)
from shards.quant import ErrorSums
from shards.reader import ShardDataset
from shards.tiers import encode_features

FRACTIONS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)
TARGETS = (0.9, 0.99, 0.999)
KEEP = (1, 4, 16)
EVAL_KEEP_TOKENS = 8192  # tokens kept in memory for the quantizer rows


class Features:
    """Second moments of the fit half and the measured half, and a few measured tokens."""

    def __init__(self, n_taps: int, width: int, concat: bool):
        self.n_taps, self.width = n_taps, width
        self.fit = SecondMoments(n_taps, width)
        self.held = SecondMoments(n_taps, width)
        # One PCA over the concatenated taps needs the F x F moment (the per-tap ones are its diagonal blocks).
        self.fit_all = SecondMoments(1, n_taps * width) if concat else None
        self.held_all = SecondMoments(1, n_taps * width) if concat else None
        self.held_tokens: list[torch.Tensor] = []
        self.kept = 0

    def add(self, index: int, h_TF: torch.Tensor) -> None:
        if index % 2 == 0:
            self.fit.add(h_TF)
            if self.fit_all is not None:
                self.fit_all.add(h_TF)
            return
        self.held.add(h_TF)
        if self.held_all is not None:
            self.held_all.add(h_TF)
        if self.kept < EVAL_KEEP_TOKENS:
            self.held_tokens.append(h_TF[: EVAL_KEEP_TOKENS - self.kept].clone())
            self.kept += self.held_tokens[-1].shape[0]


def dataset_features(path: str, max_tokens: int) -> tuple[Features, dict]:
    ds = ShardDataset(path)
    if ds.quant is not None or ds.projection is not None:
        raise SystemExit(f"--dataset {path}: needs a lossless, unprojected dataset")
    layer_ids = list(ds.provenance.taps.layer_ids or [0])
    n_taps = len(layer_ids)
    feats = Features(n_taps, ds.hidden_width // n_taps, concat=True)
    tokens = 0
    for i in range(len(ds)):
        if tokens >= max_tokens:
            break
        h = ds.torch(i)["hidden"]
        feats.add(i, h)
        tokens += h.shape[0]
    target = ds.provenance.target.name_or_path
    return feats, {"source": path, "target": target, "layer_ids": layer_ids, "tokens": tokens}


def synthetic_features(n_taps: int, hidden: int, tokens: int) -> tuple[Features, dict]:
    per_sample = 512
    samples = realistic_samples(max(2, tokens // per_sample), per_sample, n_taps, hidden, topk=8, seed=0)
    feats = Features(n_taps, hidden, concat=False)
    for i, sample in enumerate(samples):
        feats.add(i, torch.from_numpy(sample.hidden).view(torch.bfloat16))
    total = sum(s.n_tokens for s in samples)
    return feats, {"source": f"synthetic {n_taps} x {hidden} (benchmarks/synthetic.py)", "tokens": total}


def held_curve(feats: Features) -> list[np.ndarray]:
    """Per tap, the share of the measured second moment kept by the fit's top 1..H eigenvectors
    (one H x H x H product per tap; every rank's share is a prefix sum of it)."""
    if getattr(feats, "_held_curve", None) is None:
        vectors = feats.fit.eigen()[1]
        feats._held_curve = [
            captured_shares(vectors[t].t(), feats.held.sums[t]).cpu().numpy() for t in range(feats.n_taps)
        ]
    return feats._held_curve


def ranks_of(width: int) -> list[int]:
    return [max(1, round(width * f)) for f in FRACTIONS]


def curve(feats: Features) -> list[dict]:
    """Per tap: share kept at each rank fraction, on the fit sample and on the measured one."""
    values = feats.fit.eigen()[0]
    out = []
    for tap in range(feats.n_taps):
        held = held_curve(feats)[tap]
        fit = (values[tap].cumsum(0) / values[tap].sum()).cpu().numpy()
        out.append(
            {
                "tap": tap,
                "ranks": ranks_of(feats.width),
                "kept": [float(held[r - 1]) for r in ranks_of(feats.width)],
                "kept_fit_sample": [float(fit[r - 1]) for r in ranks_of(feats.width)],
            }
        )
    return out


def reconstruction_errors(rows_by_tap: list[torch.Tensor], feats: Features) -> list[dict]:
    """Per tap, with P_i = rows (r x H, orthonormal): relative RMS error of Pᵀ P h on the measured
    sample, and per channel (the worst, and the share of the kept channels' own energy lost)."""
    out = []
    for tap, rows in enumerate(rows_by_tap):
        held = feats.held.sums[tap]
        residual = torch.eye(feats.width, dtype=held.dtype) - rows.t().to(held.dtype) @ rows.to(held.dtype)
        err = residual @ held @ residual
        channel = (err.diagonal() / held.diagonal().clamp_min(1e-300)).clamp_min(0).sqrt()
        out.append(
            {
                "rel_rms": float((err.trace() / held.trace()).clamp_min(0).sqrt()),
                "worst_channel_rel_rms": float(channel.max()),
                "channel_rel_rms": channel.cpu().numpy(),
            }
        )
    return out


def pca_rows(feats: Features, rank: int) -> list[torch.Tensor]:
    _, vectors = feats.fit.eigen()
    return [vectors[tap][:, :rank].t() for tap in range(feats.n_taps)]


def block(matrix_FF: torch.Tensor, tap: int, width: int) -> torch.Tensor:
    return matrix_FF[tap * width : (tap + 1) * width, tap * width : (tap + 1) * width]


def per_tap_against_concatenated(feats: Features) -> list[dict]:
    """Same total rank n_taps * r: one PCA per tap against one over the concatenation."""
    _, vectors_all = feats.fit_all.eigen()
    F, H = feats.n_taps * feats.width, feats.width
    held = feats.held_all.sums[0]
    rows = []
    for rank in ranks_of(H):
        per_tap = reconstruction_errors(pca_rows(feats, rank), feats)
        V = vectors_all[0][:, : rank * feats.n_taps]
        residual = torch.eye(F, dtype=held.dtype) - V @ V.t()
        err = residual @ held @ residual
        concat = [
            float((block(err, t, H).trace() / block(held, t, H).trace()).clamp_min(0).sqrt())
            for t in range(feats.n_taps)
        ]
        # How the concatenated PCA spends its rank: directions whose weight lies mostly in each tap.
        weight = (V.t() ** 2).unflatten(1, (feats.n_taps, H)).sum(-1)
        spent = torch.bincount(weight.argmax(-1), minlength=feats.n_taps).tolist()
        rows.append(
            {
                "rank_per_tap": rank,
                "total_rank": rank * feats.n_taps,
                "per_tap_rel_rms": [t["rel_rms"] for t in per_tap],
                "concat_rel_rms": concat,
                "concat_directions_by_tap": spent,
            }
        )
    return rows


def variance_targets(feats: Features) -> list[dict]:
    values = feats.fit.eigen()[0]
    shares = values.cumsum(-1) / values.sum(-1, keepdim=True)
    out = []
    for target in TARGETS:
        needed = [int((shares[t] < target - 1e-12).sum()) + 1 for t in range(feats.n_taps)]
        rank = fit_projection(feats.fit, parse_projection_spec(f"pca:variance={target}")).rank
        kept = [float(held_curve(feats)[t][rank - 1]) for t in range(feats.n_taps)]
        kept_own = [float(held_curve(feats)[t][needed[t] - 1]) for t in range(feats.n_taps)]
        out.append(
            {
                "target": target,
                "rank_needed_per_tap": needed,
                "rank_stored": rank,
                "fraction_of_width": rank / feats.width,
                "sum_of_per_tap_ranks_over_stored": sum(needed) / (rank * feats.n_taps),
                "kept_at_stored_rank": kept,
                "kept_at_own_rank": kept_own,
            }
        )
    return out


def energy_concentration(feats: Features) -> list[dict]:
    out = []
    for tap in range(feats.n_taps):
        energy = feats.held.sums[tap].diagonal()
        order = torch.argsort(energy, descending=True)
        share = (energy[order].cumsum(0) / energy.sum()).cpu().numpy()
        out.append(
            {
                "tap": tap,
                "top_channels": order[:4].tolist(),
                "share_top": {str(k): float(share[k - 1]) for k in (1, 4, 16)},
                "channels_for_half": int((share < 0.5).sum()) + 1,
                "channels_for_90": int((share < 0.9).sum()) + 1,
                "uniform_channels_for_half": feats.width // 2,
            }
        )
    return out


def kept_channels_against_pca(feats: Features) -> list[dict]:
    """At each rank r: plain PCA against the top-k energy channels kept exactly + PCA of the rest at
    rank r - k (the same stored width, so the same bytes)."""
    out = []
    for fraction in (1 / 16, 1 / 8, 1 / 4):
        rank = max(1, round(feats.width * fraction))
        plain = reconstruction_errors(pca_rows(feats, rank), feats)
        for keep in KEEP:
            if keep >= rank:
                continue
            rows = [kept_channel_rows(feats.fit.sums[t], rank, keep)[0] for t in range(feats.n_taps)]
            channels = [kept_channel_rows(feats.fit.sums[t], rank, keep)[1] for t in range(feats.n_taps)]
            kept = reconstruction_errors(rows, feats)
            out.append(
                {
                    "rank_per_tap": rank,
                    "keep": keep,
                    "pca_rel_rms": [t["rel_rms"] for t in plain],
                    "kept_rel_rms": [t["rel_rms"] for t in kept],
                    "pca_kept_channels_rel_rms": [
                        float(np.sqrt((p["channel_rel_rms"][c.numpy()] ** 2).mean()))
                        for p, c in zip(plain, channels, strict=True)
                    ],
                    "kept_kept_channels_rel_rms": [
                        float(k["channel_rel_rms"][c.numpy()].max()) for k, c in zip(kept, channels, strict=True)
                    ],
                    "pca_worst_channel": [t["worst_channel_rel_rms"] for t in plain],
                    "kept_worst_channel": [t["worst_channel_rel_rms"] for t in kept],
                }
            )
    return out


def quantized_on_projection(feats: Features) -> list[dict]:
    """fp8 / nf4-g64 on the raw taps and on P·h (plain PCA, and kept channels + PCA), measured on the
    held tokens with the tier code (`shards.tiers.encode_features`)."""
    h = torch.cat(feats.held_tokens)
    H = feats.width
    quarter = max(64, round(H / 4 / 64) * 64)  # a 4-bit encoding needs a rank that is a multiple of its group
    cases = [("fp8", None), ("nf4-g64", None)]
    for rank in sorted({round(H / 8), round(H / 4), quarter}):
        cases.append(("fp8", ("pca", rank)))
        cases.append(("planes", ("pca", rank)))
        if rank % 64 == 0:
            cases.append(("nf4-g64", ("pca", rank)))
        cases.append(("fp8", ("keep4", rank)))
    out = []
    for encoding, how in cases:
        projection = None
        if how is not None:
            kind, rank = how
            if kind == "pca":
                projection = fit_projection(feats.fit, parse_projection_spec(f"pca:rank={rank}"))
            else:
                blocks = torch.stack([kept_channel_rows(feats.fit.sums[t], rank, 4)[0] for t in range(feats.n_taps)])
                projection = Projection(blocks.float(), {"method": "kept-channels"})
        sums = ErrorSums.zeros(feats.n_taps * H)
        for chunk in h.split(1024):
            _, err = encode_features(chunk, encoding, feats.n_taps, projection)
            sums.add(err)
        taps = sums.summary(feats.n_taps)
        name = encoding if how is None else f"{encoding} @ {how[0]} rank {how[1]}"
        width = (how[1] if how else H) * feats.n_taps
        out.append(
            {
                "tier": name,
                "stored_width": width,
                "rel_rms_per_tap": [t["rel_rms"] for t in taps],
                "worst_channel": max(t["worst_channel_rel_rms"] for t in taps),
            }
        )
    return out


# ----------------------------------------------------------------------------------------------
# Printing, plotting


def fmt(values, spec=".3f") -> str:
    return " / ".join(format(v, spec) for v in values)


def print_curve(name: str, rows: list[dict], width: int) -> None:
    ranks = ranks_of(width)
    print(f"\nvariance kept (measured half) against rank, {name}, tap width {width}")
    print("| tap | " + " | ".join(f"1/{round(1 / f)} ({r})" for f, r in zip(FRACTIONS, ranks, strict=True)) + " |")
    print("|---|" + "---:|" * len(ranks))
    for row in rows:
        print(f"| {row['tap']} | " + " | ".join(f"{v:.4f}" for v in row["kept"]) + " |")


def print_real(result: dict) -> None:
    print("\nper-tap PCA against one PCA over the concatenated taps (same total rank), rel. RMS per tap")
    print("| rank per tap | per tap | concatenated | concatenated: directions spent per tap |")
    print("|---:|---|---|---|")
    for r in result["per_tap_vs_concat"]:
        print(
            f"| {r['rank_per_tap']} | {fmt(r['per_tap_rel_rms'])} | {fmt(r['concat_rel_rms'])} | "
            f"{fmt(r['concat_directions_by_tap'], 'd')} |"
        )
    print("\nrank from a variance target (fit half) against the fixed fractions")
    print("| target | rank needed per tap | stored rank (max) | of width | kept at stored rank (measured) |")
    print("|---:|---|---:|---:|---|")
    for r in result["variance_targets"]:
        print(
            f"| {r['target']} | {fmt(r['rank_needed_per_tap'], 'd')} | {r['rank_stored']} | "
            f"{r['fraction_of_width']:.3f} | {fmt(r['kept_at_stored_rank'], '.4f')} |"
        )
    print("\nenergy concentration per tap (sum x² per channel, measured half)")
    print("| tap | top channels | top 1 | top 4 | top 16 | channels for 50% | for 90% |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in result["energy"]:
        s = r["share_top"]
        print(
            f"| {r['tap']} | {r['top_channels']} | {s['1']:.3f} | {s['4']:.3f} | {s['16']:.3f} | "
            f"{r['channels_for_half']} | {r['channels_for_90']} |"
        )
    print("\nkept channels (top-k energy, exact) + PCA of the rest, against plain PCA at the same rank")
    print(
        "| rank | k | PCA rel. RMS | kept + PCA rel. RMS | PCA: error of those k channels | PCA worst ch. "
        "| kept worst ch. |"
    )
    print("|---:|---:|---|---|---|---|---|")
    for r in result["kept_channels"]:
        print(
            f"| {r['rank_per_tap']} | {r['keep']} | {fmt(r['pca_rel_rms'])} | {fmt(r['kept_rel_rms'])} | "
            f"{fmt(r['pca_kept_channels_rel_rms'])} | {fmt(r['pca_worst_channel'], '.2f')} | "
            f"{fmt(r['kept_worst_channel'], '.2f')} |"
        )
    print("\nquantizers on raw and on projected coordinates (rel. RMS against h, measured half)")
    print("| tier | stored width | rel. RMS per tap | worst channel |")
    print("|---|---:|---|---:|")
    for r in result["quantized"]:
        print(f"| {r['tier']} | {r['stored_width']} | {fmt(r['rel_rms_per_tap'])} | {r['worst_channel']:.3f} |")


def plot(sources: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sources), figsize=(6 * len(sources), 4.5), sharey=True, squeeze=False)
    for ax, (name, source) in zip(axes[0], sources.items(), strict=True):
        for row in source["curve"]:
            ax.plot(FRACTIONS, row["kept"], marker="o", label=f"tap {row['tap']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(FRACTIONS, [f"1/{round(1 / f)}" for f in FRACTIONS])
        ax.set_xlabel("PCA rank per tap / tap width")
        ax.set_title(f"{name} (width {source['width']}, {source['info']['tokens']:,} tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("share of the second moment kept (held-out half)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(feats: Features, info: dict, real: bool) -> dict:
    started = time.time()
    result = {"info": info, "width": feats.width, "n_taps": feats.n_taps, "curve": curve(feats)}
    if real:
        result["per_tap_vs_concat"] = per_tap_against_concatenated(feats)
        result["variance_targets"] = variance_targets(feats)
        result["energy"] = energy_concentration(feats)
        result["kept_channels"] = kept_channels_against_pca(feats)
        result["quantized"] = quantized_on_projection(feats)
    else:
        result["variance_targets"] = variance_targets(feats)
    result["seconds"] = round(time.time() - started, 1)
    return result


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "channel_rel_rms"}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="artifacts/smollm2/shards/train", help="lossless dataset of a real target")
    parser.add_argument("--max-tokens", type=int, default=40_000, help="tokens read from --dataset")
    parser.add_argument("--synthetic-taps", type=int, default=4)
    parser.add_argument("--synthetic-hidden", type=int, default=5120)
    parser.add_argument("--synthetic-tokens", type=int, default=8192, help="0 = no synthetic side")
    parser.add_argument("--out-dir", default="out/tier_variance")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    os.makedirs(args.out_dir, exist_ok=True)
    sources = {}
    started = time.time()
    feats, info = dataset_features(args.dataset, args.max_tokens)
    print(f"real: {info['tokens']:,} tokens of {args.dataset} read in {time.time() - started:.0f} s", flush=True)
    sources["real"] = summarize(feats, info, real=True)
    print_curve(f"real target {info['target']}", sources["real"]["curve"], feats.width)
    print_real(sources["real"])
    del feats
    if args.synthetic_tokens:
        started = time.time()
        feats, info = synthetic_features(args.synthetic_taps, args.synthetic_hidden, args.synthetic_tokens)
        print(f"\nsynthetic: {info['tokens']:,} tokens in {time.time() - started:.0f} s", flush=True)
        sources["synthetic_27b"] = summarize(feats, info, real=False)
        print_curve("synthetic 27B shape", sources["synthetic_27b"]["curve"], feats.width)
        for r in sources["synthetic_27b"]["variance_targets"]:
            print(f"synthetic: variance {r['target']}: rank needed per tap {r['rank_needed_per_tap']} of {feats.width}")
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "torch": torch.__version__},
        "args": vars(args),
        "sources": _plain(sources),
    }
    with open(os.path.join(args.out_dir, "tier_variance.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(sources, os.path.join(args.out_dir, "tier_variance.png"))
    print(f"\nwrote {args.out_dir}/tier_variance.json and tier_variance.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.tier_variance", main))
