"""Scenario 5's object-store and damaged-data families (issue 45), against a real S3 server
(`moto_server` on loopback, `benchmarks.s3_server`) and local copies of the reference dataset.

- store_setup: a missing bucket, no bucket in the URI, a scheme not served here (hdfs://), missing
  credentials, a bad DFLASH_LOCK_LEASE_S / DFLASH_S3_OUTAGE_S, through train, extract,
  regenerate, shards transcode and shards verify: exit 2, one line naming the key or setting, no
  "rerun to resume", nothing written.
- store_gone: training from S3 through a proxy (`DelayProxy`) that goes away mid-run. For a few
  seconds: the run waits and ends with the uninterrupted run's losses, step for step. For good: exit
  4, one line saying the store is unreachable (not that a shard is corrupt), and the same command
  after the store is back ends with the uninterrupted run's losses and weights.
- train_damage: a flipped byte in a shard, every index object gone, a shard file gone, on a local
  disk and on S3: exit 2, one line naming the object and pointing at `python -m shards verify`, no
  "rerun" hint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

from tests.reliability.cli import call_main, one_line_problems
from tests.reliability.train_kills import compare_runs, train_extra
from tests.reliability.world import World

NO_RESUME_HINT = ("rerun", "resum")
STEPS, EVERY = 12, 3


@contextlib.contextmanager
def environment(**values: str | None):
    """os.environ with `values` set (None: removed), restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


NO_CREDENTIALS = dict(
    AWS_ACCESS_KEY_ID=None,
    AWS_SECRET_ACCESS_KEY=None,
    AWS_SESSION_TOKEN=None,
    AWS_PROFILE=None,
    AWS_SHARED_CREDENTIALS_FILE="/nonexistent/credentials",
    AWS_CONFIG_FILE="/nonexistent/config",
    AWS_EC2_METADATA_DISABLED="true",
)


def upload_reference(world: World, server, name: str) -> str:
    """The reference dataset copied into a fresh bucket on `server`; its URI."""
    from shards.__main__ import main as shards_main

    bucket = f"rel-{name}-{uuid.uuid4().hex[:8]}"
    server.create_bucket(bucket)
    uri = server.uri(f"{bucket}/base")
    code, err = call_main(shards_main, ["transcode", str(world.baseline), uri, "encoding=planes", "progress=false"])
    assert code == 0, err[-600:]
    return uri


def extract_config_to(world: World, work: Path, out_uri: str) -> str:
    """A config file in `work` for an extraction into `out_uri` (the world writes one beside a local out_dir)."""
    local = work / f"store-extract-{len(list(work.glob('store-extract-*.toml')))}"
    config = world.extract_config(local)
    config.write_text(config.read_text().replace(str(local), out_uri))
    return str(config)


