"""Object stores (S3 and S3-compatible, GCS): the file system a URI names, and what an object store
needs that `pyarrow.fs` does not offer: a lock object made with a conditional write, the clean-up
of uploads a killed writer left half done, and one-line errors.

An object store has no rename and no fsync, but a PUT is atomic per object (readers see no object
or the whole object, also for a multipart upload, which becomes visible only when completed). So
on an object store every file is written once under its final name (`common.io.atomic_write_*`,
`ShardWriter`), and a dataset's manifest, written last, decides which objects belong to it.

    fs, path = resolve_store("s3://bucket/prefix?endpoint_override=host:9000&scheme=http")
    with ObjectLock(fs, "bucket/prefix/.manifest.json.lock", what=..., hint=...) as lock:
        lock.check()          # raises LockLost once the lease could have passed to another writer

Credentials and endpoints come the standard way: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a
profile, or an instance role), AWS_ENDPOINT_URL or the URI's `endpoint_override` / `scheme` /
`region` query parameters; GCS: application default credentials. docs/object-storage.md.

The lock (S3 only). `pyarrow.fs` cannot make a conditional write, so the lock object is written
with botocore (AWS's own library; a dependency): created with `If-None-Match: *` (the store
refuses it when the object exists), renewed every `lease_s / 4` with `If-Match: <its ETag>`. A lock
object whose holder is gone is taken over with `If-Match` on the ETag that was read, so of two
processes taking it over at once one wins. The holder is gone when (a) it ran on this host and its
pid no longer runs, or (b) the object was not renewed for `lease_s` seconds, measured on the
store's clock (its `Date` against the object's `Last-Modified`), so clock skew between hosts does
not matter. A holder that could not renew for `lease_s / 2` stops committing (`check()` raises
`LockLost`). What this guarantees: while a writer runs and reaches the store, a second writer of
the same manifest, on any host, is refused at once. Not guaranteed: a holder that stops for longer
than the lease (suspended, or cut off from the store) and then resumes an upload already in flight
could still complete that one object after another writer took over; its next commit is refused.
GCS and other stores (`pyarrow.fs` offers no conditional write for them) are not locked: writing
to them is refused unless DFLASH_UNLOCKED_WRITES=1 says the user guarantees one writer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from email.utils import parsedate_to_datetime

import pyarrow.fs as pafs

log = logging.getLogger(__name__)

# Attempts per request (pyarrow's AWS standard retry strategy: exponential backoff with jitter,
# throttling answers such as 503 SlowDown and connection errors included); env to change.
RETRY_ATTEMPTS_ENV = "DFLASH_S3_RETRIES"
DEFAULT_RETRY_ATTEMPTS = 10
UNLOCKED_ENV = "DFLASH_UNLOCKED_WRITES"
LEASE_ENV = "DFLASH_LOCK_LEASE_S"
DEFAULT_LEASE_S = 60.0


class LockLost(OSError):
    """This process can no longer be sure it is the dataset's only writer (it could not renew its
    lock object in time, or another writer took it over): it must not commit."""


def is_s3(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.S3FileSystem)


def is_object_store(fs: pafs.FileSystem) -> bool:
    """A store where a PUT is atomic per object and there is no rename (S3, GCS)."""
    gcs = getattr(pafs, "GcsFileSystem", None)
    return is_s3(fs) or (gcs is not None and isinstance(fs, gcs))


def retry_attempts() -> int:
    text = os.environ.get(RETRY_ATTEMPTS_ENV, "")
    try:
        return max(1, int(text)) if text else DEFAULT_RETRY_ATTEMPTS
    except ValueError:
        raise ValueError(f"{RETRY_ATTEMPTS_ENV}: expected a positive integer, got {text!r}") from None


def resolve_store(uri: str) -> tuple[pafs.FileSystem, str]:
    """(file system, path) of a URI; for s3:// with this project's retry strategy (pyarrow's
    `from_uri` takes the query parameters but not a retry strategy)."""
    fs, path = pafs.FileSystem.from_uri(uri)
    if is_s3(fs):
        kwargs = dict(fs.__reduce__()[1][0])
        # Delayed open: an object smaller than one part (manifests, indexes) is one PutObject at
        # close instead of a multipart upload of three requests.
        kwargs.setdefault("allow_delayed_open", True)
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


_clients: dict = {}
_clients_guard = threading.Lock()


def s3_client(fs: pafs.S3FileSystem):
    """A botocore S3 client for `fs`'s store (one per settings, shared by threads: botocore clients are thread-safe)."""
    try:
        import botocore.config
        import botocore.session
    except ImportError:
        raise ValueError(
            "writing to s3:// needs botocore for the lock object (pip install botocore); see docs/object-storage.md"
        ) from None
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


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


