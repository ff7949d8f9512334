"""The shipped tiny default (`recipes.tiny.shipped`): the repository's copy is whole and is the tiny
default's target; a damaged file is refused by name; ship -> unpack gives back the build's files; a
`target=shipped` build takes its corpus and target from the shipped copy and still regenerates here."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from common.config import ConfigError
from recipes.tiny import TinyConfig, build_tiny, shipped, tap_layer_ids
from recipes.tiny import build as tiny_build
from recipes.tiny.__main__ import main as tiny_main
from recipes.tiny.config import TRAINING_KNOBS
from recipes.tiny.corpus import read_jsonl
from tests.recipes.tiny import TINY_MODEL

REPO = Path(__file__).resolve().parents[3]


def test_the_repository_s_shipped_build_is_whole_and_is_the_tiny_default_s_target():
    manifest = shipped.verify_shipped()
    assert sorted(manifest["files"]) == sorted(map(shipped.shipped_name, shipped.TARGET_FILES + shipped.CORPUS_FILES))
    config = json.loads((shipped.SHIPPED_DIR / "target/config.json").read_text())
    report = json.loads((shipped.SHIPPED_DIR / "target/tiny_report.json").read_text())
    defaults = TinyConfig()
    assert (config["hidden_size"], config["num_hidden_layers"]) == (defaults.hidden_size, defaults.num_layers)
    assert config["vocab_size"] <= defaults.vocab_size
    assert report["tap_layer_ids"] == tap_layer_ids(defaults.num_layers, defaults.n_taps)
    tiny_toml = tomllib.loads((REPO / "configs/tiny.toml").read_text())
    assert tiny_toml["extract"]["layer_ids"] == report["tap_layer_ids"]
    assert "regenerated_corpus" not in report  # measured where it is unpacked
    # target=shipped stands for a build at today's defaults: a changed default needs a new shipped build
    params = manifest["reference_build"]["recipe"]["params"]
    assert params.get("target", "train") == "train"
    assert {k: params[k] for k in TRAINING_KNOBS if k != "precision"} == {
        k: getattr(defaults, k) for k in TRAINING_KNOBS if k != "precision"
    }


def copy_of_repository_shipped(tmp_path: Path) -> Path:
    copy = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_DIR, copy)
    return copy


def test_a_damaged_or_missing_shipped_file_is_refused_by_name(tmp_path):
    copy = copy_of_repository_shipped(tmp_path)
    weights = copy / "target/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors differs"):
        shipped.unpack_shipped(tmp_path / "out", copy)
    assert not (tmp_path / "out").exists()  # checked before anything is copied

    (copy / "corpus/heldout.jsonl.gz").unlink()
    shutil.copyfile(shipped.SHIPPED_DIR / "target/model.safetensors", weights)
    with pytest.raises(ValueError, match="heldout.jsonl.gz is missing"):
        shipped.verify_shipped(copy)
    with pytest.raises(ValueError, match="not found"):
        shipped.verify_shipped(tmp_path / "nowhere")


@pytest.fixture(scope="module")
def small_build(tmp_path_factory) -> Path:
    """A whole `target=train` build at test sizes, answers cut at 4 tokens."""
    out = tmp_path_factory.mktemp("small") / "tiny"
    return build_tiny(TinyConfig(out_dir=str(out), regen_max_new_tokens=4, **TINY_MODEL), progress=False)


def test_ship_then_unpack_gives_back_the_build_s_corpus_and_target_and_ships_the_same_bytes_twice(
    small_build, tmp_path
):
    first = shipped.ship_build(small_build, tmp_path / "a", check_defaults=False)
    second = shipped.ship_build(small_build, tmp_path / "b", check_defaults=False)
    assert first == second  # the checksum of every stored file: a fixed gzip timestamp
    shipped.unpack_shipped(tmp_path / "out", tmp_path / "a")
    for name in shipped.TARGET_FILES + shipped.CORPUS_FILES:
        if name == "target/tiny_report.json":
            continue
        assert (tmp_path / "out" / name).read_bytes() == (small_build / name).read_bytes(), name
    report = json.loads((tmp_path / "out/target/tiny_report.json").read_text())
    built = json.loads((small_build / "target/tiny_report.json").read_text())
    assert "regenerated_corpus" in built and "regenerated_corpus" not in report
    assert report == {k: v for k, v in built.items() if k != "regenerated_corpus"}


def test_a_shipped_build_takes_corpus_and_target_from_the_shipped_copy_and_regenerates_here(
    small_build, tmp_path, monkeypatch, capsys
):
    shipped.ship_build(small_build, tmp_path / "shipped", check_defaults=False)
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "shipped")
    cfg = TinyConfig(out_dir=str(tmp_path / "tiny"), regen_max_new_tokens=4, threads=1)
    out = build_tiny(cfg, progress=False)
    assert tiny_build.is_built(out, tiny_build.recipe_digest(cfg))
    for name in ("target/model.safetensors", "target/tokenizer.json", "corpus/train.jsonl", "corpus/heldout.jsonl"):
        assert (out / name).read_bytes() == (small_build / name).read_bytes(), name
    # the same target, the same records, the same greedy rule: the same regenerated answers
    for name in tiny_build.REGEN_FILES.values():
        assert read_jsonl(out / name) == read_jsonl(small_build / name), name
    record = json.loads((out / "build.json").read_text())
    assert record["recipe"]["shipped"] == shipped.shipped_digest(tmp_path / "shipped")
    assert "steps" not in record["recipe"]["params"] and "python" not in record["recipe"]
    report = json.loads((out / "target/tiny_report.json").read_text())
    assert report["regenerated_corpus"]["max_new_tokens"] == 4 and "shipped_from" in report

    monkeypatch.setattr(tiny_build, "regenerate_corpus", lambda *a, **k: pytest.fail("rebuilt"))
    assert tiny_main([f"out_dir={cfg.out_dir}", "regen_max_new_tokens=4", "threads=1"]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_a_training_knob_with_target_shipped_is_an_error_naming_it(tmp_path, capsys):
    assert tiny_main([f"out_dir={tmp_path}", "steps=3"]) == 2
    err = capsys.readouterr().err
    assert "config key 'steps'" in err and "add target=train" in err
    with pytest.raises(ConfigError, match="config key 'hidden_size'"):
        build_tiny(TinyConfig(out_dir=str(tmp_path), hidden_size=64), progress=False)
    assert not any(tmp_path.iterdir())


def test_only_a_finished_default_target_train_build_is_shipped_and_a_refusal_leaves_nothing(small_build, tmp_path):
    dest = tmp_path / "shipped"
    with pytest.raises(ValueError, match="hidden_size=32 \\(default 128\\)"):
        shipped.ship_build(small_build, dest)
    partial = tmp_path / "partial"
    shutil.copytree(small_build, partial)
    (partial / "target/model.safetensors").unlink()
    with pytest.raises(ValueError, match="target/model.safetensors missing"):
        shipped.ship_build(partial, dest, check_defaults=False)
    assert list(tmp_path.iterdir()) == [partial]  # no destination, no temporary directory

    shipped.ship_build(small_build, dest, check_defaults=False)
    before = shipped.read_manifest(dest)
    with pytest.raises(ValueError, match="missing"):
        shipped.ship_build(partial, dest, check_defaults=False)
    assert shipped.verify_shipped(dest) == before  # the old shipped build is untouched


def test_auto_keeps_a_target_trained_here_and_otherwise_takes_the_shipped_one(small_build, tmp_path, monkeypatch):
    out = tmp_path / "tiny"
    shutil.copytree(small_build, out)
    monkeypatch.setattr(tiny_build, "unpack_shipped_build", lambda *a, **k: pytest.fail("replaced"))
    assert build_tiny(TinyConfig(out_dir=str(out)), progress=False) == out.resolve()  # target=auto
    assert (out / "target/model.safetensors").read_bytes() == (small_build / "target/model.safetensors").read_bytes()
    with pytest.raises(pytest.fail.Exception, match="replaced"):
        build_tiny(TinyConfig(out_dir=str(out), target="shipped"), progress=False)
    trained = TinyConfig(out_dir=str(out), regen_max_new_tokens=4, **TINY_MODEL)
    assert tiny_build.is_built(out, tiny_build.recipe_digest(trained))  # the refused replacement left it whole


def test_a_damaged_shipped_file_stops_the_command_with_its_name(tmp_path, monkeypatch, capsys):
    copy = copy_of_repository_shipped(tmp_path)
    (copy / "target/tokenizer.json").write_text("{}")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", copy)
    assert tiny_main([f"out_dir={tmp_path / 'tiny'}"]) == 2
    assert "tokenizer.json differs" in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()
