"""Packed extraction (one row of several samples, no padding): what it stores per sample equals the
sample's own extraction on a target whose every layer keeps packed samples apart, and packing is
refused, with the reason, where a kernel would let one sample see another (the torch Gated DeltaNet).
fla's convolution, rebound in place of transformers' reference one, is checked through a stand-in
kernel with fla's interface (fla's own Triton kernel runs in the GPU tier)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extract.batching import HostBatch, collate_packed, plan_packed_micro_batches
from extract.capture import Capturer, capture, sample_views
from target import kernel_routing
from target.kernel_routing import conv_via_fla, install_fla_convolution, restore_reference_convolution
from target.load import reach_text_parts
from target.packing import packed_arguments, packing_probe, packing_refusal


def test_packed_rows_hold_every_sample_once_within_the_budget():
    lengths = [7, 30, 12, 30, 5, 19, 1, 25]
    rows = plan_packed_micro_batches(lengths, 40)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 40 for row in rows)
    assert len(rows) == 4  # 129 tokens: first fit fills 30+7+1, 30+5, 25+12, 19 (ties in input order)
    assert rows == plan_packed_micro_batches(lengths, 40)  # a pure function of the lengths
    with pytest.raises(ValueError, match="exceeds tokens_per_batch"):
        plan_packed_micro_batches([41], 40)


def test_packed_arguments_restart_positions_per_sample():
    args = packed_arguments([3, 1, 2], "cpu")
    assert args["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert args["cu_seq_lens_q"].tolist() == [0, 3, 4, 6] and args["cu_seq_lens_q"].dtype == torch.int32
    assert args["max_length_q"] == args["max_length_k"] == 3


def test_packed_row_equals_each_sample_extracted_alone(qwen3_model):
    """Taps (bf16, as stored) and top-k of every sample of one packed row equal that sample's own
    extraction: the attention layers' document mask keeps samples apart, positions restart."""
    target = reach_text_parts(qwen3_model)
    assert packing_refusal(target) is None
    layer_ids, k = [0, 1, 2], 6
    seqs = [torch.randint(0, qwen3_model.config.vocab_size, (n,)) for n in (41, 29, 8, 1, 33)]
    ids_1N, lengths = collate_packed(seqs)
    host = HostBatch(
        n_taps=3, hidden_size=qwen3_model.config.hidden_size, token_budget=256, topk=k, pin=False, hidden_split=3
    )
    inflight = Capturer(target, layer_ids, k, logits_chunk=16).launch(ids_1N, lengths, host, packed=True)
    inflight.wait()
    whole = capture(target, ids_1N, lengths, layer_ids, k, packed=True)
    for b, seq in enumerate(seqs):
        planes, topk_ids, topk_logprobs, hidden_ok, logits_ok = sample_views(inflight, b, inflight.offsets[b])
        alone = capture(target, seq[None], [len(seq)], layer_ids, k)
        expected = torch.cat([t[0] for t in alone.taps], dim=-1).to(torch.bfloat16).float()
        got = torch.from_numpy(planes.join()).view(torch.bfloat16).float()
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-2, rtol=1e-2)
        assert (topk_ids[:, 0] == alone.topk_ids[:, 0].numpy()).all()
        assert np.allclose(topk_logprobs, alone.topk_logprobs.numpy(), atol=1e-4)
        assert hidden_ok and logits_ok
        at = inflight.offsets[b]
        assert torch.allclose(whole.taps[1][0, at : at + len(seq)], alone.taps[1][0], atol=1e-5)
    # The same row without the boundaries is one long sequence: later samples then differ.
    unpacked = capture(target, ids_1N, [ids_1N.shape[1]], layer_ids, k)
    second = slice(lengths[0], lengths[0] + lengths[1])
    assert not torch.allclose(unpacked.taps[1][0, second], whole.taps[1][0, second], atol=1e-3)


