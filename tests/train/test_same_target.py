"""The same target at every stage (target.identity): training, offline evaluation, export and
speculative decoding each refuse a target other than the one their input was made for, with one line
naming both directories and the differing fields; `allow_target_mismatch` lets it through and the
output records what differed.

Targets: A (a tiny Qwen3, the shards' own), B (a tiny Llama of the same widths and tokenizer: a
silent swap before this check) and A16 (A re-saved in bfloat16: the deliberate copy the override is
for; it is refused without it, since its config, weight files and head bytes all differ).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from common.hashing import tokenizer_digest
from target.identity import head_digest, target_identity
from target.identity_check import check_target
from tests.train.eval.test_eval import write_shards
from tests.train.serve.test_specdecode import tiny_qwen3, word_tokenizer
from train.__main__ import main as train_main
from train.eval.__main__ import main as eval_main
from train.serve.export import main as export_main
from train.serve.specdecode import main as specdecode_main

TRAIN_ARGS = [
    "data.token_budget=200",
    "data.holdout_fraction=0.25",
    "data.prefetch_threads=1",
    "data.prefetch_depth=2",
    "model.num_layers=1",
    "model.intermediate_size=32",
    "loss.num_anchors=6",
    "optim.max_steps=1",
    "checkpoint.every=1",
    "log.progress=false",
    "device=cpu",
]
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SHAPE_KEYS += ("num_key_value_heads", "head_dim", "tie_word_embeddings")


def _save(model, tokenizer, path):
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Targets A, B, A16, shards extracted (synthetically) from A, a one-step run on them and its export."""
    root = tmp_path_factory.mktemp("same_target")
    tokenizer = word_tokenizer()
    qwen3 = tiny_qwen3(seed=4, dtype=torch.float32)
    a = _save(qwen3, tokenizer, root / "A")
    torch.manual_seed(5)
    shape = {key: getattr(qwen3.config, key) for key in SHAPE_KEYS}
    b = _save(LlamaForCausalLM(LlamaConfig(**shape)).eval(), tokenizer, root / "B")
    a16 = _save(AutoModelForCausalLM.from_pretrained(a, dtype=torch.bfloat16), tokenizer, root / "A16")
    shards = write_shards(
        root / "shards", a, identity=target_identity(a), tokenizer_hash=tokenizer_digest(tokenizer), n=12
    )
    args = [f"out_dir={root / 'runs'}", f"data.shards={shards}", *TRAIN_ARGS]
    assert train_main([*args, "run_name=r", f"model.target={a}"]) == 0
    assert export_main([str(root / "runs" / "r"), str(root / "export"), "--dtype", "float32"]) == 0
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "w1 w2"}]}) + "\n")
    return {"root": root, "A": a, "B": b, "A16": a16, "shards": shards, "train_args": args, "prompts": prompts}


def _one_line(captured) -> str:
    err = captured.err.strip()
    assert "\n" not in err, err
    return err


def _names_both(line: str, loaded, recorded, *fields) -> None:
    assert f"target '{loaded}'" in line and f"'{recorded}'" in line, line
    assert all(field in line for field in fields), line


def test_identity_is_cheap_and_sees_the_head(world):
    a, a16 = target_identity(world["A"]), target_identity(world["A16"])
    assert a == target_identity(world["A"]) and a["name_or_path"] == str(world["A"])
    assert all(a[f] != a16[f] for f in ("config_hash", "weights_digest", "weights_content_digest", "head_digest"))
    assert head_digest(world["root"] / "shards") is None  # no safetensors: nothing to compare, not an error
    # A record without any identity field is not compared, and says so.
    assert check_target(a, {"name_or_path": "x"}, made="m", key="k", allowed=False)["status"] == "unchecked"


