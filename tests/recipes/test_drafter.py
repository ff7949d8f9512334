"""`make drafter` (recipes.drafter) at the smoke scale on the shipped tiny target, in this process: every
stage's real output (lossless decoding, the taps and mask token recorded, the derived drafter depth, the
files), a rerun that skips every step, and a changed setting that reruns only the steps it affects."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from recipes.drafter.config import DrafterRecipeConfig
from recipes.drafter.run import run_drafter
from recipes.tiny.shipped import unpack_shipped
from target.rules import auto_layer_ids

STEPS = [
    "regeneration (train)",
    "regeneration (heldout)",
    "extraction",
    "drafter training",
    "offline evaluation",
    "export",
    "speculative decoding",
    "report",
]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The tiny target, 40 of its corpus' prompts, and one smoke-scale run of the drafter command."""
    root = tmp_path_factory.mktemp("drafter")
    unpack_shipped(root / "tiny")
    lines = (root / "tiny/corpus/train.jsonl").read_text().splitlines()[:40]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DrafterRecipeConfig(
        target=str(root / "tiny/target"),
        prompts=str(root / "prompts.jsonl"),
        out=str(root / "out"),
        scale="smoke",
        in_process=True,
    )
    return cfg, run_drafter(cfg)


@pytest.mark.slow
def test_one_command_gives_a_checked_exported_drafter_with_the_derived_defaults(smoke):
    cfg, summary = smoke
    out = Path(cfg.out)
    assert [name for name, step in summary["steps"].items() if step["status"] == "ran"] == STEPS
    spec = summary["specdecode"]
    assert spec["lossless"] is True and spec["prompts"] == 4 and spec["tau"] >= 1.0  # 40 prompts: 4 held out
    assert spec["target_tokens_per_s"] > 0 and spec["speedup_wall"] > 0  # against the target's own greedy decoding
    taps = auto_layer_ids(8)[0]
    manifest = json.loads((out / "shards/train/manifest.json").read_text())
    assert summary["taps"] == taps == manifest["provenance"]["taps"]["layer_ids"] == [1, 2, 4, 5]
    export = json.loads((out / "export/config.json").read_text())
    assert export["dflash_config"]["target_layer_ids"] == taps
    assert summary["drafter_layers"] == export["num_hidden_layers"] == 2  # a quarter of the target's 8 layers
    assert summary["mask_token"] == {"id": 4093, "token": "<|MASK|>", "source": "tokenizer"}
    assert summary["eval"]["n_blocks"] > 0 and 1.0 <= summary["eval"]["tau"] <= 16
    for name in ("export/model.safetensors", "run/report.md", "run/eval_heldout.json", "summary.json"):
        assert (out / name).is_file(), name
    record = json.loads((out / "drafter.json").read_text())
    derived = {d["what"]: d for d in record["derived"]}
    assert derived["taps (layer_ids)"]["value"] == taps and "L-3" in derived["taps (layer_ids)"]["reason"]
    assert derived["device"]["value"] == "cpu" and derived["dtype"]["value"] == "float32"
    assert derived["attn_implementation"]["value"] == "sdpa" and record["config"]["scale"] == "smoke"
    assert record["prompts"]["source"] == "carved" and record["prompts"]["heldout_records"] == 4
    checked = record["self_check"]  # the target's self-check at step 1, with its numbers
    assert checked["passed"] and [c["name"] for c in checked["checks"]] == [
        "parts",
        "weights",
        "layers",
        "logits",
        "cache",
    ]
    assert checked["key"]["dtype"] == "float32" and all(c["ok"] for c in checked["checks"])
    assert record["target"]["digest"] and derived["mask token"]["value"] == 4093  # named at step 1, as extraction chose
    regen = json.loads((out / "regen/train/regenerate.json").read_text())
    assert regen["complete"] and json.loads((out / "run/config.json").read_text())["model"]["num_layers"] == 2


@pytest.mark.slow
def test_a_rerun_skips_every_step_and_a_changed_setting_reruns_only_what_it_affects(smoke, capsys):
    cfg, first = smoke
    again = run_drafter(cfg)
    assert {step["status"] for step in again["steps"].values()} == {"skipped"}
    assert again["specdecode"] == first["specdecode"]
    printed = capsys.readouterr().out
    assert "done with the same command and inputs, skipped" in printed
    assert "checked before: the same target, dtype, device and kernel" in printed  # not loaded again

    changed = DrafterRecipeConfig(**{**cfg.__dict__, "overrides": {"specdecode": ["max_new_tokens=16"]}})
    summary = run_drafter(changed)
    ran = [name for name, step in summary["steps"].items() if step["status"] != "skipped"]
    assert ran == ["speculative decoding"] and summary["steps"]["speculative decoding"]["status"] == "redone"
    assert summary["specdecode"]["max_new_tokens"] == 16 and summary["specdecode"]["lossless"] is True


@pytest.mark.slow
def test_a_bad_stage_setting_fails_before_any_step_runs_naming_the_step_and_key(smoke, tmp_path):
    cfg, _ = smoke
    out = tmp_path / "bad"
    bad = DrafterRecipeConfig(**{**cfg.__dict__, "out": str(out), "overrides": {"train": ["optim.max_stepz=3"]}})
    with pytest.raises(ValueError, match=r"step 'drafter training': unknown config key 'optim.max_stepz'"):
        run_drafter(bad)
    assert not (out / "stages.json").exists()
    shutil.rmtree(out, ignore_errors=True)
