"""The S3 server's own ceiling: PUT and ranged-GET throughput of a server on loopback (moto_server,
started here, or the one at `--port`) with no project reader or writer code in between (a
benchmark, not a test).

    python -m benchmarks.s3_ceiling                                  # small sizes: a 2-core VM, under a minute
    python -m benchmarks.s3_ceiling --object-mb 32 --range-mb 4,32 --seconds 1 --out ceiling.json   # the H200 run

What it tells apart: when training from S3 or extracting into it runs slower than local disk, is
the server the cap (these rates are low too), or the project's own read/write path (these rates
are well above what the run needed)? Rows, each run for about `--seconds`:

- `put pyarrow`: `--put-threads` concurrent `S3FileSystem` output streams, opened as `shards.ShardWriter` opens
  a shard on S3 (`common.objstore.resolve_store`: background writes on, delayed open, the retry
  strategy; `open_output_stream(path, buffer_size=1 MiB)`), each writing whole objects of
  `--object-mb` in 1 MiB writes and closing them (close waits for the upload, as a shard's
  commit does). Arrow uploads 10 MiB parts (a constant in Arrow's C++ s3fs, not settable from
  Python) on its IO thread pool (`pyarrow.io_thread_count()`, 8 by default), so one stream already
  has several parts in flight; the `io_threads` rows set `pyarrow.set_io_thread_count` first,
  the `background_writes=False` row uploads one part at a time (no concurrency in a stream).
  Arrow's AWS SDK (1.11.9xx) sends every part as an `aws-chunked` body with a CRC64 trailer
  (its default `AWS_REQUEST_CHECKSUM_CALCULATION=when_supported`); moto_server 5.2.5 decodes such
  a body in Python by appending 64 KiB chunks to a bytes object, a cost that grows with the
  square of the part size. The `when_required` rows set that variable for their streams (the SDK
  then sends a plain body): the difference is mostly moto's decoding, not the upload.
- `put botocore`: the same objects written with botocore, as one PutObject each (`part_mb` 0:
  the server's PUT rate without multipart assembly) or as a multipart upload of `--part-mb`
  parts sent one after another (what a larger part size than Arrow's 10 MiB would change).
- `get pyarrow`: `--threads` concurrent readers of `--range-mb` ranges at random offsets of the
  `--objects` objects, through one shared `open_input_file` handle per object and `read_at`, as
  `ShardDataset` reads a sample from S3; `via proxy`: the same through `DelayProxy` at 0 ms (the
  Python TCP proxy the training benchmark's S3 rows read through, in the training process).

MB/s are 10^6 bytes of object data per wall second (request overhead excluded from the bytes).
moto_server answers a range by reading the whole object under a per-object lock, so ranges much
smaller than the object cost the server the object's size: compare `--range-mb` with `--object-mb`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import threading
import time

from common.interrupts import run_main

MB = 1_000_000
WRITE_CHUNK = 1 << 20  # what the stream sees per write; the IPC writer's writes are of this order
BUCKET = "ceiling"
MIN_PART_MIB = 5  # S3's smallest part but the last (CompleteMultipartUpload answers EntityTooSmall)


# ----------------------------------------------------------------------------------------------
# Clients


def writer_filesystem(uri: str, background_writes: bool = True):
    """(file system, bucket path) with the options `ShardWriter` gets for an s3:// root; with
    `background_writes=False` the same but uploading one part at a time."""
    import pyarrow.fs as pafs

    from common.objstore import resolve_store, retry_attempts

    fs, path = resolve_store(uri)
    if not background_writes:
        kwargs = dict(fs.__reduce__()[1][0], background_writes=False)
        retry = pafs.AwsStandardS3RetryStrategy(max_attempts=retry_attempts())
        fs = pafs.S3FileSystem(**kwargs, retry_strategy=retry)
    return fs, path


def writer_options(fs) -> dict:
    """The S3FileSystem options that decide how a write is uploaded (for the report)."""
    import pyarrow as pa

    kwargs = fs.__reduce__()[1][0]
    return {
        "background_writes": kwargs["background_writes"],
        "allow_delayed_open": kwargs["allow_delayed_open"],
        "part_mib": 10,  # Arrow's kPartUploadSize (cpp/src/arrow/filesystem/s3fs.cc); not an option
        "io_threads": pa.io_thread_count(),
    }


def botocore_client(port: int):
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name=os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID") or "testing",
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY") or "testing",
        config=botocore.config.Config(max_pool_connections=64, retries={"max_attempts": 3}),
    )


# ----------------------------------------------------------------------------------------------
# Timed rows


def run_threads(threads: int, seconds: float, work) -> tuple[int, int, float]:
    """`work(thread, n)` called over and over in `threads` threads until `seconds` have passed
    (each thread at least once; the call under way is finished). Returns (bytes, calls, wall s)
    with work's returned byte counts summed."""
    totals = [[0, 0] for _ in range(threads)]
    errors: list[BaseException] = []
    deadline = time.perf_counter() + seconds

    def loop(t: int) -> None:
        try:
            while True:
                totals[t][0] += work(t, totals[t][1])
                totals[t][1] += 1
                if time.perf_counter() >= deadline:
                    return
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(err)

    started = time.perf_counter()
    pool = [threading.Thread(target=loop, args=(t,), name=f"ceiling-{t}") for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return sum(t[0] for t in totals), sum(t[1] for t in totals), wall


def row(op: str, client: str, threads: int, moved: int, calls: int, wall: float, **facts) -> dict:
    return {
        "op": op,
        "client": client,
        "threads": threads,
        **facts,
        "bytes": moved,
        "calls": calls,
        "seconds": round(wall, 3),
        "MB_per_s": round(moved / wall / MB, 1),
    }


CHECKSUM_ENV = "AWS_REQUEST_CHECKSUM_CALCULATION"  # read by the AWS SDK when a client is made (per S3FileSystem)


@contextlib.contextmanager
def checksum_calculation(mode: str | None):
    """`AWS_REQUEST_CHECKSUM_CALCULATION` set to `mode` for the block (None: left as it is)."""
    before = os.environ.get(CHECKSUM_ENV)
    if mode:
        os.environ[CHECKSUM_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CHECKSUM_ENV, None)
        else:
            os.environ[CHECKSUM_ENV] = before


def put_pyarrow(
    uri: str,
    threads: int,
    payload: bytes,
    seconds: float,
    background_writes: bool = True,
    checksums: str | None = None,
    variation: str = "",
) -> dict:
    """Whole objects through `threads` concurrent output streams opened as the shard writer opens
    them (with `checksums`: that AWS_REQUEST_CHECKSUM_CALCULATION for these streams); `variation`
    names what differs from the writer's way ("" = nothing), for the report."""
    with checksum_calculation(checksums):
        fs, root = writer_filesystem(uri, background_writes)  # the SDK client reads the variable here
        mode = os.environ.get(CHECKSUM_ENV) or "when_supported (default)"
    tag = f"put-pa-{threads}-{int(background_writes)}-{time.monotonic_ns()}"
    view = memoryview(payload)

    def write_object(t: int, n: int) -> int:
        with fs.open_output_stream(f"{root}/{tag}/{t}-{n}", buffer_size=1 << 20) as out:
            for at in range(0, len(view), WRITE_CHUNK):
                out.write(view[at : at + WRITE_CHUNK])
        return len(payload)

    facts = writer_options(fs) | {"checksums": mode, "variation": variation}
    result = row("put", "pyarrow", threads, *run_threads(threads, seconds, write_object), **facts)
    fs.delete_dir(f"{root}/{tag}")  # moto keeps every object: do not let the rows pile up in its memory
    return result


def put_botocore(port: int, key_root: str, threads: int, payload: bytes, seconds: float, part_mb: int) -> dict:
    """Whole objects with botocore: one PutObject each (`part_mb` 0) or a multipart upload of
    `part_mb` MiB parts sent one after another."""
    client = botocore_client(port)
    tag = f"{key_root}/put-boto-{threads}-{part_mb}-{time.monotonic_ns()}"
    part = part_mb << 20

    def write_object(t: int, n: int) -> int:
        key = f"{tag}/{t}-{n}"
        if not part_mb:
            client.put_object(Bucket=BUCKET, Key=key, Body=payload)
            return len(payload)
        upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
        parts = []
        for number, at in enumerate(range(0, len(payload), part), start=1):
            answer = client.upload_part(
                Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=number, Body=payload[at : at + part]
            )
            parts.append({"PartNumber": number, "ETag": answer["ETag"]})
        client.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
        return len(payload)

    variation = f"botocore multipart {part_mb} MiB parts" if part_mb else "botocore PutObject"
    result = row(
        "put", "botocore", threads, *run_threads(threads, seconds, write_object), part_mb=part_mb, variation=variation
    )
    delete_prefix(client, f"{tag}/")
    return result


def upload_objects(port: int, key_root: str, objects: int, payload: bytes) -> list[str]:
    """`objects` objects for the GET rows (PutObject each: their upload is not what is measured)."""
    client = botocore_client(port)
    keys = [f"{key_root}/get/{n}" for n in range(objects)]
    for key in keys:
        client.put_object(Bucket=BUCKET, Key=key, Body=payload)
    return keys


def get_pyarrow(uri_of, keys: list[str], threads: int, range_bytes: int, object_bytes: int, seconds: float) -> dict:
    """`threads` concurrent `read_at` calls of `range_bytes` at random offsets of random objects,
    through one handle per object shared by the threads (as `ShardDataset` reads from S3)."""
    from common.objstore import resolve_store

    fs, _ = resolve_store(uri_of(BUCKET))
    handles = [fs.open_input_file(f"{BUCKET}/{key}") for key in keys]
    length = min(range_bytes, object_bytes)
    rngs = [random.Random(t) for t in range(threads)]

    def read_range(t: int, n: int) -> int:  # noqa: ARG001 (run_threads' (thread, count) callback)
        handle = rngs[t].choice(handles)
        offset = rngs[t].randrange(0, object_bytes - length + 1)
        data = handle.read_at(length, offset)
        if len(data) != length:
            raise OSError(f"a range of {length} bytes at {offset} came back with {len(data)}")
        return length

    try:
        return row("get", "pyarrow", threads, *run_threads(threads, seconds, read_range), range_mb=length / (1 << 20))
    finally:
        for handle in handles:
            handle.close()


# ----------------------------------------------------------------------------------------------
# The whole measurement


def parse_counts(text: str, what: str, allow_zero: bool = False) -> list[int]:
    """A comma list of non-negative (or positive) integers, e.g. "1,4,16"."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected a comma list of integers, got {text!r}") from None
    if not values or any(v < (0 if allow_zero else 1) for v in values):
        raise ValueError(f"{what}: expected {'non-negative' if allow_zero else 'positive'} integers, got {text!r}")
    return values


@contextlib.contextmanager
def io_thread_count(n: int | None):
    """pyarrow's IO thread pool at `n` threads for the block (None: left as it is), then restored."""
    import pyarrow as pa

    before = pa.io_thread_count()
    if n:
        pa.set_io_thread_count(n)
    try:
        yield
    finally:
        pa.set_io_thread_count(before)


def measure(
    port: int,
    *,
    object_mb: float = 16,
    objects: int = 8,
    threads: list[int] = (1, 4, 16),
    put_threads: list[int] = (1, 4),
    range_mb: list[float] = (4,),
    io_threads: list[int] = (32,),
    part_mb: list[int] = (0, 64),
    seconds: float = 1.5,
    puts: bool = True,
    proxy: bool = True,
    log=print,
) -> dict:
    """Every row against the S3 server on 127.0.0.1:`port` (bucket `ceiling` created if missing);
    `log(line)` per row as it is measured. Returns {"setup": ..., "rows": [...]}."""
    from benchmarks.s3_server import DelayProxy, uri_for

    if object_mb <= 0 or objects < 1 or seconds <= 0:
        raise ValueError("object_mb, objects and seconds must be above 0")
    if any(0 < part < MIN_PART_MIB for part in part_mb):
        raise ValueError(f"part_mb: S3 refuses parts under {MIN_PART_MIB} MiB (but the last), got {list(part_mb)}")
    os.environ.update({k: os.environ.get(k) or v for k, v in _credentials().items()})
    client = botocore_client(port)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=BUCKET)
    payload = os.urandom(mib(object_mb))  # random: nothing on the way can compress it
    key_root = f"run-{time.monotonic_ns()}"
    uri = uri_for(port, f"{BUCKET}/{key_root}")
    rows: list[dict] = []

    def add(result: dict) -> None:
        rows.append(result)
        log(describe_row(result))

    if puts:
        ends = sorted({put_threads[0], put_threads[-1]})  # the variations at the fewest and most streams
        for n in put_threads:
            add(put_pyarrow(uri, n, payload, seconds))
        for count in io_threads:
            with io_thread_count(count):
                for n in ends:
                    add(put_pyarrow(uri, n, payload, seconds, variation=f"io threads {count}"))
        add(put_pyarrow(uri, 1, payload, seconds, background_writes=False, variation="background_writes=False"))
        for n in ends:
            add(put_pyarrow(uri, n, payload, seconds, checksums="when_required", variation="when_required"))
        for part in part_mb:
            for n in ends:
                add(put_botocore(port, key_root, n, payload, seconds, part))
    started = time.perf_counter()
    keys = upload_objects(port, key_root, objects, payload)
    setup = {
        "get_objects": objects,
        "object_mib": len(payload) / (1 << 20),
        "upload_s": round(time.perf_counter() - started, 3),
    }
    for size in range_mb:
        for n in threads:
            direct = get_pyarrow(lambda path: uri_for(port, path), keys, n, mib(size), len(payload), seconds)
            add(direct | {"via": "direct"})
        if proxy:
            with DelayProxy(port) as relay:
                for n in threads:
                    add(get_pyarrow(relay.uri, keys, n, mib(size), len(payload), seconds) | {"via": "proxy"})
    delete_prefix(client, f"{key_root}/")  # the GET objects, and directory markers pyarrow's deletes leave
    return {"setup": setup, "rows": rows}


