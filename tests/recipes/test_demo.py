"""`make demo` (recipes.demo): the steps it runs, in order, and its closing summary read from their outputs.

The demo's steps themselves are each tested elsewhere; a whole demo takes minutes (`make demo`). The
steps run through recipes.runner (the drafter command's orchestration), whose child processes
these tests replace (`subprocess.Popen` in common.processes)."""

from __future__ import annotations

import json

import pytest
import torch

from recipes import demo
from tests.paths import REPO
from train.eval.__main__ import parse_args as parse_eval_args
from train.serve.cli import parse_specdecode_args


@pytest.fixture(autouse=True)
def _configs(tmp_path):
    """The demo runs from the repository root, where its stages' config files are; the tests run it in tmp_path."""
    (tmp_path / "configs").symlink_to(REPO / "configs")


def fake_tiny_build(root):
    (root / "artifacts/tiny/target").mkdir(parents=True, exist_ok=True)
    (root / "artifacts/tiny/target/tiny_report.json").write_text(
        json.dumps(
            {
                "num_layers": 8,
                "parameters": 2_600_000,
                "heldout_next_token_accuracy": 0.25,
                "most_frequent_token_accuracy": 0.05,
                "regenerated_corpus": {"stop_repeat": 16},
            }
        )
    )


def fake_outputs(root, run="demo"):
    fake_tiny_build(root)
    run_dir = root / "runs" / run
    run_dir.mkdir(parents=True, exist_ok=True)
    overall = {
        "n_blocks": 900,
        "tau": 2.5,
        "position_acceptance": [0.6] + [0.1] * 14,
        "ddtree_tau_8": 3.0,
        "ddtree_tau_64": 4.0,
    }
    baseline = {
        "n_blocks": 900,
        "tau": 1.05,
        "position_acceptance": [0.04] + [0.0] * 14,
        "ddtree_tau_8": 1.2,
        "ddtree_tau_64": 1.4,
    }
    (run_dir / "eval_heldout.json").write_text(
        json.dumps({"checkpoints": [{"overall": overall}], "baseline": {"overall": baseline}})
    )
    (run_dir / "specdecode.json").write_text(
        json.dumps(
            {
                "summary": {
                    "prompts": 8,
                    "tau": 2.25,
                    "lossless": True,
                    "speedup": 0.5,
                    "spec": {"decode_tokens_per_s": 100.0},
                    "baseline": {"decode_tokens_per_s": 200.0},
                },
                "config": {"max_new_tokens": 96},
                "agreement": {"offline_tau_at_rounds": 2.25},
            }
        )
    )


def finished_process(started):
    """A stand-in for subprocess.Popen: `started(args, **kwargs)` runs at the start, the process ends at once, well."""

    class Finished:
        def __init__(self, args, **kwargs):
            started(args, **kwargs)

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    return Finished


def test_runs_every_step_in_order_and_summarizes_their_outputs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_run(args, **kwargs):
        calls.append(args[1:])
        if args[1:3] == ["-m", "recipes.tiny"]:
            fake_tiny_build(tmp_path)
        if args[1:3] == ["-m", "train.report"]:  # the last step: everything before it has written its files
            fake_outputs(tmp_path)

    monkeypatch.setattr("common.processes.subprocess.Popen", finished_process(fake_run))
    assert demo.main([]) == 0
    modules = [c[1] for c in calls]
    assert modules == [
        "recipes.tiny",
        "extract",
        "train",
        "train.eval",
        "train.serve.export",
        "train.serve.specdecode",
        "train.report",
    ]
    train_args, eval_args, spec_args = calls[2], calls[3], calls[5]
    assert "run_name=demo" in train_args and "optim.max_steps=800" in train_args and "model.arch=dflash" in train_args
    assert not [a for a in train_args if "seed" in a]  # seed 0: the config's own
    checkpoints, evaluation = parse_eval_args(eval_args[2:])
    assert checkpoints == ["runs/demo"] and evaluation.data == "artifacts/tiny/shards/heldout"
    assert evaluation.max_anchors == 16 and evaluation.out == "runs/demo/eval_heldout.json"
    spec = parse_specdecode_args(spec_args[2:])
    assert spec.drafter == "runs/demo/export" == calls[4][3] and spec.target == "artifacts/tiny/target"
    assert spec.device == ("cuda" if torch.cuda.is_available() else "cpu") and spec.dtype == "float32"
    assert spec.prompts == "artifacts/tiny/corpus/heldout_regen.jsonl" and spec.max_new_tokens == 96
    # every held-out prompt, each response ending where it loops, by the rule the tiny build cut its answers with
    assert spec.num_prompts == 0 and spec.stop_repeat == 16 and spec.agreement and spec.agreement_bf16
    assert calls[1][2] == "configs/tiny.toml" and calls[2][2] == "configs/tiny.toml"  # extraction and training

    out = capsys.readouterr().out
    rows = {
        line.strip().rsplit(None, 2)[0]: line.split()[-2:]
        for line in out.splitlines()
        if line.strip().startswith(("tau, ", "acceptance at k=1"))
    }
    assert rows["tau, chain of 15"] == ["2.500", "1.050"] and rows["acceptance at k=1"] == ["0.600", "0.040"]
    assert rows["tau, DDTree-64"] == ["4.000", "1.400"] and "tau, DDTree-16" not in rows  # only the budgets evaluated
    assert "tau 2.250" in out and "identical to target-only greedy decoding: True" in out and "= 0.50x" in out
    summary = json.loads((tmp_path / "runs/demo/demo_summary.json").read_text())
    assert summary["eval"]["tau"] == 2.5 and summary["eval_baseline"]["acceptance_k1"] == 0.04
    assert set(summary["timings_s"]) == {
        "tiny target + corpus",
        "extraction",
        "drafter training",
        "offline evaluation",
        "export",
        "speculative decoding",
        "report",
    }


