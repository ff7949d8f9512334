"""A pytest plugin (`-p tests.gpu_tier_report`, loaded by `tests.gpu_tier`): the run's counts written as JSON to
$DFLASH_GPU_TIER_SUMMARY after every test and at the end, so a run stopped by a deadline still says what ran.

    {"collected", "ran", "passed", "failed", "errors", "skipped", "finished", "pytest_exit", "seconds",
     "running": [tests started and not ended], "failures": [...], "tests": {nodeid: {"outcome", "seconds"}}}

`tests.gpu_tier` adds the machine, the wall time and whether its deadline stopped the run.

Under pytest-xdist only the controlling process writes (the workers' reports reach it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

STATE: dict = {}


def _controller(config) -> bool:
    return bool(os.environ.get("DFLASH_GPU_TIER_SUMMARY")) and not hasattr(config, "workerinput")


def pytest_configure(config):
    if not _controller(config):
        return
    STATE.update(path=Path(os.environ["DFLASH_GPU_TIER_SUMMARY"]), started=time.time(), collected=0, tests={})
    STATE.update(running=set(), finished=False, exitstatus=None)
    _write()


def pytest_collection_finish(session):
    if STATE and not hasattr(session.config, "workerinput"):
        STATE["collected"] = max(STATE["collected"], len(session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if STATE:
        STATE["collected"] = max(STATE["collected"], len(ids))


def pytest_runtest_logstart(nodeid, location):
    if STATE:
        STATE["running"].add(nodeid)
        _write()


def pytest_runtest_logreport(report):
    """A test's outcome from its phases: an error in setup or teardown, a skip, else its call's outcome."""
    if not STATE:
        return
    test = STATE["tests"].setdefault(report.nodeid, {"outcome": None, "seconds": 0.0})
    test["seconds"] = round(test["seconds"] + report.duration, 2)
    if report.failed and report.when != "call":
        test["outcome"] = "error"
    elif report.skipped:
        test["outcome"] = test["outcome"] or "skipped"
    elif report.when == "call":
        test["outcome"] = "failed" if report.failed else "passed"
    if report.when == "teardown":
        STATE["running"].discard(report.nodeid)
        _write()


def pytest_sessionfinish(session, exitstatus):
    if STATE and not hasattr(session.config, "workerinput"):
        STATE.update(finished=True, exitstatus=int(exitstatus))
        _write()


def _write() -> None:
    outcomes = [t["outcome"] for t in STATE["tests"].values()]
    count = {k: outcomes.count(k) for k in ("passed", "failed", "error", "skipped")}
    found = {
        "collected": STATE["collected"],
        "ran": sum(count.values()),
        "passed": count["passed"],
        "failed": count["failed"],
        "errors": count["error"],
        "skipped": count["skipped"],
        "finished": STATE["finished"],
        "pytest_exit": STATE["exitstatus"],
        "seconds": round(time.time() - STATE["started"], 1),
        "running": sorted(STATE["running"]),
        "failures": sorted(n for n, t in STATE["tests"].items() if t["outcome"] in ("failed", "error")),
        "tests": STATE["tests"],
    }
    tmp = STATE["path"].with_name(STATE["path"].name + ".tmp")
    tmp.write_text(json.dumps(found, indent=1) + "\n")
    os.replace(tmp, STATE["path"])
