"""Object stores (S3 and S3-compatible, GCS): the file system a URI names, the checks of a store
location before a run, what an object store needs that `pyarrow.fs` does not offer (a botocore
client for conditional writes and the clean-up of uploads a killed writer left half done), and
the one place where a store's errors are classified.

An object store has no rename and no fsync, but a PUT is atomic per object (readers see no object
or the whole object, also for a multipart upload, which becomes visible only when completed). So
on an object store every file is written once under its final name (`common.io.atomic_write_*`,
`ShardWriter`), and a dataset's manifest, written last, decides which objects belong to it. The
one-writer lock object lives with the other locks (`common.locks.ObjectLock`).

    fs, path = resolve_store("s3://bucket/prefix?endpoint_override=host:9000&scheme=http")
    check_location(uri, write=True)            # StoreSetupError (one line) before any work
    data = retrying(lambda: f.read_at(n, 0), where=uri)   # a store gone for a while: waited for

Credentials and endpoints come the standard way: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a
profile, or an instance role), AWS_ENDPOINT_URL or the URI's `endpoint_override` / `scheme` /
`region` query parameters; GCS: application default credentials. docs/object-storage.md.

Errors, by kind (`error_kind`):
- setup: the store cannot work as configured (a scheme not served here, no bucket in the URI, a
  missing bucket, no or refused credentials, a bad DFLASH_* setting): `StoreSetupError`, a
  ValueError whose one line names the location or setting; the commands exit 2.
- transient: the store does not answer for a while (connection refused or reset, timeouts, 5xx,
  SlowDown). pyarrow and botocore retry each request up to `DFLASH_S3_RETRIES` times (fewer where
  their backoff would outlast the outage clock); every operation is then retried with backoff while
  the store's outage clock runs, then `StoreUnreachable`, an OSError: the commands stop with one line
  and rerunning resumes.
- anything else (damaged or missing objects, a bug) is not a store error and keeps its own type.

The outage clock (`OutageClock`, one per store endpoint in a process) bounds every operation on a
store that stopped answering: it starts at the first transient error since the store last answered
and stops at its next answer; once it has run `DFLASH_S3_OUTAGE_S` seconds every operation on that
store fails at once with `StoreUnreachable` (reads, listings, deletes and whole-object writes
through `retrying`, which the file systems `resolve_store` returns use for each call; the lock
object's renewals and releases; a shard's upload fails with its own request's retries). So a command
whose store is gone for good stops about `DFLASH_S3_OUTAGE_S` seconds after the store went away.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import botocore.config
import botocore.exceptions
import botocore.session
import pyarrow as pa
import pyarrow.fs as pafs

log = logging.getLogger(__name__)
# botocore says at INFO where it found credentials, on every command that logs at INFO: noise on stderr.
logging.getLogger("botocore.credentials").setLevel(logging.WARNING)

# URI schemes served here: pyarrow's S3 and GCS file systems (others, such as hdfs://, need a JVM or
# libraries this project neither installs nor tests; docs/object-storage.md).
STORE_SCHEMES = ("s3", "gs")
# Attempts per request (pyarrow's AWS standard retry strategy: exponential backoff with jitter,
# throttling answers such as 503 SlowDown and connection errors included); env to change.
RETRY_ATTEMPTS_ENV = "DFLASH_S3_RETRIES"
DEFAULT_RETRY_ATTEMPTS = 10
OUTAGE_ENV = "DFLASH_S3_OUTAGE_S"
DEFAULT_OUTAGE_S = 300.0
MAX_BACKOFF_S = 30.0
# The AWS SDKs' retry backoff before retry i (0-based) is at most min(2**i, 20) seconds (pyarrow's
# AwsStandardS3RetryStrategy, botocore's standard mode): a request's own retries are cut to what the
# outage clock allows (`request_attempts`).
SDK_MAX_BACKOFF_S = 20.0
# GCS: pyarrow's client retries each call for a time, not a count; the same share of the clock.
GCS_CALL_LIMIT_S = 30.0
# Checking a gs:// location before a run: a client without credentials tries the metadata server
# for minutes; this long, then one line.
GCS_CHECK_LIMIT_S = 10.0
UNLOCKED_ENV = "DFLASH_UNLOCKED_WRITES"
LEASE_ENV = "DFLASH_LOCK_LEASE_S"
DEFAULT_LEASE_S = 60.0

# What pyarrow's S3 errors say (it gives no error codes, only text such as "AWS Error
# NETWORK_CONNECTION during HeadObject operation: curlCode: 7, ...").
_SETUP_TEXT = re.compile(
    r"NO_SUCH_BUCKET|ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|MISSING_AUTHENTICATION|"
    r"EXPIRED_TOKEN|INVALID_CLIENT_TOKEN_ID|UNRECOGNIZED_CLIENT|HTTP status 40[13]\b|Missing bucket name|"
    r"compiled without (S3|GCS) support|Status\((PERMISSION_DENIED|UNAUTHENTICATED):"
)
_TRANSIENT_TEXT = re.compile(
    r"NETWORK_CONNECTION|SLOW_DOWN|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|REQUEST_TIMEOUT|THROTTLING|curlCode|"
    r"HTTP status 5\d\d\b|Status\((UNAVAILABLE|DEADLINE_EXCEEDED|INTERNAL|RESOURCE_EXHAUSTED):"
)
_TRANSIENT_CODES = ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable")
# botocore's connection failures (EndpointConnectionError, ConnectionClosedError, read and connect
# timeouts) all derive from one of these.
_TRANSIENT_BOTOCORE = (botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError)
_SETUP_BOTOCORE = (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)


class StoreSetupError(ValueError):
    """The store cannot work as configured (one line naming the location or setting): exit 2."""


class StoreUnreachable(OSError):
    """The store did not answer for longer than the retries wait: stop; rerunning resumes."""


def is_s3(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.S3FileSystem)


def is_object_store(fs: pafs.FileSystem) -> bool:
    """A store where a PUT is atomic per object and there is no rename (S3, GCS)."""
    gcs = getattr(pafs, "GcsFileSystem", None)
    return is_s3(fs) or (gcs is not None and isinstance(fs, gcs))


# ----------------------------------------------------------------------------------------------
# Settings from the environment (each checked where a store is first used: one line naming it)


def retry_attempts() -> int:
    text = os.environ.get(RETRY_ATTEMPTS_ENV, "")
    try:
        return max(1, int(text)) if text else DEFAULT_RETRY_ATTEMPTS
    except ValueError:
        raise StoreSetupError(f"{RETRY_ATTEMPTS_ENV}: expected a positive integer, got {text!r}") from None


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise StoreSetupError(f"{name}: expected a positive number of seconds, got {text!r}")
    return value


def lease_seconds() -> float:
    """The lease of a lock object (`common.locks.ObjectLock`)."""
    return _seconds(LEASE_ENV, DEFAULT_LEASE_S)


def outage_seconds() -> float:
    """How long the operations on a store that stopped answering wait for it before they give up."""
    return _seconds(OUTAGE_ENV, DEFAULT_OUTAGE_S)


def request_attempts() -> int:
    """Attempts per request: `DFLASH_S3_RETRIES`, fewer where their worst backoff would outlast the
    outage clock (a store gone for good then stops the command in about DFLASH_S3_OUTAGE_S)."""
    attempts, backoff, outage = 1, 0.0, outage_seconds()
    while attempts < retry_attempts():
        backoff += min(2.0 ** (attempts - 1), SDK_MAX_BACKOFF_S)
        if backoff > outage:
            break
        attempts += 1
    return attempts


def unlocked_writes() -> bool:
    return os.environ.get(UNLOCKED_ENV, "") not in ("", "0")


def refuse_unlocked_message(where: str) -> str:
    return (
        f"{where}: this store offers pyarrow no conditional write, so a second writer on another host could not be "
        f"refused; write to s3:// (or an S3-compatible endpoint), or set {UNLOCKED_ENV}=1 if you guarantee that one "
        "process writes this dataset"
    )


# ----------------------------------------------------------------------------------------------
# Resolving a URI


def split_uri(uri: str) -> tuple[str, str]:
    """(scheme, bucket) of a store URI, as typed (lower-case scheme; the bucket may be empty)."""
    scheme, _, rest = str(uri).partition("://")
    return scheme.lower(), rest.split("?", 1)[0].split("/", 1)[0]


def uri_problem(uri: str) -> str | None:
    """What keeps `uri` from naming a store location served here (None: nothing), without a request."""
    scheme, bucket = split_uri(uri)
    if scheme not in STORE_SCHEMES:
        return (
            f"the scheme '{scheme}://' is not served here; give a local path, s3://BUCKET/PREFIX or "
            "gs://BUCKET/PREFIX (docs/object-storage.md)"
        )
    if not bucket:
        return f"no bucket in the URI; write {scheme}://BUCKET/PREFIX"
    return None


def resolve_store(uri: str) -> tuple[pafs.FileSystem, str]:
    """(file system, path) of a store URI; for s3:// with this project's retry strategy (pyarrow's
    `from_uri` takes the query parameters but not a retry strategy). StoreSetupError if the URI
    cannot name a location served here."""
    problem = uri_problem(uri)
    if problem is not None:
        raise StoreSetupError(f"{uri}: {problem}")
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, ValueError, OSError) as err:
        raise StoreSetupError(f"{uri}: {short_reason(err)}") from None
    if is_s3(fs):
        kwargs = dict(fs.__reduce__()[1][0])
        # Delayed open: an object smaller than one part (manifests, indexes) is one PutObject at
        # close instead of a multipart upload of three requests.
        kwargs["allow_delayed_open"] = True
        fs = StoreS3FileSystem(kwargs, request_attempts())
    elif _is_gcs(fs):
        kwargs = {k: v for k, v in fs.__reduce__()[1][0].items() if v not in ("", None)}
        limit = min(outage_seconds(), GCS_CALL_LIMIT_S)
        fs = StoreGcsFileSystem(kwargs, kwargs.get("retry_time_limit") or datetime.timedelta(seconds=limit))
    return fs, path.rstrip("/")


def _is_gcs(fs: pafs.FileSystem) -> bool:
    gcs = getattr(pafs, "GcsFileSystem", None)
    return gcs is not None and isinstance(fs, gcs)


# The calls of `pyarrow.fs.FileSystem` that reach the store, each run through `retrying` (and so the
# outage clock) by the file systems `resolve_store` returns. A stream's reads and writes are not
# among them: reads retry themselves (`shards.reader`), a write's failure fails its commit.
_STORE_CALLS = (
    "get_file_info",
    "create_dir",
    "delete_dir",
    "delete_dir_contents",
    "delete_file",
    "move",
    "copy_file",
    "open_input_stream",
    "open_input_file",
    "open_output_stream",
    "open_append_stream",
)


def _through_the_clock(cls):
    """`cls` with each of `_STORE_CALLS` retried through the store's outage clock."""

    def wrap(name: str, call):
        def method(self, *args, **kwargs):
            where = store_uri(self, _path_of(args[0]) if args else "")
            return retrying(lambda: call(self, *args, **kwargs), where=where, clock=self.outage_clock)

        method.__name__, method.__doc__ = name, call.__doc__
        return method

    for name in _STORE_CALLS:
        call = getattr(cls.__mro__[1], name, None)  # none: pyarrow built without this store
        if call is not None:
            setattr(cls, name, wrap(name, call))
    return cls


