"""The tiny default's target (`recipes.tiny.target`): a loadable HF directory, answer masks, length batches."""

from __future__ import annotations

import json

import torch

from recipes.tiny import (
    IM_END,
    MASK_TOKEN,
    TinyConfig,
    build_tiny_target,
)
from recipes.tiny import target as tiny_target
from tests.recipes.tiny import TINY_MODEL
from tests.recipes.tiny.test_chat import CONVERSATION


def test_build_tiny_target_writes_a_loadable_hf_directory(tmp_path, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, heldout = corpus
    cfg = TinyConfig(**TINY_MODEL)
    report = build_tiny_target(tmp_path, train[:60], heldout[:10], cfg, progress=False)
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tiny_report.json"]:
        assert (tmp_path / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 3
    assert model.config.vocab_size == len(tok) and tok.mask_token == MASK_TOKEN
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids(IM_END), tok.eos_token_id]
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    saved = json.loads((tmp_path / "tiny_report.json").read_text())
    assert saved == report
    assert 0.0 <= report["heldout_next_token_accuracy"] <= 1.0 and report["heldout_positions"] > 0
    assert 0.0 < report["most_frequent_token_accuracy"] < 1.0
    assert report["tap_layer_ids"] == [0, 1] and report["mask_token_id"] == tok.mask_token_id
    assert report["corpus"]["train"]["records"] == 60

    build_tiny_target(tmp_path / "again", train[:60], heldout[:10], cfg, progress=False)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_assistant_masks_mark_exactly_the_answers(corpus, small_tokenizer):
    train, _ = corpus
    records = [r for r in train if len(r.get("messages", [])) > 2][:3] + [r for r in train if "text" in r][:1]
    seqs = tiny_target.encode_records(small_tokenizer, records, 4096)
    masks = tiny_target.assistant_masks(small_tokenizer, records, 4096)
    for record, ids, mask in zip(records, seqs, masks, strict=True):
        assert len(mask) == len(ids)
        answers = "".join(m["content"] + IM_END for m in record.get("messages", []) if m["role"] == "assistant")
        assert small_tokenizer.decode([t for t, keep in zip(ids, mask, strict=True) if keep]) == answers


def test_length_batches_cover_every_sequence_once_within_the_budget():
    import random

    lengths = [random.Random(i).randint(1, 600) for i in range(300)] + [900]
    batches = tiny_target.length_batches(lengths, 1024, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * tiny_target.padded_width(max(lengths[i] for i in batch)) <= 1024
    assert batches == tiny_target.length_batches(lengths, 1024, random.Random(0))
    assert batches != tiny_target.length_batches(lengths, 1024, random.Random(1))


def test_next_token_loss_equals_the_models_own_loss(qwen3_model):
    ids = torch.randint(10, qwen3_model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = qwen3_model(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.allclose(tiny_target.next_token_loss(out.logits, labels), out.loss, rtol=1e-5)
