"""Background work of an extraction: worker threads with bounded queues, the rejects file, and the
progress display.

    main thread:      read windows, plan micro-batches, launch target forwards (never waits on I/O)
    "assemble":       wait for a batch's device-to-host copy, cut per-sample views out of the
                      pinned buffer (no copy: the device laid the rows out as the shards store them)
    "write":          rejects (NaN/Inf flags come from the device), `ShardWriter.write` (zstd in
                      pyarrow's threads, which release the GIL), counters, then give the buffer back

(`host_path.HostPath` wires these up.)

Queues are bounded and the pinned buffers are a fixed pool, so memory stays bounded and a slow
disk slows the forward loop down instead of filling RAM. The first exception in a worker is kept
and re-raised in the main thread at its next `put` / `check`; the worker then drains its queue so
nothing blocks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time

from common.io import atomic_write_bytes, exists, read_bytes, resolve

log = logging.getLogger(__name__)

_STOP = object()


class Worker:
    """A thread applying `handle` to queued items, in order; errors are re-raised by `check()`."""

    def __init__(self, name: str, handle, maxsize: int, on_discard=None):
        self.name, self.handle, self.on_discard = name, handle, on_discard
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self.busy_seconds = 0.0
        self.busy_cpu_seconds = 0.0  # CPU time of this thread while busy (pyarrow's pool not counted)
        self.thread = threading.Thread(target=self._run, name=f"extract-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            if self.error is not None:
                self._discard(item)
                continue
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                self.handle(item)
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                self.error = err
                self._discard(item)
            self.busy_seconds += time.perf_counter() - start
            self.busy_cpu_seconds += time.thread_time() - start_cpu

    def _discard(self, item) -> None:
        if self.on_discard is not None:
            try:
                self.on_discard(item)
            except Exception:  # noqa: BLE001
                log.exception("%s: cleaning up a discarded item failed", self.name)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, item, *, also_check=()) -> None:
        """Queue `item`, waiting while the queue is full but re-raising any worker's error."""
        while True:
            for worker in (self, *also_check):
                worker.check()
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def finish(self, timeout: float | None = None) -> None:
        """Process everything queued, stop, and re-raise the worker's error if it had one."""
        self.put(_STOP)
        self.thread.join(timeout)
        self.check()

    def abandon(self) -> None:
        """Stop without waiting for queued work to matter (after an error elsewhere)."""
        if self.error is None:
            self.error = RuntimeError(f"{self.name}: stopped because of an error elsewhere")
        with contextlib.suppress(queue.Full):
            self.queue.put(_STOP, timeout=5)
        self.thread.join(timeout=30)


class RejectLog:
    """`rejects.*.jsonl`: one JSON line per rejected record, committed with the shards.

    The manifest's `stage_state["rejects_bytes"]` says how much of the file was committed; opening
    the log truncates anything after that (written after the last commit by a killed run), so a
    rerun records those records again and every reject is counted exactly once.
    """

    def __init__(self, path: str, committed_bytes: int):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "ab"):
            pass
        size = os.path.getsize(path)
        if size < committed_bytes:
            raise ValueError(
                f"{path}: {size} bytes, but the manifest committed {committed_bytes}; the rejects file was "
                "truncated or replaced"
            )
        if size > committed_bytes:
            log.info("%s: dropping %d bytes written after the last commit", path, size - committed_bytes)
            os.truncate(path, committed_bytes)
        self.positions: dict[int, str] = {}
        with open(path, "rb") as f:
            for line in f:
                entry = json.loads(line)
                self.positions[int(entry["position"])] = entry["reason"]
        self._file = open(path, "ab")  # noqa: SIM115 (open for the sink's life; close())
        self._dirty = False

    def add(self, reject) -> bool:
        """Append `reject` unless its position is already recorded; True if it was new."""
        if reject.position in self.positions:
            return False
        self._file.write((json.dumps(reject.to_json(), ensure_ascii=False) + "\n").encode("utf-8"))
        self.positions[reject.position] = reject.reason
        self._dirty = True
        return True

    def sync(self) -> int:
        """Make every added line durable; return the file's length (what a commit may claim)."""
        if self._dirty:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as err:  # fsync errors name no file
                raise OSError(err.errno, err.strerror or str(err), self.path) from err
            self._dirty = False
        return self._file.tell()

    def upload(self) -> None:
        """Nothing to do: `sync` made the lines durable (see `ObjectRejectLog`)."""

    def close(self) -> None:
        self.sync()
        self._file.close()