def _path_of(arg) -> str:
    return arg.base_dir if isinstance(arg, pafs.FileSelector) else str(arg)


@_through_the_clock
class StoreS3FileSystem(pafs.S3FileSystem):
    """pyarrow's S3 file system with this project's retries per request and every call through the outage clock."""

    def __init__(self, kwargs: dict, attempts: int):
        super().__init__(**kwargs, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=attempts))
        self._kwargs, self._attempts = kwargs, attempts
        self.outage_clock = clock_of(str(_endpoint_of(kwargs)))

    def __reduce__(self):  # a copy in another process keeps the retries and the clock's endpoint
        return StoreS3FileSystem, (self._kwargs, self._attempts)


@_through_the_clock
class StoreGcsFileSystem(pafs.GcsFileSystem if hasattr(pafs, "GcsFileSystem") else object):  # type: ignore[misc]
    """pyarrow's GCS file system whose calls give up after `limit` and run through the outage clock."""

    def __init__(self, kwargs: dict, limit: datetime.timedelta):
        super().__init__(**{**kwargs, "retry_time_limit": limit})
        self._kwargs, self._limit = kwargs, limit
        self.outage_clock = clock_of("gs://" + str(kwargs.get("endpoint_override") or ""))

    def __reduce__(self):
        return StoreGcsFileSystem, (self._kwargs, self._limit)


