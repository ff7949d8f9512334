"""The projection of a projected extraction (storage tier, `projection = ...` in `[extract]`): settled
before the first shard is written, so the full corpus never has to exist in lossless form.

- `pca:rank=R` / `pca:variance=V`: a calibration pass runs the target over the first
  `calibration_samples` samples of the corpus (the same tokenization and batching as the extraction),
  accumulates each tap's second moment on the device in float64 (`shards.projection.SecondMoments`),
  and fits P there (`fit_projection`; ranks rounded up to a 4-bit encoding's group size). Rank 0 does
  this and writes `projection.safetensors`; other ranks wait for the file.
- a file path: that projection is copied in as it is (its checksum, the projection's identity, kept).
- resuming: the projection a manifest in the directory lists is used again, and a file left by a run
  killed before its first commit is reused when it was made with the same settings.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time

import torch

from common.io import exists_at, join_uri, list_names, resolve
from extract import corpus as C
from extract.batching import attention_mask_for, collate_right_padded, plan_micro_batches
from extract.capture import STORE_DTYPE, forward_with_taps, to_device_async
from shards.manifest import load_manifest
from shards.projection import (
    PROJECTION_FILE,
    SecondMoments,
    fit_projection,
    load_projection,
    load_projection_file,
    parse_projection_spec,
    save_projection,
)
from shards.quant import parse_encoding

log = logging.getLogger(__name__)
WAIT_SECONDS = 6 * 3600  # how long a rank waits for rank 0's calibration


def listed_projection(root: str) -> dict | None:
    """The projection entry a manifest in `root` (merged or a rank's) lists, if any."""
    if "://" not in root and not os.path.isdir(root):
        return None
    fs, path = resolve(root)
    for name in sorted(n for n in list_names(root) if n.startswith("manifest") and n.endswith(".json")):
        try:
            entry = load_manifest(fs, path, name).get("projection")
        except (ValueError, OSError):
            continue
        if entry is not None:
            return entry
    return None


def ensure_projection(cfg, target, ranks, root: str):
    """(Projection, manifest entry) for this extraction, or (None, None) without `projection`."""
    if cfg.projection is None:
        return None, None
    width = len(cfg.layer_ids) * target.hidden_size
    listed = listed_projection(root)
    if listed is not None:
        return load_projection(root, listed), listed
    if not cfg.projection.startswith("pca:"):
        projection, data = load_projection_file(cfg.projection)
        if projection.in_width != width:
            raise ValueError(
                f"projection: {cfg.projection!r} reads {projection.in_width} features, the taps give {width}"
            )
        return projection, save_projection(root, projection, data)
    path = join_uri(root, PROJECTION_FILE)
    if ranks.rank != 0:
        return _wait_for(root, path, cfg)
    left = _matching_file(path, cfg)
    if left is not None:
        log.info("%s: reusing the projection of a run that stopped before its first commit", path)
        return left, save_projection(root, left)
    projection = calibrate(cfg, target)
    return projection, save_projection(root, projection)


def _settings(cfg) -> dict:
    return {"spec": cfg.projection, "samples": cfg.calibration_samples}


def _matching_file(path: str, cfg):
    if not exists_at(path):
        return None
    projection, _ = load_projection_file(path)
    made_with = {
        "spec": projection.info.get("spec"),
        "samples": (projection.info.get("calibration") or {}).get("requested"),
    }
    return projection if made_with == _settings(cfg) else None


def _wait_for(root: str, path: str, cfg):
    started = time.time()
    while time.time() - started < WAIT_SECONDS:
        projection = _matching_file(path, cfg)
        if projection is not None:
            return projection, save_projection(root, projection, load_projection_file(path)[1])
        time.sleep(2.0)
    raise TimeoutError(f"{path}: rank 0's calibration pass did not finish within {WAIT_SECONDS} s")


def calibration_samples(cfg, target) -> list:
    """The first `cfg.calibration_samples` tokenized samples of the corpus (rejects skipped)."""
    corpus = C.find_corpus(cfg.corpus, cfg.corpus_format)
    policy = C.SamplePolicy(
        cfg.max_len, cfg.length_policy, cfg.min_loss_tokens, cfg.chat_template_kwargs, target.vocab_size
    )
    builder = C.SampleBuilder(target.tokenizer, policy)
    records = C.iter_records(corpus, streaming=cfg.streaming, max_records=cfg.max_records)
    samples: list = []
    while len(samples) < cfg.calibration_samples:
        chunk = list(itertools.islice(records, 256))
        if not chunk:
            break
        samples += [s for s in builder.build(chunk) if isinstance(s, C.TokenizedSample)]
    return samples[: cfg.calibration_samples]


@torch.inference_mode()
def calibrate(cfg, target):
    """Fit the PCA projection on the taps of the calibration samples (second moments on the device)."""
    samples = calibration_samples(cfg, target)
    if not samples:
        raise ValueError("projection: the corpus gave no samples for the calibration pass")
    started = time.perf_counter()
    device = target.output_device
    moments = SecondMoments(len(cfg.layer_ids), target.hidden_size, device=device)
    tokenizer = target.tokenizer
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    lengths = [s.n_tokens for s in samples]
    for batch in plan_micro_batches(lengths, cfg.tokens_per_batch):
        ids_BT, batch_lengths = collate_right_padded([torch.from_numpy(samples[i].input_ids) for i in batch], pad_id)
        B, T = ids_BT.shape
        mask = attention_mask_for(batch_lengths, T)
        valid_BT = (torch.arange(T)[None, :] < torch.tensor(batch_lengths)[:, None]).to(device)

        def keep(slot: int, hidden_BTH: torch.Tensor) -> None:
            # the values the shards would hold (keep runs inside this iteration's forward: its valid_BT)
            rows_NH = hidden_BTH.to(STORE_DTYPE).to(device)[valid_BT]  # noqa: B023
            rows_NH = rows_NH[torch.isfinite(rows_NH).all(dim=-1)]
            moments.add_tap(slot, rows_NH)

        forward_with_taps(
            target,
            to_device_async(ids_BT, target.input_device),
            None if mask is None else to_device_async(mask, target.input_device),
            cfg.layer_ids,
            keep,
        )
    spec = parse_encoding(cfg.hidden_encoding)
    multiple = spec.group_size if spec is not None and spec.four_bit else 1
    info = {
        "calibration": {
            "requested": cfg.calibration_samples,
            "samples": len(samples),
            "tokens": sum(lengths),
            "chosen_by": "the first samples of the corpus",
            "corpus": cfg.corpus,
        }
    }
    projection = fit_projection(moments, parse_projection_spec(cfg.projection), multiple=multiple, info=info)
    log.info(
        "calibration pass: %d samples, %d tokens, %.1f s; rank %d per tap keeps %s of the second moment",
        len(samples),
        sum(lengths),
        time.perf_counter() - started,
        projection.rank,
        json.dumps([round(x, 4) for x in projection.info["explained"]]),
    )
    return projection
