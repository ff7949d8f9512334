"""Path settings (common.locations, through common.config) and the classification of object-store
errors (common.objstore): each answer one line naming the key or setting, no request made to parse."""

from __future__ import annotations

import errno

import pyarrow as pa
import pytest

from common import locations, objstore
from common.config import ConfigError, load_config, parse_cli
from common.local_dirs import writable_dir_problem
from train.config import TrainConfig


@pytest.mark.parametrize(
    ("text", "kind", "said"),
    [
        ("{a=1}", "dir_out", "is a TOML table, not a path"),
        ("[1, 2]", "data_in", "is a TOML array, not a path"),
        ("s3://b/runs", "dir_out", "takes a local directory"),
        ("gs://b/x", "local_in", "read from a local disk"),
        ("s3://b/x", "file_out", "takes a local file"),
        ("hdfs://namenode/x", "data_in", "the scheme 'hdfs://' is not served here"),
        ("file:///tmp/x", "data_out", "the scheme 'file://' is not served here"),
        ("s3://?endpoint_override=h:1", "data_in", "no bucket in the URI; write s3://BUCKET/PREFIX"),
        ("s3:///prefix", "data_out", "no bucket in the URI"),
        ("s3:/bucket/runs", "dir_out", "looks like a s3:// URI with one slash"),
    ],
)
def test_a_path_setting_that_cannot_work_is_refused_on_its_face(text, kind, said):
    problem = locations.parse_problem(text, kind)
    assert problem is not None and said in problem and "\n" not in problem


@pytest.mark.parametrize(
    ("text", "kind"),
    [("runs", "dir_out"), ("[draft] notes", "dir_out"), ("s3://bucket/p?x=1", "data_in"), ("gs://b/p", "data_out")],
)
def test_paths_and_served_uris_parse(text, kind):
    assert locations.parse_problem(text, kind) is None


def test_config_keys_that_take_paths_are_parsed_at_load_and_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="config key 'out_dir': 's3://bucket/runs' is an object-store URI"):
        load_config(TrainConfig, None, ["out_dir=s3://bucket/runs"])
    with pytest.raises(ConfigError, match="config key 'data.shards': 'hdfs://x/y': the scheme"):
        load_config(TrainConfig, None, ["data.shards=hdfs://x/y"])
    with pytest.raises(ConfigError, match=r"config key 'out_dir': '\{a=1\}' is a TOML table"):
        load_config(TrainConfig, None, ["out_dir={a=1}"])
    # Only a command line looks at the location: a file where the run directories would go.
    (tmp_path / "file").write_text("")
    load_config(TrainConfig, None, [f"out_dir={tmp_path / 'file' / 'runs'}"])
    with pytest.raises(ConfigError, match="config key 'out_dir': .* which is a file, not a directory"):
        parse_cli(TrainConfig, [f"out_dir={tmp_path / 'file' / 'runs'}"])


def test_a_local_output_must_be_a_directory_that_can_be_made(tmp_path):
    (tmp_path / "file").write_text("")
    assert writable_dir_problem(str(tmp_path / "new" / "deeper")) is None
    assert "is a file" in writable_dir_problem(str(tmp_path / "file"))
    assert "cannot create anything under '/proc'" in writable_dir_problem("/proc/dflash-x")
    assert locations.check_problem(str(tmp_path / "file" / "x.json"), "file_out") is not None
    assert locations.check_problem(str(tmp_path / "missing-input"), "local_in") is None  # the command says


def test_store_errors_are_classified_by_what_the_store_said():
    network = OSError(
        "When reading information for key 'p/m.json' in bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject "
        "operation: curlCode: 7, Could not connect to server"
    )
    assert objstore.error_kind(network) == "transient"
    assert objstore.error_kind(OSError("AWS Error UNKNOWN (HTTP status 503) during GetObject operation")) == "transient"
    assert objstore.error_kind(OSError("AWS Error NO_SUCH_BUCKET during PutObject operation")) == "setup"
    assert objstore.error_kind(OSError("AWS Error ACCESS_DENIED during GetObject operation")) == "setup"
    assert objstore.error_kind(pa.ArrowInvalid("Missing bucket name in S3 URI")) == "setup"
    assert objstore.error_kind(OSError(errno.ENOSPC, "No space left on device")) is None  # a disk, not a store
    assert objstore.error_kind(ValueError("corrupted shard data")) is None
    assert objstore.short_reason(network).startswith("AWS Error NETWORK_CONNECTION during HeadObject")


def test_a_store_gone_for_a_while_is_waited_for_then_named_unreachable(monkeypatch):
    monkeypatch.setattr(objstore.time, "sleep", lambda s: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7")
        return "data"

    assert objstore.retrying(flaky, where="s3://b/x") == "data" and len(calls) == 4
    with pytest.raises(ValueError, match="damaged"):  # not a store error: no retry
        objstore.retrying(lambda: (_ for _ in ()).throw(ValueError("damaged")), where="s3://b/x")
    clock = iter(range(0, 10_000, 100))
    monkeypatch.setattr(objstore.time, "monotonic", lambda: next(clock))
    monkeypatch.setenv(objstore.OUTAGE_ENV, "250")

    def gone():
        raise OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7")

    with pytest.raises(objstore.StoreUnreachable, match=r"s3://b/x: the store is unreachable \(AWS Error") as err:
        objstore.retrying(gone, where="s3://b/x")
    assert "\n" not in str(err.value) and "DFLASH_S3_OUTAGE_S" in str(err.value)


@pytest.mark.parametrize("name", [objstore.LEASE_ENV, objstore.OUTAGE_ENV])
@pytest.mark.parametrize("value", ["-5", "0", "abc", "nan"])
def test_a_bad_store_setting_is_refused_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(objstore.StoreSetupError, match=f"{name}: expected a positive number of seconds"):
        objstore.check_location("s3://bucket/x?endpoint_override=127.0.0.1:9&scheme=http", write=True)
