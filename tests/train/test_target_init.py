"""`model.init_from_target`: drafter layers started from the target's decoder layers hold exactly those
layers' tensors (Qwen3 with q/k norms, Llama without: those stay fresh and are named), the rules pick the
layers they say, and a bad value, a layer that does not exist or does not fit stops with the key named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from common.config import ConfigError
from tests.train.test_loop import config, tiny  # noqa: F401  (tiny is a fixture)
from tests.train.test_model import tiny_config
from train.config import parse_init_rule
from train.model import DFlashDrafter
from train.prepare import Run
from train.target_init import init_from_target, target_layer_choice


def test_rules_pick_the_layers_they_name():
    assert target_layer_choice("first", 3, 30) == [0, 1, 2]
    assert target_layer_choice("last", 3, 30) == [27, 28, 29]
    assert target_layer_choice("spread", 5, 30) == [0, 7, 15, 22, 29]  # 29 i / 4, half up
    assert target_layer_choice("spread", 1, 30) == [0]
    assert target_layer_choice([4, 4], 2, 30) == [4, 4]
    assert parse_init_rule("none") is None and parse_init_rule(None) is None
    assert parse_init_rule("Spread") == "spread" and parse_init_rule("3, 10") == [3, 10]
    with pytest.raises(ValueError, match="model.init_from_target.*neither"):
        parse_init_rule("middle")
    with pytest.raises(ValueError, match="do not exist"):
        target_layer_choice([0, 30], 2, 30)
    with pytest.raises(ValueError, match="2 layer ids for a drafter of 3"):
        target_layer_choice([0, 1], 3, 30)


def _llama_target(path, layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


def _drafter(layers=2, intermediate=48):
    torch.manual_seed(0)
    return DFlashDrafter(tiny_config(vocab_size=64, num_hidden_layers=layers, intermediate_size=intermediate))


def test_llama_layers_copied_and_missing_norms_left_fresh(tmp_path):
    stored = _llama_target(tmp_path / "llama")
    drafter = _drafter()
    fc_before = drafter.fc.weight.clone()
    record = init_from_target(drafter, tmp_path / "llama", "last")
    assert record["target_layers"] == [2, 3]
    state = drafter.state_dict()
    for i, j in enumerate([2, 3]):
        for suffix in (
            "self_attn.q_proj.weight",
            "self_attn.v_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
        ):
            assert torch.equal(state[f"layers.{i}.{suffix}"], stored[f"model.layers.{j}.{suffix}"]), (i, suffix)
        # Llama has no per-head q/k norm: the drafter's stay at the fresh ones.
        assert torch.equal(state[f"layers.{i}.self_attn.q_norm.weight"], torch.ones(8))
    assert torch.equal(state["norm.weight"], stored["model.norm.weight"])
    assert torch.equal(drafter.fc.weight, fc_before)
    assert "fc.weight" in record["left_at_init"] and "layers.0.self_attn.k_norm.weight" in record["optional_absent"]
    assert record["copied"] == 2 * 9 + 1


def test_a_tensor_that_does_not_fit_names_the_key(tmp_path):
    _llama_target(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"model.init_from_target.*mlp.gate_proj.weight.*\(48, 32\)"):
        init_from_target(_drafter(intermediate=40), tmp_path / "llama", "first")


def test_a_run_starts_from_the_target_layers_and_records_them(tiny, tmp_path):  # noqa: F811
    # The tiny target is Qwen3 (q/k norms too); the drafter takes its MLP width (64).
    run = Run.prepare(
        config(tiny, tmp_path, "model.num_layers=2", "model.intermediate_size=64", "model.init_from_target=spread")
    )
    try:
        stored = load_file(str(tiny / "target" / "model.safetensors"))
        state = run.drafter.state_dict()
        for i, j in enumerate([0, 3]):
            for suffix in ("self_attn.k_proj.weight", "self_attn.q_norm.weight", "mlp.up_proj.weight"):
                assert torch.equal(state[f"layers.{i}.{suffix}"].cpu(), stored[f"model.layers.{j}.{suffix}"])
        info = json.loads((run.run_dir / "run.json").read_text())
        assert info["init_from"]["target_layers"] == [0, 3] and info["init_from"]["optional_absent"] == []
    finally:
        run.stream.close()
        run.release()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.init_from_target=sideways"], "neither"),
        (["model.num_layers=2", "model.init_from_target=0,1,2"], "3 layer ids for model.num_layers=2"),
        (["model.init_from_target=first", "model.init_from=/nowhere"], "together with model.init_from"),
    ],
)
def test_bad_values_stop_before_anything_runs(tiny, tmp_path, overrides, message):  # noqa: F811
    with pytest.raises(ConfigError, match=message):
        config(tiny, tmp_path, *overrides)
