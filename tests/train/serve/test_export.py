"""Export: the Hugging Face directory loads through AutoModel + trust_remote_code and computes what the
training model computes; config.json is the published DFlash format; the weight file holds exactly
the published drafter names (no embedding, no lm_head, no prefix); the model file is self-contained."""

from __future__ import annotations

import ast
import json
import os
import stat
import sys

import pytest
import torch
from safetensors import safe_open

from tests.train.test_model import tiny_config as model_tiny_config
from train import checkpoint as ck
from train.attention import build_dense_mask
from train.dflash2 import build_drafter
from train.drafter_config import DrafterConfig
from train.export_format.layout import (
    drafter_config_from_export,
    export_checkpoint,
    export_config,
    export_drafter,
    load_exported,
)
from train.model import DFlashDrafter, TargetHead
from train.serve.export import main

# The keys of the published Qwen3-8B-DFlash-b16 config.json (docs/dflash.md "Export format").
PUBLISHED_KEYS = {
    "architectures",
    "auto_map",
    "model_type",
    "block_size",
    "num_target_layers",
    "dflash_config",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "attention_bias",
    "attention_dropout",
    "layer_types",
    "max_window_layers",
    "sliding_window",
    "use_sliding_window",
    "tie_word_embeddings",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "dtype",
    "initializer_range",
    "use_cache",
}


def tiny_config(**overrides) -> DrafterConfig:
    """test_model's tiny drafter, with a max_position_embeddings the exported config.json carries."""
    return model_tiny_config(**{"max_position_embeddings": 512, **overrides})


