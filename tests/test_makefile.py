"""The Makefile passes what is typed on its command line to the commands word for word (issue 54):
every documented `make` line (README.md, docs/*.md, the Makefile's own header) runs for real with a
stand-in interpreter (`PY=`) that records the argument vector each command gets, which must be the
one the line means; values holding `&`, spaces, quotes, `$`, commas or `;` arrive as one argument;
a fresh clone's `make train` / `make bench-train` set-up prelude runs its two commands; and a few
real, cheap runs through the project's interpreter answer about the words given, not others."""

from __future__ import annotations

import shlex

import pytest

from tests.reliability.make_lines import (
    PRELUDE,
    TRICKY,
    argvs,
    documented_lines,
    expected,
    make_sandbox,
    real_make,
)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return make_sandbox(tmp_path_factory.mktemp("make"))


def test_the_docs_show_make_lines_of_every_kind():
    targets = {words[0] for _, words in documented_lines()}
    assert {"demo", "drafter", "extract", "train", "eval", "report", "export", "specdecode", "bench-gpu"} <= targets


def test_every_documented_make_line_reaches_its_command_word_for_word(sandbox):
    wrong = []
    for where, words in documented_lines():
        got = argvs(sandbox, words)
        if got != expected(words):
            wrong.append(f"{where}: make {shlex.join(words)}\n    got      {got}\n    expected {expected(words)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("target", ["drafter", "extract", "demo"])
def test_values_with_shell_characters_arrive_as_one_argument_each(sandbox, target):
    got = argvs(sandbox, [target, *TRICKY])
    assert got[-1][-len(TRICKY) :] == sorted(TRICKY, key=lambda w: w.split("=", 1)[0]), got
    assert got == expected([target, *TRICKY])
    assert not (sandbox / "pwned").exists()


def test_multi_word_run_and_args_are_passed_once(sandbox):
    assert argvs(sandbox, ["report", "RUN=runs/a runs/b", "ablated=loss.gamma"]) == [
        ["-m", "train.report", "runs/a", "runs/b", "ablated=loss.gamma"]
    ]
    assert argvs(sandbox, ["eval", "CKPT=runs/a", "DATA=d", "ARGS=--max-anchors 4"]) == [
        ["-m", "train.eval", "runs/a", "--data", "d", "--max-anchors", "4"]
    ]
    assert argvs(sandbox, ["train", "RUN=my run", "CONFIG=c.toml"]) == [["-m", "train", "c.toml", "run_name=my run"]]


@pytest.mark.parametrize("target", ["train", "bench-train"])
def test_a_fresh_clone_runs_the_set_up_prelude_before_the_command(sandbox, target):
    got = argvs(sandbox, [target])
    assert got[:2] == PRELUDE and len(got) == 3, got


def test_a_config_given_to_the_drafter_and_the_demos_reaches_them(sandbox):
    for target in ("drafter", "demo", "tiny", "smollm2"):
        assert argvs(sandbox, [target, "CONFIG=mine.toml", "a=1"])[-1][2:] == ["mine.toml", "a=1"], target


def test_real_runs_answer_about_the_words_given(tmp_path):
    """The project's own commands behind make: a report of two runs names the first (not the second twice);
    a word holding '&' reaches the extraction (which refuses the missing config: exit 2), not the shell
    (which would start it in the background and make exit 0)."""
    done = real_make(["report", f"RUN={tmp_path / 'a'} {tmp_path / 'b'}"], tmp_path)
    assert done.returncode == 2 and str(tmp_path / "a") in done.stderr, done.stderr
    uri = "s3://bucket/p?endpoint_override=127.0.0.1:9&scheme=http"
    done = real_make(["extract", f"CONFIG={tmp_path / 'none.toml'}", f"out_dir={uri}"], tmp_path)
    assert done.returncode == 2 and "none.toml" in done.stderr, done.stderr