def store_uri(fs: pafs.FileSystem, path: str) -> str:
    """A URI for messages: s3://bucket/key (the endpoint is not repeated)."""
    if is_s3(fs):
        return f"s3://{path}"
    if _is_gcs(fs):
        return f"gs://{path}"
    return path


# ----------------------------------------------------------------------------------------------
# Classifying errors, and waiting out a store that is gone for a while


def error_kind(err: BaseException) -> str | None:
    """ "setup", "transient", or None: not a store error (damage, a local disk's error, a bug)."""
    if isinstance(err, (StoreSetupError, *_SETUP_BOTOCORE)):
        return "setup"
    if isinstance(err, (StoreUnreachable, *_TRANSIENT_BOTOCORE)):
        return "transient"
    if isinstance(err, botocore.exceptions.ClientError):
        status, code = _status(err), _error_code(err)
        if status >= 500 or code in _TRANSIENT_CODES:
            return "transient"
        return "setup" if status in (401, 403) or code == "NoSuchBucket" else None
    if not isinstance(err, (OSError, pa.ArrowException)):
        return None
    text = str(err)
    if _SETUP_TEXT.search(text):
        return "setup"
    return "transient" if _TRANSIENT_TEXT.search(text) else None


def short_reason(err: BaseException) -> str:
    """The part of a store error that says what happened, on one line ("AWS Error NETWORK_CONNECTION
    during GetObject operation: curlCode: 7, Could not connect to server")."""
    text = " ".join(str(err).split())
    found = re.search(r"AWS Error [^;]*", text)
    gcs = re.search(r"google::cloud::Status\((\w+): ([^.]*)", text)
    if gcs and not found:
        under = re.search(r"underlying error message was: (.*?)(?: error_info=|$)", text)
        return (f"GCS {gcs.group(1)}: {gcs.group(2)}" + (f" ({under.group(1)})" if under else ""))[:300]
    return (found.group(0) if found else text)[:300]


