"""Ctrl-C ends every stage command with one line and status 130, not a KeyboardInterrupt traceback
(issue 28); the line says that rerunning the same command resumes."""

from __future__ import annotations

import pytest

from tests.reliability.cli import call_main


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("stage", ["extract", "regenerate", "train", "transcode"])
def test_ctrl_c_ends_with_one_line_and_status_130(stage, monkeypatch, tmp_path):
    if stage == "extract":
        from extract import pipeline
        from extract.__main__ import main
        from extract.ranks import Ranks

        monkeypatch.setattr(pipeline, "run", interrupt)
        monkeypatch.setattr(Ranks, "from_env", classmethod(lambda cls: cls()))
        args = [f"target={tmp_path}", f"corpus={tmp_path}", f"out_dir={tmp_path / 'out'}"]
    elif stage == "regenerate":
        from extract.regenerate import run as R
        from extract.regenerate.__main__ import main

        monkeypatch.setattr(R, "run", interrupt)
        args = [f"target={tmp_path}", f"corpus={tmp_path}", f"out={tmp_path / 'out'}"]
    elif stage == "train":
        import train.loop
        from train.__main__ import main

        monkeypatch.setattr(train.loop, "train", interrupt)
        args = [f"data.shards={tmp_path}", f"out_dir={tmp_path / 'runs'}"]
    else:
        import shards.__main__ as cli

        monkeypatch.setattr(cli, "transcode", interrupt)
        main, args = cli.main, ["transcode", str(tmp_path / "a"), str(tmp_path / "b"), "encoding=fp8"]
    code, stderr = call_main(main, args)
    assert code == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "rerun" in lines[0].lower(), stderr
