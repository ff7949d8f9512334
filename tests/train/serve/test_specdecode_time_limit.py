"""Speculative decoding within a time limit (`time_limit_s`, `run_benchmark(stop_at=...)`): it decodes as many
prompts as fit, always the first, stops cleanly before one that would not end in time, reports τ, the lossless
check and the speed on those it decoded, and says how many of how many; without a limit, or with room, it decodes
every prompt and says nothing of stopping."""

from __future__ import annotations

import json
import time

from tests.train.serve.test_specdecode import (
    LAYER_IDS,
    cli_inputs,
    drafter_config,
    exported,
    random_prompts,
    tiny_qwen3,
)
from train.model import DFlashDrafter
from train.serve.decoding import DFlashProposer
from train.serve.spec_target import SpecTarget
from train.serve.specdecode import main
from train.serve.specdecode_run import another_fits, run_benchmark


def test_another_prompt_starts_only_if_it_ends_in_time():
    now = time.monotonic()
    assert another_fits(now + 100, [1.0, 2.0], 0.0)  # 1.5 x the longest (2 s) = 3 s
    assert not another_fits(now + 2.5, [1.0, 2.0], 0.0)
    assert not another_fits(now + 3.2, [1.0, 2.0], 0.15)  # 3 s + 15% of the 3 s so far for the agreement
    assert another_fits(now + 3.2, [9.0, 1.0, 1.0, 1.0, 2.0], 0.0)  # the last four only


def test_a_past_deadline_decodes_the_first_prompt_and_says_it_stopped(tmp_path):
    target = SpecTarget.from_model(tiny_qwen3(), LAYER_IDS, stop_ids=[])
    proposer = DFlashProposer(exported(tmp_path, DFlashDrafter(drafter_config())), target)
    prompts = random_prompts(3)
    stopped = run_benchmark(target, proposer, prompts, 12, warmup=False, stop_at=time.monotonic())
    assert stopped["stopped"] == {"decoded": 1, "of": 3, "why": "time limit"}
    assert stopped["summary"]["prompts"] == 1 and stopped["summary"]["lossless"] and len(stopped["prompts"]) == 1
    whole = run_benchmark(target, proposer, prompts, 12, warmup=False, stop_at=time.monotonic() + 600)
    assert "stopped" not in whole and whole["summary"]["prompts"] == 3
    assert whole["prompts"][0]["taus"] == stopped["prompts"][0]["taus"]  # the same first prompt, decoded alike


def test_the_command_reports_on_the_prompts_it_decoded_in_time(tmp_path, capsys):
    prompts = cli_inputs(tmp_path, n_prompts=3)
    out = tmp_path / "result.json"
    args = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts)]
    args += ["--num-prompts", "0", "--max-new-tokens", "12", "--agreement", "--threads", "1", "--out", str(out)]
    assert main([*args, "--time-limit-s", "0.001"]) == 0  # past before the first prompt: that one only
    printed = capsys.readouterr().out
    assert "stopped at the time limit: decoded 1 of 3 prompts" in printed and "lossless: True" in printed
    result = json.loads(out.read_text())
    assert result["stopped"]["decoded"] == 1 and result["summary"]["prompts"] == 1
    assert result["config"]["time_limit_s"] == 0.001 and result["config"]["num_prompts"] == 3
    assert result["agreement"]["round_mismatches"] == 0  # on the one decoded prompt
