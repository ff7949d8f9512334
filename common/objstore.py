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
  SlowDown). pyarrow and botocore retry each request `DFLASH_S3_RETRIES` times; reads are retried
  again with backoff for up to `DFLASH_S3_OUTAGE_S` seconds (`retrying`), then `StoreUnreachable`,
  an OSError: the commands stop with one line and rerunning resumes.
- anything else (damaged or missing objects, a bug) is not a store error and keeps its own type.
"""

from __future__ import annotations

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
UNLOCKED_ENV = "DFLASH_UNLOCKED_WRITES"
LEASE_ENV = "DFLASH_LOCK_LEASE_S"
DEFAULT_LEASE_S = 60.0

# What pyarrow's S3 errors say (it gives no error codes, only text such as "AWS Error
# NETWORK_CONNECTION during HeadObject operation: curlCode: 7, ...").
_SETUP_TEXT = re.compile(
    r"NO_SUCH_BUCKET|ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|MISSING_AUTHENTICATION|"
    r"EXPIRED_TOKEN|INVALID_CLIENT_TOKEN_ID|UNRECOGNIZED_CLIENT|HTTP status 40[13]\b|Missing bucket name|"
    r"compiled without (S3|GCS) support"
)
_TRANSIENT_TEXT = re.compile(
    r"NETWORK_CONNECTION|SLOW_DOWN|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|REQUEST_TIMEOUT|THROTTLING|curlCode|"
    r"HTTP status 5\d\d\b"
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
    """How long a read waits for a store that stopped answering before it gives up."""
    return _seconds(OUTAGE_ENV, DEFAULT_OUTAGE_S)


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
        fs = pafs.S3FileSystem(**kwargs, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=retry_attempts()))
    return fs, path.rstrip("/")


def store_uri(fs: pafs.FileSystem, path: str) -> str:
    """A URI for messages: s3://bucket/key (the endpoint is not repeated)."""
    if is_s3(fs):
        return f"s3://{path}"
    gcs = getattr(pafs, "GcsFileSystem", None)
    if gcs is not None and isinstance(fs, gcs):
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
    return (found.group(0) if found else text)[:300]


T = TypeVar("T")


def retrying(call: Callable[[], T], *, where: str) -> T:
    """`call()`, retried with exponential backoff while it fails for a transient store error, for up
    to `DFLASH_S3_OUTAGE_S` seconds; then StoreUnreachable naming `where`. Other errors pass."""
    deadline, delay = None, 1.0
    while True:
        try:
            return call()
        except Exception as err:
            if error_kind(err) != "transient" or isinstance(err, StoreUnreachable):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + outage_seconds()
                log.warning("%s: the store does not answer (%s); retrying", where, short_reason(err))
            if now >= deadline:
                raise StoreUnreachable(
                    f"{where}: the store is unreachable ({short_reason(err)}; retried for {outage_seconds():.0f} s, "
                    f"{OUTAGE_ENV})"
                ) from None
            time.sleep(min(delay, deadline - now))
            delay = min(2 * delay, MAX_BACKOFF_S)


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
                retries={"max_attempts": retry_attempts(), "mode": "standard"}, connect_timeout=10, read_timeout=60
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
    client = s3_client(fs)
    bucket, key = split_path(directory)
    base = key.rstrip("/") + "/" if key else ""
    aborted = []
    for prefix in prefixes:
        pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=base + prefix)
        for page in pages:
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted.append(f"{bucket}/{upload['Key']}")
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