def delete_prefix(client, prefix: str) -> int:
    """Delete every object under `prefix` in the bucket; returns how many."""
    deleted = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
            deleted += len(keys)
    return deleted


def mib(size: float) -> int:
    return max(1, int(size * (1 << 20)))


def _credentials() -> dict:
    from benchmarks.s3_server import CREDENTIALS

    return CREDENTIALS


def describe_row(r: dict) -> str:
    """One line per row: what was done and its rate."""
    if r["op"] == "get":
        how = f"get {r['range_mb']:.3g} MiB ranges, {r['threads']:>2} readers, {r.get('via', 'direct')}"
    elif r["client"] == "pyarrow":
        how = (
            f"put pyarrow stream, {r['threads']:>2} streams, io threads {r['io_threads']}, "
            f"background_writes={r['background_writes']}, checksums {r['checksums']}"
        )
    else:
        kind = f"multipart {r['part_mb']} MiB parts" if r["part_mb"] else "PutObject"
        how = f"put botocore {kind}, {r['threads']:>2} threads"
    unit = "ranges" if r["op"] == "get" else "objects"
    return (
        f"  {how}: {r['MB_per_s']:,.1f} MB/s ({r['bytes'] / MB:,.0f} MB in {r['seconds']:.2f} s, {r['calls']} {unit})"
    )


