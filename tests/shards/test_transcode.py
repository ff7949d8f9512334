"""`python -m shards transcode`: a storage tier derived from a lossless dataset holds every sample
once, quantized exactly as the encoder does, names its source and transform, resumes after a
SIGKILL, and refuses to resume into a different transform."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import load_config
from common.locks import LockedError
from shards import ShardDataset, ShardWriter, verify_dataset
from shards.__main__ import main as shards_main
from shards.projection import load_projection
from shards.quant import quantize_bf16_bits
from shards.transcode import TranscodeConfig, transcode
from tests.shards.synth import TOPK, make_sample, provenance

REPO = Path(__file__).resolve().parents[2]
WIDTH, TAPS = 64, 2


def lossless(root: Path, n: int) -> Path:
    prov = provenance(
        target={"name_or_path": "synthetic", "num_layers": 4, "hidden_size": WIDTH // TAPS, "vocab_size": 1000}
    )
    with ShardWriter(root, provenance=prov, hidden_width=WIDTH, topk=TOPK, shard_bytes=20_000) as w:
        for i in range(n):
            w.write(make_sample(i, width=WIDTH))
    return root


def settings(*words) -> TranscodeConfig:
    return load_config(TranscodeConfig, None, ["progress=false", *words])


def test_fp8_transcode_holds_every_sample_quantized_and_names_its_source(tmp_path):
    src = lossless(tmp_path / "src", 12)
    result = transcode(str(src), str(tmp_path / "dst"), settings("encoding=fp8", "shard_bytes=3000"))
    assert result["problems"] == [] and result["samples"] == 12
    source, out = ShardDataset(src), ShardDataset(tmp_path / "dst")
    assert out.index.column("sample_id").to_pylist() == source.index.column("sample_id").to_pylist()
    for i in range(len(source)):
        expected = quantize_bf16_bits(source[i].hidden, "fp8", TAPS)
        assert np.array_equal(out[i].hidden, expected.bf16_bits())
        assert np.array_equal(out[i].topk_ids, source[i].topk_ids) and np.array_equal(
            out[i].input_ids, source[i].input_ids
        )
    transform = out.provenance.transform
    assert transform["encoding"] == "fp8" and transform["projection"] is None
    assert transform["source"]["path"] == str(src) and transform["source"]["samples"] == 12
    assert out.provenance.target == source.provenance.target
    assert {**source.manifest["provenance"], "transform": transform} == out.manifest["provenance"]  # as stored
    assert all("reconstruction" in e for e in out.shards)


def test_projected_transcode_stores_p_times_h_and_its_projection(tmp_path):
    src = lossless(tmp_path / "src", 10)
    transcode(
        str(src), str(tmp_path / "dst"), settings("encoding=planes", "projection=pca:rank=8", "calibration_samples=4")
    )
    out = ShardDataset(tmp_path / "dst")
    projection = load_projection(str(tmp_path / "dst"), out.projection)
    assert out.hidden_width == 16 == out.projection["out_width"] and out.projection["in_width"] == WIDTH
    assert out.manifest["format_version"] == 4 and verify_dataset(tmp_path / "dst") == []
    h = torch.from_numpy(ShardDataset(src)[3].hidden).view(torch.bfloat16)
    z = torch.from_numpy(out[3].hidden).view(torch.bfloat16)
    assert torch.equal(z, projection.apply(h).to(torch.bfloat16))
    # Reusing the file gives the same projection (same checksum), so drafters trained on both agree.
    transcode(
        str(src),
        str(tmp_path / "dst2"),
        settings("encoding=fp8", f"projection={tmp_path / 'dst' / 'projection.safetensors'}"),
    )
    assert ShardDataset(tmp_path / "dst2").projection["checksum"] == out.projection["checksum"]


def test_resume_refuses_a_different_transform(tmp_path):
    src = lossless(tmp_path / "src", 4)
    transcode(str(src), str(tmp_path / "dst"), settings("encoding=fp8"))
    with pytest.raises(ValueError, match="encoding: 'fp8' vs 'nf4-g16'"):
        transcode(str(src), str(tmp_path / "dst"), settings("encoding=nf4-g16"))


def test_cli_reports_bad_settings_by_key(tmp_path, capsys):
    src = lossless(tmp_path / "src", 2)
    assert shards_main(["transcode", str(src), str(tmp_path / "dst"), "encoding=fp7"]) == 2
    assert "config key 'encoding'" in capsys.readouterr().err
    assert shards_main(["transcode", str(src), str(tmp_path / "dst"), "encoding=fp8", "projection=pca:rank=0"]) == 2
    assert "config key 'projection'" in capsys.readouterr().err


def test_sigkill_midway_then_rerun_leaves_a_verified_dataset_with_every_sample_once(tmp_path):
    n = 120
    src = lossless(tmp_path / "src", n)
    dst = tmp_path / "dst"
    command = [
        sys.executable,
        "-m",
        "shards",
        "transcode",
        str(src),
        str(dst),
        "encoding=nf4-g16",
        "shard_bytes=6000",
        "threads=1",
        "progress=false",
        "verify=false",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    manifest = dst / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline and child.poll() is None:
        try:
            if len(json.loads(manifest.read_text())["shards"]) >= 3:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL, f"transcode finished before the kill: {child.stderr.read()}"
    killed = ShardDataset(dst)
    assert 0 < len(killed) < n and not killed.manifest["complete"]
    assert verify_dataset(dst) == []
    rerun = subprocess.run(command[:-1], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "already there: resumed" in rerun.stdout and "verified   OK" in rerun.stdout
    out, source = ShardDataset(dst), ShardDataset(src)
    ids = out.index.column("sample_id").to_pylist()
    assert ids == source.index.column("sample_id").to_pylist() and len(set(ids)) == n
    assert out.manifest["complete"] and verify_dataset(dst) == []
    for i in (0, len(killed) - 1, len(killed), n - 1):
        assert np.array_equal(out[i].hidden, quantize_bf16_bits(source[i].hidden, "nf4-g16", TAPS).bf16_bits())


def test_a_second_writer_of_dst_is_refused_before_the_projection_is_fitted(tmp_path):
    """transcode holds DST's manifest lock (the one every ShardWriter of DST takes) from before the
    projection is fitted and saved: while another process writes DST, nothing is touched."""
    src = lossless(tmp_path / "src", 4)
    dst = tmp_path / "dst"
    dst.mkdir()
    code = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from common import io; from shards.manifest import "
        "lock_manifest; "
        f"fs, root = io.resolve({str(dst)!r}); lock_manifest(fs, root, 'manifest.json'); print('held', "
        "flush=True); time.sleep(600)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LockedError, match=rf"another process \(pid {child.pid} "):
            transcode(str(src), str(dst), settings("encoding=fp8", "projection=pca:rank=8", "calibration_samples=2"))
        assert sorted(p.name for p in dst.iterdir()) == [
            ".manifest.json.lock"
        ]  # no projection file, no shard, no manifest
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    transcode(
        str(src), str(dst), settings("encoding=fp8", "projection=pca:rank=8", "calibration_samples=2")
    )  # freed when the holder died
    assert len(ShardDataset(dst)) == 4 and verify_dataset(dst) == []


def test_inspect_shows_the_tier_bytes_and_error_per_tap(tmp_path, capsys):
    src = lossless(tmp_path / "src", 6)
    transcode(
        str(src), str(tmp_path / "dst"), settings("encoding=fp8", "projection=pca:rank=8", "calibration_samples=3")
    )
    assert shards_main(["inspect", str(tmp_path / "dst")]) == 0
    out = capsys.readouterr().out
    assert "tier       projected to 16 features + fp8" in out and "projection 64 -> 16 features" in out
    assert "raw bf16 hidden is 128 B/token" in out  # against the full 2 x 32 features, not the stored 16
    rows = [
        line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 ")) and len(line.split()) == 5
    ]
    assert len(rows) == TAPS and all(0 < float(row[2]) < 1.5 for row in rows)  # rel. RMS per tap, recorded at encode
    assert shards_main(["inspect", str(src)]) == 0
    assert "tier       lossless (planes)" in capsys.readouterr().out


def test_verify_catches_a_damaged_projection_file(tmp_path):
    src = lossless(tmp_path / "src", 4)
    transcode(
        str(src), str(tmp_path / "dst"), settings("encoding=planes", "projection=pca:rank=8", "calibration_samples=2")
    )
    path = tmp_path / "dst" / "projection.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    problems = [str(p) for p in verify_dataset(tmp_path / "dst")]
    assert problems and "projection file checksum does not match" in problems[0]
    with pytest.raises(ValueError, match="does not match the manifest's size/checksum"):
        load_projection(str(tmp_path / "dst"), ShardDataset(tmp_path / "dst").projection)


def test_a_rank_that_a_4bit_group_does_not_divide_is_refused_not_changed(tmp_path):
    src = lossless(tmp_path / "src", 3)
    with pytest.raises(
        ValueError, match=r"rank 8 per tap is not a multiple of the 4-bit group size 16; ask for pca:rank=16"
    ):
        transcode(str(src), str(tmp_path / "dst"), settings("encoding=nf4-g16", "projection=pca:rank=8"))
    assert not (tmp_path / "dst").exists()  # the refused start left nothing to trip the next run
    existing = tmp_path / "kept"
    existing.mkdir()
    with pytest.raises(ValueError, match="rank 8 per tap"):
        transcode(str(src), str(existing), settings("encoding=nf4-g16", "projection=pca:rank=8"))
    assert existing.is_dir()  # a directory the user made stays
    # a share: rounded up
    transcode(str(src), str(tmp_path / "dst2"), settings("encoding=nf4-g16", "projection=pca:variance=0.5"))
    assert ShardDataset(tmp_path / "dst2").projection["rank_per_tap"] % 16 == 0
