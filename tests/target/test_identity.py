"""target.identity: the head digest of tensors a stage has already read equals the one read
from the directory (tied and untied heads), so training and evaluation read the two tensors once; and the digest's
bytes are those every dataset extracted from the shipped tiny target records."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from recipes.tiny.shipped import SHIPPED_DIR
from target.identity import head_digest, read_stored_head, stored_head_or_none, target_identity

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("tied", [True, False])
def test_identity_of_stored_head_equals_identity_read_from_the_directory(tmp_path, tied):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied)).save_pretrained(
        tmp_path
    )
    stored = read_stored_head(tmp_path)
    assert stored.arch.tied is tied
    assert target_identity(tmp_path, stored) == target_identity(tmp_path)
    assert target_identity(tmp_path)["head_digest"] == head_digest(tmp_path) is not None


def test_a_directory_without_weights_has_no_stored_head(tmp_path):
    transformers.LlamaConfig(**SMALL).save_pretrained(tmp_path)
    assert read_stored_head(tmp_path) is None
    assert stored_head_or_none(tmp_path / "missing") is None
    assert head_digest(tmp_path) is None


def test_the_shipped_tiny_targets_head_digest_is_the_recorded_one():
    # Golden: computed when the digest read the directory itself; a dataset records it, so it must not move.
    assert head_digest(SHIPPED_DIR / "target") == "43f59309ab6349cb1c0ad5e0f4ea670c"
