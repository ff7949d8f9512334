"""The architecture matrix: the drafter command (`recipes.drafter`) at the smoke scale on every family in
`tests.archs.families` (tests/archs/pipeline.py), each either end to end and lossless with the taps it
derived recorded in the shards and the export (a hybrid target decoded with its per-token states, no
cache copy), or refused by the command in one line before it writes anything (by its architecture
check, or by the target's self-check at step 1); its row must be the one docs/architectures.md commits."""

from __future__ import annotations

import json

import pytest
import transformers

from target.rules import auto_layer_ids, config_depth, drafter_layers
from tests.archs.families import ALL, FAMILIES, REFUSED
from tests.archs.pipeline import NO_REFERENCE, PROMPTS, run_family
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
        assert outcome.refused is not None and family.refused in outcome.refused_why, outcome.refused
        assert "\n" not in outcome.refused
        assert not (tmp_path / "out").exists()  # refused before the command wrote (or ran) anything
    else:
        assert outcome.refused is None, outcome.refused
        assert_the_command_chose_and_recorded_its_defaults(outcome, tmp_path)
        assert outcome.lossless is True and outcome.quick_start_lossless is True and outcome.tokens > 0
        assert outcome.dflash2_lossless is True and outcome.dflash2_reference_lossless in (True, None)
        if "linear_attention" in family.kwargs.get("layer_types", ()):
            assert outcome.decoding_path == "eager, with rollback"  # per-token states, no cache copy
        else:
            assert "rollback" not in outcome.decoding_path
    if outcome.dflash2_reference_note == NO_REFERENCE:
        pytest.skip(f"{NO_REFERENCE} (`make setup` installs it): the DFlash2 column is not compared")
    if page_version(committed()) != transformers.__version__:
        pytest.skip(f"docs/architectures.md is from transformers {page_version(committed())}: its row is not compared")
    assert row(outcome, family) == parse(committed()).get(family.name), "run `python -m tests.archs --table`"


def assert_the_command_chose_and_recorded_its_defaults(outcome, work):
    depth = config_depth(str(work / "target"))
    derived, export = outcome.derived, outcome.export
    taps = auto_layer_ids(depth)[0]
    assert len(taps) >= 2  # the families are deep enough for taps of several layers
    assert derived["taps (layer_ids)"] == taps == outcome.taps == export["dflash_config"]["target_layer_ids"]
    assert derived["drafter layers"] == drafter_layers(depth)[0] == export["num_hidden_layers"]
    assert outcome.mask_token_id is not None and export["dflash_config"]["mask_token_id"] == outcome.mask_token_id
    assert derived["attn_implementation"] == outcome.attention and derived["dtype"] == outcome.dtype
    prompts = json.loads((work / "out" / "drafter.json").read_text())["prompts"]
    assert prompts["source"] == "carved" and prompts["train_records"] + prompts["heldout_records"] == PROMPTS