def random_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Every parameter random, norms included (a DFlash2 drafter's convolutions and selector too), so a
    missing or misnamed tensor changes the output."""
    torch.manual_seed(seed)
    model = build_drafter(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.1) + (1.0 if "norm" in name else 0.0))
    return model


CONFIGS = {
    "plain": {},
    "partial_rope_yarn": dict(
        partial_rotary_factor=0.5,
        rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "linear_rope_mha": dict(num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "wide_target_features": dict(target_hidden_size=24, target_layer_ids=[0, 1, 3]),
    # Per-layer attention types, with windows shorter than the test contexts (S = 11 below).
    "sliding_then_full": dict(layer_types="sliding_then_full", sliding_window=5),
    "sliding_bidirectional": dict(layer_types="sliding", sliding_window=3, sliding_in_block="bidirectional"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exported_model_equals_training_model(tmp_path, name):
    cfg = tiny_config(**CONFIGS[name])
    model = random_drafter(cfg)
    export_drafter(model.state_dict(), cfg, tmp_path / name, dtype="float32")
    exported = load_exported(tmp_path / name, trust_remote_code=True)
    assert type(exported).__name__ == "DFlashDraftModel"

    S, Q = 11, 4
    target_hidden = torch.randn(2, S, cfg.feature_width)
    noise = torch.randn(2, Q, cfg.hidden_size)
    for positions in (
        torch.cat(
            [torch.arange(S).expand(2, S), (torch.arange(Q) + S).expand(2, Q)], 1
        ),  # block right after the context
        torch.cat(
            [torch.arange(S).expand(2, S), torch.tensor([[40, 41, 42, 43], [300, 301, 302, 303]])], 1
        ),  # far positions
    ):
        with torch.no_grad():
            expected = model(noise, target_hidden, positions)
            got = exported(position_ids=positions, noise_embedding=noise, target_hidden=target_hidden)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)

    # Logits through the target's head, and the block with no context at all.
    head = TargetHead(torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size))
    with torch.no_grad():
        empty = torch.zeros(2, 0, cfg.feature_width)
        positions = (torch.arange(Q) + 5).expand(2, Q)
        torch.testing.assert_close(
            head.logits(exported(position_ids=positions, noise_embedding=noise, target_hidden=empty)),
            head.logits(model(noise, empty, positions)),
            rtol=1e-6,
            atol=1e-5,
        )


def test_exported_model_takes_the_training_mask_for_many_blocks(tmp_path):
    """Offline evaluation runs many blocks in one forward under the training mask; the export must agree."""
    cfg = tiny_config()
    model = random_drafter(cfg, seed=1)
    export_drafter(model.state_dict(), cfg, tmp_path / "e", dtype="float32")
    exported = load_exported(tmp_path / "e", trust_remote_code=True)
    S, K = 12, cfg.block_size
    anchors, keep = torch.tensor([[3, 7, 10], [5, 0, 0]]), torch.tensor([[True, True, True], [True, False, False]])
    positions = torch.cat([torch.arange(S).expand(2, S), (anchors[:, :, None] + torch.arange(K)).view(2, -1)], 1)
    mask = build_dense_mask(anchors, keep, S, K)
    noise, hidden = torch.randn(2, 3 * K, cfg.hidden_size), torch.randn(2, S, cfg.feature_width)
    with torch.no_grad():
        expected = model(noise, hidden, positions, mask)
        got = exported(position_ids=positions, noise_embedding=noise, target_hidden=hidden, attention_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got).all()  # padding blocks (see nothing) give no NaN


@pytest.mark.parametrize(
    "layout",
    [{}, dict(num_hidden_layers=3, layer_types="sliding_then_full", sliding_window=5)],
    ids=["full", "sliding"],
)
def test_context_cache_equals_recomputing_the_whole_context(tmp_path, layout):
    """Serving keeps the context K/V in a DynamicCache across rounds and crops the block entries away
    (cached keys sit at positions 0..cached-1, and a sliding window still applies to them)."""
    from transformers import DynamicCache

    from train.serve.spec_target import crop_cache

    cfg = tiny_config(block_size=4, **layout)
    model = random_drafter(cfg, seed=2)
    export_drafter(model.state_dict(), cfg, tmp_path / "e", dtype="float32")
    exported = load_exported(tmp_path / "e", trust_remote_code=True)
    features = torch.randn(1, 24, cfg.feature_width)
    K = cfg.block_size
    cache = DynamicCache()
    cached = 0
    for anchor in (6, 9, 19):  # three rounds; the context grows by what was verified
        noise = torch.randn(1, K, cfg.hidden_size)
        with torch.no_grad():
            step = exported(
                position_ids=torch.arange(cached, anchor + K)[None],
                noise_embedding=noise,
                target_hidden=features[:, cached:anchor],
                past_key_values=cache,
                use_cache=True,
            )
            crop_cache(cache, anchor)
            cached = anchor
            full = exported(
                position_ids=torch.arange(anchor + K)[None], noise_embedding=noise, target_hidden=features[:, :anchor]
            )
            trained = model(noise, features[:, :anchor], torch.arange(anchor + K)[None])
        assert cache.get_seq_length() == anchor
        torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(step, trained, rtol=1e-5, atol=1e-6)


def test_config_is_the_published_format(tmp_path):
    cfg = tiny_config(num_target_layers=8, target_layer_ids=[1, 3, 5], block_size=16, mask_token_id=38)
    out = export_drafter(
        random_drafter(cfg).state_dict(),
        cfg,
        tmp_path / "e",
        token_ids={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    )
    config = json.loads((out / "config.json").read_text())
    assert set(config) >= PUBLISHED_KEYS
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert config["model_type"] == "qwen3"
    assert (config["block_size"], config["num_target_layers"]) == (16, 8)
    assert config["dflash_config"] == {
        "mask_token_id": 38,
        "target_layer_ids": [1, 3, 5],
        "block_size": 16,
        "causal": False,
        "layer_causal": [False, False],
        "use_swa": False,
    }
    assert config["layer_types"] == ["full_attention"] * 2 and config["use_sliding_window"] is False
    assert config["sliding_window"] is None and config["is_causal"] is False and config["is_neox_style"] is True
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (32, 48, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 8)
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None and config["partial_rotary_factor"] == 1.0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    assert (config["vocab_size"], config["dtype"], config["torch_dtype"], config["tie_word_embeddings"]) == (
        40,
        "bfloat16",
        "bfloat16",
        False,
    )
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert drafter_config_from_export(config) == cfg


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_round_trips_through_transformers(tmp_path, name):
    """What transformers keeps of config.json (it folds rope keys into rope_parameters) still describes the drafter."""
    from transformers import AutoConfig

    cfg = tiny_config(**CONFIGS[name])
    assert drafter_config_from_export(export_config(cfg)) == cfg
    export_drafter(random_drafter(cfg).state_dict(), cfg, tmp_path / "e")
    reread = AutoConfig.from_pretrained(tmp_path / "e").to_dict()
    assert drafter_config_from_export(reread) == cfg


def test_weight_file_holds_exactly_the_published_drafter_tensors(tmp_path):
    cfg = tiny_config()
    model = random_drafter(cfg)
    out = export_drafter(model.state_dict(), cfg, tmp_path / "e")
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        dtypes = {handle.get_tensor(n).dtype for n in names}
        loaded = {n: handle.get_tensor(n) for n in names}
    assert names == set(model.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n or n.startswith("model.") for n in names)
    assert dtypes == {torch.bfloat16}
    umask = os.umask(0)
    os.umask(umask)
    for file in out.iterdir():  # readable by a serving process as a plain open() would allow
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file.name
    for n, tensor in model.state_dict().items():
        assert torch.equal(loaded[n], tensor.bfloat16())
    # Loading the bf16 export in float32 gives exactly the rounded weights.
    exported = load_exported(out, dtype=torch.float32, trust_remote_code=True)
    for n, tensor in exported.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, loaded[n].float()), n


def test_model_file_is_self_contained(tmp_path):
    cfg = tiny_config()
    out = export_drafter(random_drafter(cfg).state_dict(), cfg, tmp_path / "e")
    tree = ast.parse((out / "dflash.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import in dflash.py"
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) <= {"torch", "transformers"}, roots


def _write_run(tmp_path, cfg: DrafterConfig, model: DFlashDrafter, target: str | None = None):
    run = tmp_path / "runs" / "demo"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snapshot = ck.take_snapshot(7, model, optimizer, {"step": 7}, cfg.to_dict())
    path = ck.write_checkpoint(run / "checkpoints", snapshot)
    (run / "run.json").write_text(json.dumps({"target": target}))
    return run, path


def test_cli_exports_a_checkpoint_or_a_run(tmp_path, capsys):
    cfg = tiny_config()
    model = random_drafter(cfg, seed=4)
    run, ckpt = _write_run(tmp_path, cfg, model)
    assert main([str(ckpt), str(tmp_path / "by_ckpt"), "--dtype", "float32"]) == 0
    assert "exported" in capsys.readouterr().out
    assert main([str(run), str(tmp_path / "by_run"), "--dtype", "float32"]) == 0
    info = json.loads((tmp_path / "by_run" / "dflash_export.json").read_text())
    assert info["step"] == 7 and info["checkpoint"].endswith("step-00000007")
    noise, hidden = torch.randn(1, 4, 32), torch.randn(1, 5, cfg.feature_width)
    positions = torch.arange(9)[None]
    with torch.no_grad():
        expected = model(noise, hidden, positions)
        for out in ("by_ckpt", "by_run"):
            got = load_exported(tmp_path / out, trust_remote_code=True)(
                position_ids=positions, noise_embedding=noise, target_hidden=hidden
            )
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Exporting again over an earlier export replaces it.
    assert main([str(ckpt), str(tmp_path / "by_ckpt")]) == 0
    assert json.loads((tmp_path / "by_ckpt" / "config.json").read_text())["dtype"] == "bfloat16"


def test_target_token_ids_and_shape_check(tmp_path):
    cfg = tiny_config()
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps({"hidden_size": 32, "vocab_size": 40, "bos_token_id": 5, "eos_token_id": [6, 7]})
    )
    _, ckpt = _write_run(tmp_path, cfg, random_drafter(cfg))
    out = export_checkpoint(ckpt, tmp_path / "e", target=str(target))
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (5, [6, 7])
    (target / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 40}))
    with pytest.raises(ValueError, match="hidden_size"):
        export_checkpoint(ckpt, tmp_path / "e2", target=str(target))


def test_user_errors_name_the_problem(tmp_path, capsys):
    cfg = tiny_config()
    state = random_drafter(cfg).state_dict()
    with pytest.raises(ValueError, match="missing"):
        export_drafter({k: v for k, v in state.items() if k != "norm.weight"}, cfg, tmp_path / "a")
    with pytest.raises(ValueError, match="unexpected"):
        export_drafter({**state, "model.embed_tokens.weight": torch.zeros(40, 32)}, cfg, tmp_path / "b")
    with pytest.raises(ValueError, match="shapes"):
        export_drafter({**state, "fc.weight": torch.zeros(32, 32)}, cfg, tmp_path / "c")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a DFlash export"):
        export_drafter(state, cfg, busy)
    assert (busy / "notes.txt").read_text() == "mine"
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Per-layer attention types in the export

from train.attention import MaskRule, build_layer_masks  # noqa: E402

MIXED = dict(
    num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=5
)


@pytest.mark.parametrize("sliding_in_block", ["causal", "bidirectional"])
def test_many_block_training_masks_equal_one_block_at_a_time_in_the_export(tmp_path, sliding_in_block):
    """Train/serve agreement: the per-type training masks over many blocks give, for every block,
    what the exported model computes for that block alone at inference (no mask: positions decide),
    with its context cut back to the anchor; contexts reach beyond the window."""
    cfg = tiny_config(**MIXED, sliding_in_block=sliding_in_block)
    model = random_drafter(cfg, seed=5)
    export_drafter(model.state_dict(), cfg, tmp_path / "e", dtype="float32")
    exported = load_exported(tmp_path / "e", trust_remote_code=True)
    rules = {t: MaskRule(window=w, causal=c) for t, (w, c) in exported.attention_rules.items()}
    assert rules == cfg.mask_rules
    S, K = 14, cfg.block_size
    anchors, keep = torch.tensor([[2, 9, 13]]), torch.tensor([[True, True, True]])
    positions = torch.cat([torch.arange(S)[None], (anchors[:, :, None] + torch.arange(K)).view(1, -1)], 1)
    masks = build_layer_masks("sdpa", anchors, keep, S, K, rules)
    noise, hidden = torch.randn(1, 3 * K, cfg.hidden_size), torch.randn(1, S, cfg.feature_width)
    with torch.no_grad():
        many = exported(position_ids=positions, noise_embedding=noise, target_hidden=hidden, attention_mask=masks)
        torch.testing.assert_close(many, model(noise, hidden, positions, masks), rtol=1e-6, atol=1e-6)
        for n, a in enumerate(anchors[0].tolist()):
            alone = exported(
                position_ids=torch.arange(a + K)[None],
                noise_embedding=noise[:, n * K : (n + 1) * K],
                target_hidden=hidden[:, :a],
            )
            torch.testing.assert_close(alone, many[:, n * K : (n + 1) * K], rtol=1e-5, atol=1e-6)
    # The semantics matter: the same weights under the other in-block rule compute something else.
    other = _with_rule(model, "bidirectional" if sliding_in_block == "causal" else "causal")
    other_masks = build_layer_masks("sdpa", anchors, keep, S, K, other.config.mask_rules)
    with torch.no_grad():
        assert not torch.allclose(other(noise, hidden, positions, other_masks), many, atol=1e-3)


def _with_rule(model: DFlashDrafter, sliding_in_block: str) -> DFlashDrafter:
    """The same weights under another in-block rule (forward with attn_mask=None: one block, positions decide)."""
    import dataclasses

    other = DFlashDrafter(dataclasses.replace(model.config, sliding_in_block=sliding_in_block)).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_config_states_the_attention_semantics(tmp_path):
    cfg = tiny_config(**MIXED)
    config = export_config(cfg)
    assert config["layer_types"] == MIXED["layer_types"] and config["sliding_window"] == 5
    assert config["use_sliding_window"] is True and config["max_window_layers"] == 3
    # Mixed causality is the engines' own default: no override, the per-layer result stated.
    assert config["is_causal"] is None and config["dflash_config"]["causal"] is None
    assert config["dflash_config"]["layer_causal"] == [True, True, False]
    assert config["dflash_config"]["swa_window_size"] == 5 and config["dflash_config"]["use_swa"] is False
    bidirectional = export_config(tiny_config(**MIXED, sliding_in_block="bidirectional"))
    assert bidirectional["is_causal"] is False and bidirectional["dflash_config"]["causal"] is False
    assert bidirectional["dflash_config"]["layer_causal"] == [False, False, False]
    all_sliding = export_config(tiny_config(layer_types="sliding", sliding_window=7))
    assert all_sliding["is_causal"] is True and all_sliding["dflash_config"]["causal"] is True
    for c in (
        cfg,
        tiny_config(**MIXED, sliding_in_block="bidirectional"),
        tiny_config(layer_types="sliding", sliding_window=7),
    ):
        assert drafter_config_from_export(export_config(c)) == c


def test_serving_warning_for_bidirectional_sliding_layers(tmp_path, capsys):
    from train.export_format.layout import serving_warnings

    assert serving_warnings(tiny_config(**MIXED)) == []
    assert serving_warnings(tiny_config()) == []
    assert "SGLang" in serving_warnings(tiny_config(**MIXED, sliding_in_block="bidirectional"))[0]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: c.update(is_causal=True), "full_attention layers \\[2\\] are causal"),
        (lambda c: c["dflash_config"].update(layer_causal=[True, False, False]), "layer_causal"),
        (lambda c: c["dflash_config"].update(swa_window_size=9), "disagree"),
        (lambda c: c.update(sliding_window=None) or c["dflash_config"].pop("swa_window_size"), "need sliding_window"),
        (lambda c: c.update(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
    ],
)
def test_unreadable_attention_semantics_are_refused(edit, needle):
    config = export_config(tiny_config(**MIXED))
    edit(config)
    with pytest.raises(ValueError, match=needle):
        drafter_config_from_export(config)


def test_a_published_style_config_reads_as_the_engines_read_it():
    """z-lab's configs carry no causality keys and block_size at the top level: sliding layers are then causal."""
    config = export_config(tiny_config(**MIXED))
    for key in ("is_causal", "is_neox_style"):
        config.pop(key)
    config["dflash_config"] = {"mask_token_id": 39, "target_layer_ids": [0, 2]}
    cfg = drafter_config_from_export(config)
    assert cfg.layer_types == MIXED["layer_types"] and cfg.sliding_window == 5 and cfg.sliding_in_block == "causal"
    config["is_causal"] = False  # as z-lab's DFlash2 configs write it
    assert drafter_config_from_export(config).sliding_in_block == "bidirectional"
