"""Regeneration prompts longer than the target's context (issue 28): a prompt that leaves no room for
an answer is a counted `prompt_too_long` reject before any generation is started for it (the local
backend once tried to allocate 14 GB for a 29,717-token prompt); an answer stops where it would run
past the context; the limit is the target's max_position_embeddings unless `max_context` sets a
smaller one."""

from __future__ import annotations

import json
import os

import pytest

from common.config import ConfigError, load_config
from extract.regenerate import local, store
from extract.regenerate import run as R
from extract.regenerate.config import RegenerateConfig
from tests.extract.conftest import write_lines
from tests.extract.regen_fixtures import read_jsonl, save_target, word_model

LIMIT = 1024  # the tiny targets' max_position_embeddings (tests/extract/conftest.py)


@pytest.fixture(scope="module")
def word_target(tmp_path_factory, chat_tokenizer):
    model = word_model(chat_tokenizer)
    return save_target(tmp_path_factory.mktemp("word_target"), model, chat_tokenizer), model


def config(target, corpus, out, *extra) -> RegenerateConfig:
    words = [f"target={target}", f"corpus={corpus}", f"out={out}", "max_new_tokens=12", "batch_size=4"]
    words += ["window_records=4", "dtype=float32", "device=cpu", "progress=false", *extra]
    return load_config(RegenerateConfig, None, words)


def prompt_of(tokens: int) -> dict:
    return {"prompt": " ".join(["fox"] * tokens)}


def test_a_prompt_longer_than_the_context_is_rejected_before_generation(
    tmp_path, word_target, chat_tokenizer, monkeypatch
):
    target, model = word_target
    corpus = write_lines(tmp_path / "c.jsonl", [prompt_of(5), prompt_of(3 * LIMIT), prompt_of(8), prompt_of(LIMIT)])
    widths = []
    real = local.generate_batch

    def recording(model, prompts, *args, **kwargs):
        widths.append(max(len(p) for p in prompts))
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(local, "generate_batch", recording)
    summary = R.run(config(target, corpus, tmp_path / "out"), model=model, tokenizer=chat_tokenizer)
    assert summary["complete"] and max(widths) < LIMIT  # the long prompts never reached the model
    counts = summary["corpus_counts"]
    assert counts["stored"] == 2 and counts["rejected_by_reason"] == {"prompt_too_long": 2}
    rejects = read_jsonl(os.path.join(tmp_path / "out", store.REJECTS_FILE))
    assert [r["position"] for r in rejects] == [1, 3] and "context holds 1,024" in rejects[0]["detail"]


def test_an_answer_stops_at_the_context(tmp_path, word_target, chat_tokenizer):
    target, model = word_target
    renderer_prompt = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": " ".join(["fox"] * 40)}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    prompt_tokens = len(chat_tokenizer(renderer_prompt, add_special_tokens=False)["input_ids"])
    corpus = write_lines(tmp_path / "c.jsonl", [prompt_of(40)])
    cfg = config(target, corpus, tmp_path / "out", f"max_context={prompt_tokens + 3}", "max_new_tokens=50")
    summary = R.run(cfg, model=model, tokenizer=chat_tokenizer)
    assert summary["complete"] and summary["corpus_counts"]["stored"] == 1
    assert summary["counts"]["answer_tokens"] <= 3


def test_max_context_above_the_targets_is_refused_and_below_it_is_used(tmp_path, word_target, chat_tokenizer):
    target, model = word_target
    corpus = write_lines(tmp_path / "c.jsonl", [prompt_of(5), prompt_of(60)])
    with pytest.raises(ConfigError, match="max_context.*max_position_embeddings"):
        R.check_inputs(config(target, corpus, tmp_path / "a", f"max_context={LIMIT + 1}"))
    summary = R.run(config(target, corpus, tmp_path / "b", "max_context=40"), model=model, tokenizer=chat_tokenizer)
    assert summary["corpus_counts"]["rejected_by_reason"] == {"prompt_too_long": 1}
    assert json.loads((tmp_path / "b" / store.PROVENANCE_FILE).read_text())["config"]["max_context"] == 40