def summary_label(r: dict) -> str:
    """The group a row's rate is summarised in."""
    if r["op"] == "get":
        return f"get {r['range_mb']:.3g} MiB ranges {r.get('via', 'direct')}"
    if r["client"] == "botocore":
        return "put botocore " + ("multipart" if r["part_mb"] else "PutObject")
    return "put as the shard writer" if not r["variation"] else "put pyarrow, other options"


def summarize(result: dict) -> dict[str, float]:
    """The best rate (MB/s) of each group of rows: what a run from or into this server is capped by."""
    best: dict[str, float] = {}
    for r in result["rows"]:
        label = summary_label(r)
        best[label] = max(best.get(label, 0.0), r["MB_per_s"])
    return best


def print_summary(result: dict, log=print) -> None:
    log(
        "S3 server ceiling (best of each group): "
        + ", ".join(f"{k} {v:,.0f} MB/s" for k, v in summarize(result).items())
    )


def measure_options(args) -> dict:
    """`measure`'s keyword arguments from the command line (ValueError naming a bad option)."""
    if args.object_mb < 1 or args.objects < 1 or args.seconds <= 0:
        raise ValueError("--object-mb and --objects must be positive, --seconds above 0")
    part_mb = parse_counts(args.part_mb, "--part-mb", allow_zero=True) if args.part_mb.strip() else []
    if any(0 < part < MIN_PART_MIB for part in part_mb):
        raise ValueError(f"--part-mb: S3 refuses parts under {MIN_PART_MIB} MiB (but the last), got {args.part_mb}")
    return dict(
        object_mb=args.object_mb,
        objects=args.objects,
        threads=parse_counts(args.threads, "--threads"),
        put_threads=parse_counts(args.put_threads, "--put-threads"),
        range_mb=parse_counts(args.range_mb, "--range-mb"),
        io_threads=parse_counts(args.io_threads, "--io-threads") if args.io_threads.strip() else [],
        part_mb=part_mb,
        seconds=args.seconds,
        puts=not args.no_puts,
        proxy=not args.no_proxy,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3_ceiling", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0, help="an S3 server already on 127.0.0.1 (0 = start moto_server)")
    p.add_argument("--object-mb", type=int, default=16, help="object size, MiB")
    p.add_argument("--objects", type=int, default=8, help="objects the GET rows read from")
    p.add_argument("--threads", default="1,4,16", help="concurrent readers per GET row (comma list)")
    p.add_argument("--put-threads", default="1,4", help="concurrent output streams per PUT row (comma list)")
    p.add_argument("--range-mb", default="4", help="ranged GET sizes, MiB (comma list; above --object-mb: the object)")
    p.add_argument("--io-threads", default="32", help="extra PUT rows with pyarrow.set_io_thread_count(N) (comma list)")
    p.add_argument("--part-mb", default="0,64", help="botocore PUT rows: 0 = one PutObject, N = multipart of N MiB")
    p.add_argument("--seconds", type=float, default=1.5, help="time per row (the object or range under way finishes)")
    p.add_argument("--no-puts", action="store_true", help="GET rows only")
    p.add_argument("--no-proxy", action="store_true", help="no GET rows through DelayProxy")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        kw = measure_options(args)
    except ValueError as err:
        p.error(str(err))
    from benchmarks.s3_server import MotoServer

    server = None if args.port else MotoServer()
    try:
        port = args.port or server.port
        origin = "moto_server started here" if server else "given"
        print(f"S3 server on 127.0.0.1:{port} ({origin}), {os.cpu_count()} CPUs")
        started = time.perf_counter()
        result = measure(port, **kw)
    finally:
        if server is not None:
            server.stop()
    print_summary(result)
    print(f"{len(result['rows'])} rows in {time.perf_counter() - started:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cpus": os.cpu_count(), "best": summarize(result), **result}, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.s3_ceiling", main))
