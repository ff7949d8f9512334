"""Regeneration and how answers end (`extract.regenerate.answer_checks`): a target that declares no
end-of-answer token is refused before anything is generated, in one line naming the file to fix and
the token its chat template ends answers with; a template whose end-of-turn token does not end
generation is warned about; the summary says how many answer tokens the round trip cut away, and
warns when that is most of them."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from extract.regenerate import run as R
from extract.regenerate.__main__ import main
from extract.regenerate.answer_checks import check_answer_end, declared_stop_ids
from tests.extract.regen_fixtures import chat_corpus, save_target, word_model


@pytest.fixture(scope="module")
def endless_target(tmp_path_factory, chat_tokenizer):
    """The word target with every end-of-answer token removed: no eos in its configs or tokenizer."""
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.eos_token = None
    model = word_model(chat_tokenizer)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    return save_target(tmp_path_factory.mktemp("endless"), model, tokenizer), tokenizer


def test_a_target_without_an_end_of_answer_token_is_refused_before_generating(
    endless_target, chat_tokenizer, tmp_path, monkeypatch, capsys
):
    target, tokenizer = endless_target
    assert declared_stop_ids(target, tokenizer)[0] == set()
    monkeypatch.setattr(R, "load_local_model", lambda *a: pytest.fail("the target was loaded"))
    corpus = chat_corpus(tmp_path / "corpus.jsonl", 3)
    words = [f"target={target}", f"corpus={corpus}", f"out={tmp_path / 'out'}", "device=cpu", "progress=false"]
    assert main(words) == 2
    err = capsys.readouterr().err.strip()
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "\n" not in err and "declares no end-of-answer token" in err
    assert f"{target}/generation_config.json" in err and f"'<|im_end|>', id {im_end}" in err
    assert not (tmp_path / "out" / "data.jsonl").exists()


def test_a_template_end_that_does_not_stop_generation_is_warned_about(chat_tokenizer, tmp_path, caplog):
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end]}))
    with caplog.at_level(logging.WARNING):
        ids = check_answer_end(str(tmp_path), chat_tokenizer, {"enable_thinking": False}, 10)
    assert im_end in ids and not caplog.records  # the template's end token ends generation: nothing to say
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.eos_token = "<|im_start|>"  # an eos that is not the token answers end with
    with caplog.at_level(logging.WARNING):
        check_answer_end(str(tmp_path), tokenizer, {"enable_thinking": False}, 10)
    assert f"add {im_end} to eos_token_id" in caplog.text


def test_the_summary_says_how_much_the_round_trip_cut_and_warns_when_most():
    counts = dict.fromkeys(("stored", "rejected", "failed", "already_done", "answers", "prompt_tokens"), 1)
    counts.update(answer_tokens=40, answers_at_cap=1, answers_cut=1, round_trip_tokens=1000, round_trip_cut_tokens=960)
    summary = {"counts": counts, "seconds": 1.0, "records_per_s": 1.0, "answer_tokens_per_s": 40.0}
    text = R.format_summary(summary)
    assert "the round trip cut 960 of 1,000 answer tokens, 96.0%" in text
    assert "WARNING: the decode/re-encode round trip cut away most of the answers" in text
    counts.update(round_trip_cut_tokens=10)
    assert "WARNING" not in R.format_summary(summary)
