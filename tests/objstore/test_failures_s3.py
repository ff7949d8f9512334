"""Failures against a real S3 server, each with one clear line and nothing lost: a wrong bucket,
missing credentials (refused before any work), throttling (503 SlowDown, retried), and a server
that goes away mid-run (retried, then an error; what was committed stays and a rerun resumes)."""

from __future__ import annotations

import pytest

from common import objstore
from common.config import ConfigError
from shards import ShardDataset, ShardWriter, verify_dataset
from tests.shards.synth import TOPK, WIDTH, make_sample, provenance


def open_writer(uri):
    return ShardWriter(uri, provenance=provenance(), hidden_width=WIDTH, topk=TOPK, shard_bytes=4_000)


def test_a_wrong_bucket_is_one_line_naming_it(s3_uri, moto_server):
    from extract.checks import check_out_dir

    wrong = moto_server.uri("no-such-bucket/data")
    with pytest.raises(ConfigError, match="out_dir.*bucket 'no-such-bucket' does not exist") as err:
        check_out_dir(wrong, "out_dir")
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="no manifest"):
        ShardDataset(wrong)


def test_missing_credentials_are_refused_before_any_work(s3_uri, monkeypatch, tmp_path):
    from common.objstore import check_location

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ValueError, match="no S3 credentials found .*AWS_ACCESS_KEY_ID"):
        check_location(s3_uri, write=True)


def test_throttling_answers_are_retried(s3_uri, moto_server):
    from benchmarks.s3_server import DelayProxy

    bucket_path = s3_uri.split("://", 1)[1].split("?", 1)[0]
    with DelayProxy(moto_server.port) as proxy:
        uri = proxy.uri(bucket_path)
        proxy.slowdown(2)  # the next two connections are answered 503 SlowDown
        with open_writer(uri) as w:
            for i in range(6):
                w.write(make_sample(i))
                if i == 3:
                    proxy.slowdown(2)
        assert proxy._slowdowns == 0, "the throttling answers were not all met"
        assert len(ShardDataset(uri)) == 6 and verify_dataset(uri) == []


def test_a_server_gone_mid_run_fails_and_a_rerun_resumes_with_nothing_lost(s3_uri, moto_server, monkeypatch):
    from benchmarks.s3_server import DelayProxy

    monkeypatch.setenv("DFLASH_S3_RETRIES", "2")
    monkeypatch.setenv("DFLASH_S3_OUTAGE_S", "3")  # the writes wait this long for the store (common.objstore)
    bucket_path = s3_uri.split("://", 1)[1].split("?", 1)[0]
    with DelayProxy(moto_server.port) as proxy:
        uri = proxy.uri(bucket_path)
        w = open_writer(uri)
        for i in range(5):
            w.write(make_sample(i))
        w.flush()
        committed = w.manifest["counts"]["samples"]
        proxy.down()
        with pytest.raises(OSError) as err:
            for i in range(5, 40):
                w.write(make_sample(i))
            w.flush()
        assert "\n" not in str(err.value).strip()
        with pytest.raises(OSError):
            w.close(complete=False)
        proxy.up()
        # A rerun is a new process: its store's outage clock at rest, and the dead writer's lock object
        # taken over at once (the same pid, alive here, releases it instead).
        objstore.reset_outage_clocks()
        w._lock.release()
        ds = ShardDataset(uri)
        assert len(ds) >= committed and verify_dataset(uri) == []
        with open_writer(uri) as again:
            done = again.committed_ids()
            for i in range(40):
                if make_sample(i).sample_id not in done:
                    again.write(make_sample(i))
        ids = [s.sample_id for s in ShardDataset(uri)]
        assert sorted(ids) == sorted(make_sample(i).sample_id for i in range(40))
        assert verify_dataset(uri) == []


def test_setup_errors_of_every_command_are_one_line_before_any_work(s3_uri, moto_server, tmp_path, capsys):
    from common.config import parse_cli
    from shards.__main__ import main as shards_main
    from train.config import TrainConfig

    with open_writer(s3_uri) as w:
        w.write(make_sample(0))
    missing = moto_server.uri("no-such-bucket/data")
    with pytest.raises(ConfigError, match="config key 'data.shards': .*bucket 'no-such-bucket' does not exist"):
        parse_cli(TrainConfig, [f"data.shards={missing}"])
    with pytest.raises(ConfigError, match="config key 'out_dir': .* takes a local directory"):
        parse_cli(TrainConfig, [f"data.shards={s3_uri}", f"out_dir={moto_server.uri('runs')}"])
    for dst, said in ((missing, "bucket 'no-such-bucket' does not exist"), ("hdfs://nn/x", "is not served here")):
        assert shards_main(["transcode", s3_uri, dst, "encoding=fp8", "progress=false"]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and "DST" in err and "\n" not in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing was written anywhere


def test_a_store_gone_for_a_while_is_waited_for_and_one_gone_for_good_is_named_unreachable(
    s3_uri, moto_server, monkeypatch, caplog
):
    import logging
    import threading

    from benchmarks.s3_server import DelayProxy
    from common.objstore import StoreUnreachable

    with open_writer(s3_uri) as w:
        for i in range(12):
            w.write(make_sample(i))
    monkeypatch.setenv("DFLASH_S3_RETRIES", "1")
    bucket_path = s3_uri.split("://", 1)[1].split("?", 1)[0]
    with DelayProxy(moto_server.port) as proxy:
        ds = ShardDataset(proxy.uri(bucket_path))
        assert ds[0].sample_id == make_sample(0).sample_id  # the shard checked and its handle kept
        proxy.down()
        threading.Timer(2.0, proxy.up).start()
        caplog.set_level(logging.WARNING, logger="common.objstore")
        assert ds[len(ds) - 1].sample_id == make_sample(11).sample_id  # waited for the store, then read
        assert "the store does not answer" in caplog.text
        monkeypatch.setenv("DFLASH_S3_OUTAGE_S", "1.5")
        proxy.down()
        with pytest.raises(StoreUnreachable, match="the store is unreachable") as err:
            ds[1]
        assert "\n" not in str(err.value) and "DFLASH_S3_OUTAGE_S" in str(err.value)
