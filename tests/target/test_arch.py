"""target.arch.check_architecture: the embedding and head found through transformers' accessors
whatever their stored names, the input embedding's scale, the one-line refusals; and the text
config's canonical spellings (target.checkpoint.text_config)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from target.arch import check_architecture
from target.checkpoint import text_config
from train.model import TargetHead

V = 96
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def saved(tmp_path, name: str, config) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / name
    model.save_pretrained(path)
    return model, str(path)


def test_gpt_neox_embed_in_and_embed_out_are_found_and_read(tmp_path):
    model, path = saved(tmp_path, "neox", transformers.GPTNeoXConfig(vocab_size=V, **SMALL, tie_word_embeddings=False))
    arch = check_architecture(path)
    assert (arch.embed_tensor, arch.head_tensor, arch.tied) == ("gpt_neox.embed_in.weight", "embed_out.weight", False)
    head = TargetHead.from_pretrained(path)
    assert torch.equal(head.embed_VD, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head_VD, model.get_output_embeddings().weight)


def test_gpt2_tied_wte_and_its_n_embd_spelling(tmp_path):
    config = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model, path = saved(tmp_path, "gpt2", config)
    arch = check_architecture(path)
    assert (arch.embed_tensor, arch.tied, arch.embed_scale) == ("transformer.wte.weight", True, 1.0)
    head = TargetHead.from_pretrained(path)
    assert head.embed_VD.data_ptr() == head.lm_head_VD.data_ptr()  # one tensor, not two
    stored = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert "hidden_size" not in stored  # the checkpoint spells it n_embd ...
    tc = text_config(path)  # ... the text config has both spellings
    assert (tc["hidden_size"], tc["num_attention_heads"], tc["num_hidden_layers"], tc["n_embd"]) == (32, 4, 2, 32)


@pytest.mark.parametrize("config_class", ["Gemma2Config", "Gemma3TextConfig"])
def test_gemma_embedding_scale_is_the_modules_and_the_head_embeds_as_it_does(tmp_path, config_class):
    config = getattr(transformers, config_class)(vocab_size=V, head_dim=8, num_key_value_heads=2, **SMALL)
    model, path = saved(tmp_path, config_class, config)
    arch = check_architecture(path)
    assert arch.embed_scale == pytest.approx(32**0.5, rel=1e-6)
    ids = torch.tensor([[3, 7, 90, 0]])
    for dtype in (torch.float32, torch.bfloat16):
        head = TargetHead.from_pretrained(path, dtype=dtype)
        module = model.to(dtype).get_input_embeddings()
        assert torch.equal(head.embed(ids), module(ids))  # the very numbers transformers feeds layer 0
        assert not torch.equal(head.embed(ids), torch.nn.functional.embedding(ids, head.embed_VD))


def test_multimodal_checkpoint_language_model_prefix(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=V, head_dim=8, num_key_value_heads=2, layer_types=["full_attention"] * 2, **SMALL)
    config = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=16, out_hidden_size=32))
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config)
    model.save_pretrained(tmp_path / "vlm")
    arch = check_architecture(tmp_path / "vlm")
    assert arch.embed_tensor == "model.language_model.embed_tokens.weight"
    assert torch.equal(TargetHead.from_pretrained(str(tmp_path / "vlm")).embed_VD, model.get_input_embeddings().weight)


@pytest.mark.parametrize(
    "name, build, needle",
    [
        (
            "t5",
            lambda: transformers.T5Config(vocab_size=V, d_model=32, d_ff=64, num_layers=1, num_heads=4),
            "encoder-decoder",
        ),
        (
            "opt",
            lambda: transformers.OPTConfig(vocab_size=V, word_embed_proj_dim=16, ffn_dim=64, **SMALL),
            "token embedding is 16 wide but its hidden states 32",
        ),
        ("phi", lambda: transformers.PhiConfig(vocab_size=V, **SMALL), "output head has a bias"),
    ],
)
def test_a_family_that_cannot_work_is_refused_in_one_line_naming_why(tmp_path, name, build, needle):
    path = tmp_path / name
    build().save_pretrained(path)  # the config alone: the refusal needs no weights
    with pytest.raises(ValueError) as err:
        check_architecture(path)
    message = str(err.value)
    assert needle in message and str(path.resolve()) in message and "\n" not in message


def test_a_directory_without_weights_is_checked_except_its_tensors(tmp_path):
    transformers.LlamaConfig(vocab_size=V, **SMALL).save_pretrained(tmp_path / "cfg")
    arch = check_architecture(tmp_path / "cfg")
    assert (arch.model_class, arch.embed_tensor, arch.head_tensor) == ("LlamaForCausalLM", None, None)
    with pytest.raises(ValueError, match="holds no safetensors weights"):
        TargetHead.from_pretrained(str(tmp_path / "cfg"))
    with pytest.raises(ValueError, match="no config.json"):
        check_architecture(tmp_path / "nowhere")


def test_a_rewritten_checkpoint_is_checked_again(tmp_path):
    _, path = saved(tmp_path, "t", transformers.LlamaConfig(vocab_size=V, **SMALL, tie_word_embeddings=False))
    assert not check_architecture(path).tied
    saved(tmp_path, "t", transformers.LlamaConfig(vocab_size=V, **SMALL, tie_word_embeddings=True))
    assert check_architecture(path).tied


FOUR = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
FOUND_BY_THEIR_OWN_NAMES = {
    # family: (config, where the decoder's layers are, the final norm's name)
    "Llama-4 text": (
        lambda: transformers.Llama4TextConfig(
            vocab_size=V, **FOUR, head_dim=8, num_local_experts=2, intermediate_size_mlp=64, no_rope_layers=[1] * 4
        ),
        "model.layers",
        "model.norm",
    ),
    "LFM2": (
        lambda: transformers.Lfm2Config(vocab_size=V, **FOUR, layer_types=["conv", "full_attention"] * 2),
        "model.layers",
        "model.embedding_norm",
    ),
    "XGLM": (
        lambda: transformers.XGLMConfig(vocab_size=V, d_model=32, ffn_dim=64, num_layers=4, attention_heads=4),
        "model.layers",
        "model.layer_norm",
    ),
    "RecurrentGemma": (
        lambda: transformers.RecurrentGemmaConfig(
            vocab_size=V, **{**FOUR, "num_key_value_heads": 1}, head_dim=8, lru_width=32, attention_window_size=8
        ),
        "model.layers",
        "model.final_norm",
    ),
}


@pytest.mark.parametrize("family", FOUND_BY_THEIR_OWN_NAMES, ids=list(FOUND_BY_THEIR_OWN_NAMES))
def test_the_parts_are_found_by_the_models_own_accessors_and_names(tmp_path, family):
    """Refused before as "cannot find the decoder layers and final norm" although the parts exist."""
    from target.load import reach_text_parts

    make_config, layers, norm = FOUND_BY_THEIR_OWN_NAMES[family]
    config = make_config()
    config.save_pretrained(tmp_path)
    assert check_architecture(tmp_path).model_class.endswith("ForCausalLM")
    model = AutoModelForCausalLM.from_config(config)
    target = reach_text_parts(model)
    names = {id(m): n for n, m in model.named_modules()}
    assert (names[id(target.layers)], names[id(target.final_norm)]) == (layers, norm)
    assert target.num_layers == 4 and target.lm_head is model.get_output_embeddings()


@pytest.mark.parametrize(
    "config, reason",
    [
        (
            lambda: transformers.Mamba2Config(
                vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, n_groups=1
            ),
            "it has no attention layers (a recurrent-only model",
        ),
        (
            lambda: transformers.Gemma3nTextConfig(
                vocab_size=V,
                **FOUR,
                head_dim=8,
                vocab_size_per_layer_input=V,
                num_kv_shared_layers=0,
                layer_types=["full_attention"] * 4,
                activation_sparsity_pattern=[0.0] * 4,
            ),
            "its decoder layers carry 4 stacked streams (AltUp)",
        ),
    ],
    ids=["Mamba-2", "Gemma-3n"],
)
def test_what_cannot_work_is_refused_with_the_right_reason(tmp_path, config, reason):
    """Mamba-2 crashed in training (KeyError 'num_attention_heads'), Gemma-3n in extraction (four streams)."""
    config().save_pretrained(tmp_path)
    with pytest.raises(ValueError) as refused:
        check_architecture(tmp_path)
    assert reason in str(refused.value) and "cannot be a DFlash target" in str(refused.value)
    assert "\n" not in str(refused.value)
