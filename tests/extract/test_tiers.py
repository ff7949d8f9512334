"""Extraction straight into a storage tier (quantized and/or projected on the device, here the CPU):
every sample is what quantizing the lossless extraction gives, the reconstruction error is
recorded, a projected extraction fits P in a calibration pass and stores P·h, non-finite samples are
still rejected, and a changed projection refuses to resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shards import ShardDataset, verify_dataset
from shards.projection import load_projection
from shards.quant import decode_pieces, parse_encoding, quantize_bf16_bits
from target.load import reach_text_parts
from tests.extract.conftest import build_model, chat_record, mixed_corpus, write_lines
from tests.extract.test_pipeline import LAYERS, make_config, run


@pytest.fixture(scope="module")
def lossless(tmp_path_factory, loaded_target):
    root = tmp_path_factory.mktemp("tiers")
    corpus, _ = mixed_corpus(root / "corpus.jsonl")
    run(make_config(root / "lossless", corpus), loaded_target)
    return root, corpus


def by_id(root) -> dict:
    ds = ShardDataset(str(root))
    return {ds.compact(i).sample_id: i for i in range(len(ds))}, ds


@pytest.mark.parametrize("encoding", ["fp8", "nf4-g16"])
def test_quantized_extraction_equals_quantizing_the_lossless_one(lossless, loaded_target, encoding):
    root, corpus = lossless
    out = root / encoding
    run(make_config(out, corpus, hidden_encoding=encoding), loaded_target)
    assert verify_dataset(str(out)) == []
    ids, ds = by_id(out)
    reference_ids, reference = by_id(root / "lossless")
    assert ids.keys() == reference_ids.keys() and ds.manifest["format_version"] == 4 and ds.encoding == encoding
    for sid, i in ids.items():
        stored = ds.compact(i).hidden
        expected = quantize_bf16_bits(reference[reference_ids[sid]].hidden, encoding, len(LAYERS))
        for a, b in zip((*stored.codes, *stored.scales), (*expected.codes, *expected.scales), strict=True):
            assert np.array_equal(a, b), sid
    recorded = [tap["rel_rms"] for e in ds.shards for tap in e["reconstruction"]["taps"]]
    assert len(recorded) == len(LAYERS) * len(ds.shards) and 0 < max(recorded) < (0.05 if encoding == "fp8" else 0.2)


def test_projected_extraction_fits_p_in_a_calibration_pass_and_stores_p_times_h(lossless, loaded_target):
    root, corpus = lossless
    out = root / "projected"
    run(make_config(out, corpus, hidden_encoding="fp8", projection="pca:rank=16", calibration_samples=8), loaded_target)
    assert verify_dataset(str(out)) == []
    ds = ShardDataset(str(out))
    entry = ds.projection
    assert (
        entry["in_width"] == 3 * 64 and entry["out_width"] == ds.hidden_width == 3 * 16 and len(entry["explained"]) == 3
    )
    projection = load_projection(str(out), entry)
    assert projection.info["calibration"]["samples"] == 8
    reference_ids, reference = by_id(root / "lossless")
    spec = parse_encoding("fp8")
    for i in range(len(ds)):
        stored = ds.compact(i)
        h = torch.from_numpy(reference[reference_ids[stored.sample_id]].hidden).view(torch.bfloat16)
        z = projection.apply(h)
        pairs = [
            (torch.from_numpy(c), torch.from_numpy(s))
            for c, s in zip(stored.hidden.codes, stored.hidden.scales, strict=True)
        ]
        z_hat = decode_pieces(pairs, spec, torch.float32)
        assert torch.allclose(z_hat, z, rtol=0.07, atol=1e-3 * float(z.abs().max()))  # within an e4m3 step
    errors = [tap["rel_rms"] for e in ds.shards for tap in e["reconstruction"]["taps"]]
    assert all(0 < x < 1 for x in errors)
    with pytest.raises(
        ValueError, match="config key 'projection' is 'pca:rank=16' in the dataset but 'pca:rank=8' now"
    ):
        run(
            make_config(out, corpus, hidden_encoding="fp8", projection="pca:rank=8", calibration_samples=8),
            loaded_target,
        )


def test_nonfinite_samples_are_rejected_in_a_quantized_extraction(tmp_path, loaded_target, chat_tokenizer):
    import json
    import random

    model = build_model(loaded_target.model.config)
    poison = (
        chat_tokenizer.convert_tokens_to_ids("fox")
        if "fox" in chat_tokenizer.get_vocab()
        else chat_tokenizer.encode(" fox")[0]
    )
    model.model.embed_tokens.weight[poison] = float("nan")
    target = reach_text_parts(model, chat_tokenizer, path="")
    rng = random.Random(3)
    records = [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "the fox runs far away " * 3},
            ]
        }
    ]
    records += [chat_record(rng, 4, 20) for _ in range(3)]
    corpus = write_lines(tmp_path / "c.jsonl", records)
    summary = run(make_config(tmp_path / "out", corpus, hidden_encoding="fp8"), target)
    bad = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [b["reason"] for b in bad] == ["nonfinite_hidden"] and summary["samples"] == 3
    assert verify_dataset(str(tmp_path / "out")) == []


def test_tier_settings_are_checked_by_key(tmp_path):
    from common.config import ConfigError

    assert make_config(tmp_path, "c.jsonl", hidden_encoding="nf4").hidden_encoding == "nf4-g64"  # the stored name
    with pytest.raises(ConfigError, match="config key 'hidden_encoding': 'fp7' is not allowed"):
        make_config(tmp_path, "c.jsonl", hidden_encoding="fp7")
    with pytest.raises(ConfigError, match="config key 'projection': rank must be a positive integer"):
        make_config(tmp_path, "c.jsonl", projection="pca:rank=0")
    with pytest.raises(
        ConfigError, match="config key 'projection': rank 40 per tap is not a multiple of nf4-g64's group size 64"
    ):
        make_config(tmp_path, "c.jsonl", hidden_encoding="nf4", projection="pca:rank=40")


def test_two_ranks_share_rank_0s_projection_and_merge(lossless, loaded_target, tmp_path):
    from extract.ranks import Ranks

    root, corpus = lossless
    out = tmp_path / "out"
    cfg = make_config(out, corpus, hidden_encoding="nf4-g16", projection="pca:rank=16", calibration_samples=6)
    first = run(cfg, loaded_target, Ranks(rank=0, world=2))  # rank 0 fits P in its calibration pass
    assert first["partial"]
    final = run(cfg, loaded_target, Ranks(rank=1, world=2))  # rank 1 takes it from rank 0's manifest
    assert final["complete"] and verify_dataset(str(out)) == []
    ds = ShardDataset(str(out))
    assert ds.projection["out_width"] == 48 and {e["encoding"] for e in ds.shards} == {"nf4-g16"}
    assert len(ds) == len(ShardDataset(str(root / "lossless")))
