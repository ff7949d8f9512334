"""`python -m shards transcode SRC DST encoding=... [projection=...]`: derive a cheaper dataset (a
storage tier) from an existing one, without the target.

    python -m shards transcode artifacts/tiny/shards/train artifacts/tiny/tiers/fp8 encoding=fp8
    python -m shards transcode SRC DST encoding=fp8 projection=pca:rank=32 calibration_samples=256
    python -m shards transcode SRC DST encoding=nf4-g64 projection=OTHER_DATASET/projection.safetensors

- `encoding`: planes / plain (lossless) or fp8 / int4-gG / nf4-gG (`shards/quant.py`).
- `projection` (optional): `pca:rank=R` (R per tap), `pca:variance=V` (every tap keeps at least that
  share of its second moment), or a projection file to reuse (another dataset's, so that drafters
  trained on both read the same features). A PCA is fitted on `calibration_samples` samples of SRC
  spread over it by a hash of their ids (`shards/projection.py`).
- Resumable: the writer commits shard by shard; a rerun of the same command (after a kill, a full
  disk, ...) skips the samples DST already holds, reuses its projection, and refuses a different
  transform. Each sample is written once.
- Provenance: SRC's, plus `transform` naming the source dataset (path, manifest digest, encoding,
  counts) and the transform (encoding, projection). Reconstruction error per tap is measured
  against SRC's values as each sample is encoded and recorded per shard (`python -m shards inspect`).
- At the end DST is verified (`verify_dataset`, whole-file checksums included) and the command
  prints bytes per token against SRC and against raw bf16.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections import deque

import numpy as np
import pyarrow.fs as pafs
import xxhash

from common import io
from common.config import fail, knob, set_resolved
from common.hashing import json_digest
from shards.describe import raw_bytes_per_token
from shards.manifest import MANIFEST_NAME, load_manifest, lock_manifest, projection_of
from shards.projection import (
    Projection,
    SecondMoments,
    fit_projection,
    load_projection,
    load_projection_file,
    parse_projection_spec,
    save_projection,
)
from shards.quant import canonical_encoding, parse_encoding
from shards.reader import ShardDataset
from shards.schema import DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL
from shards.tiers import encode_features
from shards.verify import verify_dataset
from shards.writer import ShardWriter

TRANSFORM_KEY = "transform"
_CALIBRATION_SALT = b"dflash-calibration:"


@dataclasses.dataclass(frozen=True)
class TranscodeConfig:
    encoding: str = knob(help="target encoding: planes, plain (lossless), fp8, int4-gG, nf4-gG (int4 / nf4 = group 64)")
    projection: str | None = knob(
        None, help="pca:rank=R, pca:variance=V, or a projection file to reuse; none = full features"
    )
    calibration_samples: int = knob(
        256, help="samples of SRC the PCA is fitted on (spread over SRC by a hash of their ids)", min=1
    )
    zstd_level: int = knob(DEFAULT_ZSTD_LEVEL, help="zstd level of DST's shards", min=1, max=22)
    shard_bytes: int = knob(DEFAULT_SHARD_BYTES, help="size at which a DST shard is committed, in bytes", min=1 << 10)
    threads: int = knob(
        2, help="threads that read and encode samples ahead of the writer (zstd uses pyarrow's pool)", min=1, max=256
    )
    device: str = knob(
        "cpu", help="where samples are projected, quantized and measured, and the PCA fitted: cpu, cuda or cuda:N"
    )
    manifest: str = knob(MANIFEST_NAME, help="manifest file name of SRC (DST's is manifest.json)")
    verify: bool = knob(True, help="verify DST at the end (every sample and whole-file checksum)")
    progress: bool = knob(True, help="show a progress bar")

    def check(self) -> None:
        try:
            set_resolved(self, "encoding", canonical_encoding(self.encoding))
        except ValueError as err:
            fail("encoding", str(err).removeprefix("hidden_encoding: "))
        if (
            self.projection is not None
            and not self.projection.startswith("pca:")
            and not os.path.exists(self.projection)
        ):
            fail(
                "projection",
                f"{self.projection!r} is neither pca:rank=R / pca:variance=V nor an existing projection file",
            )
        if self.projection is not None and self.projection.startswith("pca:"):
            try:
                parse_projection_spec(self.projection)
            except ValueError as err:
                fail("projection", str(err).removeprefix("projection: "))
        if not (
            self.device == "cpu"
            or self.device == "cuda"
            or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            fail("device", f"{self.device!r} is not allowed; use cpu, cuda or cuda:N")


def calibration_indices(ds: ShardDataset, n: int) -> list[int]:
    """`n` samples spread over the dataset: the smallest xxh3 of (salt, id); fixed by the ids alone."""
    ids = ds.index.column("sample_id").to_pylist()
    rank = np.fromiter(
        (xxhash.xxh3_64_intdigest(_CALIBRATION_SALT + s.encode()) for s in ids), dtype=np.uint64, count=len(ids)
    )
    return sorted(np.argsort(rank, kind="stable")[:n].tolist())


def fit_on_dataset(
    ds: ShardDataset, spec_text: str, n_samples: int, n_taps: int, multiple: int, device="cpu"
) -> Projection:
    """A PCA projection fitted on `n_samples` samples of `ds` (uncentered, per tap)."""
    import torch

    width = ds.hidden_width
    moments = SecondMoments(n_taps, width // n_taps, device=device)
    chosen = calibration_indices(ds, n_samples)
    for i in chosen:
        moments.add(torch.from_numpy(ds[i].hidden).view(torch.bfloat16).to(device))
    info = {
        "calibration": {
            "samples": len(chosen),
            "of": len(ds),
            "chosen_by": "smallest xxh3-64 of 'dflash-calibration:' + sample id",
        }
    }
    return fit_projection(moments, parse_projection_spec(spec_text), multiple=multiple, info=info)


def _source_record(src: str, ds: ShardDataset) -> dict:
    m = ds.manifest
    return {
        "path": os.path.abspath(src) if "://" not in src else src,
        "manifest": ds.manifest_name,
        "manifest_digest": json_digest({k: v for k, v in m.items() if k not in ("writer", "manifest_checksum")}),
        "encoding": m["encoding"],
        "projection": (projection_of(m) or {}).get("checksum"),
        "samples": m["counts"]["samples"],
        "tokens": m["counts"]["tokens"],
    }


def _projection(
    cfg: TranscodeConfig, ds: ShardDataset, dst_root: str, n_taps: int
) -> tuple[Projection | None, dict | None]:
    """The projection DST uses (resumed from DST, loaded from a file, or fitted), and its manifest entry."""
    if cfg.projection is None:
        return None, None
    fs, root = io.resolve(dst_root)
    if io.exists(fs, io.join(root, MANIFEST_NAME)):
        existing = projection_of(load_manifest(fs, root))
        if existing is not None:  # a resumed run keeps its projection (the writer checks the rest)
            return load_projection(dst_root, existing), existing
    if cfg.projection.startswith("pca:"):
        spec = parse_encoding(cfg.encoding)
        multiple = spec.group if spec is not None and spec.four_bit else 1
        projection = fit_on_dataset(ds, cfg.projection, cfg.calibration_samples, n_taps, multiple, device=cfg.device)
        return projection, save_projection(dst_root, projection)
    projection, data = load_projection_file(cfg.projection)
    if projection.in_width != ds.hidden_width:
        raise ValueError(
            f"projection: {cfg.projection!r} reads {projection.in_width} features, SRC has {ds.hidden_width}"
        )
    return projection, save_projection(dst_root, projection, data)


def _encode(ds: ShardDataset, i: int, cfg: TranscodeConfig, pieces: int, projection: Projection | None):
    sample = ds[i]
    stored, error = encode_features(
        sample.hidden,
        cfg.encoding,
        pieces,
        projection,
        what=f"sample {sample.sample_id!r}: field 'hidden'",
        device=cfg.device,
    )
    return dataclasses.replace(sample, hidden=stored), error  # type: ignore[arg-type]  # codes or bf16 bits


def transcode(src: str, dst: str, cfg: TranscodeConfig) -> dict:
    """Write DST from SRC (resuming what DST already holds); returns a summary."""
    ds = ShardDataset(src, manifest_name=cfg.manifest)
    if not ds.manifest.get("complete"):
        raise ValueError(
            f"{src}: the source dataset is not complete (a writer is running, was killed or failed); finish it first"
        )
    if ds.projection is not None and cfg.projection is not None:
        raise ValueError(
            f"{src}: already projected ({ds.projection['checksum']}); transcode from the unprojected dataset"
        )
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("DST must be another directory than SRC")
    fs, root = io.resolve(dst)
    created = fs.get_file_info(root).type == pafs.FileType.NotFound
    fs.create_dir(root, recursive=True)
    # One writer per dataset: the lock the ShardWriter takes, held from before the projection is
    # fitted and saved into DST (a second transcode into DST stops at once, naming this one).
    with lock_manifest(fs, root, MANIFEST_NAME):
        try:
            entry, resumed_past = _transcode_locked(src, dst, ds, cfg)
        except ValueError:
            if created:  # still under the lock: no other writer can have started in DST
                _remove_if_nothing_written(fs, root)
            raise
    problems = verify_dataset(dst, progress=cfg.progress) if cfg.verify else []
    out = ShardDataset(dst)
    tokens = out.manifest["counts"]["tokens"]
    dst_bytes = sum(
        e["bytes"] + e["index_bytes"] for e in out.shards
    )  # the projection file is a fixed cost, shown apart
    src_bytes = sum(e["bytes"] + e["index_bytes"] for e in ds.shards)
    raw = raw_bytes_per_token(ds.projection["in_width"] if ds.projection else ds.hidden_width, ds.topk)
    return {
        "samples": len(out),
        "tokens": tokens,
        "resumed_past": resumed_past,
        "problems": [str(p) for p in problems],
        "bytes_per_token": dst_bytes / max(tokens, 1),
        "source_bytes_per_token": src_bytes / max(tokens, 1),
        "ratio_to_raw_bf16": dst_bytes / max(tokens, 1) / raw["hidden"],
        "projection": entry,
        "verified": cfg.verify,
    }


def _remove_if_nothing_written(fs, root: str) -> None:
    """A refused start leaves nothing behind: DST, created by this call, goes again if it holds no
    more than the writer's lock file (a refusal after samples were written keeps them to resume)."""
    entries = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    if all(os.path.basename(e.path) == f".{MANIFEST_NAME}.lock" for e in entries):
        fs.delete_dir(root)