class ObjectRejectLog:
    """The rejects file on an object store, where nothing can be appended: the lines are kept in
    memory and the whole object is written again (once per shard commit, before the manifest that
    claims its length: `ShardWriter.before_save`). The object only ever grows by whole lines, so its
    first `rejects_bytes` bytes are exactly what the manifest committed, as with the local file."""

    def __init__(self, uri: str, committed_bytes: int):
        self.path = uri
        self._fs, self._key = resolve(uri)
        data = read_bytes(self._fs, self._key) if exists(self._fs, self._key) else b""
        if len(data) < committed_bytes:
            raise ValueError(
                f"{uri}: {len(data)} bytes, but the manifest committed {committed_bytes}; the rejects object was "
                "truncated or replaced"
            )
        if len(data) > committed_bytes:
            log.info("%s: dropping %d bytes written after the last commit", uri, len(data) - committed_bytes)
        self._data = bytearray(data[:committed_bytes])
        self._stored = data[:committed_bytes] == data
        self.positions: dict[int, str] = {}
        for line in bytes(self._data).splitlines():
            entry = json.loads(line)
            self.positions[int(entry["position"])] = entry["reason"]

    def add(self, reject) -> bool:
        if reject.position in self.positions:
            return False
        self._data += (json.dumps(reject.to_json(), ensure_ascii=False) + "\n").encode("utf-8")
        self.positions[reject.position] = reject.reason
        self._stored = False
        return True

    def sync(self) -> int:
        """The length a commit may claim; the bytes reach the store in `upload` (before that commit)."""
        return len(self._data)

    def upload(self) -> None:
        if not self._stored:
            atomic_write_bytes(self._key, bytes(self._data), self._fs)
            self._stored = True

    def close(self) -> None:
        self.upload()


def open_reject_log(path: str, committed_bytes: int):
    """The rejects log of a dataset root: a local file (appended, fsynced) or an object (rewritten whole)."""
    return ObjectRejectLog(path, committed_bytes) if "://" in path else RejectLog(path, committed_bytes)


def read_committed_rejects(path: str, committed_bytes: int) -> list[dict]:
    fs, key = resolve(path)
    if not exists(fs, key):
        return []
    with fs.open_input_stream(key) as f:
        data = f.read(committed_bytes)
    return [json.loads(line) for line in data.splitlines() if line.strip()]


class Progress:
    """A tqdm bar over input records (ETA) with samples, tokens, tok/s, rejects and bytes written."""

    def __init__(self, total: int | None, desc: str, enabled: bool):
        self._lock = threading.Lock()
        self.samples = self.tokens = self.rejects = self.skipped_samples = 0
        self.bytes = 0
        self.start = time.perf_counter()
        self._last = 0.0
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total,
                desc=desc,
                unit="rec",
                dynamic_ncols=True,
                smoothing=0.05,
                bar_format=(
                    "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total_fmt} rec [{elapsed}<{remaining}] {postfix}"
                )
                if total
                else None,
            )

    def advance(self, records: float) -> None:
        with self._lock:
            if self.bar is not None and records:
                self.bar.update(records)
            self._refresh()

    def wrote(self, samples: int, tokens: int, nbytes: int) -> None:
        with self._lock:
            self.samples += samples
            self.tokens += tokens
            self.bytes = nbytes
            self._refresh()

    def rejected(self, n: int = 1) -> None:
        with self._lock:
            self.rejects += n

    def skipped(self, samples: int) -> None:
        with self._lock:
            self.skipped_samples += samples

    def tokens_per_second(self) -> float:
        return self.tokens / max(1e-9, time.perf_counter() - self.start)

    def _refresh(self) -> None:
        now = time.perf_counter()
        if self.bar is None or now - self._last < 0.5:
            return
        self._last = now
        postfix = (
            f"samples={self.samples:,} tok={self.tokens:,} tok/s={self.tokens_per_second():,.0f} "
            f"written={self.bytes / 1e9:.2f}GB rejects={self.rejects:,}"
        )
        if self.skipped_samples:
            postfix += f" resumed-past={self.skipped_samples:,}"
        self.bar.set_postfix_str(postfix, refresh=False)

    def close(self) -> None:
        with self._lock:
            self._last = 0.0
            self._refresh()
            if self.bar is not None:
                self.bar.close()
