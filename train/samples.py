"""Which samples a run trains on, and whether a dataset fits the drafter, both from the shard index
and manifest alone (no hidden state is read):

- the held-out split (`is_holdout`: a seed-independent hash of the sample id, shared with eval, so
  train and eval agree and a larger fraction holds out a superset);
- `check_compatible`: the manifest's provenance (taps, widths, tokenizer, target, top-k, storage tier)
  against what the drafter config expects, every problem named at once;
- `select_samples`: holdout, too few loss tokens, oversize, then `max_samples` (a nested, uniformly
  spread subset), with the count each rule left out.

`train.data.DataStream` applies them before it plans a single batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import xxhash

from shards.provenance import Provenance, provenance_of
from train.config import DataConfig
from train.stored_features import mixed_encoding_problems, projection_problems

_HOLDOUT_SALT = b"dflash-holdout:"
_SUBSET_SALT = b"dflash-subset:"


# ----------------------------------------------------------------------------------------------
# Holdout and compatibility


def _unit_hash(sample_id: str, salt: bytes) -> float:
    """A uniform number in [0, 1) fixed by the sample id alone."""
    return xxhash.xxh3_64_intdigest(salt + sample_id.encode("utf-8")) / 2.0**64


def spread_subset(sample_ids, positions: np.ndarray, n: int | None, salt: bytes) -> np.ndarray:
    """At most `n` of `positions` (ascending): those whose ids hash smallest under `salt`, so the
    subset is fixed by the ids alone and nested as `n` grows."""
    if n is None or positions.size <= n:
        return positions
    rank = np.fromiter((_unit_hash(sample_ids[i], salt) for i in positions), dtype=np.float64, count=positions.size)
    return np.sort(positions[np.argsort(rank, kind="stable")[:n]])


def is_holdout(sample_id: str, fraction: float) -> bool:
    """Whether a sample is held out for eval; independent of seed and dataset order, so train and
    eval agree and a larger fraction holds out a superset."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"holdout fraction must lie in [0, 1], got {fraction}")
    return _unit_hash(sample_id, _HOLDOUT_SALT) < fraction


def holdout_mask(sample_ids: list[str], fraction: float) -> np.ndarray:
    """`is_holdout` over many ids, as a bool array."""
    return np.fromiter((is_holdout(s, fraction) for s in sample_ids), dtype=bool, count=len(sample_ids))


# expected key -> (the manifest field, how it must relate to the expected value)
EXPECTED_FIELDS: dict[str, tuple[str, str]] = {
    "layer_ids": ("provenance.taps.layer_ids", "equal"),
    "hidden_width": ("hidden_width", "equal"),
    "hidden_size": ("provenance.target.hidden_size", "equal"),
    "vocab_size": ("provenance.target.vocab_size", "equal"),
    "tokenizer_hash": ("provenance.tokenizer.hash", "equal"),
    "topk": ("topk", "at_least"),
    "target_name": ("provenance.target.name_or_path", "equal"),
    "target_config_hash": ("provenance.target.config_hash", "equal"),
}
_MISSING = object()


