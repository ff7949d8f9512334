"""One outage clock bounds every operation on a store that stopped answering (issue 54): each
request's own retries fit in it, every call of the file systems `resolve_store` returns runs through
it, and once it has given up every further operation fails at once. The whole commands against a
store taken away for good: tests/reliability/outage_cases.py."""

from __future__ import annotations

import pickle
import time

import pytest

from common import objstore

DEAD = "s3://bucket/x?endpoint_override=127.0.0.1:1&scheme=http"


@pytest.fixture(autouse=True)
def clocks_at_rest(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    objstore.reset_outage_clocks()
    yield
    objstore.reset_outage_clocks()


@pytest.mark.parametrize(
    "outage, retries, attempts", [("300", "10", 10), ("4", "10", 3), ("2", "10", 2), ("0.5", "5", 1)]
)
def test_a_requests_own_retries_fit_in_the_outage_clock(monkeypatch, outage, retries, attempts):
    """The SDKs' worst backoff before retry i is min(2**i, 20) s: 1 + 2 fits 4 s, 1 + 2 + 4 does not."""
    monkeypatch.setenv(objstore.OUTAGE_ENV, outage)
    monkeypatch.setenv(objstore.RETRY_ATTEMPTS_ENV, retries)
    assert objstore.request_attempts() == attempts


def test_every_call_of_a_store_file_system_waits_then_the_next_fails_at_once(monkeypatch):
    monkeypatch.setenv(objstore.OUTAGE_ENV, "1.5")
    fs, path = objstore.resolve_store(DEAD)
    assert isinstance(fs, objstore.StoreS3FileSystem) and isinstance(fs, objstore.pafs.S3FileSystem)
    started = time.monotonic()
    with pytest.raises(objstore.StoreUnreachable, match=r"s3://bucket/x: the store is unreachable \(.*OUTAGE_S"):
        fs.get_file_info(path)
    waited = time.monotonic() - started
    assert waited >= 1.0, waited  # retried while the clock ran
    for call in (lambda: fs.delete_file(path + "/a"), lambda: fs.open_output_stream(path + "/b")):
        started = time.monotonic()
        with pytest.raises(objstore.StoreUnreachable):
            call()
        assert time.monotonic() - started < 0.5  # the clock had given up: no request at all
    other, _ = objstore.resolve_store(DEAD)  # the same store, another file system: the same clock
    with pytest.raises(objstore.StoreUnreachable):
        other.get_file_info(path)
    objstore.reset_outage_clocks()  # a new command
    assert objstore.outage_clock(fs).left() == float("inf")


def test_an_answer_stops_the_clock(monkeypatch):
    monkeypatch.setattr(objstore.time, "sleep", lambda s: None)
    clock = objstore.clock_of("test://answers")
    calls = []

    def twice_gone():
        calls.append(1)
        if len(calls) <= 2:
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7")
        return "ok"

    assert objstore.retrying(twice_gone, where="s3://b/k", clock=clock) == "ok"
    assert clock.left() == float("inf") and len(calls) == 3


def test_a_store_file_system_keeps_its_retries_and_clock_in_a_copy():
    fs, _ = objstore.resolve_store(DEAD)
    copy = pickle.loads(pickle.dumps(fs))
    assert type(copy) is objstore.StoreS3FileSystem and copy.outage_clock is fs.outage_clock


def test_a_gcs_location_no_credentials_reach_is_refused_in_time(monkeypatch):
    """Without credentials pyarrow's GCS client asks a cloud VM's metadata server for minutes, saying
    nothing; the check gives up after GCS_CHECK_LIMIT_S (or the outage clock) in one line."""
    if not hasattr(objstore.pafs, "GcsFileSystem"):
        pytest.skip("pyarrow built without GCS")
    monkeypatch.setenv(objstore.OUTAGE_ENV, "2")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "")
    started = time.monotonic()
    with pytest.raises(objstore.StoreSetupError, match="gs://dflash-no-such-bucket/x: .*(GCS|credentials)") as err:
        objstore.check_location("gs://dflash-no-such-bucket/x", write=False)
    assert time.monotonic() - started < 30 and "\n" not in str(err.value)
