"""`python -m recipes.data_ladder`: growing shares of one training set, each trained and evaluated."""

from __future__ import annotations

import json

from tests.paths import child_pythonpath
from tests.train.test_loop import make_tiny, tiny_run_args


def test_ladder_trains_each_share_and_evaluates_it(tmp_path, monkeypatch):
    from recipes import data_ladder

    tiny = make_tiny(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", child_pythonpath())
    words = [w for w in tiny_run_args(tiny, tmp_path / "unused") if not w.startswith(("out_dir=", "optim.max_steps"))]
    out, config = tmp_path / "ladder.json", tmp_path / "ladder.toml"
    config.write_text("[train]\n")
    argv = ["--eval", str(tiny / "shards"), "--fractions", "0.5,1", "--steps", "2", "--out", str(out)]
    argv += ["--eval-split", "all", *words]  # the tiny set has no held-out split: measure it on purpose
    assert data_ladder.main([str(config), *argv]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["fraction"] for r in rows] == [0.5, 1.0]
    assert 0 < rows[0]["samples"] < rows[1]["samples"]
    for row in rows:
        assert row["total_steps"] == 2 and row["epochs"] > 0 and row["tokens_seen"] > 0
        assert row["shards"]["tau"] >= 1.0 and row["shards"]["n_blocks"] > 0


def test_bad_arguments_and_eval_sets_are_one_line_before_any_training(tmp_path, monkeypatch, capsys):
    """Issue 45: tracebacks for bad arguments, and `--eval` checked only after a run had trained."""
    import pytest

    from recipes import data_ladder

    tiny = make_tiny(tmp_path / "tiny")
    config = tmp_path / "ladder.toml"
    config.write_text("[train]\n")
    monkeypatch.setattr(data_ladder, "train_share", lambda *a: pytest.fail("a run was trained"))
    shards = str(tiny / "shards")
    capsys.readouterr()  # what building the tiny target printed
    cases = [
        ([str(config), "--eval", str(tmp_path / "missing")], "--eval: no shards dataset at"),
        ([str(config), "--eval", "s3://?x=1"], "--eval: 's3://?x=1': no bucket in the URI"),
        ([str(config), "--eval", shards, "--fractions", "abc"], "--fractions: expected comma-separated shares"),
        ([str(config), "--eval", shards, "--fractions", "0,2"], "--fractions: expected comma-separated shares"),
        ([str(config), "--eval", shards, "--steps", "0"], "--steps: expected a positive number"),
        ([str(tmp_path / "no.toml"), "--eval", shards], "config file"),
        ([str(config), "--eval", shards, "optim.lr=abc"], "config key 'optim.lr'"),
    ]
    for argv, said in cases:
        assert data_ladder.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("data_ladder: ") and said in err and "\n" not in err, err
