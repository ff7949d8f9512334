"""Short version of scenario 6: load sites, code-running pickles and extension types, remote code, and
where each tool may write."""

from __future__ import annotations

from tests.reliability import security


def test_security_checks(world, tmp_path):
    outcome = security.run(world, work=tmp_path, examples=40)
    assert outcome.passed, outcome.explain()


def test_the_source_scan_finds_an_unsafe_load(tmp_path, monkeypatch):
    """The scan can fail: a torch.load without weights_only and a pickle import are reported."""
    pkg = tmp_path / "train"
    pkg.mkdir()
    (pkg / "bad.py").write_text(
        "import pickle\nimport torch\nx = torch.load('f.pt')\ny = AutoTokenizer.from_pretrained('d')\n"
    )
    monkeypatch.setattr(security, "REPO", tmp_path)
    monkeypatch.setattr(security, "PACKAGES", ("train",))
    found = security.scan_sources()
    assert found["torch_load_unsafe"] == ["train/bad.py:3"]
    assert found["pickle_imports"] == ["train/bad.py:1"]
    assert found["trust_remote_code_unset"] == ["train/bad.py:4"]
