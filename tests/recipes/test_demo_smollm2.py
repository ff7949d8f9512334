"""`make demo target=smollm2` (recipes.demo_smollm2): every step's command line is valid for its stage at
both scales, and the summary says n/a where a number is missing instead of failing, and gives a DFlash2 drafter's
unary proposals beside its selector's."""

from __future__ import annotations

import pytest

from common.config import parse_cli
from recipes.demo_smollm2 import SCALES, smollm2_stages, smollm2_summary, smollm2_summary_text


@pytest.mark.parametrize("scale, device", [("full", "cuda"), ("reduced", "cpu")])
def test_every_step_parses_with_its_stage_config(scale, device):
    from extract.config import ExtractConfig
    from extract.regenerate.config import RegenerateConfig
    from recipes.smollm2.config import SmolConfig
    from train.config import TrainConfig

    stages = {
        "recipes.smollm2": (SmolConfig, "smollm2"),
        "extract.regenerate": (RegenerateConfig, "regenerate"),
        "extract": (ExtractConfig, "extract"),
        "train": (TrainConfig, "train"),
    }
    from train.eval.__main__ import parse_args as parse_eval_args
    from train.serve.cli import parse_specdecode_args

    planned = smollm2_stages(SCALES[scale], "demo", device, ["seed=1", "data.seed=1"], None, eval_anchors=7)
    steps = [step for stage in planned for step in stage]
    # What runs side by side needs only what earlier stages wrote: the checkpoint, never each other's output.
    [together] = [stage for stage in planned if len(stage) > 1]
    assert sorted(argv[1] for _, argv in together) == ["train.eval", "train.eval", "train.serve.export"]
    assert planned.index(together) == 1 + [n for n, _ in steps].index("drafter training")
    seen = set()
    for _name, argv in steps:
        assert argv[0] == "-m"
        if argv[1] == "train.eval":
            checkpoints, eval_cfg = parse_eval_args(argv[2:])
            assert checkpoints == ["runs/demo"] and eval_cfg.max_anchors == 7
            assert eval_cfg.attention == ("sdpa" if device == "cuda" else "auto")
            seen.add(argv[1])
        if argv[1] in stages:
            cls, section = stages[argv[1]]
            cfg = parse_cli(cls, argv[2:], section=section)
            seen.add(argv[1])
            if argv[1] == "train":
                assert cfg.optim.max_steps == SCALES[scale].steps and cfg.seed == 1
                assert cfg.model.num_layers == SCALES[scale].num_layers and cfg.device == device
                assert not cfg.compile
            if argv[1] == "extract.regenerate":
                assert cfg.max_new_tokens == SCALES[scale].max_new_tokens and cfg.dtype == "float32"
                assert cfg.device == device and cfg.batch_size == SCALES[scale].regen_batch
        if argv[1] == "train.serve.specdecode":
            spec = parse_specdecode_args(argv[2:])
            assert spec.dtype == "float32" and spec.device == device and spec.peer_baselines
            assert spec.prompts.endswith("humaneval.jsonl") and spec.out == "runs/demo/specdecode_humaneval.json"
            assert spec.peer_names == ["generate", "prompt_lookup"] and spec.num_prompts == SCALES[scale].online_prompts
            seen.add(argv[1])
    assert seen == set(stages) | {"train.eval", "train.serve.specdecode"}
    assert [n for n, _ in steps][-1] == "report"


def test_summary_of_a_run_with_nothing_written_says_n_a(tmp_path):
    summary = smollm2_summary(str(tmp_path), {"extraction": 1.0}, {}, SCALES["reduced"])
    text = smollm2_summary_text(summary)
    assert "reduced scale" in text and "n/a" in text


def test_summary_of_a_dflash2_run_gives_its_unary_proposals_beside_its_selectors(tmp_path):
    import json

    def overall(tau):
        return {"n_blocks": 9, "tau": tau, "ddtree_tau_64": tau + 1, "position_acceptance": [0.5]}

    for split, tau in (("humaneval", 2.0), ("chat_heldout", 3.0)):
        checkpoint = {"proposals": "selector", "overall": overall(tau), "unary": {"overall": overall(tau - 0.25)}}
        (tmp_path / f"eval_{split}.json").write_text(json.dumps({"checkpoints": [checkpoint]}))
    summary = smollm2_summary(str(tmp_path), {}, {}, SCALES["full"])
    he = summary["eval"]["humaneval"]
    assert (he["drafter"]["tau"], he["unary"]["tau"], he["unary"]["ddtree_tau_64"]) == (2.0, 1.75, 2.75)
    lines = smollm2_summary_text(summary).splitlines()
    assert next(line for line in lines if "unary: tau, chain" in line).split()[-2:] == ["1.750", "2.750"]
    (tmp_path / "eval_humaneval.json").write_text(json.dumps({"checkpoints": [{"overall": overall(2.0)}]}))
    assert "unary" not in smollm2_summary(str(tmp_path), {}, {}, SCALES["full"])["eval"]["humaneval"]  # DFlash


def test_each_step_says_its_time_as_it_ends(capsys):
    """A demo cut short keeps the times of the steps it finished: each step prints its own on ending,
    and a failing step still records and prints its time before the demo stops."""
    from recipes.runner import step

    timings: dict[str, float] = {}
    step(timings, "first", ["-c", "pass"])
    with pytest.raises(SystemExit, match="step 'second' failed"):
        step(timings, "second", ["-c", "raise SystemExit(3)"])
    printed = capsys.readouterr().out
    assert list(timings) == ["first", "second"] and all(t > 0 for t in timings.values())
    assert f"=== first: {timings['first']:.1f} s (demo so far {timings['first']:.1f} s)" in printed
    assert f"=== second: {timings['second']:.1f} s (demo so far {sum(timings.values()):.1f} s)" in printed


def test_steps_side_by_side_record_one_time_and_stop_on_a_failure(tmp_path, capsys):
    """A stage's steps run at once: the stage's wall time is recorded once (so the demo's total is still
    the sum of its timings), and a failing step stops the demo naming its log, after the others end."""
    from recipes.runner import steps_together

    slow = "import time; time.sleep(0.5); print('slow done')"
    timings: dict[str, float] = {"before": 1.0}
    steps_together(timings, [("quick", ["-c", "print('quick done')"]), ("slow", ["-c", slow])], None, str(tmp_path))
    printed = capsys.readouterr().out
    assert list(timings) == ["before", "quick + slow"] and 0.5 <= timings["quick + slow"] < 30
    assert "quick done" in printed and "slow done" in printed
    assert f"(demo so far {sum(timings.values()):.1f} s)" in printed
    with pytest.raises(SystemExit, match=r"step 'bad' \(exit 3, log .*bad\.log\) failed"):
        steps_together(timings, [("bad", ["-c", "raise SystemExit(3)"]), ("ok", ["-c", slow])], None, str(tmp_path))
    assert "ok: exit 0" in capsys.readouterr().out and "bad + ok" in timings
