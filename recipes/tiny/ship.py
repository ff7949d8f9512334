"""`python -m recipes.tiny.ship [source=artifacts/tiny] [dest=DIR]`: make a finished
`python -m recipes.tiny target=train` build the shipped tiny default (`recipes.tiny.shipped`), the
corpus and target every machine's demo then starts from. A maintainer's command: run it when the
tiny target's recipe changes on purpose, and commit recipes/tiny/shipped/.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from common.config import ConfigError, knob, parse_cli
from common.interrupts import run_main
from recipes.tiny.shipped import SHIPPED_DIR, ship_build


@dataclasses.dataclass(frozen=True)
class ShipConfig:
    """`python -m recipes.tiny.ship [key=value ...]`: ship a finished build as the tiny default."""

    source: str = knob("artifacts/tiny", help="a finished `python -m recipes.tiny target=train` build", path="local_in")
    dest: str = knob(
        "", help="where the shipped build goes; empty = the repository's recipes/tiny/shipped/", path="dir_out"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_cli(ShipConfig, sys.argv[1:] if argv is None else argv)
        manifest = ship_build(Path(cfg.source), Path(cfg.dest) if cfg.dest else None)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    print(
        f"shipped {len(manifest['files'])} files ({total / 1e6:.1f} MB) from {cfg.source} to {cfg.dest or SHIPPED_DIR}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("tiny ship", main))
