"""Every documented entry point answers `--help` without importing torch, and lists the allowed
values of its keys (a Literal key shows its values, never just its type)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.paths import REPO, child_pythonpath

ENTRY_POINTS = {
    # module: a line its help must hold (the allowed values of one of its keys, or an option)
    "extract": "dtype = 'bfloat16'  ('bfloat16' | 'float16' | 'float32')",
    "extract.regenerate": "backend = 'local'  ('local' | 'server')",
    "recipes.tiny": "precision = 'auto'  ('auto' | 'fp32' | 'bf16')",
    "extract.merge": "world = None  (int | none)  >= 1",
    "train": "precision = 'auto'  ('auto' | 'bf16' | 'fp32')",
    "train.eval": "precision = 'auto'  ('auto' | 'bf16' | 'fp32')",
    "train.serve.export": "dtype = 'bfloat16'  ('bfloat16' | 'float16' | 'float32')",
    "train.serve.specdecode": "dtype = 'float32'  ('float32' | 'bfloat16' | 'float16')",
    "train.report": "usage: python -m train.report RUN_DIR [RUN_DIR ...] [key=value | --key value ...]",
    "recipes.demo": "run = 'demo'  (str)",
    "recipes.drafter": "scale = 'full'  ('full' | 'smoke')",
    "recipes.compare_tiers": "budget = 32",
    "recipes.data_ladder": "prefix = 'ladder'  (str)",
    "shards": "python -m shards transcode SRC DST encoding=ENC",
    "shards transcode": "zstd_level = 1  (int)  range [1, 22]",
}


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """A PYTHONPATH entry whose `torch` fails to import, named in the error."""
    root = tmp_path_factory.mktemp("no_torch")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text('raise ImportError("--help imported torch")\n')
    return str(root)


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_help_needs_no_torch_and_lists_allowed_values(module, no_torch):
    command = module.split()  # `shards transcode`: a command word after the module
    done = subprocess.run(
        [sys.executable, "-m", *command, "--help"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=child_pythonpath(no_torch)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "imported torch" not in done.stderr
    assert ENTRY_POINTS[module] in done.stdout, done.stdout[-3000:]
    assert "(Literal)" not in done.stdout