T = TypeVar("T")


class OutageClock:
    """How long one store has not answered: started by the first transient error since its last
    answer, stopped by the next answer. Once it has run `DFLASH_S3_OUTAGE_S` seconds, `check` fails
    every operation on the store at once (after a pause of MAX_BACKOFF_S without any attempt, one
    more attempt is let through: a long-lived process sees a store that came back)."""

    def __init__(self):
        self._since: float | None = None  # the first failure of the current outage
        self._last = 0.0  # the last failed attempt
        self._reason = ""
        self._guard = threading.Lock()

    def failed(self, where: str, err: BaseException) -> None:
        with self._guard:
            now = time.monotonic()
            if self._since is None:
                self._since = now
                log.warning(
                    "%s: the store does not answer (%s); waiting up to %.0f s for it (%s)",
                    where,
                    short_reason(err),
                    outage_seconds(),
                    OUTAGE_ENV,
                )
            self._last, self._reason = now, short_reason(err)

    def answered(self) -> None:
        if self._since is not None:
            with self._guard:
                self._since = None

    def left(self) -> float:
        """Seconds until the clock gives up (inf while the store answers)."""
        since = self._since
        return math.inf if since is None else since + outage_seconds() - time.monotonic()

    def unreachable(self, where: str) -> StoreUnreachable:
        return StoreUnreachable(
            f"{where}: the store is unreachable ({self._reason}; no answer for {outage_seconds():.0f} s, {OUTAGE_ENV})"
        )

    def check(self, where: str) -> None:
        """StoreUnreachable naming `where` if the store has not answered for the whole outage time."""
        if self.left() <= 0 and time.monotonic() - self._last < MAX_BACKOFF_S:
            raise self.unreachable(where)