def test_training_refuses_another_target_and_the_override_is_recorded(world, capsys):
    args, a = world["train_args"], world["A"]
    run = json.loads((world["root"] / "runs" / "r" / "run.json").read_text())
    assert run["target_check"]["status"] == "same" and run["target_identity"] == target_identity(a)
    for other, fields in ((world["B"], ("config_hash", "head_digest")), (world["A16"], ("config_hash", "head_digest"))):
        assert train_main([*args, "run_name=swap", f"model.target={other}"]) == 2
        line = _one_line(capsys.readouterr()).removeprefix("train: ")
        _names_both(line, other, a, *fields)
        assert str(world["shards"]) in line and "model.allow_target_mismatch=true" in line
    assert not (world["root"] / "runs" / "swap" / "run.json").exists()  # refused before anything was written
    assert train_main([*args, "run_name=copy", f"model.target={world['A16']}", "model.allow_target_mismatch=true"]) == 0
    run = json.loads((world["root"] / "runs" / "copy" / "run.json").read_text())
    check = run["target_check"]
    assert check["status"] == "allowed" and check["allowed_by"] == "model.allow_target_mismatch"
    assert {"config_hash", "weights_digest", "weights_content_digest", "head_digest"} == set(check["differs"])
    assert check["target"] == str(world["A16"]) and check["expected"] == str(a)
    assert run["target_identity"] == target_identity(world["A16"])


def test_evaluation_refuses_another_target(world, tmp_path, capsys):
    run, shards = world["root"] / "runs" / "r", world["shards"]
    common = [str(run), "--data", str(shards), "split=all", "progress=false", "load_threads=1", "device=cpu"]
    assert eval_main([*common, f"target={world['B']}", f"out={tmp_path / 'x.json'}"]) == 2
    _names_both(_one_line(capsys.readouterr()).removeprefix("eval: "), world["B"], world["A"], "config_hash")
    out = tmp_path / "allowed.json"
    assert eval_main([*common, f"target={world['A16']}", "allow_target_mismatch=true", f"out={out}"]) == 0
    printed = capsys.readouterr().out
    check = json.loads(out.read_text())["checkpoints"][0]["target_check"]
    assert check["run"]["status"] == check["data"]["status"] == "allowed"
    assert f"target {world['A16']} is not the run's target {world['A']}" in printed
    assert eval_main([*common, f"out={tmp_path / 'same.json'}"]) == 0
    same = json.loads((tmp_path / "same.json").read_text())["checkpoints"][0]["target_check"]
    assert same["run"]["status"] == same["data"]["status"] == "same"


def test_export_refuses_another_target_and_records_it(world, tmp_path, capsys):
    run = world["root"] / "runs" / "r"
    info = json.loads((world["root"] / "export" / "dflash_export.json").read_text())
    assert info["target_check"]["status"] == "same" and info["target_identity"] == target_identity(world["A"])
    assert export_main([str(run), str(tmp_path / "e"), "--target", str(world["B"])]) == 2
    line = _one_line(capsys.readouterr()).removeprefix("error: ")
    _names_both(line, world["B"], world["A"], "config_hash", "head_digest")
    assert not (tmp_path / "e").exists()
    assert export_main([str(run), str(tmp_path / "e"), "--target", str(world["B"]), "allow_target_mismatch=true"]) == 0
    assert "NOT the run's target" in capsys.readouterr().out
    info = json.loads((tmp_path / "e" / "dflash_export.json").read_text())
    assert info["target_check"]["status"] == "allowed" and info["target_identity"] == target_identity(world["B"])


def test_speculative_decoding_refuses_another_target(world, tmp_path, capsys):
    common = ["--drafter", str(world["root"] / "export"), "--prompts", str(world["prompts"])]
    common += ["--max-new-tokens", "6", "--num-prompts", "1"]
    assert specdecode_main([*common, "--target", str(world["B"])]) == 2
    line = _one_line(capsys.readouterr()).removeprefix("error: ")
    _names_both(line, world["B"], world["A"], "config_hash", "head_digest")
    assert "lossless" not in capsys.readouterr().out
    out = tmp_path / "allowed.json"
    args = [*common, "--target", str(world["B"]), "--allow-target-mismatch", "--out", str(out)]
    assert specdecode_main(args) == 0
    assert f"target {world['B']} is not the drafter's target {world['A']}" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["target_check"]["status"] == "allowed" and result["config"]["allow_target_mismatch"] is True
    # The same target passes; the attention implementation is taken and recorded.
    same = tmp_path / "same.json"
    assert specdecode_main([*common, "--target", str(world["A"]), "attn_implementation=eager", "--out", str(same)]) == 0
    result = json.loads(same.read_text())
    assert result["target_check"]["status"] == "same" and result["config"]["attn_implementation"] == "eager"
    assert result["config"]["attn_implementation_used"] == "eager"
    assert result["summary"]["lossless"]