def test_packing_is_refused_where_the_torch_gated_deltanet_would_run(qwen35_model):
    """On the CPU the Gated DeltaNet's torch convolution and delta rule drop the boundaries: refused,
    saying why; a rebound convolution asked for packed input on the CPU raises instead of mixing."""
    reason = packing_refusal(reach_text_parts(qwen35_model))
    assert reason is not None and "Gated DeltaNet" in reason and "cpu" in reason
    conv = conv_via_fla(lambda h, w, b=None, activation=None: h, lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    x = torch.randn(1, 4, 6)
    assert conv(x, torch.randn(4, 3)) is x  # unpacked CPU tensors go to the reference
    with pytest.raises(ValueError, match="packed sequences need fla's CUDA kernel"):
        conv(x, torch.randn(4, 3), cu_seq_lens_q=torch.tensor([0, 2, 6], dtype=torch.int32))


def reference_conv(x_BDT, weight_DW, bias=None, activation=None):
    out = F.conv1d(x_BDT, weight_DW.unsqueeze(1), bias, padding=weight_DW.shape[-1] - 1, groups=x_BDT.shape[1])
    out = out[..., : x_BDT.shape[-1]]
    return F.silu(out) if activation in ("silu", "swish") else out


def stand_in_fla_conv(calls):
    """fla's interface (x [B, T, D], weight [D, W], cu_seqlens with B = 1) -> (y [B, T, D], state)."""

    def causal_conv1d(x, weight=None, bias=None, activation=None, cu_seqlens=None, **_):
        calls.append(None if cu_seqlens is None else cu_seqlens.tolist())
        assert x.ndim == 3 and x.is_contiguous() and weight.ndim == 2
        cuts = [0, x.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        parts = [
            reference_conv(x[:, a:b].transpose(1, 2), weight, bias, activation).transpose(1, 2)
            for a, b in itertools.pairwise(cuts)
        ]
        return torch.cat(parts, dim=1), None

    return causal_conv1d


def test_rebound_convolution_passes_layout_and_boundaries_to_the_kernel(monkeypatch, qwen35_model):
    """Through the rebound module function a packed row's convolution restarts at every boundary, in
    fla's layout, and an unpacked call equals transformers' reference convolution."""
    calls: list = []
    monkeypatch.setattr(kernel_routing, "_kernel_takes", lambda tensor: True)  # the CPU stands in for CUDA here
    module = __import__(type(qwen35_model.model.layers[0].linear_attn).__module__, fromlist=["x"])
    original = module.causal_conv1d_fn
    monkeypatch.setattr(module, "causal_conv1d_fn", original)  # restored after the test
    assert install_fla_convolution(qwen35_model, kernel=stand_in_fla_conv(calls)) == [
        f"{module.__name__}.causal_conv1d_fn"
    ]
    assert install_fla_convolution(qwen35_model, kernel=stand_in_fla_conv(calls)) == []  # once
    conv = module.causal_conv1d_fn
    x_BDT, weight, bias = torch.randn(1, 8, 20), torch.randn(8, 4), torch.randn(8)
    assert torch.allclose(conv(x_BDT, weight, bias, activation="silu"), reference_conv(x_BDT, weight, bias, "silu"))
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    packed = conv(x_BDT, weight, bias, activation="silu", cu_seq_lens_q=cu)
    for a, b in itertools.pairwise(cu.tolist()):
        alone = reference_conv(x_BDT[..., a:b], weight, bias, "silu")
        assert torch.allclose(packed[..., a:b], alone, atol=1e-6)
    assert calls == [None, cu.tolist()]
    assert restore_reference_convolution(qwen35_model) == [f"{module.__name__}.causal_conv1d_fn"]
    assert module.causal_conv1d_fn is original  # a benchmark's baseline runs the reference again


def test_a_packed_extraction_holds_the_unpacked_datasets_samples(tmp_path, loaded_target, qwen35_model):
    """`packing=true` end to end: the same samples, rejects and counts as the padded extraction, every
    sample's stored taps and top-k equal within the tolerance padding already has; a target whose
    layers cannot keep packed samples apart is refused before anything is written."""
    from extract import pipeline
    from extract.ranks import Ranks
    from extract.summary import format_summary
    from shards import ShardDataset, verify_dataset
    from tests.extract.conftest import mixed_corpus
    from tests.extract.test_pipeline import make_config

    corpus, expected = mixed_corpus(tmp_path / "corpus.jsonl")
    padded = pipeline.run(make_config(tmp_path / "padded", corpus), target=loaded_target, ranks=Ranks())[None]
    packed = pipeline.run(
        dataclasses.replace(make_config(tmp_path / "packed", corpus), packing=True), target=loaded_target, ranks=Ranks()
    )[None]
    assert verify_dataset(str(tmp_path / "packed")) == []
    assert packed["samples"] == padded["samples"] == 24 and packed["rejects"] == padded["rejects"] == expected
    assert packed["this_run"]["pad_efficiency"] == 1.0 and padded["this_run"]["pad_efficiency"] < 1.0
    for run in (packed, padded):  # real tokens per forward against the budget, counted per launched batch
        fill = run["this_run"]["tokens"] / run["this_run"]["budget_tokens"]
        assert run["this_run"]["batch_fill"] == fill and 0 < fill <= 1
        assert f"micro-batches {fill:.1%} full" in format_summary(run)
    a = {s.sample_id: s for s in ShardDataset(str(tmp_path / "padded"))}
    b = {s.sample_id: s for s in ShardDataset(str(tmp_path / "packed"))}
    assert a.keys() == b.keys()
    for sid in a:
        assert np.array_equal(a[sid].input_ids, b[sid].input_ids)
        ha = torch.from_numpy(a[sid].hidden.view(np.uint16).copy()).view(torch.bfloat16).float()
        hb = torch.from_numpy(b[sid].hidden.view(np.uint16).copy()).view(torch.bfloat16).float()
        assert torch.allclose(ha, hb, atol=1e-2, rtol=1e-2), sid
        assert np.array_equal(a[sid].topk_ids[:, 0], b[sid].topk_ids[:, 0]), sid
        assert np.allclose(a[sid].topk_logprobs, b[sid].topk_logprobs, atol=1e-4), sid
    with pytest.raises(ValueError, match="packing: refused for this target: its Gated DeltaNet layers"):
        cfg = dataclasses.replace(make_config(tmp_path / "hybrid", corpus), packing=True, layer_ids=[0, 1])
        pipeline.run(cfg, target=reach_text_parts(qwen35_model, loaded_target.tokenizer), ranks=Ranks())
    assert not (tmp_path / "hybrid" / "manifest.json").exists()


def test_the_probe_catches_a_model_whose_attention_ignores_the_boundaries(qwen3_model):
    """A decoder whose mask builder never sees the position ids passes the structural check but
    mixes packed samples: the probe (two rows that share their last sample) refuses it."""
    target = reach_text_parts(qwen3_model)
    assert packing_probe(target) is None  # Qwen3 keeps packed samples apart

    class NoDocumentMask(torch.nn.Module):
        """The decoder with the position ids withheld from it: plain causal attention over the row."""

        def __init__(self, decoder):
            super().__init__()
            self.inner = decoder

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, input_ids, position_ids=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    leaky = dataclasses.replace(target, decoder=NoDocumentMask(target.decoder))
    reason = packing_probe(leaky)
    assert reason is not None and "changed with the sample before it" in reason


def test_packing_with_a_storage_tier_is_refused_up_front(tmp_path):
    from common.config import ConfigError
    from tests.extract.test_pipeline import make_config

    with pytest.raises(ConfigError, match="config key 'packing': not with a storage tier"):
        cfg = make_config(tmp_path / "out", tmp_path / "c.jsonl", hidden_encoding="fp8")
        dataclasses.replace(cfg, packing=True).check()


def test_packed_sdpa_runs_each_sample_causally_and_equals_it_alone(qwen3_model, monkeypatch):
    """With `use_packed_sdpa` a packed row's attention is SDPA once per sample, causal and maskless
    (the flash kernel's case), never over the row's dense N x N mask; the stored values still equal
    each sample's own extraction, and an unpacked forward is transformers' SDPA unchanged."""
    from target.packing import PACKED_SDPA, use_packed_sdpa

    target = reach_text_parts(qwen3_model)
    seqs = [torch.randint(0, qwen3_model.config.vocab_size, (n,)) for n in (23, 40, 5)]
    ids_1N, lengths = collate_packed(seqs)
    dense = capture(target, ids_1N, lengths, [1, 3], 4, packed=True)  # through the row's document mask
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.shape[-2], attn_mask is None, is_causal))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    restore = use_packed_sdpa(target)
    try:
        assert restore is not None and qwen3_model.config._attn_implementation == PACKED_SDPA
        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        per_sample = capture(target, ids_1N, lengths, [1, 3], 4, packed=True)
        n_layers = qwen3_model.config.num_hidden_layers
        assert calls == [(n, True, True) for _ in range(n_layers) for n in lengths]
        assert packing_probe(target) is None
        calls.clear()
        alone = capture(target, seqs[1][None], [lengths[1]], [1, 3], 4)
        assert len(calls) == n_layers  # unpacked: one SDPA call per layer, as transformers makes it
    finally:
        restore()  # the model is shared with other tests
    assert qwen3_model.config._attn_implementation == "sdpa"
    for a, b in zip(dense.taps, per_sample.taps, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    at = lengths[0]
    assert torch.allclose(per_sample.taps[0][0, at : at + lengths[1]], alone.taps[0][0], atol=1e-5)
    assert torch.equal(per_sample.topk_ids, dense.topk_ids)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_packed_sdpa_keeps_sliding_windows(family):
    """Sliding-window models (Mistral passes the window to the attention function, Qwen2 sets it on the
    module): packed per-sample SDPA still applies the window, so each sample equals its own extraction."""
    from transformers import MistralConfig, Qwen2Config

    from target.packing import use_packed_sdpa
    from tests.extract.conftest import build_model

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=8,
    )
    if family == "mistral":
        config = MistralConfig(**common)
    else:
        config = Qwen2Config(**common, use_sliding_window=True, max_window_layers=0)
    target = reach_text_parts(build_model(config))
    seqs = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (20, 30, 1, 13)]
    ids_1N, lengths = collate_packed(seqs)
    restore = use_packed_sdpa(target)
    assert restore is not None
    try:
        packed = capture(target, ids_1N, lengths, [0, 1], 4, packed=True)
    finally:
        restore()
    at = 0
    for seq in seqs:
        alone = capture(target, seq[None], [len(seq)], [0, 1], 4)
        assert torch.allclose(packed.taps[1][0, at : at + len(seq)], alone.taps[1][0], atol=1e-5), len(seq)
        at += len(seq)
