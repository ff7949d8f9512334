"""The repository root and the PYTHONPATH of child processes the tests start.

A child must import the repository and everything its parent imports: on a machine without an
installed venv the packages come from PYTHONPATH (the GPU image carries wheels in /tmp/site), so
the repository is put in front of the parent's PYTHONPATH, never in its place.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_pythonpath(*first: str) -> str:
    """`first` paths, the repository, then the parent's PYTHONPATH."""
    return os.pathsep.join(p for p in (*first, str(REPO), os.environ.get("PYTHONPATH", "")) if p)
