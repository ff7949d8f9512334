"""Reading a regenerated corpus back: a directory written by `python -m extract.regenerate`
(`extract.regenerate.store` writes it; docs/regenerate.md) is read from its data file alone, and its
`regenerate.json` is what an extraction's manifest carries as `corpus.regeneration`.

These names are the contract between the two: the data file, the provenance file written last
(so a directory without it, but with journals, is a regeneration that has not finished), and the
journals' names.
"""

from __future__ import annotations

import json
import os

DATA_FILE = "data.jsonl"
PROVENANCE_FILE = "regenerate.json"


def is_journal(name: str) -> bool:
    """Whether `name` is one of a regeneration's journals (a rank's file, or an object store's segment)."""
    return name.startswith("journal.rank") and name.endswith(".jsonl")


def _journals(directory: str) -> list[str]:
    return [f for f in sorted(os.listdir(directory)) if is_journal(f)]


def regeneration_of(corpus_path: str) -> tuple[str, dict] | None:
    """(data file, provenance) when `corpus_path` is a regeneration's output directory or its
    data file, else None. ValueError for an output directory whose regeneration is unfinished."""
    if os.path.isdir(corpus_path):
        directory, named = corpus_path, None
    elif os.path.isfile(corpus_path):
        directory, named = os.path.dirname(os.path.abspath(corpus_path)), os.path.basename(corpus_path)
    else:
        return None
    provenance_path = os.path.join(directory, PROVENANCE_FILE)
    if not os.path.isfile(provenance_path):
        if named is None and _journals(directory):
            raise ValueError(
                f"corpus: '{corpus_path}' is a regeneration that has not finished (journals, no {PROVENANCE_FILE}); "
                "rerun its `python -m extract.regenerate` command to finish it"
            )
        return None
    with open(provenance_path, encoding="utf-8") as f:
        provenance = json.load(f)
    data_file = provenance.get("data_file", DATA_FILE)
    if named is not None and named != data_file:
        return None  # another file that happens to sit next to a regeneration
    if not provenance.get("complete"):
        raise ValueError(f"corpus: '{corpus_path}': {provenance_path} says the regeneration is not complete")
    return os.path.join(directory, data_file), provenance


def provenance_for_manifest(provenance: dict) -> dict:
    """The part of regenerate.json an extraction manifest carries (everything but the bulky config copy)."""
    return {k: v for k, v in provenance.items() if k not in ("config", "journal_header")}