_clocks: dict[str, OutageClock] = {}
_clocks_guard = threading.Lock()


def clock_of(endpoint: str) -> OutageClock:
    """The outage clock of the store at `endpoint` (one per endpoint in this process)."""
    with _clocks_guard:
        return _clocks.setdefault(endpoint, OutageClock())


def reset_outage_clocks() -> None:
    """Every store's clock at rest (a new command starts here: `common.config.parse_command`)."""
    with _clocks_guard:
        for clock in _clocks.values():
            clock.answered()


def _endpoint_of(kwargs: dict) -> str:
    endpoint = kwargs.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_URL") or "aws"
    return f"s3://{endpoint}"


def outage_clock(fs: pafs.FileSystem) -> OutageClock:
    """The clock of `fs`'s store (a file system `resolve_store` did not make shares one per kind)."""
    return getattr(fs, "outage_clock", None) or clock_of(type(fs).__name__)


def retrying(call: Callable[[], T], *, where: str, clock: OutageClock | None = None) -> T:
    """`call()`, retried with exponential backoff while it fails for a transient store error and the
    store's outage clock (`clock`; by default that of every store without one) runs; then
    StoreUnreachable naming `where`. At once when the clock has already given up. Other errors pass."""
    clock = clock or clock_of("")
    delay = 1.0
    while True:
        clock.check(where)
        try:
            result = call()
        except Exception as err:
            if error_kind(err) != "transient" or isinstance(err, StoreUnreachable):
                raise
            clock.failed(where, err)
            if clock.left() <= 0:
                raise clock.unreachable(where) from None
            time.sleep(min(delay, clock.left()))
            delay = min(2 * delay, MAX_BACKOFF_S)
            continue
        clock.answered()
        return result


# ----------------------------------------------------------------------------------------------
# botocore: what pyarrow cannot do (conditional writes, listing multipart uploads)


def _client_kwargs(fs: pafs.S3FileSystem) -> dict:
    """botocore client settings that reach the same endpoint, region and credentials as `fs`."""
    k = fs.__reduce__()[1][0]
    endpoint = k.get("endpoint_override") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"{k.get('scheme') or 'https'}://{endpoint}"
    kwargs = {"endpoint_url": endpoint, "region_name": k.get("region") or os.environ.get("AWS_REGION") or "us-east-1"}
    if k.get("access_key"):
        kwargs.update(aws_access_key_id=k["access_key"], aws_secret_access_key=k.get("secret_key"))
        if k.get("session_token"):
            kwargs["aws_session_token"] = k["session_token"]
    return kwargs


def endpoint_key(fs: pafs.S3FileSystem) -> str:
    """The endpoint `fs` reaches (two file systems with equal keys are one store)."""
    return str(_client_kwargs(fs)["endpoint_url"])


_clients: dict = {}
_clients_guard = threading.Lock()


def s3_client(fs: pafs.S3FileSystem):
    """A botocore S3 client for `fs`'s store (one per settings, shared by threads: botocore clients are thread-safe)."""
    kwargs = _client_kwargs(fs)
    # The credentials botocore finds depend on the environment: a client per environment, too.
    env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE")}
    key = json.dumps([kwargs, env], sort_keys=True)
    with _clients_guard:
        if key not in _clients:
            session = botocore.session.get_session()
            config = botocore.config.Config(
                retries={"max_attempts": request_attempts(), "mode": "standard"}, connect_timeout=10, read_timeout=60
            )
            _clients[key] = session.create_client("s3", config=config, **kwargs)
        return _clients[key]


def split_path(path: str) -> tuple[str, str]:
    """(bucket, key) of a path inside an S3 file system."""
    bucket, _, key = path.partition("/")
    return bucket, key


def _error_code(err) -> str:
    return str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))


