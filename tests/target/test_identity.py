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


def test_the_content_digest_sees_a_weight_changed_where_the_quick_fingerprint_does_not_look(tmp_path):
    """The quick `weights_digest` reads 1 MiB at the start, middle and end of each file: a byte changed
    anywhere else passed as the same target at export, decoding and evaluation."""
    from target.identity import directory_digest, weights_content_digest, weights_digest
    from target.identity_check import check_target

    data = bytearray(torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=torch.Generator()).numpy())
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(data))
    before = {"quick": weights_digest(tmp_path), "content": weights_content_digest(tmp_path)}
    directory = directory_digest(tmp_path)
    data[(5 << 20) + 123] ^= 1  # between the middle and the end samples
    weights.write_bytes(bytes(data))
    assert weights_digest(tmp_path) == before["quick"]
    assert weights_content_digest(tmp_path) != before["content"] and directory_digest(tmp_path) != directory
    loaded = {"name_or_path": "B", "weights_digest": before["quick"], "weights_content_digest": "x"}
    recorded = {"name_or_path": "A", "weights_digest": before["quick"], "weights_content_digest": before["content"]}
    with pytest.raises(ValueError, match="weights_content_digest .* differ"):
        check_target(loaded, recorded, made="the shards were extracted from", key="k", allowed=False)


def test_each_file_is_hashed_once_and_again_when_it_changes(tmp_path, monkeypatch):
    import target.file_digests as fd

    monkeypatch.setenv(fd.CACHE_ENV, str(tmp_path / "cache"))
    hashed: list[str] = []
    real = fd._hash
    monkeypatch.setattr(fd, "_hash", lambda path, size: hashed.append(path) or real(path, size))
    file = tmp_path / "w.safetensors"
    file.write_bytes(b"a" * 1000)
    first = fd.file_digest(file)
    assert fd.file_digest(file) == first and len(hashed) == 1  # from the cache, not read again
    assert fd.cache_file() == tmp_path / "cache" / "file-digests.json" and fd.cache_file().is_file()
    file.write_bytes(b"b" * 1000)  # rewritten in place, same size
    assert fd.file_digest(file) != first and len(hashed) == 2
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(fd.CACHE_ENV, str(tmp_path / "a-file" / "cache"))  # cannot be made: the digest, every time
    assert fd.file_digest(file) == fd.file_digest(file) and len(hashed) == 4
