"""A target whose input embedding module scales its rows (Gemma: x sqrt(hidden_size)) gets the same
drafts from training's embedding (`TargetHead.embed`, which offline evaluation uses too), from our
speculative decoding (`SpecTarget.embed`), from the export's model driven as z-lab's older loop drives it
(`target.model.embed_tokens(block)`) and from z-lab's newer loop (pip dflash 0.1.0: the raw table times
the `dflash_config.input_embedding_scale` every export writes), docs/serving.md "Embedding and head";
the raw table rows would give other drafts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from tests.train.serve.test_specdecode import drafter_config
from train.dflash2 import build_drafter
from train.drafter_config import DrafterConfig
from train.export_format.layout import (
    export_config,
    export_drafter,
    load_exported,
    target_embed_scale,
    target_token_ids,
    target_warnings,
)
from train.model import DFlashDrafter, TargetHead
from train.serve.decoding import DFlashProposer, greedy_generate, speculative_generate
from train.serve.spec_target import SpecTarget

V, B, MASK, LAYER_IDS = 64, 8, 63, [0, 1]


def test_training_decoding_and_the_export_embed_a_gemma_block_alike(tmp_path):
    torch.manual_seed(0)
    model = _gemma()
    model.save_pretrained(tmp_path / "target")
    head = TargetHead.from_pretrained(str(tmp_path / "target"))
    assert head.embed_scale == float(torch.tensor(32**0.5))  # the module's float32 sqrt(hidden)

    cfg = _config()
    trained = DFlashDrafter(cfg).eval()
    export_drafter(trained.state_dict(), cfg, tmp_path / "drafter", dtype="float32")
    exported = load_exported(tmp_path / "drafter", dtype=torch.float32)

    spec = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    ids = torch.randint(0, MASK, (12,), generator=torch.Generator().manual_seed(1))
    _, features_TF = spec.teacher_forced(ids[None])
    anchor = 9
    block = torch.tensor([[int(ids[anchor])] + [MASK] * (B - 1)])
    positions = torch.arange(anchor + B)[None]
    context = features_TF[None, :anchor]

    with torch.no_grad():
        # training (and offline evaluation): the frozen head's embedding
        training = head.logits(trained(head.embed(block), context, positions)[:, 1:])[0]
        unscaled = head.logits(trained(F.embedding(block, head.embed_VD), context, positions)[:, 1:])[0]
        # z-lab's loop on the export: the target's embedding module, the target's lm_head
        hidden = exported(
            position_ids=positions, noise_embedding=model.model.embed_tokens(block), target_hidden=context
        )
        zlab = exported.compute_logits(hidden[:, 1:], model.lm_head)[0]
    ours = DFlashProposer(exported, spec, context_cache=False).draft_logits(context, int(ids[anchor]), anchor)

    torch.testing.assert_close(ours, training, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(zlab.float(), training, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), training.argmax(-1))
    assert not torch.allclose(unscaled, training, rtol=1e-2, atol=1e-2)  # the scale matters: the test can fail


def test_every_export_writes_the_targets_embedding_scale_where_it_is_not_1(tmp_path, capsys):
    """`dflash_config.input_embedding_scale` (read by vLLM's DFlash2 model and z-lab's newer loop, which embed
    the block with the raw table times it): the target's scale for Gemma, absent for a target that does not
    scale, whose DFlash export stays byte for byte what it was; without a target directory, a warning."""
    from tests.train.serve.test_export import _write_run
    from train.serve.export import main

    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    Gemma3ForCausalLM(Gemma3TextConfig(**small, head_dim=8)).save_pretrained(tmp_path / "gemma")
    LlamaForCausalLM(LlamaConfig(**small)).save_pretrained(tmp_path / "llama")
    scale = float(torch.tensor(32**0.5))
    assert target_embed_scale(str(tmp_path / "gemma")) == scale and target_embed_scale(str(tmp_path / "llama")) == 1
    (warning,) = target_warnings(str(tmp_path / "gemma"))
    assert "5.65685" in warning and "SGLang does not read it" in warning
    assert target_warnings(str(tmp_path / "llama")) == [] and "no target directory" in target_warnings(None)[0]
    cfg = _config()
    _, ckpt = _write_run(tmp_path, cfg, DFlashDrafter(cfg))
    for name in ("gemma", "llama"):
        assert main([str(ckpt), str(tmp_path / f"e-{name}"), f"target={tmp_path / name}"]) == 0
    gemma = json.loads((tmp_path / "e-gemma" / "config.json").read_text())
    assert gemma["dflash_config"]["input_embedding_scale"] == scale
    assert "input_embedding_scale 5.65685" in capsys.readouterr().out
    llama = (tmp_path / "e-llama" / "config.json").read_text()
    assert "input_embedding_scale" not in llama
    token_ids = target_token_ids(str(tmp_path / "llama"), cfg)
    assert llama == json.dumps(export_config(cfg, token_ids=token_ids), indent=2) + "\n"
    assert json.loads((tmp_path / "e-llama" / "dflash_export.json").read_text())["input_embedding_scale"] == 1.0


def _gemma() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    return Gemma3ForCausalLM(
        Gemma3TextConfig(**small, num_key_value_heads=2, head_dim=8, final_logit_softcapping=None)
    ).eval()


def _config(**overrides) -> DrafterConfig:
    return drafter_config(**{"target_layer_ids": LAYER_IDS, "num_target_layers": 3, "block_size": B, **overrides})


class _Drafts:
    """Records the drafts a loop makes (of `method`'s output, through `pick`), round by round."""

    def __init__(self, owner, method: str, pick):
        self.rounds, inner = [], getattr(owner, method)

        def wrapped(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.rounds.append(pick(out))
            return out

        setattr(owner, method, wrapped)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_the_reference_loop_on_a_gemma_export_drafts_what_our_loop_drafts(tmp_path, arch):
    """z-lab's `dflash_generate` (pip dflash 0.1.0) embeds the block with the raw table times
    input_embedding_scale; with the scale the export writes it drafts, round for round, what our loop drafts
    (the target's embedding module, as in training), and stays lossless; without it, other drafts."""
    ref = pytest.importorskip("dflash.model", reason="z-lab's reference code (pip dflash==0.1.0) is not installed")
    model = _gemma()
    model.save_pretrained(tmp_path / "target")
    extra = dict(arch="dflash2", selector_rank=8, selector_top_k=8) if arch == "dflash2" else {}
    cfg = _config(**extra)
    drafter = build_drafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # away from the near-constant fresh init, selector included
    export_drafter(
        drafter.state_dict(), cfg, tmp_path / "d", dtype="float32", embed_scale=target_embed_scale(tmp_path / "target")
    )
    spec = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    ours = DFlashProposer(load_exported(tmp_path / "d"), spec)
    mine = _Drafts(ours, "propose", list)
    reference_class = ref.DFlash2DraftModel if arch == "dflash2" else ref.DFlashDraftModel
    prompt, new = torch.randint(0, MASK, (9,), generator=torch.Generator().manual_seed(2)).tolist(), 20

    def reference_run() -> tuple[list[int], list]:
        theirs = reference_class.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
        if arch == "dflash2":
            drafts = _Drafts(theirs, "propose", lambda out: out[0][0].tolist())
        else:
            drafts = _Drafts(theirs, "compute_logits", lambda out: out[0].argmax(-1).tolist())
        output = ref.dflash_generate(theirs, model, torch.tensor([prompt]), new, None)
        return output[0, len(prompt) :].tolist(), drafts.rounds

    base = greedy_generate(spec, prompt, new).tokens
    generation = speculative_generate(spec, ours, prompt, new)
    tokens, theirs = reference_run()
    assert tokens == generation.tokens == base  # lossless
    whole, total = 0, 0  # rounds in which both loops draft a whole block (the reference cuts the last ones)
    while whole < len(generation.rounds) and total + B <= new:
        total, whole = total + generation.rounds[whole].committed, whole + 1
    assert whole >= 4 and theirs[:whole] == mine.rounds[:whole]
    config_file = tmp_path / "d" / "config.json"
    config = json.loads(config_file.read_text())
    del config["dflash_config"]["input_embedding_scale"]
    config_file.write_text(json.dumps(config))
    assert reference_run()[1][:whole] != mine.rounds[:whole]  # the raw rows draft something else
