"""A target whose input embedding module scales its rows (Gemma: x sqrt(hidden_size)) gets the same
drafts from training's embedding (`TargetHead.embed`, which offline evaluation uses too), from our
speculative decoding (`SpecTarget.embed`) and from the export's model driven as z-lab's loop drives it
(`target.model.embed_tokens(block)`, docs/serving.md "Embedding and head"); the raw table rows
would give other drafts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from train.drafter_config import DrafterConfig
from train.export_format.layout import export_drafter, load_exported, target_warnings
from train.model import DFlashDrafter, TargetHead
from train.serve.decoding import DFlashProposer
from train.serve.spec_target import SpecTarget

V, B, MASK, LAYER_IDS = 64, 8, 63, [0, 1]


def test_training_decoding_and_the_export_embed_a_gemma_block_alike(tmp_path):
    torch.manual_seed(0)
    target_config = Gemma3TextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=None,
    )
    model = Gemma3ForCausalLM(target_config).eval()
    model.save_pretrained(tmp_path / "target")
    head = TargetHead.from_pretrained(str(tmp_path / "target"))
    assert head.embed_scale == float(torch.tensor(32**0.5))  # the module's float32 sqrt(hidden)

    cfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        target_layer_ids=LAYER_IDS,
        num_target_layers=3,
        mask_token_id=MASK,
        block_size=B,
        rope_theta=10000.0,
    )
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


def test_the_export_warns_that_vllm_feeds_a_scaled_embeddings_raw_rows(tmp_path):
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    Gemma3ForCausalLM(Gemma3TextConfig(**small, head_dim=8)).save_pretrained(tmp_path / "gemma")
    LlamaForCausalLM(LlamaConfig(**small)).save_pretrained(tmp_path / "llama")
    (warning,) = target_warnings(str(tmp_path / "gemma"))
    assert "5.65685" in warning and "vLLM" in warning
    assert target_warnings(str(tmp_path / "llama")) == [] and target_warnings(None) == []
