"""The host path of an extraction: what happens to a micro-batch after its forward is launched.

`HostPath` waits for the device-to-host copy into a pinned pool buffer, cuts the samples out of it
as views (the device already laid them out as the shards store them), rejects the samples the
device flagged non-finite and writes the others to the `ShardWriter`, in two worker threads; a
buffer goes back to the pool (`_Lease`) once every sample cut from it is written.
"""

from __future__ import annotations

import queue
import threading

from extract import corpus as C
from extract.batching import BufferPool, HostBatch
from extract.capture import sample_views
from extract.sink import Progress, RejectLog, Worker
from shards import Sample

# Rejects by policy: length and loss-token filtering, duplicates and samples holding the mask token are
# counted and listed, never an error. Every other reason is the corpus's fault, and `on_error = fail`
# stops on it.
POLICY_REASONS = frozenset({C.TOO_LONG, C.TOO_FEW_LOSS_TOKENS, C.DUPLICATE, C.HOLDS_MASK_TOKEN})


class HostPath:
    """The host side of the forward loop, in two worker threads (see `sink.Worker`):

        "assemble": wait for a micro-batch's device-to-host copy and cut its samples out of the
                    pinned buffer as views (the device already laid them out as stored: no copy)
        "write":    reject the samples the device flagged non-finite; write the others with
                    `ShardWriter.write(..., hidden_known_finite=True)` (the flags cover exactly the
                    stored bf16 values; zstd runs in pyarrow's threads); counters; then give the
                    buffer back to the pool

    A buffer returns to the pool only when every sample cut from it is written (or its batch is
    dropped after an error), so the pool bounds the batches on the host and a slow writer slows
    the forward loop down. `benchmarks.extract_host` measures this class on synthetic batches.
    """

    def __init__(
        self,
        writer,
        rejects: RejectLog,
        pool: BufferPool,
        progress: Progress,
        stats: dict,
        *,
        on_error: str,
        depth: int,
    ):
        self.writer, self.rejects, self.pool, self.progress, self.stats = writer, rejects, pool, progress, stats
        self.on_error = on_error
        self.writing = Worker("write", self._write, maxsize=2, on_discard=self._release)
        self.assembling = Worker("assemble", self._assemble, maxsize=depth, on_discard=self._release)

    # -- the forward loop's side

    def acquire(self) -> HostBatch:
        """A free buffer, waiting while all are in flight but re-raising a worker's error."""
        while True:
            self.check()
            try:
                return self.pool.acquire(timeout=0.2)
            except queue.Empty:
                continue

    def put_rejects(self, rejects: list, share: float) -> None:
        self.assembling.put(("rejects", rejects, share), also_check=(self.writing,))

    def put_batch(self, inflight, samples: list, to_write: list[bool], share: float) -> None:
        lease = _Lease(self.pool, inflight.host)
        try:
            self.assembling.put(("batch", (lease, inflight, samples, to_write), share), also_check=(self.writing,))
        except BaseException:
            inflight.wait()  # a worker failed: take the buffer back, once the device is done writing into it
            lease.release()
            raise

    def check(self) -> None:
        self.assembling.check()
        self.writing.check()

    def finish(self) -> None:
        self.assembling.finish()
        self.writing.finish()

    def abandon(self) -> None:
        self.assembling.abandon()
        self.writing.abandon()

    # -- worker threads

    def _assemble(self, item) -> None:
        kind, payload, share = item
        if kind == "rejects":
            self.writing.put(item)
            return
        lease, inflight, samples, to_write = payload
        inflight.wait()
        self.writing.put(("samples", (lease, self.cut(inflight, samples, to_write)), share))

    def _write(self, item) -> None:
        kind, payload, share = item
        if kind == "rejects":
            for reject in payload:
                self.record_reject(reject)
        else:
            lease, out = payload
            try:
                self.store(out)
            finally:
                lease.release()  # the views into the buffer are dead from here on
        self.progress.advance(share)

    # -- the work itself (also called directly by benchmarks.extract_host)

    @staticmethod
    def cut(inflight, samples: list, to_write: list[bool]) -> list[tuple]:
        """(tokenized, Sample of views into the buffer, hidden_ok, logits_ok) of each wanted sample of a landed
        batch."""
        out = []
        offsets = inflight.offsets
        for b, (tokenized, wanted) in enumerate(zip(samples, to_write, strict=True)):
            if wanted:
                hidden, topk_ids, topk_logprobs, hidden_ok, logits_ok = sample_views(inflight, b, offsets[b])
                sample = Sample(
                    tokenized.sample_id, tokenized.input_ids, tokenized.loss_mask, hidden, topk_ids, topk_logprobs
                )
                out.append((tokenized, sample, hidden_ok, logits_ok))
        return out

    def store(self, out: list[tuple]) -> None:
        """Write (or reject) the samples `cut` returned, in order."""
        for tokenized, sample, hidden_ok, logits_ok in out:
            self._write_sample(tokenized, sample, hidden_ok, logits_ok)

    def _write_sample(self, tokenized, sample, hidden_ok: bool, logits_ok: bool) -> None:
        if not (hidden_ok and logits_ok):
            reason = C.NONFINITE_HIDDEN if not hidden_ok else C.NONFINITE_LOGITS
            what = "tap hidden states" if not hidden_ok else "final logits"
            self.record_reject(
                C.Reject(tokenized.position, tokenized.source, reason, f"NaN/Inf in the {what}", tokenized.sample_id)
            )
            return
        writer = self.writer
        writer.stage_state["rejects_bytes"] = self.rejects.sync()  # committed with the next shard
        writer.write(sample, hidden_known_finite=True)
        self.stats["samples"] += 1
        self.stats["tokens"] += sample.n_tokens
        self.progress.wrote(1, sample.n_tokens, writer.bytes_written)

    def record_reject(self, reject) -> None:
        new = self.rejects.add(reject)
        if new:
            key = "duplicates" if reject.reason == C.DUPLICATE else f"rejected.{reject.reason}"
            self.writer.extra_counts[key] += 1
            self.progress.rejected()
        if self.on_error == "fail" and reject.reason not in POLICY_REASONS:
            self.writer.stage_state["rejects_bytes"] = self.rejects.sync()
            self.writer.flush()
            raise ValueError(
                f"{reject.source} (position {reject.position}): {reject.reason}: {reject.detail}. "
                "Stopping because on_error = fail; on_error=skip counts such records and goes on."
            )

    @staticmethod
    def _release(item) -> None:
        """A dropped item (after an error) gives its buffer back."""
        if item[0] in ("batch", "samples"):
            item[1][0].release()


class _Lease:
    """A pool buffer on loan to one batch; `release` gives it back once, however often it is called
    (the write thread's `finally` and a worker's discard handler may both reach it)."""

    def __init__(self, pool: BufferPool, host: HostBatch):
        self._pool, self._host = pool, host
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            host, self._host = self._host, None
        if host is not None:
            self._pool.release(host)
