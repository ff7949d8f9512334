"""`chat_template = FILE` (target.chat_template) for a target without a chat template (a base model):
regeneration and extraction render with the file's template, record its hash as the tokenizer's
`chat_template_hash`, and refuse to mix templates; a missing or broken file is a config error that
names the key. (Speculative decoding's prompts: tests/train/serve/test_specdecode.py.)"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from common.hashing import text_digest
from extract import pipeline
from extract.config import ExtractConfig
from extract.ranks import Ranks
from extract.regenerate import run as R
from extract.regenerate import store
from extract.regenerate.config import RegenerateConfig
from shards import ShardDataset
from target.load import load_target
from tests.extract.regen_fixtures import chat_corpus, save_target, word_model


@pytest.fixture(scope="module")
def base_target(tmp_path_factory, chat_tokenizer):
    """The word target saved without a chat template, and its template in a file of its own."""
    root = tmp_path_factory.mktemp("base")
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = None
    target = save_target(root / "target", word_model(chat_tokenizer), tokenizer)
    template = root / "chat.jinja"
    template.write_text(chat_tokenizer.chat_template, encoding="utf-8")
    return target, str(template)


def regenerate_config(target, corpus, out, *extra) -> RegenerateConfig:
    words = [f"target={target}", f"corpus={corpus}", f"out={out}", "max_new_tokens=8", "dtype=float32"]
    return load_config(RegenerateConfig, None, [*words, "device=cpu", "progress=false", *extra])


def extract_words(target, corpus, out, *extra) -> list[str]:
    words = [f"target={target}", f"corpus={corpus}", f"out_dir={out}", "layer_ids=[0]", "topk=4", "max_len=256"]
    return [
        *words,
        "tokens_per_batch=512",
        "min_loss_tokens=1",
        "dtype=float32",
        "device=cpu",
        "progress=false",
        *extra,
    ]


def test_a_base_target_regenerates_and_extracts_with_a_template_file(base_target, tmp_path):
    target, template = base_target
    corpus = chat_corpus(tmp_path / "corpus.jsonl", 4)
    with pytest.raises(ValueError, match="set chat_template=FILE"):
        R.run(regenerate_config(target, corpus, tmp_path / "refused"))
    summary = R.run(regenerate_config(target, corpus, tmp_path / "regen", f"chat_template={template}"))
    assert summary["complete"] and summary["corpus_counts"]["stored"] == 4
    provenance = json.loads(Path(os.path.join(tmp_path / "regen", store.PROVENANCE_FILE)).read_text())
    digest = text_digest(Path(template).read_text(encoding="utf-8"))
    assert provenance["target"]["chat_template_hash"] == digest and provenance["chat_template_file"] == template

    loaded = load_target(target, dtype="float32")
    assert loaded.tokenizer.chat_template is None
    words = extract_words(target, tmp_path / "regen", tmp_path / "shards", f"chat_template={template}")
    done = pipeline.run(load_config(ExtractConfig, None, words), target=loaded, ranks=Ranks())[None]
    assert done["samples"] == 4 and loaded.tokenizer.chat_template is None  # the caller's tokenizer is untouched
    provenance = ShardDataset(str(tmp_path / "shards")).provenance
    assert provenance.tokenizer.chat_template_hash == digest
    assert provenance.extract_config["chat_template"] == template

    other = tmp_path / "other.jinja"
    other.write_text(Path(template).read_text(encoding="utf-8").replace("<|im_start|>", "<|im_start|> "))
    words = extract_words(target, tmp_path / "regen", tmp_path / "other", f"chat_template={other}")
    with pytest.raises(ConfigError, match=f"chat_template.*answered with another chat template \\('{template}'"):
        pipeline.run(load_config(ExtractConfig, None, words), target=loaded, ranks=Ranks())


def test_a_missing_or_broken_template_file_names_the_key(tmp_path):
    base = ["target=/x", "corpus=/y", f"out={tmp_path}"]
    with pytest.raises(ConfigError, match="chat_template.*cannot read"):
        load_config(RegenerateConfig, None, [*base, f"chat_template={tmp_path / 'missing.jinja'}"])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}\n{% endfo %}")
    with pytest.raises(ConfigError, match="chat_template.*line 2: not a Jinja template"):
        load_config(ExtractConfig, None, extract_words("/x", "/y", tmp_path / "o", f"chat_template={broken}"))
