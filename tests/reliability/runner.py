"""Run an extraction or a training as a child process with a fault installed, optionally SIGKILLed by
the parent at a moment a `watch` callback picks.

Two modes:
- "process": a real `python -m tests.reliability.child extract|train ...` (the CLI path users run;
  ~4 s of start-up each). The full suite uses this.
- "fork": `os.fork()` of the current process, which already holds the loaded target, then
  `pipeline.run` / `train` in the child (~1 s each). The short pytest versions use this.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from tests.reliability import faults
from tests.reliability.world import REPO, World, child_env

MODES = ("process", "fork")


def watch_after_count(count: Callable[[], int], threshold: int, delay: float) -> Callable[[float], bool]:
    """A `watch` that fires `delay` seconds after `count()` (committed samples, logged steps, ...)
    first reaches `threshold`."""
    seen_at: list[float] = []

    def watch(elapsed: float) -> bool:
        if not seen_at and count() >= threshold:
            seen_at.append(elapsed)
        return bool(seen_at) and elapsed >= seen_at[0] + delay

    return watch


@dataclasses.dataclass
class ChildResult:
    status: int  # exit code, or -N for a death by signal N
    fired: list  # faults that fired (from the fault log)
    counts: dict  # points reached (only when the child exited normally)
    stderr: str
    seconds: float
    killed_by_parent: bool = False

    @property
    def killed(self) -> bool:
        return self.status == -signal.SIGKILL


def _status(raw: int) -> int:
    if os.WIFSIGNALED(raw):
        return -os.WTERMSIG(raw)
    return os.WEXITSTATUS(raw)


def run_stage(
    world: World,
    stage: str,
    *,
    config: Path | None = None,
    train_args: list[str] | None = None,
    fault: faults.Fault | None = None,
    mode: str = "fork",
    watch: Callable[[float], bool] | None = None,
    timeout: float = 300.0,
    default_threads: bool = False,
) -> ChildResult:
    """Run `stage` ("extract" with `config`, or "train" with `train_args`) with `fault` in a child.

    `watch(elapsed_seconds)` is polled every few milliseconds while the child runs; when it returns
    True the parent SIGKILLs the child (a kill at a random moment). `default_threads`: the child
    runs with torch's own thread count instead of one (process mode only).
    """
    assert mode in MODES, mode
    if mode == "fork" and _parent_used_cuda():
        # torch refuses CUDA and multithreaded autograd in a child forked after the parent used CUDA
        # (an earlier test in this pytest worker may have): the same scenario in a fresh process.
        mode = "process"
    assert not default_threads or mode == "process", "a forked child keeps the parent's one thread"
    assert (stage == "extract") == (config is not None) and (stage == "train") == (train_args is not None)
    with tempfile.TemporaryDirectory(prefix="fault-") as tmp:
        log_path = Path(tmp) / "fault.jsonl"
        err_path = Path(tmp) / "stderr.txt"
        start = time.perf_counter()
        if mode == "process":
            wait, kill = _start_process(stage, config, train_args, fault, log_path, err_path, default_threads)
        else:
            wait, kill = _start_fork(world, stage, config, train_args, fault, log_path, err_path)
        status, by_parent = _supervise(wait, kill, watch, timeout, start)
        seconds = time.perf_counter() - start
        fired, counts = faults.read_log(log_path)
        stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
    return ChildResult(status, fired, counts, stderr, seconds, by_parent)


def _supervise(wait, kill, watch, timeout, start) -> tuple[int, bool]:
    by_parent = False
    while True:
        status = wait()
        if status is not None:
            return status, by_parent
        elapsed = time.perf_counter() - start
        if not by_parent and ((watch is not None and watch(elapsed)) or elapsed > timeout):
            kill()
            by_parent = True
        time.sleep(0.003)


def _start_process(stage, config, train_args, fault, log_path, err_path, default_threads=False):
    env = child_env(threads=None if default_threads else 1)
    env[faults.ENV_LOG] = str(log_path)
    if fault is not None:
        env[faults.ENV_FAULT] = fault.spec
    args = [str(config)] if stage == "extract" else list(train_args)
    with open(err_path, "w") as err:  # the child holds its own copy of the handle
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.child", stage, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )

    def wait():
        code = proc.poll()
        return None if code is None else code

    def kill():
        proc.send_signal(signal.SIGKILL)

    return wait, kill


def _parent_used_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _start_fork(world, stage, config, train_args, fault, log_path, err_path):
    if stage == "extract":
        world.target  # noqa: B018 (loads it): load in the parent once; every child shares it
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.environ[faults.ENV_LOG] = str(log_path)
            faults.install(fault)
            _run_in_child(world, stage, config, train_args)
            faults.dump_counts()
            code = 0
        except BaseException:  # noqa: BLE001 - report and exit; the parent reads the status
            with open(err_path, "a") as f:
                f.write(traceback.format_exc())
        finally:
            os._exit(code)

    def wait():
        done, raw = os.waitpid(pid, os.WNOHANG)
        return _status(raw) if done else None

    def kill():
        os.kill(pid, signal.SIGKILL)

    return wait, kill


def _run_in_child(world, stage, config, train_args) -> None:
    import logging

    logging.disable(logging.CRITICAL)  # the parent's handlers may hold locks copied by fork
    if stage == "extract":
        from common.config import load_config
        from extract import pipeline
        from extract.config import ExtractConfig
        from extract.ranks import Ranks

        cfg = load_config(ExtractConfig, config, section="extract")
        pipeline.run(cfg, target=world.target, ranks=Ranks())
    else:
        from common.config import load_config
        from train.config import TrainConfig
        from train.loop import train

        train(load_config(TrainConfig, None, train_args))
