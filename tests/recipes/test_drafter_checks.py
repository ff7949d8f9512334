"""The drafter command's first step (recipes.drafter.checks, run, plan, runner): one output folder per
target, a mask token refused at step 1 naming `extract.mask_token_id`, held-out prompts left out of
training, a ledger keyed by the content of everything a step reads (the target directory, the config
file's table, the chat template), and how to turn chunked prefill off for a hybrid target's server.
Each refusal comes before anything is written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from extract.regenerate.server import chunked_prefill_advice
from recipes.drafter.checks import check_owner
from recipes.drafter.config import DrafterRecipeConfig, default_out, parse_drafter_args
from recipes.drafter.plan import Heldout, Job, plan_stages
from recipes.drafter.prompts import split_prompts
from recipes.drafter.run import run_drafter
from recipes.runner import Ledger, Stage, file_digest
from target.identity import directory_digest

PROMPT = {"messages": [{"role": "user", "content": "the quick brown fox"}]}


def prompts_file(path, n: int, start: int = 0) -> str:
    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) for i in range(start, start + n)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_two_targets_in_folders_of_one_name_get_two_output_folders(tmp_path):
    a, b = tmp_path / "A" / "target", tmp_path / "B" / "target"
    assert default_out(str(a)) != default_out(str(b))
    assert default_out(str(a)).startswith(os.path.join("runs", "drafter-target-"))
    assert default_out(str(a)) == default_out(str(a) + "/") == default_out(str(tmp_path / "A" / ".." / "A" / "target"))
    assert parse_drafter_args([f"target={a}", "prompts=p.jsonl"]).out_dir == default_out(str(a))


def test_a_folder_that_holds_another_targets_drafter_is_refused_before_anything_is_written(saved_target, tmp_path):
    other = shutil.copytree(saved_target, tmp_path / "B" / "target")
    (other / "config.json").write_text((other / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_epz"'))
    out = tmp_path / "out"
    out.mkdir()
    record = {"config": {}, "target": {"path": os.path.realpath(other), "digest": directory_digest(other)}}
    (out / "drafter.json").write_text(json.dumps(record))
    cfg = DrafterRecipeConfig(target=saved_target, prompts=prompts_file(tmp_path / "p.jsonl", 20), out=str(out))
    with pytest.raises(ValueError, match="holds the drafter of another target") as refused:
        run_drafter(cfg)
    assert "\n" not in str(refused.value) and str(other) in str(refused.value)
    assert sorted(os.listdir(out)) == ["drafter.json"]
    moved = shutil.copytree(saved_target, tmp_path / "moved")  # the same target elsewhere is the same target
    same = {"config": {}, "target": {"path": os.path.realpath(saved_target), "digest": directory_digest(saved_target)}}
    (out / "drafter.json").write_text(json.dumps(same))
    check_owner(str(out), str(moved), directory_digest(moved))


def test_a_tokenizer_without_a_spare_special_token_is_refused_at_step_one_naming_the_setting(saved_target, tmp_path):
    """Before: accepted, then refused by training after regeneration and extraction, naming model.mask_token_id."""
    target = shutil.copytree(saved_target, tmp_path / "target")
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("mask_token")
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    template = tmp_path / "template.jinja"  # writes every special token the tokenizer has
    template.write_text(
        "<|MASK|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    out = tmp_path / "out"
    cfg = DrafterRecipeConfig(
        target=str(target),
        prompts=prompts_file(tmp_path / "p.jsonl", 20),
        out=str(out),
        chat_template=str(template),
        device="cpu",
    )
    with pytest.raises(ValueError, match=r"no special token to spare.*set extract\.mask_token_id=ID") as refused:
        run_drafter(cfg)
    assert "\n" not in str(refused.value) and not out.exists()


def test_held_out_prompts_are_left_out_of_training_and_counted(tmp_path):
    train = prompts_file(tmp_path / "train.jsonl", 30)
    held = prompts_file(tmp_path / "held.jsonl", 10, start=25)  # 25..29 are in both
    answered = json.dumps({"messages": [*PROMPT["messages"], {"role": "assistant", "content": "another answer"}]})
    with open(train, "a") as f:
        f.write(answered + "\n")
    with open(held, "a") as f:
        f.write(json.dumps(PROMPT) + "\n")  # the same prompt with no answer: the same prompt
    split = split_prompts(train, held, str(tmp_path / "out"), asked=0, seed=0, smoke=False)
    assert split.record["overlap_left_out"] == 6 and split.record["train_records"] == 25
    assert "6 training prompts also held out: left out of training" in split.reason
    assert not {json.loads(x)["messages"][0]["content"] for x in split.lines["train"]} & {
        json.loads(x)["messages"][0]["content"] for x in split.lines["heldout"]
    }
    assert not (tmp_path / "out").exists()  # written only once step 1 has passed
    split.write()
    assert Path(split.train).read_text().splitlines() == split.lines["train"]
    with pytest.raises(ValueError, match="every training prompt .* is also a held-out prompt"):
        split_prompts(held, held, str(tmp_path / "out"), asked=0, seed=0, smoke=False)


def job_for(tmp_path, target: str, config: str = "", template: str = "") -> Job:
    return Job(
        target=target,
        train_prompts=str(tmp_path / "p.jsonl"),
        heldout=(Heldout("heldout", str(tmp_path / "h.jsonl")),),
        online="heldout",
        shards_dir=str(tmp_path / "out/shards"),
        runs_dir=str(tmp_path / "out"),
        run_name="run",
        export_dir=str(tmp_path / "out/export"),
        regen_dir=str(tmp_path / "out/regen"),
        config=config,
        target_digest=directory_digest(target),
        chat_template=template,
    )


def step_inputs(job: Job) -> dict[str, dict]:
    return {s.name: {"digests": dict(s.digests), "reads": s.reads} for g in plan_stages(job) for s in g}


def test_every_step_that_reads_the_target_is_keyed_by_its_content(saved_target, tmp_path):
    """Before: a config, chat template or weights edited in place left every step skipped as done."""
    target = shutil.copytree(saved_target, tmp_path / "target")
    config = tmp_path / "base.toml"
    config.write_text("[train]\nseed = 1\n[eval]\nmax_anchors = 8\n")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    before = step_inputs(job_for(tmp_path, str(target), str(config), str(template)))
    assert "target directory" not in before["report"]["digests"]
    assert all("target directory" in before[name]["digests"] for name in before if name != "report")
    assert all(str(template) in before[name]["reads"] for name in before if name.startswith(("regen", "extr", "spec")))
    (target / "config.json").write_text((target / "config.json").read_text().replace("\n", "\n "))  # edited in place
    config.write_text("[train]\nseed = 1\n[eval]\nmax_anchors = 16\n")
    after = step_inputs(job_for(tmp_path, str(target), str(config), str(template)))
    changed = {n for n in before if before[n]["digests"] != after[n]["digests"]}
    assert changed == set(before) - {"report"}
    assert (
        before["drafter training"]["digests"]["config table [train]"]
        == after["drafter training"]["digests"]["config table [train]"]
    )
    assert (
        before["offline evaluation"]["digests"]["config table [eval]"]
        != after["offline evaluation"]["digests"]["config table [eval]"]
    )


def test_the_ledger_redoes_a_step_whose_target_changed_and_reads_an_older_ledger_as_it_was(tmp_path):
    record = tmp_path / "out.json"
    record.write_text('{"complete": true}')
    ledger = Ledger(str(tmp_path / "stages.json"))
    stage = Stage("X", "m", ("a=1",), records=(str(record),), digests=(("target directory", "aaa"),))
    ledger.mark(stage, "done", {str(record): file_digest(str(record))})
    assert ledger.decide(stage)[0] == "skip"
    changed = Stage("X", "m", ("a=1",), records=(str(record),), digests=(("target directory", "bbb"),))
    assert ledger.decide(changed)[0] == "redo"
    del ledger.entries["X"]["inputs"]["digests"]  # written before the digests existed
    assert ledger.decide(changed)[0] == "skip"


def test_a_hybrid_target_regenerated_through_a_server_is_told_how_to_turn_chunked_prefill_off(tmp_path):
    (tmp_path / "hybrid").mkdir()
    (tmp_path / "hybrid/config.json").write_text(
        json.dumps({"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]})
    )
    advice = chunked_prefill_advice(str(tmp_path / "hybrid"))
    assert "--no-enable-chunked-prefill" in advice and "--chunked-prefill-size -1" in advice
    assert "linear_attention" in advice and "\n" not in advice
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain/config.json").write_text(json.dumps({"model_type": "llama"}))
    assert chunked_prefill_advice(str(tmp_path / "plain")) is None


def test_chat_prompts_for_a_tokenizer_without_a_chat_template_are_refused_at_step_one(saved_target, tmp_path):
    """Before, with regenerate=false, extraction rejected every record and training found no data."""
    target = shutil.copytree(saved_target, tmp_path / "base-model")
    (target / "chat_template.jinja").unlink()
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    prompts = prompts_file(tmp_path / "p.jsonl", 20)
    cfg = DrafterRecipeConfig(target=str(target), prompts=prompts, out=str(out), regenerate=False, device="cpu")
    with pytest.raises(ValueError, match=r"no chat template and your prompts are chats: set chat_template=FILE"):
        run_drafter(cfg)
    assert not out.exists()


def test_a_cache_mismatch_refuses_unless_accepted_and_the_result_is_reused_while_nothing_changed(
    tmp_path, chat_tokenizer
):
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.drafter.checks import check_key, target_self_check
    from target.self_check import SelfCheckFailed
    from tests.archs.families import by_name

    config = by_name("Jamba (cache differs from the full forward)").config(len(chat_tokenizer), {})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "jamba")
    chat_tokenizer.save_pretrained(tmp_path / "jamba")
    target, out = str(tmp_path / "jamba"), tmp_path / "out"
    key = check_key(directory_digest(target), "float32", "cpu", "sdpa")
    cfg = DrafterRecipeConfig(target=target, prompts="p.jsonl", out=str(out))
    with pytest.raises(SelfCheckFailed, match="allow_cache_mismatch=true"):
        target_self_check(cfg, str(out), key)
    accepted = DrafterRecipeConfig(target=target, prompts="p.jsonl", out=str(out), allow_cache_mismatch=True)
    record, reused = target_self_check(accepted, str(out), key)
    assert record["accepted"] == ["cache"] and not record["passed"] and not reused
    out.mkdir()
    (out / "drafter.json").write_text(json.dumps({"self_check": record}))
    assert target_self_check(accepted, str(out), key)[1] is True  # the same key: not loaded again
    with pytest.raises(SelfCheckFailed):  # the recorded mismatch still needs the setting
        target_self_check(cfg, str(out), key)
    assert target_self_check(accepted, str(out), {**key, "dtype": "bfloat16"})[1] is False


def test_a_folder_of_the_earlier_default_name_that_holds_this_targets_drafter_is_still_used(tmp_path, monkeypatch):
    from recipes.drafter.config import legacy_out
    from recipes.drafter.run import output_folder

    monkeypatch.chdir(tmp_path)
    target = tmp_path / "models" / "target"
    target.mkdir(parents=True)
    cfg = DrafterRecipeConfig(target=str(target), prompts="p.jsonl")
    assert output_folder(cfg) == default_out(str(target))  # nothing there: the new name
    old = tmp_path / legacy_out(str(target))
    old.mkdir(parents=True)
    (old / "drafter.json").write_text(json.dumps({"config": {"target": str(target)}}))  # written before the digest
    assert output_folder(cfg) == legacy_out(str(target))
    (old / "drafter.json").write_text(json.dumps({"config": {"target": str(tmp_path / "other" / "target")}}))
    assert output_folder(cfg) == default_out(str(target))  # another target's: never reused
