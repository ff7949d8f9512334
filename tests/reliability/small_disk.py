"""Full disks for real: a stage's command with its output on a small tmpfs, then the same command
again after the disk has grown.

The file system is made by the test: a child process in its own user and mount namespaces
(`unshare --user --map-root-user --mount`, which needs no privileges where the kernel allows
unprivileged user namespaces) mounts a tmpfs of `size_kb` on an empty directory, runs the stage's
real command line entry point there (in the child, so what it writes goes through the operating
system's own ENOSPC, including torch's and safetensors' native writers), lists what it left,
remounts the tmpfs larger and runs the command again, then copies the finished output out of the
namespace for the parent to compare with a clean run. Where namespaces are not allowed,
`unavailable()` says why and the scenario runs with injected ENOSPC alone (`io_errors`).

    python -m tests.reliability.small_disk SPEC.json     # the child; SPEC written by `run_case`
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.reliability.world import REPO, child_env

MAINS = {
    "extract": "extract.__main__",
    "transcode": "shards.__main__",
    "transcode_wide": "shards.__main__",
    "regenerate": "extract.regenerate.__main__",
    "train": "train.__main__",
    "train_optimizer": "train.__main__",
}
GROWN_KB = 512 * 1024


def unavailable() -> str | None:
    """Why a small tmpfs cannot be made here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "no unshare / mount command"
    with tempfile.TemporaryDirectory() as where:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where} && touch {where}/x"],
            capture_output=True,
            text=True,
        )
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a user namespace: {probe.stderr.strip()[:200]}"
    return None


def disk_bytes(path: Path) -> int:
    """What the files under `path` take on a tmpfs: whole 4 kB pages."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in Path(path).rglob("*") if p.is_file())


def run_case(stage: str, args: list[str], *, disk: Path, size_kb: int, output: str, keep: Path) -> dict:
    """Run `stage` with `args` on a `size_kb` tmpfs mounted at `disk`, then again with room; `output`
    (relative to `disk`) is copied to `keep`. Returns the child's report: first (status, stderr),
    temporaries left, second (status, stderr)."""
    disk.mkdir(parents=True, exist_ok=True)
    spec = keep.with_suffix(".spec.json")
    report = keep.with_suffix(".report.json")
    spec.write_text(
        json.dumps(
            {
                "stage": stage,
                "args": args,
                "disk": str(disk),
                "size_kb": size_kb,
                "output": output,
                "keep": str(keep),
                "report": str(report),
            }
        )
    )
    done = subprocess.run(
        ["unshare", "-rm", sys.executable, "-m", "tests.reliability.small_disk", str(spec)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=600,
    )
    if not report.exists():
        return {"error": f"the child failed ({done.returncode}): {done.stderr[-1500:]}"}
    return json.loads(report.read_text())


def temporaries(root: Path) -> list[str]:
    """Temporary files and directories a writer left (`*.tmp`, `.tmp-` checkpoint directories)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(".tmp") or ".tmp-" in p.name)


def _child(spec: dict) -> dict:
    import importlib

    from tests.reliability.cli import call_main

    disk = spec["disk"]
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['size_kb']}k", "tmpfs", disk], check=True)
    main = importlib.import_module(MAINS[spec["stage"]]).main
    first = call_main(main, spec["args"])
    left = temporaries(Path(disk))
    subprocess.run(["mount", "-o", f"remount,size={GROWN_KB}k", disk], check=True)
    second = call_main(main, spec["args"])
    output = Path(disk) / spec["output"]
    if output.exists():
        shutil.copytree(output, spec["keep"], dirs_exist_ok=True)
    return {"first": list(first), "left": left, "second": list(second)}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.reliability.world import single_thread

    single_thread()
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(spec["report"]).write_text(json.dumps(_child(spec)))
