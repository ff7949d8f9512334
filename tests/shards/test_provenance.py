"""`shards.provenance.Provenance`, the typed contract between extraction and every reader: it writes
today's layout key for key (what extraction wrote before the type came, tests/extract/golden), reads
every earlier and partial layout (a field the record lacks is None, unknown keys are kept), names the
field it cannot read, and no runtime module reads the record by string paths outside it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shards.provenance import MaskSource, MaskToken, Provenance, TargetRecord, provenance_of
from tests.paths import REPO

GOLDEN = REPO / "tests" / "extract" / "golden" / "provenance.json"


def test_todays_layout_reads_and_writes_back_key_for_key():
    golden = json.loads(GOLDEN.read_text())
    typed = Provenance.from_dict(golden)
    assert typed.to_dict() == golden and json.dumps(typed.to_dict(), sort_keys=True) == json.dumps(
        golden, sort_keys=True
    )
    assert typed.taps.layer_ids == (0, 1, 2) and typed.topk == 4 and typed.target.hidden_size == 64
    assert typed.tokenizer.mask_token_id == 383 and typed.tokenizer.mask_token == MaskToken(
        "<|MASK|>", MaskSource.TOKENIZER
    )
    assert typed.corpus.records == 34 and typed.corpus.skipped is None and typed.transform is None
    assert not typed.extra and not typed.target.extra and not typed.tokenizer.extra


def test_optional_parts_appear_only_when_recorded():
    golden = json.loads(GOLDEN.read_text())
    golden["tokenizer"]["mask_token"] = {"token": "<a>", "source": "auto", "passed_over": [3, 4]}
    golden["corpus"]["skipped"] = [{"name": "x.bin", "reason": "not text"}]
    golden["corpus"]["regeneration"] = {"backend": {"kind": "local"}}
    golden["transform"] = {"encoding": "fp8", "tool": "python -m shards transcode"}
    typed = Provenance.from_dict(golden)
    assert typed.to_dict() == golden
    assert typed.tokenizer.mask_token.passed_over == (3, 4) and typed.tokenizer.mask_token.source is MaskSource.AUTO
    assert typed.transform["encoding"] == "fp8" and typed.corpus.regeneration == {"backend": {"kind": "local"}}


@pytest.mark.parametrize(
    "record",
    [
        {},  # a synthetic dataset's (benchmarks, tests)
        {"taps": {"layer_ids": [1, 16]}},  # only the taps
        {"target": {"name_or_path": "t", "hidden_size": 8, "vocab_size": 64}, "tokenizer": {"hash": "h"}},
        {"tokenizer": {"mask_token_id": 7}, "topk": 4},  # before the mask token's text and source were recorded
        {"target": {"name_or_path": "t", "config_hash": "c", "weights_digest": "w"}},  # before the head digest
    ],
)
def test_earlier_and_partial_layouts_read_with_none_for_what_they_lack(record):
    typed = provenance_of({"provenance": record})
    flat = typed.to_dict()
    for part, value in record.items():  # what the record holds reads back as it was
        if isinstance(value, dict):
            assert {k: flat[part][k] for k in value} == {k: v for k, v in value.items()}
        else:
            assert flat[part] == value
    assert typed.tokenizer.mask_token.source is None and typed.target.head_digest is None
    assert typed.n_taps == (len(record["taps"]["layer_ids"]) if "taps" in record else None)
    assert provenance_of({}) == Provenance()  # a manifest without provenance


def test_unknown_keys_are_kept_and_unreadable_parts_named():
    typed = Provenance.from_dict({"future": 1, "target": {"name_or_path": "t", "new_digest": "d"}})
    assert typed.extra == {"future": 1} and typed.target.extra == {"new_digest": "d"}
    assert typed.to_dict()["future"] == 1 and typed.to_dict()["target"]["new_digest"] == "d"
    assert TargetRecord.from_dict({"name_or_path": "t", "config_hash": "c"}).identity() == {
        "name_or_path": "t",
        "config_hash": "c",
        "weights_digest": None,
        "weights_content_digest": None,
        "head_digest": None,
    }
    # The digest of every weight byte (issue 52) is part of the identity a stage compares: as an unknown
    # key it fell into `extra`, and the check compared the sampled digest only.
    assert TargetRecord.from_dict({"weights_content_digest": "x"}).identity()["weights_content_digest"] == "x"
    with pytest.raises(ValueError, match=r"provenance tokenizer.mask_token.source: 'guess' is none of"):
        Provenance.from_dict({"tokenizer": {"mask_token": {"source": "guess"}}})
    with pytest.raises(ValueError, match="provenance taps: expected a table, got list"):
        Provenance.from_dict({"taps": [1, 2]})


# ----------------------------------------------------------------------------------------------
# No reader goes around the type

RUNTIME = ("common", "shards", "target", "extract", "train", "recipes", "benchmarks")
PARTS = "target|tokenizer|taps|topk|corpus|extract_config|dtype|compute_dtype|max_len|transform|git_sha|tool_version"
UNTYPED = (
    re.compile(rf"""\bprov\w*\)?\s*(?:\.get\(|\[)\s*["'](?:{PARTS})["']"""),  # provenance.get("taps"), prov["topk"]
    re.compile(r"""["']provenance["']\]\s*(?:\[|\.get\()"""),  # manifest["provenance"]["taps"]
    re.compile(r"""\.get\(\s*["']provenance["']"""),  # manifest.get("provenance")
    re.compile(rf"""["']provenance["'],\s*["'](?:{PARTS})["']"""),  # a path: ("provenance", "taps", ...)
)


def untyped_reads(root: Path) -> list[str]:
    """'path:line' of each read of a provenance field by string key outside shards/provenance.py."""
    found = []
    for package in RUNTIME:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == "shards/provenance.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if any(pattern.search(line) for pattern in UNTYPED):
                    found.append(f"{rel}:{number}")
    return sorted(found)


def test_no_runtime_module_reads_the_provenance_by_string_paths():
    found = untyped_reads(REPO)
    assert not found, "provenance read around shards.provenance.Provenance:\n" + "\n".join(found)


def test_the_scan_finds_planted_untyped_reads(tmp_path):
    planted = {
        "train/a.py": 'taps = (provenance.get("taps") or {}).get("layer_ids")\n',
        "recipes/b.py": 'name = manifest["provenance"]["target"]["name_or_path"]\n',
        "extract/c.py": 'p = manifest.get("provenance") or {}\n',
        "shards/d.py": 'k = ds.provenance["topk"]\nw = prov.get("target")\nf = ("provenance", "taps", "layer_ids")\n',
        "shards/ok.py": "taps = provenance_of(manifest).taps.layer_ids\ncopy = dict(manifest['provenance'])\n",
        "shards/provenance.py": 'x = record.get("target")\n',
    }
    for name, text in planted.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = ["extract/c.py:1", "recipes/b.py:1", "shards/d.py:1", "shards/d.py:2", "shards/d.py:3", "train/a.py:1"]
    assert untyped_reads(tmp_path) == found
