"""Quantized encodings (storage tiers, format version 4): error bounds of each encoding, the zero
token, massive-activation channels, NaN/Inf refused, and the shard round trip through the writer
and reader (the lossless path unchanged)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.synthetic import _tap_structure, realistic_hidden
from shards import ShardDataset, ShardWriter, verify_dataset
from shards.manifest import check_manifest, read_index
from shards.quant import (
    QuantizedHidden,
    decode_piece,
    e4m3_half_step,
    encode_piece,
    fp8_decode,
    fp8_encode,
    parse_encoding,
    quantize_bf16_bits,
)
from shards.schema import ShardFormatError
from tests.shards.synth import TOPK, WIDTH, make_sample, provenance


def massive_activation_values(n_tokens=64, n_taps=2, hidden=256, seed=0) -> torch.Tensor:
    """bf16 features with massive-activation channels (30-200x the tap scale, 10x more on token 0)
    and an all-zero token, as float32 [T, n_taps * hidden]."""
    rng = np.random.default_rng(seed)
    bits = realistic_hidden(rng, n_tokens, _tap_structure(rng, n_taps, hidden))
    values = torch.from_numpy(bits).view(torch.bfloat16).float()
    values[5] = 0.0
    return values


def test_fp8_error_is_within_half_an_e4m3_step_of_the_scaled_value():
    x = massive_activation_values()
    x[7, :3] = torch.tensor([1e-30, -3e-8, 2.5e4])  # tiny and huge values in one token
    codes, exponents = fp8_encode(x)
    scale = torch.ldexp(torch.ones(()), exponents.float())
    x_hat = fp8_decode(codes, exponents, torch.float32)
    assert torch.all((x - x_hat).abs() / scale <= e4m3_half_step(x / scale))
    assert torch.all((x / scale).abs() <= 448.0)  # the power-of-two scale never clips
    assert torch.all((x / scale).abs().amax(-1)[x.abs().amax(-1) > 0] > 224.0)  # and uses the top octave
    assert torch.equal(fp8_decode(codes, exponents, torch.bfloat16).float(), x_hat)  # bf16 holds e4m3 x 2^e exactly


@pytest.mark.parametrize("name", ["int4-g16", "int4-g64", "nf4-g16", "nf4-g64"])
def test_4bit_error_is_within_half_the_largest_level_gap_times_the_group_scale(name):
    spec = parse_encoding(name)
    x = massive_activation_values()
    codes, scales = encode_piece(x, spec)
    x_hat = decode_piece(codes, scales, spec, torch.float32)
    s = scales.view(torch.bfloat16).float().repeat_interleave(spec.group_size, dim=-1)
    bound = s * spec.max_error_over_scale()
    assert torch.all((x - x_hat).abs() <= bound * (1 + 1e-6) + 1e-30)
    assert spec.max_error_over_scale() == pytest.approx(1 / 14 if spec.kind == "int4" else 0.1519, abs=1e-4)


@pytest.mark.parametrize("name", ["fp8", "int4-g64", "nf4-g64"])
def test_all_zero_token_decodes_to_exact_zeros(name):
    spec = parse_encoding(name)
    x = torch.zeros(3, 128)
    x[1] = torch.linspace(-2, 2, 128)
    codes, scales = encode_piece(x, spec)
    x_hat = decode_piece(codes, scales, spec, torch.float32)
    assert torch.equal(x_hat[0], torch.zeros(128)) and torch.equal(x_hat[2], torch.zeros(128))


def test_massive_activation_channels_cost_fp8_little_but_zero_their_4bit_group():
    """What the massive channels do (measured in docs/benchmarks-log-2026-11-30-to-2026-12-04.md,
    "Storage tiers"): fp8's per-token scale is set by them, yet e4m3's exponent keeps every other channel at ~3%
    relative error; a 4-bit group that holds one has its scale set by it, and its ordinary channels decode to ~0
    (relative error ~1)."""
    x = massive_activation_values(n_tokens=128, n_taps=1, hidden=512)
    massive = x.abs().mean(0).topk(4).indices
    rest = torch.ones(512, dtype=torch.bool)
    rest[massive] = False

    def channel_rel_rms(x_hat):
        return ((x - x_hat).pow(2).sum(0) / x.pow(2).sum(0).clamp_min(1e-30)).sqrt()

    fp8 = channel_rel_rms(decode_piece(*encode_piece(x, parse_encoding("fp8")), parse_encoding("fp8"), torch.float32))
    assert float(fp8[rest].max()) < 0.05
    spec = parse_encoding("nf4-g64")
    nf4 = channel_rel_rms(decode_piece(*encode_piece(x, spec), spec, torch.float32))
    shares_group = torch.zeros(512, dtype=torch.bool)
    for channel in massive.tolist():
        shares_group[channel // 64 * 64 : channel // 64 * 64 + 64] = True
    assert float(nf4[shares_group & rest].median()) > 0.5  # the group's ordinary channels are lost
    assert float(nf4[~shares_group].median()) < 0.2  # groups without one keep most of it


@pytest.mark.parametrize("name", ["fp8", "nf4-g16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_values_are_refused_at_encode(name, bad):
    x = torch.randn(4, 32)
    x[2, 5] = bad
    with pytest.raises(ValueError, match=r"NaN/Inf .*index \[2"):
        encode_piece(x, parse_encoding(name))


def test_writer_refuses_nonfinite_hidden_naming_the_sample(tmp_path):
    sample = make_sample(0)
    sample.hidden[1, 3] = 0x7FC0  # bf16 NaN
    with ShardWriter(
        tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK, hidden_encoding="fp8"
    ) as w:
        with pytest.raises(ValueError, match=rf"sample '{sample.sample_id}': field 'hidden': .*NaN/Inf"):
            w.write(sample)
        w.write(make_sample(1))
    assert len(ShardDataset(tmp_path / "ds")) == 1


@pytest.mark.parametrize("name", ["fp8", "int4", "nf4-g16"])
def test_quantized_round_trip_through_writer_and_reader(tmp_path, name):
    width, taps = 128, 2
    prov = provenance(
        target={"name_or_path": "synthetic", "num_layers": 4, "hidden_size": width // taps, "vocab_size": 1000}
    )
    samples = [make_sample(i, width=width) for i in range(6)]
    root = tmp_path / "ds"
    with ShardWriter(root, provenance=prov, hidden_width=width, topk=TOPK, hidden_encoding=name, shard_bytes=2000) as w:
        for sample in samples:
            w.write(sample)
    ds = ShardDataset(root)
    manifest = ds.manifest
    assert manifest["format_version"] == 4 and manifest["encoding"] == parse_encoding(name).name
    assert {e["encoding"] for e in manifest["shards"]} == {manifest["encoding"]} and len(manifest["shards"]) > 1
    for i, sample in enumerate(samples):
        expected = quantize_bf16_bits(sample.hidden, manifest["encoding"], taps)
        assert np.array_equal(ds[i].hidden, expected.bf16_bits())
        compact = ds.compact(i).hidden
        assert isinstance(compact, QuantizedHidden)
        for a, b in zip((*compact.codes, *compact.scales), (*expected.codes, *expected.scales), strict=True):
            assert np.array_equal(a, b)
        np.testing.assert_array_equal(ds.torch(i)["hidden"].view(torch.uint16).numpy(), expected.bf16_bits())
    assert verify_dataset(root) == []
    recorded = [tap["rel_rms"] for e in manifest["shards"] for tap in e["reconstruction"]["taps"]]
    assert len(recorded) == taps * len(manifest["shards"]) and 0 < max(recorded) < (0.05 if name == "fp8" else 0.2)


def test_lossless_datasets_are_still_format_version_3(tmp_path):
    with ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK) as w:
        w.write(make_sample(0))
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and "projection" not in manifest
    assert "reconstruction" not in manifest["shards"][0]


def test_a_quantized_encoding_in_an_older_format_version_is_refused():
    manifest = {
        "format": "dflash-shards",
        "format_version": 3,
        "encoding": "fp8",
        "hidden_width": 16,
        "topk": 4,
        "counts": {},
        "shards": [],
        "provenance": {},
    }
    with pytest.raises(ShardFormatError, match="storage tiers are version 4"):
        check_manifest(manifest, "m.json")


def test_writer_refuses_group_size_that_does_not_divide_the_pieces(tmp_path):
    with pytest.raises(ValueError, match="hidden_encoding: nf4-g16 needs column pieces"):
        ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK, hidden_encoding="nf4-g16")


@pytest.mark.parametrize("name", ["fp8", "int4-g16", "nf4-g16"])
def test_verify_catches_a_damaged_byte_in_every_encoding(tmp_path, name):
    width = 64
    prov = provenance(
        target={"name_or_path": "synthetic", "num_layers": 4, "hidden_size": width // 2, "vocab_size": 1000}
    )
    root = tmp_path / "ds"
    with ShardWriter(root, provenance=prov, hidden_width=width, topk=TOPK, hidden_encoding=name) as w:
        for i in range(3):
            w.write(make_sample(i, n_tokens=30, width=width))
    entry = ShardDataset(root).shards[0]
    index = read_index(ShardDataset(root).fs, str(root), entry)
    offset, length = int(index.column("offset")[1].as_py()), int(index.column("length")[1].as_py())
    path = root / entry["file"]
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    problems = verify_dataset(root, checksums=False)
    assert problems and any(p.sample_id == index.column("sample_id")[1].as_py() for p in problems)
    with pytest.raises(ShardFormatError, match="row 1"):
        ShardDataset(root)[1]


def test_verify_reports_nan_codes_written_without_the_finite_check(tmp_path):
    width = 64
    prov = provenance(
        target={"name_or_path": "synthetic", "num_layers": 4, "hidden_size": width // 2, "vocab_size": 1000}
    )
    sample = make_sample(0, width=width)
    quantized = quantize_bf16_bits(sample.hidden, "fp8", 2)
    quantized.codes[1][2, 7] = 0x7F  # e4m3 NaN
    sample.hidden = quantized
    root = tmp_path / "ds"
    with ShardWriter(
        root, provenance=prov, hidden_width=width, topk=TOPK, hidden_encoding="fp8", reject_nonfinite=False
    ) as w:
        w.write(sample)
    assert [p.message for p in verify_dataset(root)] == ["hidden has 1 NaN/Inf values"]
