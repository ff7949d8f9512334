"""recipes.drafter's command line (stage settings by prefix, errors naming the key), the held-out carve
(deterministic, leak-free, recorded) and the precedence of derived defaults, a config file's tables and the
user's stage settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError
from recipes.drafter.__main__ import main
from recipes.drafter.config import default_out, parse_drafter_args
from recipes.drafter.defaults import derive, resolve_attention, resolve_dtype, stage_defaults
from recipes.drafter.plan import Heldout, Job, plan_stages
from recipes.drafter.prompts import split_prompts
from recipes.tiny.shipped import SHIPPED_DIR

TARGET = str(SHIPPED_DIR / "target")


def test_stage_settings_go_to_their_stage_and_bad_keys_are_named(tmp_path, capsys):
    cfg = parse_drafter_args(["target=t", "prompts=p.jsonl", "train.optim.max_steps=5", "specdecode.device=cpu"])
    assert cfg.overrides == {"train": ["optim.max_steps=5"], "specdecode": ["device=cpu"]}
    assert cfg.out_dir == default_out("t") and cfg.out_dir.startswith("runs/drafter-t-") and cfg.regenerate
    config = tmp_path / "mine.toml"
    config.write_text('[drafter]\ntarget = "m"\nprompts = "p.jsonl"\noverrides = {train = ["seed=1"]}\n[train]\n')
    from_file = parse_drafter_args([str(config), "train.optim.max_steps=5"])
    assert from_file.config == str(config) and from_file.overrides == {"train": ["seed=1", "optim.max_steps=5"]}
    with pytest.raises(ConfigError, match="unknown config key 'scal'"):
        parse_drafter_args(["target=t", "prompts=p", "scal=smoke"])
    with pytest.raises(ConfigError, match="'prompts'"):
        parse_drafter_args(["target=t"])
    with pytest.raises(ConfigError, match="'overrides.training': no such stage"):
        parse_drafter_args(["target=t", "prompts=p", 'overrides={training = ["x=1"]}'])
    with pytest.raises(ConfigError, match="'server'"):
        parse_drafter_args(["target=t", "prompts=p", "server=localhost:8000"])
    assert main(["target=t", "prompts=p", "scale=big"]) == 2
    assert "'scale'" in capsys.readouterr().err
    assert main(["target=/nonexistent", "prompts=p"]) == 2
    assert "'target'" in capsys.readouterr().err


def write_prompts(path, n, duplicate=False):
    records = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(n)]
    lines = [json.dumps(r) for r in records] + ([json.dumps(records[0])] * 3 if duplicate else [])
    path.write_text("\n".join(lines) + "\n")


def test_the_held_out_carve_is_deterministic_leak_free_and_recorded(tmp_path):
    write_prompts(tmp_path / "p.jsonl", 100, duplicate=True)
    first = split_prompts(str(tmp_path / "p.jsonl"), "", str(tmp_path / "a"), asked=0, seed=0, smoke=False)
    again = split_prompts(str(tmp_path / "p.jsonl"), "", str(tmp_path / "b"), asked=0, seed=0, smoke=False)
    first.write(), again.write()
    train, held = (Path(p).read_text().splitlines() for p in (first.train, first.heldout))
    assert Path(again.heldout).read_text().splitlines() == held and len(set(held)) == 10  # 10% of 100 distinct records
    assert not set(train) & set(held) and len(train) + len(held) == 103  # copies of a record stay on one side
    assert first.record["source"] == "carved" and first.record["seed"] == 0 and "10%" in first.reason
    other = split_prompts(str(tmp_path / "p.jsonl"), "", str(tmp_path / "c"), asked=3, seed=1, smoke=False)
    other.write()
    assert (
        len(Path(other.heldout).read_text().splitlines()) >= 3
        and Path(other.heldout).read_text() != Path(first.heldout).read_text()
    )
    smoke = split_prompts(str(tmp_path / "p.jsonl"), "", str(tmp_path / "d"), asked=0, seed=0, smoke=True)
    assert smoke.record["train_records"] == 32 and smoke.record["heldout_records"] == 4
    write_prompts(tmp_path / "two.jsonl", 2)
    with pytest.raises(ValueError, match="'prompts'.* holds 2 records; carving 2 held-out prompts"):
        split_prompts(str(tmp_path / "two.jsonl"), "", str(tmp_path / "e"), asked=0, seed=0, smoke=False)


def test_derived_defaults_yield_to_a_config_table_and_to_stage_settings(tmp_path):
    config = tmp_path / "base.toml"
    config.write_text('[train.model]\nnum_layers = 3\n[extract]\ndtype = "bfloat16"\n')
    cfg = parse_drafter_args(
        [str(config), f"target={TARGET}", "prompts=p.jsonl", "specdecode.dtype=bfloat16", "device=cpu"]
    )
    derived = {d.what: d for d in derive(cfg)}
    assert derived["drafter layers"].value == 2 and derived["taps (layer_ids)"].value == [1, 2, 4, 5]
    assert derived["drafter layers"].yours == (f"[train] model.num_layers in {config}",)
    assert derived["dtype"].value == "float32" and len(derived["dtype"].yours) == 2  # the table's and the user's
    assert derived["drafter class"].value == "dflash" and derived["drafter class"].settings == (
        "train.model.arch=dflash",
    )
    dflash2 = {d.what: d for d in derive(parse_drafter_args([f"target={TARGET}", "prompts=p.jsonl", "arch=dflash2"]))}
    assert (
        dflash2["drafter class"].settings == ("train.model.arch=dflash2",)
        and "block 8" in dflash2["drafter class"].reason
    )
    job = Job(
        target=TARGET,
        train_prompts="t.jsonl",
        heldout=(Heldout("heldout", "h.jsonl"),),
        online="heldout",
        shards_dir="s",
        runs_dir="r",
        run_name="run",
        export_dir="e",
        regen_dir="g",
        config=str(config),
        defaults=stage_defaults(cfg, list(derived.values())),
        overrides=cfg.overrides,
    )
    args = {s.module: list(s.args) for group in plan_stages(job) for s in group}
    assert args["train"][0] == str(config) and not [a for a in args["train"] if a.startswith("model.num_layers")]
    assert "dtype=float32" not in args["extract"] and "dtype=float32" in args["extract.regenerate"]
    assert args["train.serve.specdecode"].index("dtype=bfloat16") > args["train.serve.specdecode"].index(
        "dtype=float32"
    )
    assert "train.optim.max_steps" not in " ".join(args["train"]) and "data.holdout_fraction=0.0" in args["train"]


def test_dtype_and_attention_follow_the_device_and_the_target(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cpu", TARGET)[0] == "float32"
    assert resolve_dtype("auto", "cuda", TARGET)[0] == "float32"  # 5 MB of weights: launch-bound
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:
        f.truncate(3 * 10**9)  # sparse: a 3 GB file that takes no disk
    assert resolve_dtype("auto", "cuda", str(big))[0] == "bfloat16"
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda", str(big))[0] == "float16"
    assert resolve_dtype("float32", "cuda", str(big)) == ("float32", "your setting")
    assert resolve_attention("auto", TARGET)[0] == "sdpa"
    gemma2 = tmp_path / "gemma2"
    gemma2.mkdir()
    (gemma2 / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    attention, reason = resolve_attention("auto", str(gemma2))
    assert attention == "eager" and "Gemma2ForCausalLM does not support SDPA" in reason


def test_a_prompt_line_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path):
    """Issue 54: "'utf-8' codec can't decode byte 0xff in position 673" named no file."""
    write_prompts(tmp_path / "p.jsonl", 5)
    lines = (tmp_path / "p.jsonl").read_bytes().splitlines()
    lines[3] = lines[3].replace(b"question", b"qu\xffestion")
    (tmp_path / "p.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(
        ValueError, match=r"config key 'prompts': .*p\.jsonl line 4 is not UTF-8 text \(byte 46 of the line"
    ):
        split_prompts(str(tmp_path / "p.jsonl"), "", str(tmp_path / "out"), asked=2, seed=0, smoke=False)
    utf16 = tmp_path / "utf16.jsonl"  # what the corpus reader takes, the prompt sets take too
    utf16.write_bytes(("\n".join(lines[i].decode() for i in (0, 1, 2)) + "\n").encode("utf-16"))
    split = split_prompts(str(utf16), "", str(tmp_path / "u"), asked=1, seed=0, smoke=False)
    assert len(split.lines["train"]) + len(split.lines["heldout"]) == 3


def test_text_prompt_records_become_user_turns_when_the_target_answers_them(tmp_path):
    """Issue 54: `--help` lists {"text": ...} as accepted, and regeneration rejected every such record."""
    texts = [{"text": f"say {i}", "id": i} for i in range(6)] + [{"messages": [{"role": "user", "content": "hi"}]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    split = split_prompts(str(tmp_path / "p.jsonl"), "", str(tmp_path / "a"), asked=2, seed=0, smoke=False)
    records = [json.loads(line) for name in ("train", "heldout") for line in split.lines[name]]
    users = sorted(r["messages"][0]["content"] for r in records)
    assert users == sorted([f"say {i}" for i in range(6)] + ["hi"]) and all(
        set(r) <= {"messages", "id"} for r in records
    )
    assert split.record["text_records_as_user_turns"] == 6 and '6 {"text": ...} records are user turns' in split.reason
    kept = split_prompts(
        str(tmp_path / "p.jsonl"), "", str(tmp_path / "b"), asked=2, seed=0, smoke=False, texts_as_prompts=False
    )
    assert (
        sum('"text"' in line for name in ("train", "heldout") for line in kept.lines[name]) == 6
    )  # regenerate=false: as given
