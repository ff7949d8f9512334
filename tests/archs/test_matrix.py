"""The architecture matrix: every family in `tests.archs.families` through the whole pipeline at
smoke scale (tests/archs/pipeline.py), each either end to end and lossless with the taps recorded,
or refused by the first stage in one line; its row must be the one docs/architectures.md commits."""

from __future__ import annotations

import pytest
import transformers

from tests.archs.families import ALL, FAMILIES, REFUSED
from tests.archs.pipeline import LAYER_IDS, run_family
from tests.archs.table import chat_tokenizer, committed, page_version, parse, render, row

AVAILABLE = [f for f in ALL if f.available]


def test_the_matrix_covers_at_least_sixteen_working_families_and_the_refusals():
    assert len([f for f in FAMILIES if f.available]) >= 16
    assert {f.name for f in REFUSED} <= {f.name for f in AVAILABLE}


def test_the_committed_page_is_the_generators_with_a_row_per_family():
    rows = parse(committed())
    assert render(rows, page_version(committed())) == committed()  # the frame (text, header, order) is the generator's
    assert set(rows) <= {f.name for f in ALL}
    assert {f.name for f in AVAILABLE} <= set(rows), "run `python -m tests.archs --table`"


@pytest.mark.parametrize("family", AVAILABLE, ids=[f.name for f in AVAILABLE])
def test_family_runs_end_to_end_or_is_refused_in_one_line(family, tmp_path):
    outcome = run_family(family, chat_tokenizer(), tmp_path)
    if family.refused is not None:
        assert outcome.refused is not None and family.refused in outcome.refused, outcome.refused
        assert "\n" not in outcome.refused and "cannot be a DFlash target" in outcome.refused
        assert not (tmp_path / "regen" / "data.jsonl").exists()  # refused before anything was generated
    else:
        assert outcome.refused is None, outcome.refused
        assert outcome.taps == LAYER_IDS  # the shards record the taps extraction was given
        assert outcome.lossless is True and outcome.tokens > 0
    if page_version(committed()) != transformers.__version__:
        pytest.skip(f"docs/architectures.md is from transformers {page_version(committed())}: its row is not compared")
    assert row(outcome, family) == parse(committed()).get(family.name), "run `python -m tests.archs --table`"
