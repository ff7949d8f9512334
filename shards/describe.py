"""Human-readable reports for `python -m shards inspect` and `show`: each function returns lines of
text, and says so explicitly when there is nothing to show (an empty dataset still prints a report).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from common import io
from shards.manifest import RESERVED_COUNTS, SAMPLE_CHECKSUM_ALGO_KEY
from shards.reader import ShardDataset
from shards.schema import Sample, bf16_bits_to_float32, count_nonfinite_bf16


def raw_bytes_per_token(hidden_width: int, topk: int) -> dict[str, int]:
    """Uncompressed bytes one token takes: bf16 hidden alone, and every stored field."""
    hidden = 2 * hidden_width
    return {"hidden": hidden, "all": hidden + 4 + 1 + 4 * topk + 4 * topk}


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def length_histogram(n_tokens: np.ndarray, width: int = 40) -> list[str]:
    """Power-of-two length buckets with counts, token shares and a bar."""
    if n_tokens.size == 0:
        return ["  (no samples: nothing to histogram)"]
    edges = [1 << p for p in range(int(np.log2(max(1, n_tokens.max()))) + 2)]
    counts, _ = np.histogram(n_tokens, bins=edges)
    token_sums, _ = np.histogram(n_tokens, bins=edges, weights=n_tokens)
    lines = [f"  {'tokens':>17}  {'samples':>9}  {'share of tokens':>15}"]
    top = counts.max()
    for low, high, count, tokens in zip(edges[:-1], edges[1:], counts, token_sums, strict=True):
        if count:
            bar = "#" * max(1, round(width * count / top))
            lines.append(f"  [{low:>7}, {high:>7})  {count:>9}  {tokens / n_tokens.sum():>14.1%}  {bar}")
    q = np.percentile(n_tokens, [0, 50, 90, 99, 100]).astype(int)
    lines.append(f"  min {q[0]}  median {q[1]}  p90 {q[2]}  p99 {q[3]}  max {q[4]}  mean {n_tokens.mean():.1f}")
    return lines


def unchecked_shards(entries: list[dict]) -> list[str]:
    """Files of the shards written before per-sample checksums (format version 1)."""
    return [e["file"] for e in entries if SAMPLE_CHECKSUM_ALGO_KEY not in e]


def checksum_line(ds: ShardDataset) -> str:
    """What a reader checks on every read of this dataset."""
    unchecked = unchecked_shards(ds.shards)
    algos = sorted({e[SAMPLE_CHECKSUM_ALGO_KEY] for e in ds.shards if SAMPLE_CHECKSUM_ALGO_KEY in e})
    if not ds.shards:
        return "checksums  (no shards)"
    if not unchecked:
        return (
            f"checksums  every sample checked against its {'/'.join(algos)} on every read (all {len(ds.shards)} shards)"
        )
    return (
        f"checksums  {len(unchecked)} of {len(ds.shards)} shards written before per-sample checksums (format "
        "version 1): "
        "their samples are read unchecked; `python -m shards verify` checks their whole-file checksums"
    )


def inspect_lines(ds: ShardDataset) -> list[str]:
    """Provenance, counts, sizes vs raw bf16, and the length histogram of a dataset."""
    m = ds.manifest
    counts = m["counts"]
    tokens = counts["tokens"]
    shard_bytes = sum(e["bytes"] for e in ds.shards)
    index_bytes = sum(e["index_bytes"] for e in ds.shards)
    # A projected dataset is compared with the raw bf16 of the full features it stands for.
    raw = raw_bytes_per_token(ds.projection["in_width"] if ds.projection else ds.hidden_width, ds.topk)
    levels = sorted({e.get("zstd_level") for e in ds.shards}, key=str)
    lines = [
        f"dataset    {io.join(ds.root, ds.manifest_name)}",
        f"format     {m['format']} v{m['format_version']}, complete: {'yes' if m.get('complete') else 'NO'}",
        f"layout     encoding {ds.encoding}, hidden_width {ds.hidden_width} in {ds.hidden_split} column piece(s), "
        f"topk {ds.topk}, "
        f"zstd level(s) {levels or '-'}",
        f"written by {m['writer'].get('tool_version')} at {m['writer'].get('git_sha')}, updated "
        f"{m['writer'].get('updated')}",
        "provenance",
        *("  " + line for line in json.dumps(ds.manifest["provenance"], indent=2, sort_keys=True).splitlines()),
        f"counts     {counts['samples']} samples, {tokens} tokens, {counts['loss_tokens']} loss tokens"
        + (f" ({counts['loss_tokens'] / tokens:.1%})" if tokens else ""),
    ]
    extra = {k: v for k, v in counts.items() if k not in RESERVED_COUNTS}
    lines.append(f"extra      {', '.join(f'{k}={v}' for k, v in extra.items()) if extra else '(none)'}")
    lines.append(
        f"files      {len(ds.shards)} shards, {_human_bytes(shard_bytes)} (+ {_human_bytes(index_bytes)} of index "
        "files)"
    )
    lines.append(checksum_line(ds))
    if tokens:
        per_token = shard_bytes / tokens
        lines.append(
            f"size       {per_token:.1f} B/token; raw bf16 hidden is {raw['hidden']} B/token "
            f"({per_token / raw['hidden']:.3f} of it), "
            f"all fields raw {raw['all']} B/token ({per_token / raw['all']:.3f} of it)"
        )
    else:
        lines.append("size       (no tokens: bytes per token undefined)")
    lines += tier_lines(ds)
    lines.append("length histogram (tokens per sample)")
    lines += length_histogram(ds.n_tokens)
    return lines


def reconstruction_by_tap(entries: list[dict]) -> tuple[list[dict], int, int]:
    """Per tap over the shards that recorded it: relative RMS error (from the summed energies) and
    the worst channel of any shard; plus (tokens covered, shards without a record)."""
    recorded = [e["reconstruction"] for e in entries if "reconstruction" in e]
    if not recorded:
        return [], 0, len(entries)
    taps = []
    for i in range(len(recorded[0]["taps"])):
        parts = [r["taps"][i] for r in recorded]
        sq, err2 = sum(p["sq"] for p in parts), sum(p["err2"] for p in parts)
        worst = max(parts, key=lambda p: p["worst_channel_rel_rms"])
        taps.append(
            {
                "rel_rms": (err2 / sq) ** 0.5 if sq > 0 else 0.0,
                "worst_channel": worst["worst_channel"],
                "worst_channel_rel_rms": worst["worst_channel_rel_rms"],
            }
        )
    return taps, sum(r["tokens"] for r in recorded), len(entries) - len(recorded)


def tier_lines(ds: ShardDataset) -> list[str]:
    """The storage tier: encoding, projection, and the reconstruction error per tap recorded at encode time."""
    lossless = ds.quant is None and ds.projection is None
    lines = [f"tier       {'lossless (' + ds.encoding + ')' if lossless else _tier_name(ds)}"]
    if ds.quant is not None:
        piece = ds.hidden_width // ds.hidden_split
        scales = (
            "one power-of-two scale per token per piece"
            if not ds.quant.four_bit
            else f"one bf16 scale per {ds.quant.group_size} values"
        )
        lines.append(f"           {ds.encoding}: {ds.quant.bytes_per_value(piece):.4f} B/value before zstd ({scales})")
    if ds.projection is not None:
        p = ds.projection
        explained = ", ".join(f"{x:.4f}" for x in p.get("explained") or [])
        lines.append(
            f"           projection {p['in_width']} -> {p['out_width']} features ({p.get('method')}, {p.get('spec')}, "
            f"rank {p.get('rank_per_tap')} per tap), second-moment share kept per tap on {p.get('calibration_tokens')} "
            f"calibration tokens: {explained}; {p['file']} {p['checksum']}"
        )
    if lossless:
        lines.append("error      none: bit-exact bf16")
        return lines
    taps, tokens, missing = reconstruction_by_tap(ds.shards)
    if not taps:
        lines.append(
            "error      (no reconstruction error recorded: the writer was given quantized values without their "
            "originals)"
            if ds.shards
            else "error      (no shards: nothing recorded)"
        )
        return lines
    layer_ids: Sequence[int] = ds.provenance.taps.layer_ids or []
    lines.append(
        f"error      reconstruction error recorded at encode time over {tokens} tokens"
        + (f" ({missing} shards without a record)" if missing else "")
        + ":"
    )
    lines.append(f"  {'tap':>3}  {'layer id':>8}  {'rel. RMS':>9}  {'worst channel':>13}  {'its rel. RMS':>12}")
    for i, tap in enumerate(taps):
        layer = layer_ids[i] if i < len(layer_ids) and len(layer_ids) == len(taps) else "-"
        lines.append(
            f"  {i:>3}  {layer!s:>8}  {tap['rel_rms']:>9.4f}  {tap['worst_channel']:>13}  "
            f"{tap['worst_channel_rel_rms']:>12.4f}"
        )
    return lines


def _tier_name(ds: ShardDataset) -> str:
    parts = []
    if ds.projection is not None:
        parts.append(f"projected to {ds.projection['out_width']} features")
    parts.append(ds.encoding)
    return " + ".join(parts)


def resolve_sample(ds: ShardDataset, key: str) -> int:
    """Dataset position of SAMPLE given as a position (negative counts from the end) or a sample id."""
    try:
        position = int(key)
    except ValueError:
        ids = ds.index.column("sample_id").to_pylist()
        if key not in ids:
            raise KeyError(f"no sample with id {key!r} in {ds.root}") from None
        return ids.index(key)
    ds.locate(position)  # IndexError naming the range if out of range
    return position % len(ds)


def _token_text(tokenizer, token_id: int) -> str:
    return repr(tokenizer.decode([int(token_id)])) if tokenizer is not None else ""


def tap_statistics(sample: Sample, layer_ids: tuple[int, ...] | list | None) -> list[str]:
    """mean / std / absmax per tap of the hidden states, from the exact bf16 values."""
    width = sample.hidden.shape[1]
    n_taps = len(layer_ids) if layer_ids else 1
    lines = []
    if width % n_taps:
        lines.append(f"  (hidden width {width} is not divisible by {n_taps} taps; showing it as one block)")
        n_taps, layer_ids = 1, None
    values = bf16_bits_to_float32(sample.hidden).reshape(sample.n_tokens, n_taps, width // n_taps)
    lines.append(f"  {'tap':>3}  {'layer id':>8}  {'mean':>10}  {'std':>10}  {'absmax':>10}  {'NaN/Inf':>7}")
    for tap in range(n_taps):
        block = values[:, tap]
        finite = block[np.isfinite(block)].astype(np.float64)
        bad = count_nonfinite_bf16(sample.hidden.reshape(sample.n_tokens, n_taps, -1)[:, tap])
        layer = layer_ids[tap] if layer_ids else "-"
        if finite.size:
            lines.append(
                f"  {tap:>3}  {layer!s:>8}  {finite.mean():>10.4g}  {finite.std():>10.4g}  "
                f"{np.abs(finite).max():>10.4g}  {bad:>7}"
            )
        else:
            lines.append(f"  {tap:>3}  {layer!s:>8}  (no finite values)  {bad:>7}")
    return lines


def show_lines(ds: ShardDataset, key: str, tokenizer=None, positions: int = 8, topk_shown: int = 5) -> list[str]:
    """One sample: where it lives, its tokens, the top-k of its first positions, per-tap statistics."""
    position = resolve_sample(ds, key)
    shard, row = ds.locate(position)
    sample = ds[position]
    lines = [
        f"sample     {sample.sample_id}",
        f"location   position {position}, {ds.shards[shard]['file']} row {row}",
        f"tokens     {sample.n_tokens} ({sample.n_loss_tokens} with loss)",
    ]
    if tokenizer is not None:
        lines.append("text       " + repr(tokenizer.decode(sample.input_ids.tolist())))
    else:
        shown = sample.input_ids[:64].tolist()
        lines.append(f"input_ids  {shown}{' ...' if sample.n_tokens > 64 else ''}  (give --tokenizer DIR to decode)")
    # topk row t is the target's distribution for the token at t + 1 (see docs/ARCHITECTURE.md).
    next_ids = sample.input_ids[1:]
    agree = float(np.mean(sample.topk_ids[:-1, 0] == next_ids)) if next_ids.size else float("nan")
    lines.append(f"top-1 at t equals input_ids[t+1] at {agree:.1%} of positions (row t predicts token t+1)")
    lines.append(
        f"top-{min(topk_shown, ds.topk)} for the first {min(positions, sample.n_tokens)} positions (id:logprob):"
    )
    for t in range(min(positions, sample.n_tokens)):
        nxt = (
            f"{int(sample.input_ids[t + 1])}{_token_text(tokenizer, sample.input_ids[t + 1])}"
            if t + 1 < sample.n_tokens
            else "-"
        )
        entries = "  ".join(
            f"{int(i)}{_token_text(tokenizer, i)}:{lp:.3f}"
            for i, lp in zip(sample.topk_ids[t, :topk_shown], sample.topk_logprobs[t, :topk_shown], strict=True)
        )
        lines.append(
            f"  t={t:<4} loss={int(sample.loss_mask[t])} "
            f"in={int(sample.input_ids[t])}{_token_text(tokenizer, sample.input_ids[t])} next={nxt}  |  {entries}"
        )
    layer_ids = ds.provenance.taps.layer_ids
    lines.append(f"hidden     [{sample.n_tokens}, {sample.hidden.shape[1]}] bf16, per tap:")
    lines += tap_statistics(sample, layer_ids)
    return lines
