"""target.checkpoint: the text config of plain and multimodal checkpoints, and reading only the
embedding / lm_head tensors from single-file, sharded, tied and multimodal checkpoints that
transformers itself saved."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

from target import checkpoint
from target.checkpoint import EMBED, LM_HEAD, load_tensors, tensor_names, text_config
from target.rules import config_depth

V, H = 96, 32


def _qwen3(tmp_path, name, tie, **save_kwargs):
    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tie,
    )
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # make embedding and head distinguishable even if init coincides
        model.model.embed_tokens.weight.normal_()
        if not tie:
            model.lm_head.weight.normal_()
    out = tmp_path / name
    model.save_pretrained(out, **save_kwargs)
    return model, out


def test_untied_single_file_reads_exactly_the_two_tensors(tmp_path, monkeypatch):
    model, path = _qwen3(tmp_path, "untied", tie=False)
    read = []
    original = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self._inner = original(*a, **k)

        def __enter__(self):
            handle = self._inner.__enter__()
            spy = self

            class Handle:
                def keys(self):
                    return handle.keys()

                def get_tensor(self, name):
                    read.append(name)
                    return handle.get_tensor(name)

            spy._handle = Handle()
            return spy._handle

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

    monkeypatch.setattr(checkpoint, "safe_open", Spy)  # the name load_tensors opens files with
    tensors = load_tensors(path, [EMBED, LM_HEAD])
    assert sorted(read) == sorted([EMBED, LM_HEAD])
    assert torch.equal(tensors[EMBED], model.model.embed_tokens.weight)
    assert torch.equal(tensors[LM_HEAD], model.lm_head.weight)
    assert not torch.equal(tensors[EMBED], tensors[LM_HEAD])


def test_tied_head_is_the_embedding(tmp_path):
    model, path = _qwen3(tmp_path, "tied", tie=True)
    tensors = load_tensors(path, [EMBED, LM_HEAD])
    assert torch.equal(tensors[LM_HEAD], model.model.embed_tokens.weight)
    assert tensors[EMBED] is tensors[LM_HEAD]  # read once, not duplicated
    from train.model import TargetHead

    head = TargetHead.from_pretrained(str(path))
    assert head.embed_VD.data_ptr() == head.lm_head_VD.data_ptr()


def test_sharded_checkpoint_uses_the_index(tmp_path):
    model, path = _qwen3(tmp_path, "sharded", tie=False, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(set(tensor_names(path).values())) > 1
    tensors = load_tensors(path, [LM_HEAD, EMBED, "model.norm.weight"])
    assert list(tensors) == [LM_HEAD, EMBED, "model.norm.weight"]
    assert torch.equal(tensors[LM_HEAD], model.lm_head.weight)
    assert torch.equal(tensors["model.norm.weight"], model.model.norm.weight)


def test_multimodal_checkpoint_nesting(tmp_path):
    cfg = Qwen3_5Config(
        text_config=dict(
            vocab_size=V,
            hidden_size=H,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            partial_rotary_factor=0.25,
            rope_theta=1e7,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H),
    )
    model = Qwen3_5ForConditionalGeneration(cfg)
    model.save_pretrained(tmp_path / "vlm")
    tc = text_config(tmp_path / "vlm")
    assert tc["hidden_size"] == H and tc["vocab_size"] == V and tc["num_hidden_layers"] == 4
    assert tc["tie_word_embeddings"] is False
    assert "vocab_size" not in json.loads((tmp_path / "vlm" / "config.json").read_text())  # really nested
    assert any(n.startswith("model.language_model.") for n in tensor_names(tmp_path / "vlm"))
    tensors = load_tensors(tmp_path / "vlm", [EMBED, LM_HEAD])
    assert torch.equal(tensors[EMBED], model.model.language_model.embed_tokens.weight)
    assert torch.equal(tensors[LM_HEAD], model.lm_head.weight)


def test_plain_config_is_returned_as_is(tmp_path):
    _, path = _qwen3(tmp_path, "plain", tie=False)
    tc = text_config(path)
    assert tc["hidden_size"] == H and tc["model_type"] == "qwen3"


def test_errors_name_what_is_missing(tmp_path):
    _, path = _qwen3(tmp_path, "err", tie=False)
    with pytest.raises(ValueError, match="no tensor 'model.nope.weight'"):
        load_tensors(path, ["model.nope.weight"])
    # an untied config whose head is missing must not silently fall back to the embedding
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    del weights[LM_HEAD]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="tie_word_embeddings=false"):
        load_tensors(path, [LM_HEAD])
    with pytest.raises(ValueError, match="no config.json"):
        text_config(tmp_path / "absent")


@pytest.mark.parametrize("key", ["text_config", "llm_config", "language_config"])
def test_the_widths_and_the_depth_come_from_the_same_nested_table(tmp_path, key):
    """A wrapper checkpoint keeps its decoder's config under one of several keys: the widths
    (text_config) and the tap rule's depth (config_depth) must read the same table."""
    decoder = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4}
    top = {
        "model_type": "wrapper",
        "hidden_size": 999,
        "num_hidden_layers": 99,
        key: decoder,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(top))
    cfg = text_config(tmp_path)
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == config_depth(str(tmp_path)) == 6
    assert cfg["tie_word_embeddings"] is True