def _status(err) -> int:
    return int(getattr(err, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_conflict(err: BaseException) -> bool:
    """A conditional write refused because the object exists or changed (If-None-Match / If-Match)."""
    return isinstance(err, botocore.exceptions.ClientError) and (
        _status(err) in (409, 412) or _error_code(err) in ("PreconditionFailed", "ConditionalRequestConflict")
    )


def is_missing(err: BaseException) -> bool:
    return isinstance(err, botocore.exceptions.ClientError) and _status(err) == 404


def abort_uploads(fs: pafs.FileSystem, directory: str, prefixes: tuple[str, ...]) -> list[str]:
    """Abort the multipart uploads under `directory` whose object names start with one of `prefixes`
    (a killed writer's half-uploaded shards: invisible, but billed until aborted); their keys."""
    if not is_s3(fs):
        return []
    client, clock = s3_client(fs), outage_clock(fs)
    bucket, key = split_path(directory)
    base = key.rstrip("/") + "/" if key else ""
    aborted = []
    for prefix in prefixes:
        pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=base + prefix)
        where = store_uri(fs, f"{bucket}/{base}{prefix}")
        # (mypy infers no type for a lambda with defaults)
        for page in retrying(lambda pages=pages: list(pages), where=where, clock=clock):  # type: ignore[misc]
            for upload in page.get("Uploads", []):
                key, upload_id = upload["Key"], upload["UploadId"]
                retrying(
                    functools.partial(client.abort_multipart_upload, Bucket=bucket, Key=key, UploadId=upload_id),
                    where=store_uri(fs, f"{bucket}/{key}"),
                    clock=clock,
                )
                aborted.append(f"{bucket}/{key}")
    return aborted


# ----------------------------------------------------------------------------------------------
# Checking a location before a run (one clear line instead of a failure minutes later)


def check_location(uri: str, *, write: bool) -> None:
    """StoreSetupError (one line) unless `uri` names a store served here whose bucket can be reached
    with the credentials at hand, and (writing) the settings a writer reads are valid."""
    fs, path = resolve_store(uri)
    outage_seconds()
    if write:
        lease_seconds()
        if not is_s3(fs) and not unlocked_writes():
            raise StoreSetupError(refuse_unlocked_message(store_uri(fs, path)))
    if is_s3(fs):
        _check_bucket(uri, fs, split_path(path)[0])
    elif _is_gcs(fs):
        _check_gcs(uri, fs, path)


def _check_gcs(uri: str, fs: StoreGcsFileSystem, path: str) -> None:
    """One look at the location, given up after GCS_CHECK_LIMIT_S (a client without credentials
    otherwise asks the metadata server of a cloud VM for minutes, silently)."""
    limit = datetime.timedelta(seconds=min(outage_seconds(), GCS_CHECK_LIMIT_S))
    try:
        pafs.GcsFileSystem.get_file_info(StoreGcsFileSystem(fs._kwargs, limit), path)  # no outage retries
    except (OSError, pa.ArrowException) as err:
        if "OAuth2 access token" in str(err):
            raise StoreSetupError(
                f"{uri}: no usable GCS credentials (set GOOGLE_APPLICATION_CREDENTIALS=/path/key.json, run "
                f"`gcloud auth application-default login`, or run on a VM with a service account): {short_reason(err)}"
            ) from None
        raise StoreSetupError(
            f"{uri}: cannot reach the store (gave up after {limit.total_seconds():.0f} s): {short_reason(err)}"
        ) from None


def _check_bucket(uri: str, fs: pafs.S3FileSystem, bucket: str) -> None:
    client = s3_client(fs)
    if client._request_signer._credentials is None:  # noqa: SLF001 - botocore resolved no credentials at all
        raise StoreSetupError(
            f"{uri}: no S3 credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run "
            "with an instance role)"
        )
    where = _client_kwargs(fs)["endpoint_url"] or "AWS S3"
    try:
        client.head_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError as err:
        status = _status(err)
        if status == 404:
            raise StoreSetupError(f"{uri}: bucket {bucket!r} does not exist at {where}") from None
        if status in (401, 403):
            raise StoreSetupError(
                f"{uri}: access to bucket {bucket!r} denied at {where} (check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY and the bucket policy)"
            ) from None
        raise StoreSetupError(f"{uri}: cannot reach bucket {bucket!r} at {where}: {short_reason(err)}") from None
    except botocore.exceptions.BotoCoreError as err:
        raise StoreSetupError(f"{uri}: cannot reach the store at {where}: {short_reason(err)}") from None