def _recorded(manifest: dict, provenance: Provenance) -> dict[str, Any]:
    """{field of EXPECTED_FIELDS: what the manifest records} (_MISSING where it records nothing)."""
    values = {
        "provenance.taps.layer_ids": None if provenance.taps.layer_ids is None else list(provenance.taps.layer_ids),
        "hidden_width": manifest.get("hidden_width"),
        "provenance.target.hidden_size": provenance.target.hidden_size,
        "provenance.target.vocab_size": provenance.target.vocab_size,
        "provenance.tokenizer.hash": provenance.tokenizer.hash,
        "topk": manifest.get("topk"),
        "provenance.target.name_or_path": provenance.target.name_or_path,
        "provenance.target.config_hash": provenance.target.config_hash,
    }
    return {field: _MISSING if value is None else value for field, value in values.items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return [*a] == [*b]
    return a == b


def check_compatible(manifest: dict, expected: dict) -> None:
    """Refuse a dataset whose manifest disagrees with what the drafter needs.

    `expected` holds any of the keys of `EXPECTED_FIELDS` (an unknown key is an error, so a typo
    never silently skips a check), and may hold `projection`: the drafter's projection identity
    ({checksum, in_width, out_width}) or None for full tap features (storage tiers, `train.stored_features`).
    Shards whose encodings differ from the dataset's are always refused. `topk` is a minimum (the
    loss needs at least that many entries); every other field must be equal. A field missing from
    the manifest is reported too. The manifest must also be complete and self-consistent
    (hidden_width = n_taps x hidden_size). All problems are reported at once in one ValueError, each
    naming the manifest field and both values.
    """
    expected = dict(expected)
    projection = expected.pop("projection", _MISSING)  # the drafter's projection identity, or None
    unknown = sorted(set(expected) - set(EXPECTED_FIELDS))
    if unknown:
        raise ValueError(
            f"check_compatible: unknown expected field(s) {unknown}; known: {sorted(EXPECTED_FIELDS) + ['projection']}"
        )
    problems = []
    if manifest.get("complete") is False:
        problems.append("manifest field 'complete' is false: the extraction has not finished")
    problems += mixed_encoding_problems(manifest)
    if projection is not _MISSING:
        problems += projection_problems(manifest, projection)
    recorded = _recorded(manifest, provenance_of(manifest))
    for key, want in expected.items():
        where, rule = EXPECTED_FIELDS[key]
        have = recorded[where]
        if have is _MISSING:
            problems.append(f"manifest field '{where}' is missing; the drafter config expects {key}={want!r}")
        elif rule == "at_least" and not have >= want:
            problems.append(f"manifest field '{where}' = {have!r} but the drafter config needs {key} >= {want!r}")
        elif rule == "equal" and not _same(have, want):
            problems.append(f"manifest field '{where}' = {have!r} but the drafter config expects {key}={want!r}")
    layer_ids, hidden_size, width = (
        recorded[EXPECTED_FIELDS[key][0]] for key in ("layer_ids", "hidden_size", "hidden_width")
    )
    if isinstance(manifest.get("projection"), dict):
        width = manifest["projection"].get("in_width", _MISSING)  # the projection reads the taps' features
    if _MISSING not in (layer_ids, hidden_size, width) and width != len(layer_ids) * hidden_size:
        problems.append(
            f"manifest field 'hidden_width' = {width!r} but len(provenance.taps.layer_ids) x "
            "provenance.target.hidden_size "
            f"= {len(layer_ids)} x {hidden_size!r}: the manifest contradicts itself"
        )
    if problems:
        raise ValueError("the shards dataset does not fit this drafter:\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------------------------
# Sample selection (pure, on index columns)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Dataset indices chosen for training, in index order, and why the others were left out."""

    indices: np.ndarray  # int64 dataset indices
    excluded: dict  # reason -> count


def select_samples(
    sample_ids: list[str], n_tokens: np.ndarray, n_loss_tokens: np.ndarray, cfg: DataConfig
) -> Selection:
    """Apply holdout, min_loss_tokens, oversize and max_samples, in that order."""
    n_tokens = np.asarray(n_tokens, dtype=np.int64)
    keep = np.ones(len(sample_ids), dtype=bool)
    excluded = {}
    held = holdout_mask(sample_ids, cfg.holdout_fraction)
    excluded["holdout"] = int(held.sum())
    keep &= ~held
    few = keep & (np.asarray(n_loss_tokens) < cfg.min_loss_tokens)
    excluded["min_loss_tokens"] = int(few.sum())
    keep &= ~few
    over = keep & (n_tokens > cfg.token_budget)
    if over.any() and cfg.oversize == "fail":
        raise ValueError(
            f"{int(over.sum())} training sample(s) are longer than data.token_budget={cfg.token_budget} "
            f"(longest {int(n_tokens[over].max())} tokens; first {sample_ids[int(np.flatnonzero(over)[0])]}): "
            f"raise data.token_budget or set data.oversize='skip'"
        )
    excluded["oversize"] = int(over.sum())
    keep &= ~over
    indices = np.flatnonzero(keep).astype(np.int64)
    excluded["max_samples"] = 0
    if cfg.max_samples is not None and indices.size > cfg.max_samples:
        chosen = spread_subset(sample_ids, indices, cfg.max_samples, _SUBSET_SALT)
        excluded["max_samples"] = int(indices.size - chosen.size)
        indices = chosen
    return Selection(indices=indices, excluded=excluded)


def selection_digest(sample_ids: list[str], lengths: np.ndarray) -> str:
    h = xxhash.xxh3_64()
    h.update("\n".join(sample_ids).encode("utf-8"))
    h.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return h.hexdigest()
