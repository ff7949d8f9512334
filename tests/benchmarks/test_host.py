"""A device host made ready (benchmarks.suites.host): the modules the project needs are derived from its source
and pyproject.toml, not listed by hand; a module that does not import is named in one line with the wheel to
carry, including a module's own missing dependency (botocore without jmespath)."""

from __future__ import annotations

import os
import sys

import pytest

from benchmarks.suites import host


def test_the_project_needs_what_it_imports_at_the_top_and_its_declared_dependencies():
    needed = host.needed_modules()
    # botocore at the top of common.objstore; zstandard and datasets declared and imported inside functions
    assert {"torch", "transformers", "pyarrow", "botocore", "zstandard", "datasets", "xxhash"} <= set(needed)
    assert not {"json", "openai", "fla", "moto", "common", "tests"} & set(needed)  # stdlib, server client, optional


def test_the_derivation_on_a_planted_tree(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["Foo-Bar>=1", "unused", "openai"]\n'
    )
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "a.py").write_text(
        "import os\nimport numpy as np\nfrom common import b\nif True:\n    import top_in_if\n"
        "try:\n    import fla\nexcept ImportError:\n    fla = None\n"
        "def f():\n    import foo_bar\n    import not_declared\n    import openai\n"
    )
    assert host.needed_modules(tmp_path, ("common",)) == ["foo_bar", "numpy", "top_in_if"]


def test_a_missing_module_and_a_missing_dependency_are_named_with_their_wheels(tmp_path):
    (tmp_path / "fakeboto").mkdir()
    (tmp_path / "fakeboto" / "__init__.py").write_text("import fakejmes_missing\n")
    (tmp_path / "brokenmod.py").write_text("raise RuntimeError('built for another CUDA')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    found = host.missing(["json", "fakeboto", "fla", "brokenmod"], env)
    assert found == {
        "fakeboto": "fakejmes_missing",
        "fla": None,
        "brokenmod": "RuntimeError: built for another CUDA",
    }
    line = host.missing_line(found, ".whl")
    assert "\n" not in line and "fakeboto (it imports fakejmes_missing: wheel fakejmes_missing)" in line
    assert "fla (wheel fla-core)" in line and "brokenmod (RuntimeError: built for another CUDA)" in line
    assert "fetch-wheels.sh" in line


def test_ready_refuses_in_one_line_before_anything_runs_and_remembers_a_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "SITE", str(tmp_path / "site"))
    with pytest.raises(SystemExit) as stopped:
        host.ready(str(tmp_path / "no-wheels"), ["json", "surely_not_installed_xyz"], tmp_path)
    assert str(stopped.value).startswith("benchmarks.suites: not importable here: surely_not_installed_xyz (wheel")
    env = host.ready(str(tmp_path / "no-wheels"), ["json"], tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)  # no wheels: the repository first
    assert len(list((tmp_path / "site").glob(".importable-*"))) == 1  # the next command skips the check
    monkeypatch.setattr(host, "missing", lambda *a: pytest.fail("checked again"))
    host.ready(str(tmp_path / "no-wheels"), ["json"], tmp_path)


def test_the_suites_command_stops_at_a_missing_wheel(tmp_path, monkeypatch, capsys):
    from benchmarks.suites import __main__ as suites_main

    monkeypatch.setattr(suites_main, "needed_modules", lambda: ["surely_not_installed_xyz"])
    monkeypatch.setattr(host, "SITE", str(tmp_path / "site"))
    monkeypatch.setattr(sys, "argv", ["x"])
    with pytest.raises(SystemExit, match="not importable here: surely_not_installed_xyz"):
        suites_main.main(["shape27b", "--wheels", str(tmp_path / "none")])
