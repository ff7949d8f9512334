"""The drafter's width, heads, MLP and rope derived from a target config in any of transformers'
layouts (`DrafterConfig.from_target`, `train.drafter_config.target_rope`), read as the stages read it
(`target.checkpoint.with_canonical_keys` of the config's own dict)."""

from __future__ import annotations

import pytest
import transformers

from target.checkpoint import with_canonical_keys
from train.config import ModelConfig
from train.drafter_config import DEFAULT_ROPE_THETA, DrafterConfig, target_rope

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)


def as_read(config) -> dict:
    return with_canonical_keys(config.to_dict())


def drafter_for(config, **widths) -> DrafterConfig:
    return DrafterConfig.from_target(
        as_read(config), ModelConfig(num_layers=1, **widths), layer_ids=[0, 1], mask_token_id=0
    )


def test_gpt2_widths_through_its_attribute_map_and_a_default_mlp_and_rope():
    cfg = drafter_for(transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=4, n_head=4))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 4, 8)
    assert (cfg.num_target_layers, cfg.intermediate_size, cfg.rope_theta) == (4, 128, DEFAULT_ROPE_THETA)
    assert target_rope(as_read(transformers.GPT2Config()))[2] == "the target has no rope theta: the drafter uses 1e+06"


def test_the_drafter_mlp_is_silu_whatever_the_targets_activation():
    neox = transformers.GPTNeoXConfig(**SMALL, rotary_pct=0.25, rotary_emb_base=5000)
    assert neox.hidden_act == "gelu"
    cfg = drafter_for(neox)
    # The target's theta; its partial rotary factor stays the target's own (the drafter rotates its whole head).
    assert (cfg.hidden_act, cfg.rope_theta, cfg.partial_rotary_factor) == ("silu", 5000.0, 1.0)


def test_per_layer_type_rope_takes_the_full_attention_layers_one():
    gemma = transformers.Gemma3TextConfig(
        **SMALL,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
        },
    )
    theta, scaling, why = target_rope(as_read(gemma))
    assert (theta, scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert "per layer type" in why and "full_attention" in why
    cfg = drafter_for(gemma)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})


@pytest.mark.parametrize(
    "parameters, expected_scaling, departs",
    [
        ({"rope_type": "default", "rope_theta": 5e5}, None, False),
        (
            {
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "llama3",
            False,
        ),
        ({"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}, None, True),
    ],
)
def test_static_scaling_is_kept_and_a_length_dependent_one_dropped_with_the_reason(
    parameters, expected_scaling, departs
):
    llama = transformers.LlamaConfig(**SMALL, rope_parameters=dict(parameters))
    theta, scaling, why = target_rope(as_read(llama))
    assert theta == 5e5 and (scaling or {}).get("rope_type") == expected_scaling
    assert (why is not None) == departs
    assert drafter_for(llama).rope_theta == 5e5  # and DrafterConfig accepts what was derived


def test_top_level_rope_theta_of_an_older_config_is_read():
    theta, scaling, why = target_rope({"rope_theta": 123456.0, "rope_scaling": None})
    assert (theta, scaling, why) == (123456.0, None, None)


def test_explicit_widths_and_rope_win_over_the_targets():
    cfg = drafter_for(transformers.LlamaConfig(**SMALL), intermediate_size=48, rope_theta=777.0)
    assert (cfg.intermediate_size, cfg.rope_theta) == (48, 777.0)


def test_an_older_gpt_neox_config_json_reads_its_rotary_base():
    raw = dict(model_type="gpt_neox", rotary_emb_base=5000, rotary_pct=0.25, **SMALL)  # no rope_parameters
    assert target_rope(with_canonical_keys(raw))[:2] == (5000.0, None)
