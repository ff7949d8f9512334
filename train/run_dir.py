"""The run directory: one training per directory, a start that is refused leaves nothing behind.

`claim_run_dir` is the first thing `train.prepare.Run.prepare` does, before anything is read or
written: it names the directory (rank 0's name for every rank), creates it, checks that every
rank sees it (data parallel: `out_dir` must be shared) and takes rank 0's lock on it
(`common.locks`); `release_run_dir` undoes a start that goes no further.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from common.locks import LockedError, exclusive_lock
from train.config import TrainConfig
from train.distributed import Dist

__all__ = ["claim_run_dir", "release_run_dir"]


def claim_run_dir(cfg: TrainConfig, dist: Dist) -> tuple[Path, object, list[Path]]:
    """(run directory, its lock, the directories this start created): one training per run directory.
    Rank 0 holds the lock; a second training stops at once on every rank, naming the holder
    (the OS drops the lock of a killed one)."""
    lock, problem = None, None
    run_dir, created = _make_run_dir(cfg, dist)
    if dist.is_main:
        try:
            lock = exclusive_lock(
                str(run_dir / ".train.lock"),
                what=f"the run directory {run_dir}",
                hint="Two trainings into one run would corrupt its checkpoints and metrics: wait for the other, "
                "or choose another run_name.",
            )
        except LockedError as exc:
            if dist.world_size == 1:
                raise
            problem = str(exc)
    try:
        dist.agree(problem)
    except BaseException:
        release_run_dir(run_dir, lock, created=[])  # the directory is the other training's
        raise
    return run_dir, lock, created


def release_run_dir(run_dir: Path, lock, *, created: list[Path]) -> None:  # noqa: ARG001 (takes claim_run_dir's result)
    """Unlock; a refused start leaves none of the directories it created behind (only empty ones go)."""
    if lock is not None:
        lock.release()
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            directory.rmdir()


def _make_run_dir(cfg: TrainConfig, dist: Dist) -> tuple[Path, list[Path]]:
    """(the run directory, the directories rank 0 created for it now)."""
    # One name for every rank (a default name holds the time, which the ranks would read apart).
    name = dist.broadcast(cfg.run_name or time.strftime("run-%Y%m%d-%H%M%S"))
    out = Path(cfg.out_dir).resolve()
    run_dir = (out / name).resolve()
    if run_dir.parent != out:  # run_name is a plain name, so only a symlink out_dir/NAME gets here
        raise ValueError(
            f"config key 'run_name': '{out / name}' leads to '{run_dir}', outside out_dir '{out}'; choose another "
            "run_name"
        )
    # The directories this start creates (out_dir too, when new): a refused start removes them again.
    created = [d for d in (out, run_dir) if not d.exists()] if dist.is_main else []
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    if dist.world_size > 1:  # every rank reads rank 0's checkpoints: the run directory must be shared
        token = dist.broadcast(f".ranks-{time.time_ns()}-{dist.peers[0]['pid']}")
        if dist.is_main:
            (run_dir / token).touch()
        dist.gather_objects(None)  # a barrier over the host group
        seen = (run_dir / token).exists()
        problem = (
            None
            if seen
            else (
                f"config key 'out_dir': rank {dist.rank} on {dist.peers[dist.rank]['host']} does not see the run "
                "directory "
                f"'{run_dir}' that rank 0 created; out_dir must be on a filesystem every node shares"
            )
        )
        try:
            dist.agree(problem)
        finally:
            if dist.is_main:
                (run_dir / token).unlink(missing_ok=True)
    return run_dir, created
