"""The cached `python -m recipes.tiny` build (`recipes.tiny.build`): cached, rebuilt on a new recipe, never
half-finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.tiny import (
    MASK_TOKEN,
    TinyConfig,
    build_tiny,
)
from recipes.tiny import build as tiny_build
from recipes.tiny.__main__ import main as tiny_main
from tests.recipes.tiny import TINY_MODEL


def fail_if_called(*args, **kwargs):
    raise AssertionError("the target was rebuilt")


def test_build_is_cached_and_a_changed_recipe_rebuilds(tmp_path, monkeypatch, capsys):
    cfg = TinyConfig(out_dir=str(tmp_path / "tiny"), **TINY_MODEL)
    out = build_tiny(cfg, progress=False)
    for name in tiny_build.REQUIRED_FILES:
        assert (out / name).is_file(), name
    assert json.loads((out / "build.json").read_text())["recipe_digest"] == tiny_build.recipe_digest(cfg)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    monkeypatch.setattr(tiny_build, "build_tiny_target", fail_if_called)
    assert tiny_main([f"out_dir={cfg.out_dir}"] + [f"{k}={v}" for k, v in TINY_MODEL.items()] + ["threads=2"]) == 0
    assert "nothing to do" in capsys.readouterr().out

    changed = TinyConfig(out_dir=cfg.out_dir, **{**TINY_MODEL, "steps": 3})
    assert tiny_build.recipe_digest(changed) != tiny_build.recipe_digest(cfg)
    with pytest.raises(AssertionError, match="rebuilt"):
        build_tiny(changed, progress=False)
    assert tiny_build.is_built(out, tiny_build.recipe_digest(cfg))  # the failed rebuild left the old build intact
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_recipe_keys_on_the_device_type_and_the_precision_it_resolves_to(monkeypatch):
    cfg = TinyConfig(**TINY_MODEL)
    seen = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setattr(tiny_build, "resolve_build_device", lambda choice, device=device: device)
        seen[device] = (tiny_build.recipe(cfg)["params"], tiny_build.recipe_digest(cfg))
        # how many threads build it changes the rounding at most, not the recipe
        assert tiny_build.recipe_digest(TinyConfig(**{**TINY_MODEL, "threads": 2})) == seen[device][1]
    assert seen["cpu"][0]["device"] == "cpu" and seen["cuda"][0]["device"] == "cuda"
    assert seen["cuda"][0]["precision"] == "bf16"  # auto on a GPU
    assert seen["cpu"][1] != seen["cuda"][1]  # a CPU-built cache is not taken for a GPU build


def fake_target(out_dir, train, heldout, cfg, progress=True):
    """Stands in for the (slow) real target build: writes the files the cache checks."""
    out = Path(out_dir)
    out.mkdir(parents=True)
    for name in [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]:
        (out / name).write_text("{}")
    report = {
        "heldout_next_token_accuracy": 0.5,
        "most_frequent_token_accuracy": 0.1,
        "train_probe_next_token_accuracy": 0.6,
        "heldout_answer_next_token_accuracy": 0.4,
        "most_frequent_token_answer_accuracy": 0.1,
        "num_layers": 3,
        "hidden_size": 32,
        "parameters": 1,
        "vocab_size": 400,
        "mask_token": MASK_TOKEN,
        "mask_token_id": 399,
        "tap_layer_ids": [0, 1],
        "corpus": {"train": {"records": len(train), "tokens": 1}, "heldout": {"records": len(heldout), "tokens": 1}},
    }
    (out / "tiny_report.json").write_text(json.dumps(report))
    return {**report, "train_seconds": 0.0, "device": "cpu"}


def fake_regeneration(target_dir, train, heldout, cfg=None, progress=True):
    """Stands in for the greedy re-answering, which needs a real target."""
    return train, heldout, {}


def test_a_partial_build_is_detected_and_redone(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_build, "build_tiny_target", fake_target)
    monkeypatch.setattr(tiny_build, "regenerate_corpus", fake_regeneration)
    cfg = TinyConfig(out_dir=str(tmp_path / "tiny"), **TINY_MODEL)
    out = build_tiny(cfg, progress=False)
    digest = tiny_build.recipe_digest(cfg)
    assert tiny_build.is_built(out, digest)

    (out / "target" / "model.safetensors").unlink()  # damaged after the fact
    leftover = tmp_path / "tiny.deadbeef.tmp"  # what a build killed midway leaves behind
    (leftover / "target").mkdir(parents=True)
    assert not tiny_build.is_built(out, digest)
    build_tiny(cfg, progress=False)
    assert tiny_build.is_built(out, digest) and not leftover.exists()


def test_a_build_that_dies_midway_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    def dies(out_dir, *args, **kwargs):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_build, "build_tiny_target", dies)
    cfg = TinyConfig(out_dir=str(tmp_path / "tiny"), **TINY_MODEL)
    with pytest.raises(KeyboardInterrupt):
        build_tiny(cfg, progress=False)
    assert not (tmp_path / "tiny").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
