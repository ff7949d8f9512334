"""Target loading: a saved multimodal Qwen3.5/3.6-style checkpoint loads as its text decoder only,
with the same weights; layer ids are checked from config.json alone; provenance digests."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from extract.capture import capture
from target.identity import target_identity, weights_digest
from target.identity_check import IDENTITY_FIELDS
from target.load import load_target, reach_text_parts, read_text_config, target_provenance
from tests.extract.conftest import qwen35_text_config


@pytest.fixture(scope="module")
def saved_vlm(tmp_path_factory, chat_tokenizer):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = qwen35_text_config(len(chat_tokenizer)).to_dict()
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        spatial_merge_size=1,
        temporal_patch_size=1,
    )
    torch.manual_seed(0)
    vlm = (
        Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
        .eval()
        .requires_grad_(False)
    )
    path = tmp_path_factory.mktemp("vlm")
    vlm.save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return str(path), vlm


def test_multimodal_checkpoint_loads_as_text_decoder_with_the_same_weights(saved_vlm):
    path, vlm = saved_vlm
    config = read_text_config(path)
    assert config.model_type == "qwen3_5_text" and config.num_hidden_layers == 4  # read without loading weights
    target = load_target(path, dtype="float32", device="cpu")
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM" and not hasattr(target.model.model, "visual")
    assert target.layers is target.model.model.layers and target.final_norm is target.model.model.norm
    ids = torch.randint(0, target.vocab_size, (1, 20))
    got = capture(target, ids, [20], [0, 1, 2], topk=3)
    ref = capture(reach_text_parts(vlm), ids, [20], [0, 1, 2], topk=3)
    for a, b in zip(got.taps, ref.taps, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got.topk_ids, ref.topk_ids)
    prov = target_provenance(target)
    assert prov["architecture"] == "Qwen3_5ForConditionalGeneration" and prov["loaded_as"] == "Qwen3_5ForCausalLM"
    assert prov["num_layers"] == 4 and prov["hidden_size"] == 64 and prov["vocab_size"] == target.vocab_size
    # The manifest records the identity the later stages compute from the directory (target.identity).
    identity = target_identity(path)
    assert prov["head_digest"] and all(prov[f] == identity[f] for f in IDENTITY_FIELDS)
    assert prov["attn_implementation"] == "sdpa"  # the implementation the target was loaded with


def test_weights_digest_sees_changed_weights(saved_target, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(saved_target, copy)
    assert weights_digest(str(copy)) == weights_digest(saved_target)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte in the middle of the tensors
    weights.write_bytes(bytes(data))
    assert weights_digest(str(copy)) != weights_digest(saved_target)


def test_missing_target_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        read_text_config(str(tmp_path / "nowhere"))
    assert os.path.isdir(tmp_path)