@pytest.mark.parametrize("cuda", [False, True])
def test_steps_run_with_this_interpreter_few_threads_and_the_gpu_when_there_is_one(tmp_path, monkeypatch, capsys, cuda):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Fake GPU")
    monkeypatch.setattr("common.device.usable_cores", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    calls = []

    together = []

    def fake_run(args, env=None, stdout=None, **kwargs):
        calls.append((args, env))
        if stdout is not None:  # the steps a GPU runs side by side, each with its own log
            together.append(args[2])
        if "train.report" in args:
            fake_outputs(tmp_path)

    monkeypatch.setattr("common.processes.subprocess.Popen", finished_process(fake_run))
    assert demo.main([]) == 0
    assert together == (["train.eval", "train.eval", "train.serve.export"] if cuda else [])
    assert all(
        args[0] == demo.sys.executable for args, _ in calls
    )  # not a venv path: `python3 -m recipes.demo` works anywhere
    assert {env["OMP_NUM_THREADS"] for _, env in calls} == {"4"}  # 16 cores, small models: 4 threads
    spec = next(args for args, _ in calls if "train.serve.specdecode" in args)
    assert parse_specdecode_args(spec[3:]).device == ("cuda" if cuda else "cpu")
    summary = json.loads((tmp_path / "runs/demo/demo_summary.json").read_text())
    assert summary["machine"]["device"] == ("cuda" if cuda else "cpu") and summary["machine"]["threads"] == 4
    assert summary["machine"]["gpu"] == ("Fake GPU" if cuda else None)
    assert ("on GPU (Fake GPU)" if cuda else "on CPU;") in capsys.readouterr().out


def test_a_set_omp_num_threads_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    envs = []
    monkeypatch.setattr("recipes.runner.run_child", lambda args, env=None: (envs.append(env), 1)[1])
    with pytest.raises(SystemExit):
        demo.main([])
    assert envs[0]["OMP_NUM_THREADS"] == "3"


def test_a_failing_step_stops_the_demo_and_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("recipes.runner.run_child", lambda args, env=None: 3 if args[1] == "extract" else 0)
    with pytest.raises(SystemExit, match="step 'extraction' failed \\(exit 3\\)"):
        demo.main([])


def test_missing_outputs_read_as_not_available(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = demo.summary_text(demo.summarize("runs/none", {"x": 1.0}))
    assert "n/a" in text and "tau, chain of 15" in text


@pytest.mark.parametrize("argv, key", [(["run=../elsewhere"], "'run'"), (["steps=abc"], "'steps'")])
def test_a_config_error_is_one_line_and_status_2(tmp_path, monkeypatch, capsys, argv, key):
    monkeypatch.chdir(tmp_path)
    assert demo.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("demo: config key " + key) and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_another_seed_reaches_the_drafter_s_init_and_data_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_run(args, **kwargs):
        calls.append(args[1:])
        if args[1:3] == ["-m", "train.report"]:
            fake_outputs(tmp_path, run="s2")

    monkeypatch.setattr("common.processes.subprocess.Popen", finished_process(fake_run))
    assert demo.main(["run=s2", "seed=2", "steps=5"]) == 0
    train_args = next(c for c in calls if c[1] == "train")
    assert {"run_name=s2", "optim.max_steps=5", "seed=2", "data.seed=2"} <= set(train_args)
