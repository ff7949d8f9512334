"""Capture on tiny random Qwen3 and Qwen3.5 (hybrid Gated DeltaNet) models, against transformers:
hooks == output_hidden_states[i+1]; top-1 == model(...).logits.argmax; log-probs == log_softmax of
the full logits; padding never changes a sample's values; NaN/Inf flags are per sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from extract.batching import HostBatch
from extract.capture import Capturer, capture, final_topk, sample_views
from target.head import known_scalings
from target.load import reach_text_parts
from tests.extract.conftest import build_model, qwen35_text_config

MODELS = ["qwen3_model", "qwen35_model"]


def reference(model, ids_1T):
    with torch.no_grad():
        return model(ids_1T, output_hidden_states=True, use_cache=False)


@pytest.mark.parametrize("model_name", MODELS)
def test_hooks_equal_output_hidden_states_plus_one(request, model_name):
    model = request.getfixturevalue(model_name)
    target = reach_text_parts(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 37))
    layer_ids = list(range(target.num_layers - 1))  # every layer but the last (see the next test)
    got = capture(target, ids, [37], layer_ids, topk=4)
    ref = reference(model, ids)
    assert len(ref.hidden_states) == target.num_layers + 1
    for slot, layer_id in enumerate(layer_ids):
        assert torch.equal(got.taps[slot], ref.hidden_states[layer_id + 1]), layer_id
        if layer_id > 0:
            assert not torch.equal(got.taps[slot], ref.hidden_states[layer_id])  # an off-by-one would show


def test_last_layer_tap_is_the_raw_output_and_final_logits_use_the_normed_state(qwen35_model):
    """HF replaces hidden_states[L] by the final-normed state; the hook keeps the raw output, and
    the stored logits come from final_norm(raw last layer) -> lm_head of the same forward."""
    target = reach_text_parts(qwen35_model)
    L = target.num_layers
    ids = torch.randint(0, qwen35_model.config.vocab_size, (1, 20))
    got = capture(target, ids, [20], [L - 1], topk=3)
    ref = reference(qwen35_model, ids)
    assert torch.allclose(target.final_norm(got.taps[0]), ref.hidden_states[L], atol=1e-6)
    assert torch.equal(got.last_hidden, ref.hidden_states[L])


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_matches_full_logits(request, model_name, dtype):
    base = request.getfixturevalue(model_name)
    model = build_model(base.config, dtype=dtype) if dtype != torch.float32 else base
    target = reach_text_parts(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 50))
    got = capture(target, ids, [50], [1], topk=8, logits_chunk=7)  # several chunks, one ragged
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    assert torch.equal(got.topk_ids[:, 0].long(), logits.argmax(-1))
    full = torch.log_softmax(logits.float(), dim=-1)
    expected = full.topk(8, dim=-1).values
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 logits: ~3 significant digits
    assert torch.allclose(got.topk_logprobs, expected, atol=tol, rtol=tol)
    assert torch.allclose(full.gather(1, got.topk_ids.long()), got.topk_logprobs, atol=1e-5)
    assert (got.topk_logprobs[:, 1:] <= got.topk_logprobs[:, :-1]).all()
    assert (
        got.topk_ids.dtype == torch.int32 and got.topk_logprobs.dtype == torch.float32 and bool(got.logits_finite.all())
    )


def test_chunk_size_does_not_change_results(qwen3_model):
    target = reach_text_parts(qwen3_model)
    hidden = torch.randn(23, qwen3_model.config.hidden_size)
    one = final_topk(target, hidden, 5, chunk=1000)
    many = final_topk(target, hidden, 5, chunk=4)
    assert torch.equal(one[0], many[0]) and torch.allclose(one[1], many[1], atol=1e-6)


@pytest.mark.parametrize("model_name", MODELS)
def test_right_padded_batch_equals_unpadded_single_samples(request, model_name):
    """What the pipeline stores for a sample in a padded batch (bf16 taps, top-k) equals its own
    unpadded extraction: padding never leaks in (Qwen3.5's linear attention included)."""
    model = request.getfixturevalue(model_name)
    target = reach_text_parts(model)
    layer_ids, k = [0, 1, 2], 6
    lengths = [41, 29, 8, 41]
    seqs = [torch.randint(0, model.config.vocab_size, (n,)) for n in lengths]
    ids_BT = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_BT[b, : len(s)] = s
    host = HostBatch(
        n_taps=3, hidden_size=model.config.hidden_size, token_budget=256, topk=k, pin=False, hidden_split=3
    )
    inflight = Capturer(target, layer_ids, k, logits_chunk=16).launch(ids_BT, lengths, host)
    inflight.wait()
    for b, seq in enumerate(seqs):
        planes, topk_ids, topk_logprobs, hidden_ok, logits_ok = sample_views(inflight, b, inflight.offsets[b])
        hidden = planes.join()
        alone = capture(target, seq[None], [len(seq)], layer_ids, k)
        expected = torch.cat([t[0] for t in alone.taps], dim=-1).to(torch.bfloat16)
        assert hidden.shape == (len(seq), 3 * model.config.hidden_size) and hidden.dtype == np.uint16
        got = torch.from_numpy(hidden).view(torch.bfloat16).float()
        assert torch.allclose(got, expected.float(), atol=1e-2, rtol=1e-2)
        assert (topk_ids[:, 0] == alone.topk_ids[:, 0].numpy()).all()
        assert np.allclose(topk_logprobs, alone.topk_logprobs.numpy(), atol=1e-4)
        assert hidden_ok and logits_ok


@pytest.mark.parametrize("encoding,split", [("planes", 1), ("planes", 2), ("planes", 8), ("plain", 1)])
def test_hidden_layout_is_taps_concatenated_in_order(qwen3_model, encoding, split):
    """Both host layouts hold exactly the bf16 bits of the taps, concatenated in layer_ids order,
    whatever the column pieces (one per tap, or several per tap)."""
    target = reach_text_parts(qwen3_model)
    ids = torch.randint(0, qwen3_model.config.vocab_size, (1, 12))
    host = HostBatch(
        n_taps=2, hidden_size=64, token_budget=64, topk=2, pin=False, encoding=encoding, hidden_split=split
    )
    inflight = Capturer(target, [2, 0], 2, 8).launch(ids, [12], host)  # deliberately not sorted
    inflight.wait()
    view = sample_views(inflight, 0, 0)[0]
    if encoding == "planes":
        assert len(view.hi) == len(view.lo) == split and all(
            p.shape == (12, 128 // split) and p.flags.c_contiguous for p in view.hi
        )
    bits = view.join() if encoding == "planes" else view
    assert bits.dtype == np.uint16 and bits.shape == (12, 128)
    hidden = torch.from_numpy(bits).view(torch.bfloat16)
    ref = reference(qwen3_model, ids).hidden_states
    assert torch.equal(hidden[:, :64], ref[3][0].to(torch.bfloat16))
    assert torch.equal(hidden[:, 64:], ref[1][0].to(torch.bfloat16))


def test_nonfinite_flags_are_per_sample(qwen3_model):
    model = build_model(qwen3_model.config)
    target = reach_text_parts(model)
    poison = 7
    model.model.embed_tokens.weight[poison] = float("nan")
    ids = torch.randint(10, 50, (3, 10))
    ids[1, 4] = poison
    host = HostBatch(n_taps=1, hidden_size=64, token_budget=64, topk=2, pin=False)
    inflight = Capturer(target, [1], 2, 8).launch(ids, [10, 10, 10], host)
    inflight.wait()
    flags = [sample_views(inflight, b, inflight.offsets[b])[3:] for b in range(3)]
    assert flags == [(True, True), (False, False), (True, True)]
    # Infinite logits alone (finite hidden states) are caught too.
    model2 = build_model(qwen3_model.config)
    model2.lm_head.weight[3] = float("inf")
    inflight = Capturer(reach_text_parts(model2), [1], 2, 8).launch(ids[:1], [10], host)
    inflight.wait()
    assert sample_views(inflight, 0, 0)[3:] == (True, False)


def test_the_fallback_head_applies_the_known_scalings():
    class Cfg:
        final_logit_softcapping = 30.0
        model_type = "gemma2"

    logits = torch.tensor([[100.0, -100.0, 3.0]])
    assert torch.allclose(known_scalings(Cfg())(logits), torch.tanh(logits / 30.0) * 30.0)

    class Plain:
        model_type = "qwen3"

    assert torch.equal(known_scalings(Plain())(logits), logits)


def test_qwen35_multimodal_wrapper_reaches_the_text_decoder(chat_tokenizer):
    """The Qwen3.6 checkpoint class (Qwen3_5ForConditionalGeneration): capture through its
    language model equals the text-only class built from the same weights."""
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
    target = reach_text_parts(vlm)
    assert target.layers is vlm.model.language_model.layers and target.lm_head is vlm.lm_head
    ids = torch.randint(0, len(chat_tokenizer), (1, 16))
    got = capture(target, ids, [16], [0, 1, 2], topk=3)
    with torch.no_grad():
        ref = vlm(input_ids=ids, output_hidden_states=True, use_cache=False)
    for slot, layer_id in enumerate([0, 1, 2]):
        assert torch.equal(got.taps[slot], ref.hidden_states[layer_id + 1])
    assert torch.equal(got.topk_ids[:, 0].long(), ref.logits[0].argmax(-1))


def test_tied_logits_store_the_argmax_first():
    from extract.capture import ties_lowest_id_first

    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 5.0, 0.0]])
    values, ids = ties_lowest_id_first(*torch.topk(logits, 4, dim=-1))
    assert ids.tolist() == [[1, 3, 4, 2]] and values.tolist() == [[5.0, 5.0, 5.0, 3.0]]
    assert ids[0, 0] == logits.argmax(-1)[0]


def test_masked_vocabulary_is_fine_unless_it_reaches_the_top_k(qwen3_model):
    model = build_model(qwen3_model.config)
    target = reach_text_parts(model)
    hidden = torch.randn(4, 64)
    original = target.logits_fn
    target.logits_fn = lambda hidden: original(hidden).masked_fill(
        torch.arange(model.config.vocab_size) >= 10, float("-inf")
    )
    try:
        _, logprobs, finite = final_topk(target, hidden, 5, 8)  # 10 finite logits >= k: fine
        assert bool(finite.all()) and torch.isfinite(logprobs).all()
        _, _, finite = final_topk(target, hidden, 12, 8)  # -inf would be stored: flagged
        assert not bool(finite.any())
    finally:
        target.logits_fn = original
