"""Whether a local directory can take an output, on the standard library alone: the device host's
carrying step (`benchmarks.carry`, through `recipes.smollm2.pins`) runs before any wheel is installed."""

from __future__ import annotations

import os
import tempfile


def writable_dir_problem(root: str) -> str | None:
    """None if the local directory `root` exists or can be created, and something can be written in it."""
    existing = root
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == root else f"lies under '{existing}', which is a file"
        return f"'{root}' {where}, not a directory; choose another path"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable by this user; choose another path"
    # os.access answers yes for root, and on file systems where nothing can be made (/proc, /sys,
    # a read-only mount): make (and remove) a directory there to know.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dflash-probe-", dir=existing))
    except OSError as err:
        return f"cannot create anything under '{existing}' ({err.strerror or err}); choose another path"
    return None
