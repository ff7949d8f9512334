"""Tool version and git sha, recorded in every output so results can be traced to code."""

from __future__ import annotations

import functools
import os
import subprocess
from importlib import metadata

PACKAGE = "dflash-offline"


@functools.lru_cache(maxsize=1)
def tool_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "0+unknown"


@functools.lru_cache(maxsize=1)
def git_sha() -> str:
    """The checkout's commit, with '-dirty' if it has uncommitted changes; 'unknown' outside git."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict:
    return {"tool_version": tool_version(), "git_sha": git_sha()}
