"""The mask token lies in the vocabulary (issue 45): extraction refuses a configured id outside the
target's vocabulary before the weights load, in one line naming the key, as training would refuse
the dataset later; an id inside it is taken."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from common.config import ConfigError
from extract.checks import check_mask_token_id
from shards.provenance import MaskSource
from tests.extract.conftest import mixed_corpus


def test_an_id_outside_the_vocabulary_is_refused_naming_the_setting():
    check_mask_token_id(None, 400)
    check_mask_token_id(399, 400)
    with pytest.raises(ConfigError, match=r"config key 'mask_token_id': 400 lies outside .* \(ids 0\.\.399\)"):
        check_mask_token_id(400, 400)
    with pytest.raises(ValueError, match="the tokenizer's mask_token = 512 lies outside"):
        check_mask_token_id(512, 400, MaskSource.TOKENIZER)


def test_extraction_refuses_it_in_one_line_before_loading_the_target(tmp_path, saved_target, monkeypatch):
    from extract import pipeline
    from extract.__main__ import main

    corpus, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    vocab = json.loads(Path(saved_target, "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(pipeline, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    words = [f"target={saved_target}", f"corpus={corpus}", f"out_dir={tmp_path / 'out'}", "layer_ids=[0, 2]"]
    words += ["topk=4", "device=cpu", "dtype=float32", "progress=false", f"mask_token_id={vocab + 3}"]
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(words)
    lines = err.getvalue().strip().splitlines()
    assert (
        code == 2 and lines[-1].startswith("extract: config key 'mask_token_id'") and "Traceback" not in err.getvalue()
    )
    assert not (tmp_path / "out").exists()