def setup_cases(world: World, tally, work: Path, server) -> None:
    from extract.__main__ import main as extract_main
    from extract.regenerate.__main__ import main as regenerate_main
    from shards.__main__ import main as shards_main
    from train.__main__ import main as train_main

    good = upload_reference(world, server, "setup")
    missing = server.uri("no-such-bucket/data")
    no_bucket = good.replace(good.split("://", 1)[1].split("?", 1)[0], "", 1)
    sibling = good.replace("/base?", "/base-out?")
    runs = work / "store-setup-runs"
    train = lambda shards, *extra: (train_main, world.train_args(runs, "s", "optim.max_steps=1", *extra, shards=shards))  # noqa: E731
    extract = lambda out: (extract_main, [extract_config_to(world, work, out)])  # noqa: E731
    cases = [
        ("train, a missing bucket", {}, *train(missing), ("data.shards", "does not exist")),
        ("train, no bucket in the URI", {}, *train(no_bucket), ("data.shards", "no bucket")),
        ("train, hdfs://", {}, *train("hdfs://namenode/data"), ("data.shards", "not served here")),
        ("train, no credentials", NO_CREDENTIALS, *train(good), ("data.shards", "no S3 credentials")),
        ("train, DFLASH_S3_OUTAGE_S=abc", {"DFLASH_S3_OUTAGE_S": "abc"}, *train(good), ("DFLASH_S3_OUTAGE_S",)),
        ("train, out_dir on S3", {}, *train(good, f"out_dir={server.uri('runs/x')}"), ("out_dir", "local")),
        ("extract, a missing bucket", {}, *extract(missing), ("out_dir", "does not exist")),
        ("extract, DFLASH_LOCK_LEASE_S=-5", {"DFLASH_LOCK_LEASE_S": "-5"}, *extract(sibling), ("LEASE",)),
        ("extract, no credentials", NO_CREDENTIALS, *extract(sibling), ("out_dir", "no S3 credentials")),
        (
            "regenerate, a missing bucket",
            {},
            regenerate_main,
            [f"target={world.target_dir}", f"corpus={world.corpus}", f"out={missing}", "backend=local"],
            ("out", "does not exist"),
        ),
        ("transcode, a missing bucket", {}, shards_main, ["transcode", good, missing, "encoding=fp8"], ("DST",)),
        ("transcode, hdfs://", {}, shards_main, ["transcode", good, "hdfs://nn/x", "encoding=fp8"], ("DST",)),
        ("verify, a missing bucket", {}, shards_main, ["verify", missing], ("dir", "does not exist")),
    ]
    before = sorted(p.name for p in work.iterdir())
    for name, env, main, args, says in cases:
        with environment(**env):
            code, stderr = call_main(main, args)
        problems, line = one_line_problems(code, stderr, exit_code=2, says=says, never=NO_RESUME_HINT)
        tally.add("store_setup:" + name.split(",")[0], not problems, f"{name}: {'; '.join(problems)}")
    written = sorted(set(p.name for p in work.iterdir()) - set(before) - {"store-setup-runs"})
    tally.add("store_setup:nothing written", not written, f"setup errors left files behind: {written}")


def _down_after_steps(proxy, metrics: Path, steps: int, for_s: float | None, done: threading.Event) -> None:
    """Cut the store once the run has logged `steps` steps; back after `for_s` seconds (None: never)."""
    while not done.is_set() and _lines(metrics) < steps:
        time.sleep(0.005)
    if done.is_set():
        return
    proxy.down()
    proxy.cut_mid_run = True
    if for_s is not None:
        done.wait(for_s)
        proxy.up()


def _lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def _train_through(proxy, world: World, runs: Path, name: str, uri_path: str, outage_s: float | None):
    """Train from the store behind `proxy`, which goes away after step 3 (for `outage_s` seconds)."""
    from train.__main__ import main as train_main

    done = threading.Event()
    metrics = runs / name / "metrics.jsonl"
    watcher = threading.Thread(target=_down_after_steps, args=(proxy, metrics, 3, outage_s, done), daemon=True)
    watcher.start()
    args = world.train_args(runs, name, *train_extra(STEPS, EVERY), shards=proxy.uri(uri_path))
    try:
        return call_main(train_main, args)
    finally:
        done.set()
        watcher.join()
        proxy.up()