def _transcode_locked(src: str, dst: str, ds: ShardDataset, cfg: TranscodeConfig) -> tuple[dict | None, int]:
    """Settle DST's projection and write the samples it lacks (under DST's manifest lock); returns
    (DST's projection entry, samples DST already held)."""
    provenance = dict(ds.manifest["provenance"])  # the source's record as stored, with the transform added
    taps = ds.provenance.n_taps
    n_taps = taps if taps and ds.hidden_width % taps == 0 else ds.hidden_split
    projection, entry = _projection(cfg, ds, dst, n_taps)
    provenance[TRANSFORM_KEY] = {
        "source": _source_record(src, ds),
        "encoding": cfg.encoding,
        "projection": None if entry is None else {"checksum": entry["checksum"], "from": cfg.projection},
        "tool": "python -m shards transcode",
    }
    width = projection.out_width if projection is not None else ds.hidden_width
    projection = projection.to(cfg.device) if projection is not None else None
    with ShardWriter(
        dst,
        provenance=provenance,
        hidden_width=width,
        topk=ds.topk,
        hidden_encoding=cfg.encoding,
        zstd_level=cfg.zstd_level,
        shard_bytes=cfg.shard_bytes,
        projection=entry,
    ) as writer:
        done = writer.committed_ids()
        ids = ds.index.column("sample_id").to_pylist()
        todo = [i for i, sid in enumerate(ids) if sid not in done]
        _write_all(ds, writer, todo, cfg, projection, len(ids) - len(todo))
    return entry, len(ids) - len(todo)