def _error_code(err) -> str:
    return str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))


def _status(err) -> int:
    return int(getattr(err, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def abort_uploads(fs: pafs.FileSystem, directory: str, prefixes: tuple[str, ...]) -> list[str]:
    """Abort the multipart uploads under `directory` whose object names start with one of `prefixes`
    (a killed writer's half-uploaded shards: invisible, but billed until aborted); their keys."""
    if not is_s3(fs):
        return []
    client = s3_client(fs)
    bucket, key = _split(directory)
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
    """ValueError (one line) unless `uri`'s bucket can be reached with the credentials at hand."""
    fs, path = resolve_store(uri)
    if not is_s3(fs):
        if write and is_object_store(fs) and not unlocked_writes():
            raise ValueError(refuse_unlocked_message(store_uri(fs, path)))
        return
    bucket, _ = _split(path)
    client = s3_client(fs)
    if client._request_signer._credentials is None:  # noqa: SLF001 - botocore resolved no credentials at all
        raise ValueError(
            f"{uri}: no S3 credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run "
            "with an instance role)"
        )
    import botocore.exceptions

    try:
        client.head_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError as err:
        status = _status(err)
        if status == 404:
            raise ValueError(f"{uri}: bucket {bucket!r} does not exist at {_endpoint(fs)}") from None
        if status in (401, 403):
            raise ValueError(
                f"{uri}: access to bucket {bucket!r} denied at {_endpoint(fs)} (check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY and the bucket policy)"
            ) from None
        raise ValueError(f"{uri}: cannot reach bucket {bucket!r} at {_endpoint(fs)}: {err}") from None
    except botocore.exceptions.BotoCoreError as err:
        raise ValueError(f"{uri}: cannot reach the store at {_endpoint(fs)}: {err}") from None


def _endpoint(fs: pafs.S3FileSystem) -> str:
    return _client_kwargs(fs)["endpoint_url"] or "AWS S3"


def unlocked_writes() -> bool:
    return os.environ.get(UNLOCKED_ENV, "") not in ("", "0")


def refuse_unlocked_message(where: str) -> str:
    return (
        f"{where}: this store offers pyarrow no conditional write, so a second writer on another host could not be "
        f"refused; write to s3:// (or an S3-compatible endpoint), or set {UNLOCKED_ENV}=1 if you guarantee that one "
        "process writes this dataset"
    )


# ----------------------------------------------------------------------------------------------
# The lock object


def lease_seconds() -> float:
    text = os.environ.get(LEASE_ENV, "")
    try:
        return float(text) if text else DEFAULT_LEASE_S
    except ValueError:
        raise ValueError(f"{LEASE_ENV}: expected seconds, got {text!r}") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ObjectLock:
    """One writer at a time through a lock object (see the file docstring). Counted within one
    process, like `common.locks.exclusive_lock`."""

    _held: dict[str, "ObjectLock"] = {}
    _guard = threading.Lock()

    def __new__(cls, fs, path: str, *, what: str, hint: str, wait_seconds: float = 0.0):
        key = f"{_client_kwargs(fs)['endpoint_url']}|{path}"
        with cls._guard:
            held = cls._held.get(key)
            if held is not None:
                held._count += 1
                return held
            lock = super().__new__(cls)
            lock._key, lock._count = key, 1
            lock._acquire(fs, path, what, hint, wait_seconds)
            cls._held[key] = lock
            return lock

    def __init__(self, *args, **kwargs):
        pass  # everything happens in __new__ (a second open in this process returns the held lock)

    def _acquire(self, fs, path: str, what: str, hint: str, wait_seconds: float) -> None:
        import botocore.exceptions

        self.fs, self.path, self.what = fs, path, what
        self.client = s3_client(fs)
        self.bucket, self.key = _split(path)
        self.lease = lease_seconds()
        self.token = uuid.uuid4().hex
        self._error: BaseException | None = None
        self._stop = threading.Event()
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                self.etag = self._put(IfNoneMatch="*")
                break
            except botocore.exceptions.ClientError as err:
                if _status(err) not in (409, 412) and _error_code(err) not in (
                    "PreconditionFailed",
                    "ConditionalRequestConflict",
                ):
                    raise OSError(f"{store_uri(fs, path)}: cannot create the lock object: {err}") from None
            taken = self._take_over_if_stale()
            if taken:
                break
            if time.monotonic() >= deadline:
                raise _locked_error(
                    f"{what} is being written by another process ({self._holder}; lock object "
                    f"{store_uri(fs, path)}). {hint}"
                )
            time.sleep(0.5)
        self.renewed_at = time.monotonic()
        self._thread = threading.Thread(target=self._renew_loop, name="object-lock", daemon=True)
        self._thread.start()

    def _body(self) -> bytes:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "token": self.token, "lease_s": self.lease}
        info["since"] = getattr(self, "_since", None) or time.strftime("%Y-%m-%d %H:%M:%S")
        self._since = info["since"]
        return json.dumps(info).encode()

    def _put(self, **condition) -> str:
        return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(), **condition)["ETag"]

    def _take_over_if_stale(self) -> bool:
        """Read the lock object; if its holder is gone, replace it (If-Match its ETag). True if taken."""
        import botocore.exceptions

        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except botocore.exceptions.ClientError as err:
            if _status(err) == 404:  # released meanwhile: the next create attempt decides
                self._holder = "released meanwhile"
                return False
            raise
        body = got["Body"].read()
        try:
            info = json.loads(body)
        except ValueError:
            info = {}
        age = _server_age(got)
        self._holder = (
            f"pid {info.get('pid')} on {info.get('host')}, since {info.get('since')}, renewed {age:.0f} s ago"
            if info
            else "holder unknown"
        )
        same_host_dead = (
            info.get("host") == socket.gethostname()
            and isinstance(info.get("pid"), int)
            and not _pid_alive(info["pid"])
        )
        expired = age > float(info.get("lease_s", self.lease))
        if not (same_host_dead or expired):
            return False
        why = "its process is gone" if same_host_dead else f"not renewed for {age:.0f} s"
        try:
            self.etag = self._put(IfMatch=got["ETag"])
        except botocore.exceptions.ClientError as err:
            if _status(err) in (404, 409, 412):
                return False  # another process took it over first (or released it): the next round decides
            raise
        log.warning("%s: took over the lock object of %s (%s)", store_uri(self.fs, self.path), self._holder, why)
        return True

    def _renew_loop(self) -> None:
        import botocore.exceptions

        while not self._stop.wait(self.lease / 4):
            try:
                self.etag = self._put(IfMatch=self.etag)
                self.renewed_at = time.monotonic()
            except botocore.exceptions.ClientError as err:
                if _status(err) in (404, 412):
                    self._error = LockLost(
                        f"{store_uri(self.fs, self.path)}: another process took over the lock of {self.what}; "
                        "this writer stops without committing"
                    )
                    return
                log.warning("renewing the lock object %s failed (will retry): %s", self.path, err)
            except Exception as err:  # noqa: BLE001 - a network error: retried at the next round
                log.warning("renewing the lock object %s failed (will retry): %s", self.path, err)

    def check(self) -> None:
        """Raise LockLost unless this process still holds the lock with time to spare."""
        if self._error is not None:
            raise self._error
        idle = time.monotonic() - self.renewed_at
        if idle > self.lease / 2:
            raise LockLost(
                f"{store_uri(self.fs, self.path)}: could not renew the lock of {self.what} for {idle:.0f} s (the "
                "store is unreachable?); stopping without committing: rerun to resume"
            )

    def release(self) -> None:
        with self._guard:
            self._count -= 1
            if self._count > 0:
                return
            self._held.pop(self._key, None)
        self._stop.set()
        self._thread.join(timeout=5)
        if self._error is None:
            with contextlib.suppress(Exception):
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)

    def __enter__(self) -> "ObjectLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _server_age(response) -> float:
    """Seconds since the object was last written, on the store's own clock."""
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    try:
        now = parsedate_to_datetime(headers["date"])
    except (KeyError, TypeError, ValueError):
        import datetime

        now = datetime.datetime.now(datetime.timezone.utc)
    return (now - response["LastModified"]).total_seconds()


def _locked_error(message: str):
    from common.locks import LockedError

    return LockedError(message)