def gone_cases(world: World, tally, work: Path, server) -> None:
    from benchmarks.s3_server import DelayProxy
    from train.__main__ import main as train_main

    uri = upload_reference(world, server, "gone")
    uri_path = uri.split("://", 1)[1].split("?", 1)[0]
    runs = work / "store-gone-runs"
    code, stderr = call_main(train_main, world.train_args(runs, "reference", *train_extra(STEPS, EVERY), shards=uri))
    if code != 0:
        tally.add("store_gone:reference", False, f"the reference run from S3 failed ({code}): {stderr[-400:]}")
        return
    with environment(DFLASH_S3_RETRIES="1", DFLASH_S3_OUTAGE_S="60"), DelayProxy(server.port, 0.01) as proxy:
        proxy.cut_mid_run = False
        code, stderr = _train_through(proxy, world, runs, "a-while", uri_path, outage_s=3.0)
        problems = [f"exit {code}: {stderr.strip()[-300:]}"] if code != 0 else []
        problems += [] if proxy.cut_mid_run else ["the run ended before the store went away: nothing was tested"]
        problems += compare_runs(runs / "a-while", runs / "reference", STEPS)[0]
        tally.add("store_gone:for a while", not problems, f"a store gone for 3 s mid-run: {'; '.join(problems)}")
    with environment(DFLASH_S3_RETRIES="1", DFLASH_S3_OUTAGE_S="2"), DelayProxy(server.port, 0.01) as proxy:
        code, stderr = _train_through(proxy, world, runs, "for-good", uri_path, outage_s=None)
        problems, line = one_line_problems(
            code, stderr, exit_code=4, says=("the store is unreachable",), never=("corrupt", "verify")
        )
        code, stderr = call_main(
            train_main, world.train_args(runs, "for-good", *train_extra(STEPS, EVERY), shards=proxy.uri(uri_path))
        )
        problems += [f"the rerun failed ({code}): {stderr[-300:]}"] if code != 0 else []
        problems += compare_runs(runs / "for-good", runs / "reference", STEPS)[0] if code == 0 else []
        tally.add("store_gone:for good", not problems, f"a store gone for good: {'; '.join(problems)} <- {line}")


def damaged_copies(world: World, work: Path) -> dict[str, tuple[Path, str]]:
    """{case: (local damaged copy of the reference dataset, the object the message must name)}."""
    import json

    shards = json.loads((world.baseline / "manifest.json").read_text())["shards"]
    cases = {}
    for case in ("flipped byte", "every index gone", "a shard gone"):
        root = work / f"damaged-{case.replace(' ', '-')}"
        shutil.copytree(world.baseline, root, dirs_exist_ok=True)
        entry = shards[len(shards) // 2]
        if case == "flipped byte":
            data = bytearray((root / entry["file"]).read_bytes())
            data[len(data) // 2] ^= 0xFF
            (root / entry["file"]).write_bytes(bytes(data))
            cases[case] = (root, entry["file"])
        elif case == "every index gone":
            for e in shards:
                (root / e["index_file"]).unlink()
            cases[case] = (root, ".index.arrow")
        else:
            (root / entry["file"]).unlink()
            cases[case] = (root, entry["file"])
    return cases


def damage_cases(world: World, tally, work: Path, server=None) -> None:
    from shards.__main__ import main as shards_main
    from train.__main__ import main as train_main

    runs = work / "damaged-runs"
    for case, (root, names) in damaged_copies(world, work).items():
        where = {"local": str(root)}
        if server is not None:
            bucket = f"rel-dmg-{uuid.uuid4().hex[:8]}"
            server.create_bucket(bucket)
            where["S3"] = server.uri(f"{bucket}/data")
            client = server.client()
            for path in root.iterdir():
                client.put_object(Bucket=bucket, Key=f"data/{path.name}", Body=path.read_bytes())
        for place, shards in where.items():
            args = world.train_args(runs, f"dmg-{uuid.uuid4().hex[:6]}", "optim.max_steps=40", shards=shards)
            code, stderr = call_main(train_main, args)
            problems, line = one_line_problems(
                code, stderr, exit_code=2, says=(names, "python -m shards verify"), never=NO_RESUME_HINT
            )
            tally.add(f"train_damage:{case}", not problems, f"{case} ({place}): {'; '.join(problems)}")
            code, stderr = call_main(shards_main, ["verify", shards, "--no-progress"])
            tally.add(f"train_damage:{case}", code == 1, f"{case} ({place}): verify exit {code}, not 1")


def run_all(world: World, tally, work: Path, server=None) -> str:
    """Every family above; the S3 ones only with a server (`moto_server`). Returns a line for the report."""
    work.mkdir(parents=True, exist_ok=True)
    damage_cases(world, tally, work, server)
    if server is None:
        return "object-store families: not run (no moto_server here: the dev extra installs it)"
    setup_cases(world, tally, work, server)
    gone_cases(world, tally, work, server)
    return "object-store families ran against moto_server on loopback"