def _write_all(ds, writer: ShardWriter, todo: list[int], cfg: TranscodeConfig, projection, skipped: int) -> None:
    """Encode in `cfg.threads` threads (torch and zstd release the GIL), write in SRC order."""
    from tqdm import tqdm

    pieces = writer.hidden_split
    bar = tqdm(
        total=len(todo) + skipped,
        initial=skipped,
        unit="sample",
        desc="transcode",
        disable=None if cfg.progress else True,
    )
    with concurrent.futures.ThreadPoolExecutor(max_workers=cfg.threads, thread_name_prefix="transcode") as pool:
        window: deque = deque()
        queue = iter(todo)
        for i in queue:
            window.append(pool.submit(_encode, ds, i, cfg, pieces, projection))
            if len(window) >= 2 * cfg.threads:
                break
        while window:
            sample, error = window.popleft().result()
            nxt = next(queue, None)
            if nxt is not None:
                window.append(pool.submit(_encode, ds, nxt, cfg, pieces, projection))
            writer.write(sample, hidden_known_finite=parse_encoding(cfg.encoding) is not None, hidden_error=error)
            bar.update(1)
    bar.close()


def summary_lines(src: str, dst: str, result: dict) -> list[str]:
    lines = [
        f"transcoded {src} -> {dst}: {result['samples']} samples, {result['tokens']} tokens"
        + (f" ({result['resumed_past']} already there: resumed)" if result["resumed_past"] else ""),
        f"size       {result['bytes_per_token']:.1f} B/token ({result['ratio_to_raw_bf16']:.3f} of raw bf16 of the "
        "full features; "
        f"the source: {result['source_bytes_per_token']:.1f} B/token)",
    ]
    if result["projection"]:
        p = result["projection"]
        lines.append(
            f"projection {p['in_width']} -> {p['out_width']} ({p.get('spec')}), second-moment share kept per tap: "
            + ", ".join(f"{x:.4f}" for x in p.get("explained") or [])
            + f"; {p['file']}: {p['bytes']} bytes, once"
        )
    if result["problems"]:
        lines += result["problems"] + [f"FAILED: {len(result['problems'])} problem(s) in {dst}"]
    elif result["verified"]:
        lines.append("verified   OK (every sample, whole-file checksums)")
    return lines
