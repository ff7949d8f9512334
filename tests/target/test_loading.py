"""A target's files as the stages read them: a weight tensor missing from the files (transformers would
initialise it randomly, differently in every process), a truncated safetensors file (a traceback from
the loader before), and a config.json with the `{"__float__": "Infinity"}` objects transformers writes
for Mamba-2-family settings (every such checkpoint crashed at step 1)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from recipes.drafter.config import DrafterRecipeConfig
from recipes.drafter.defaults import derive
from target.checkpoint import check_weight_files, read_config, text_config
from target.load import load_target
from tests.archs.families import by_name


def copy_of(saved_target: str, tmp_path, name: str = "copy") -> str:
    return shutil.copytree(saved_target, tmp_path / name)


def test_a_weight_tensor_missing_from_the_files_is_refused_in_one_line(saved_target, tmp_path):
    path = copy_of(saved_target, tmp_path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    dropped = "model.layers.2.mlp.down_proj.weight"
    del tensors[dropped]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as refused:
        load_target(str(path), dtype="float32", device="cpu")
    message = str(refused.value)
    assert "\n" not in message and dropped in message and "1 tensor(s) the model expects" in message


def test_every_tensor_loaded_is_recorded(saved_target):
    target = load_target(saved_target, dtype="float32", device="cpu")
    assert target.loading["missing_keys"] == [] and target.loading["mismatched_keys"] == []


def test_a_truncated_safetensors_file_is_named_before_the_loader_runs(saved_target, tmp_path):
    path = copy_of(saved_target, tmp_path)
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(ValueError, match=r"model\.safetensors is damaged or truncated \(its header describes") as err:
        check_weight_files(path)
    assert f"the file holds {size - 1000}" in str(err.value)
    with pytest.raises(ValueError, match="damaged or truncated"):
        load_target(str(path), dtype="float32", device="cpu")
    with open(weights, "wb") as f:
        f.write(b"\x10\x00")  # not even a header length
    with pytest.raises(ValueError, match="less than a header"):
        check_weight_files(path)


def test_a_config_with_infinity_is_read_as_transformers_reads_it(tmp_path, chat_tokenizer):
    config = by_name("Falcon-H1 (Mamba-2 + attention, lm_head_multiplier)").config(len(chat_tokenizer), {})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "t")
    chat_tokenizer.save_pretrained(tmp_path / "t")
    assert '"__float__": "Infinity"' in (tmp_path / "t/config.json").read_text()  # as transformers writes it
    assert read_config(tmp_path / "t")["time_step_limit"] == [0.0, float("inf")]
    assert text_config(tmp_path / "t")["num_attention_heads"] == 4  # the canonical keys: the class parsed it
    cfg = DrafterRecipeConfig(target=str(tmp_path / "t"), prompts="p.jsonl", device="cpu")
    assert {d.what: d.value for d in derive(cfg)}["taps (layer_ids)"] == [1, 2]
    json.loads((tmp_path / "t/config.json").read_text())  # still plain JSON for every other reader
