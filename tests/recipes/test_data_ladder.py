"""`python -m recipes.data_ladder`: growing shares of one training set, each trained and evaluated
through the recipes' step runner."""

from __future__ import annotations

import json

import pytest

from tests.paths import child_pythonpath
from tests.train.test_loop import make_tiny, tiny_run_args


def test_ladder_trains_each_share_evaluates_it_and_a_rerun_skips_what_is_done(tmp_path, monkeypatch, capsys):
    from recipes import data_ladder

    tiny = make_tiny(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", child_pythonpath())
    words = [w for w in tiny_run_args(tiny, tmp_path / "runs") if not w.startswith("optim.max_steps")]
    out, config = tmp_path / "ladder.json", tmp_path / "ladder.toml"
    config.write_text("[train]\n")
    argv = [str(config), f"heldout=['{tiny / 'shards'}']", "fractions=[0.5, 1]", "steps=2", f"out={out}"]
    argv += [
        f"train_overrides={json.dumps(words)}",
        "eval_overrides=['split=all', 'max_anchors=16']",
    ]  # no held-out split
    assert data_ladder.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["fraction"] for r in rows] == [0.5, 1.0]
    assert 0 < rows[0]["samples"] < rows[1]["samples"]
    for row in rows:
        assert row["total_steps"] == 2 and row["epochs"] > 0 and row["tokens_seen"] > 0
        assert row["shards"]["tau"] >= 1.0 and row["shards"]["n_blocks"] > 0
        assert row["run"].startswith(str(tmp_path / "runs"))  # the training config's out_dir
    capsys.readouterr()
    assert data_ladder.main(argv) == 0
    assert capsys.readouterr().out.count("done with the same command and inputs, skipped") == 4
    assert json.loads(out.read_text())["rows"] == rows


def test_bad_arguments_and_heldout_sets_are_one_line_before_any_training(tmp_path, monkeypatch, capsys):
    """Issue 45: tracebacks for bad arguments, and held-out sets checked only after a run had trained;
    issue 53: the old options are refused in one line naming the keys that replace them."""
    from recipes import data_ladder

    tiny = make_tiny(tmp_path / "tiny")
    config = tmp_path / "ladder.toml"
    config.write_text("[train]\n")
    monkeypatch.setattr(data_ladder, "ladder", lambda *a: pytest.fail("a run was trained"))
    shards = f"heldout=['{tiny / 'shards'}']"
    capsys.readouterr()  # what building the tiny target printed
    cases = [
        ([str(config), f"heldout=['{tmp_path / 'missing'}']"], "config key 'heldout': no shards dataset at"),
        ([str(config), "heldout=['s3://?x=1']"], "config key 'heldout': 's3://?x=1': no bucket in the URI"),
        ([str(config), shards, "fractions=abc"], "config key 'fractions'"),
        ([str(config), shards, "fractions=[0, 2]"], "config key 'fractions': expected shares in (0, 1]"),
        ([str(config), shards, "steps=0"], "config key 'steps'"),
        ([str(tmp_path / "no.toml"), shards], "config file"),
        ([str(config), shards, "train_overrides=['optim.lr=abc']"], "config key 'optim.lr'"),
        ([str(config), "--eval", str(tiny / "shards"), "--fractions", "0.5,1"], "'--eval' is the ladder's old"),
    ]
    for argv, said in cases:
        assert data_ladder.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("data_ladder: ") and said in err and "\n" not in err, err
