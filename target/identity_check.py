"""Whether a stage loads the target its input was made for (`check_target`), torch-free.

Extraction records the target's identity (`target.identity`: config hash, weights digests,
embedding and head digest) in the shards' manifest (`provenance.target`). Training, offline
evaluation, export and speculative decoding compute it for the target they are given and compare it
with what their input records: training with the shards' manifest, evaluation with the run's
`run.json` and the evaluated shards' manifest, the export with the run's `run.json`, speculative
decoding with the export's `dflash_export.json`. Another target is refused with one line naming both
directories and the fields that differ. `allow_target_mismatch = true` lets a deliberate copy
through (the same weights re-saved in another dtype, resharded, or its config.json edited: each
changes a digest), and the stage's output records what differed. A field that one side does not
record (a dataset or export made before the head digest existed, a checkpoint without safetensors)
is not compared; when no field can be compared the record says so.
"""

from __future__ import annotations

import logging

__all__ = ["IDENTITY_FIELDS", "OVERRIDE_KEY", "recorded_identity", "check_target", "allowed_line"]

IDENTITY_FIELDS = ("config_hash", "weights_digest", "weights_content_digest", "head_digest")
OVERRIDE_KEY = "allow_target_mismatch"

log = logging.getLogger(__name__)


def recorded_identity(record: dict | None) -> dict:
    """The identity fields (and the path) a manifest's `provenance.target` or an output's record holds."""
    record = record or {}
    return {key: record.get(key) for key in ("name_or_path", *IDENTITY_FIELDS)}


def _short(value) -> str:
    return str(value)[:12]


def check_target(loaded: dict, recorded: dict | None, *, made: str, key: str, allowed: bool) -> dict:
    """Compare the identity of the target a stage loads with the one its input records.

    `made` says what the input is, completing "the target <made>", e.g. "the shards at 'S' were
    extracted from"; `key` is the stage's override key (e.g. `model.allow_target_mismatch`).
    Returns the record the stage writes with its output; ValueError (one line naming both
    directories and the differing fields) unless the targets agree or `allowed`.
    """
    recorded = recorded_identity(recorded)
    compared = [f for f in IDENTITY_FIELDS if loaded.get(f) is not None and recorded.get(f) is not None]
    differs = [f for f in compared if loaded[f] != recorded[f]]
    result = {
        "target": loaded.get("name_or_path"),
        "expected": recorded.get("name_or_path"),
        "compared": compared,
        "differs": differs,
    }
    if not compared:
        log.warning(
            "target '%s' not checked against the target %s: no identity recorded there",
            loaded.get("name_or_path"),
            made,
        )
        return {**result, "status": "unchecked"}
    if not differs:
        return {**result, "status": "same"}
    detail = ", ".join(f"{f} {_short(loaded[f])} vs {_short(recorded[f])}" for f in differs)
    line = (
        f"target '{loaded.get('name_or_path')}' is not '{recorded.get('name_or_path')}', the target {made}: "
        f"{detail} differ"
    )
    if not allowed:
        raise ValueError(
            f"{line}; give that target, or set {key}=true if this one is a deliberate copy of it (e.g. re-saved "
            "in another dtype)"
        )
    log.warning("%s; allowed by %s=true", line, key)
    return {**result, "status": "allowed", "allowed_by": key}


def allowed_line(check: dict | None, whose: str) -> str | None:
    """The line an output prints for a check that differed and was allowed ("target X is not
    <whose> target Y (... differ): allowed by KEY"); None for any other check."""
    if not check or check.get("status") != "allowed":
        return None
    return (
        f"target {check['target']} is not {whose} target {check['expected']} "
        f"({', '.join(check['differs'])} differ): allowed by {check['allowed_by']}"
    )
