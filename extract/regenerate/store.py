"""Exactly once, whatever happens: the journal of finished records and the atomic commit.

Layout of `out/` (docs/regenerate.md):

    data.jsonl            the regenerated corpus, records in input order   } written at the end,
    rejects.jsonl         one line per rejected record, with the reason    } each atomically;
    regenerate.json       provenance, settings, counts (written last)      } regenerate.json last
    summary.json          this run's counts and throughput (also when incomplete)
    journal.rankNNN.jsonl finished records, appended as they finish (removed after the commit)

Each rank appends one JSON line per finished record (stored or rejected) to its own journal,
flushed at once (a killed process loses nothing it wrote) and fsynced at most every
`fsync_every_s` seconds and at the end (a power loss loses at most that much). The first line is
a header with the settings that decide the corpus; a run with other settings is refused. Records
are keyed by a stable id (`conversation.record_id`), so a rerun reads every journal, skips what
is done, and finishes the rest; a torn last line (a kill in the middle of a write) is cut off
before appending. Records that failed (a server that stayed down through every retry) are not
finished: a rerun tries them again.

The commit (rank 0, after every rank finished) reads all journals, keeps one entry per id, checks
that every record of the corpus has one, and writes data.jsonl, rejects.jsonl and then
regenerate.json by temporary file + fsync + rename; then removes the journals. A kill at any point
leaves either the journals (a rerun commits again) or the finished output (a rerun says so).

One writer at a time: each rank holds `common.locks.writer_lock` on `.rankNNN.lock` for its
whole run (the commit included): `flock` on a local disk (released by the OS if the process dies),
a lock object made with conditional writes on S3.

On an object store (`out=s3://bucket/prefix`), which cannot append, a rank's journal is a series
of objects `journal.rankNNN.sNNNNNN.jsonl`, each written once under its final name (a PUT is
atomic: a reader sees all of it or nothing) and each starting with the header: the records
finished since the last one, put at most every `fsync_every_s` seconds and at the end. A kill
loses the records not yet put (they are answered again), never part of one. The commit writes
data.jsonl and rejects.jsonl in place (an object becomes visible only when its upload completes),
then regenerate.json, then deletes the journal objects; a killed upload (an open multipart upload,
invisible) is aborted by the next run. docs/object-storage.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io as pyio
import json
import logging
import os
import re
import tempfile
import time

from common import io
from common.io import (
    atomic_write_bytes,
    atomic_write_json,
    commit,
    discard,
    join_uri,
    named_os_error,
    remove_temp_files,
    resolve,
    temp_name,
)
from common.locks import Lock, writer_lock
from common.objstore import abort_uploads
from extract.corpus.regenerated import DATA_FILE, PROVENANCE_FILE, is_journal

log = logging.getLogger(__name__)

REJECTS_FILE = "rejects.jsonl"
SUMMARY_FILE = "summary.json"
JOURNAL_VERSION = 1


def journal_name(rank: int) -> str:
    return f"journal.rank{rank:03d}.jsonl"


def segment_name(rank: int, number: int) -> str:
    """An object store's journal object number `number` of `rank`."""
    return f"journal.rank{rank:03d}.s{number:06d}.jsonl"


_SEGMENT = re.compile(r"journal\.rank(\d{3})\.s(\d{6})\.jsonl")


def on_object_store(out: str) -> bool:
    return "://" in str(out)


def lock_rank(out: str, rank: int) -> Lock:
    fs, root = resolve(out)
    return writer_lock(
        fs,
        io.join(root, f".rank{rank:03d}.lock"),
        what=f"the regenerated corpus {out} (rank {rank})",
        hint="Wait for it to finish, or stop it; a killed run leaves nothing locked.",
    )


def journal_files(out: str) -> list[str]:
    if on_object_store(out):
        names = io.list_names(out)
    elif os.path.isdir(out):  # os.listdir, not pyarrow: a corpus directory may hold names that are not UTF-8
        names = sorted(os.listdir(out))
    else:
        names = []
    return [f for f in names if is_journal(f)]


def _open_binary(path: str):
    """A local file, or an object read whole into memory (a journal object holds a few seconds of records)."""
    if not on_object_store(path):
        return open(path, "rb")
    fs, where = resolve(path)
    return pyio.BytesIO(io.read_bytes(fs, where))


@dataclasses.dataclass
class JournalScan:
    """What one pass over a journal found: its header, the byte length of its complete lines, the
    finished records (id -> `FinishedRecord`, without the stored records), and its run lines."""

    header: dict | None = None
    complete_bytes: int = 0
    finished: dict = dataclasses.field(default_factory=dict)
    runs: list = dataclasses.field(default_factory=list)
    duplicates: int = 0


@dataclasses.dataclass
class FinishedRecord:
    position: int
    status: str  # ok | rejected
    file: str
    offset: int  # of the journal line
    length: int
    stats: dict
    reason: str | None = None


def scan_journal(path: str) -> JournalScan:
    """One streaming pass over a journal (a line at a time: a corpus of a million records is never
    held in memory). An incomplete last line (a kill mid-write) is not read; a broken line before it
    is an error naming the file and line."""
    scan = JournalScan()
    with _open_binary(path) as f:
        offset = 0
        for n, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # torn by a kill: not part of the journal
            try:
                item = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(
                    f"{path}:{n}: not a journal line ({err}); the journal is damaged: move it away to start this "
                    "rank afresh"
                ) from None
            if n == 1:
                if not isinstance(item, dict) or item.get("journal") != JOURNAL_VERSION:
                    raise ValueError(f"{path}: the first line is not a version-{JOURNAL_VERSION} journal header")
                scan.header = item
            elif item.get("status") in ("ok", "rejected"):
                if item["id"] in scan.finished:
                    scan.duplicates += 1
                else:
                    scan.finished[item["id"]] = FinishedRecord(
                        item["position"],
                        item["status"],
                        path,
                        offset,
                        len(line),
                        item.get("stats", {}),
                        item.get("reason"),
                    )
            elif item.get("status") == "run":
                scan.runs.append(item)
            offset += len(line)
        scan.complete_bytes = offset
    return scan


def scan_all(out: str) -> dict[str, JournalScan]:
    return {name: scan_journal(join_uri(out, name)) for name in journal_files(out)}


def check_resumable(out: str, header: dict) -> None:
    """ValueError if a journal of `out` (any rank's: a resume may change the world size) holds
    finished records made with other settings."""
    for name, scan in scan_all(out).items():
        problems = header_problems(scan.header, header)
        if problems and scan.finished:
            raise ValueError(
                f"{out}: cannot resume: " + "; ".join(problems) + f" ({name}). Use the same settings, or another out "
                "directory."
            )


def open_journal(out: str, rank: int, header: dict, fsync_every_s: float, lock: Lock):
    """This rank's journal: appended on a local disk, a series of objects on an object store."""
    if on_object_store(out):
        return SegmentJournal(out, rank, header, fsync_every_s, lock)
    return Journal(out, rank, header, fsync_every_s)


class Journal:
    """This rank's append-only journal (see the module docstring)."""

    def __init__(self, out: str, rank: int, header: dict, fsync_every_s: float):
        self.path = os.path.join(out, journal_name(rank))
        self.fsync_every_s = fsync_every_s
        self.torn_bytes = 0
        check_resumable(out, header)
        if os.path.exists(self.path):
            scan = scan_journal(self.path)
            size, complete = os.path.getsize(self.path), scan.complete_bytes
            if header_problems(scan.header, header):  # nothing finished under those settings: start afresh with these
                complete = 0
            self.torn_bytes = size - complete
            if self.torn_bytes:
                log.warning("%s: discarding %d bytes of a line torn by a kill", self.path, self.torn_bytes)
                os.truncate(self.path, complete)
        self.file = open(self.path, "ab")  # noqa: SIM115 (open for the journal's life; close())
        if self.file.tell() == 0:
            self.file.write((json.dumps({"journal": JOURNAL_VERSION, **header}, sort_keys=True) + "\n").encode())
            self.sync()
        self.last_sync = time.monotonic()

    def append(self, entry: dict) -> None:
        try:
            self.file.write((json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"))
            self.file.flush()
        except OSError as err:  # a full disk: a torn last line, which the resume discards
            raise named_os_error(err, self.path) from err
        if time.monotonic() - self.last_sync >= self.fsync_every_s:
            self.sync()

    def sync(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as err:
            raise named_os_error(err, self.path) from err
        self.last_sync = time.monotonic()

    def close(self) -> None:
        if not self.file.closed:
            try:
                self.sync()
            finally:
                with contextlib.suppress(OSError):
                    self.file.close()  # after a failed write, closing fails the same way: said already


class SegmentJournal:
    """This rank's journal on an object store: records are collected in memory and put as a new
    object (header first, then the records) at most every `fsync_every_s` seconds and at close,
    each after `lock.check()` (no object once another writer may hold the lock)."""

    torn_bytes = 0  # an object is whole or absent: nothing is ever torn

    def __init__(self, out: str, rank: int, header: dict, fsync_every_s: float, lock: Lock):
        self.out, self.rank, self.fsync_every_s, self.lock = out, rank, fsync_every_s, lock
        check_resumable(out, header)
        self.fs, self.root = resolve(out)
        abort_uploads(self.fs, self.root, (f"journal.rank{rank:03d}.",))  # a killed put of a large object
        numbers = [-1]
        for name in journal_files(out):
            match = _SEGMENT.fullmatch(name)
            if match is None or int(match.group(1)) != rank:
                continue
            if header_problems(scan_journal(join_uri(out, name)).header, header):  # nothing finished under those
                self.fs.delete_file(io.join(self.root, name))
                continue
            numbers.append(int(match.group(2)))
        self.number = max(numbers) + 1
        self.header_line = (json.dumps({"journal": JOURNAL_VERSION, **header}, sort_keys=True) + "\n").encode()
        self.lines: list[bytes] = []
        self.last_sync = time.monotonic()

    def append(self, entry: dict) -> None:
        self.lines.append((json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"))
        if time.monotonic() - self.last_sync >= self.fsync_every_s:
            self.sync()

    def sync(self) -> None:
        """Put the records collected since the last put as the next journal object."""
        if self.lines:
            self.lock.check()
            path = io.join(self.root, segment_name(self.rank, self.number))
            atomic_write_bytes(path, self.header_line + b"".join(self.lines), self.fs)
            self.number += 1
            self.lines = []
        self.last_sync = time.monotonic()

    def close(self) -> None:
        self.sync()


def header_problems(stored: dict | None, fresh: dict) -> list[str]:
    """What differs between a journal's settings and this run's, in words."""
    if stored is None:
        return []
    problems = []
    for part in ("settings", "target", "corpus"):
        old, new = stored.get(part, {}), fresh.get(part, {})
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                problems.append(f"{part} {key} is {old.get(key)!r} in the journal but {new.get(key)!r} now")
    return problems


def finished_records(out: str) -> tuple[dict[str, FinishedRecord], int]:
    """Every finished record in every journal of `out` (the first entry of an id wins), and how many
    entries repeated an id (none under the lock)."""
    finished: dict[str, FinishedRecord] = {}
    duplicates = 0
    for scan in scan_all(out).values():
        duplicates += scan.duplicates
        for record_id, entry in scan.finished.items():
            if record_id in finished:
                duplicates += 1
            else:
                finished[record_id] = entry
    return finished, duplicates


def done_ids(out: str) -> set[str]:
    return set(finished_records(out)[0])


# ----------------------------------------------------------------------------------------------
# Commit


def is_complete(out: str) -> dict | None:
    """The provenance of a committed corpus in `out`, or None."""
    fs, root = resolve(out)
    path = io.join(root, PROVENANCE_FILE)
    if not io.exists(fs, path) or not io.exists(fs, io.join(root, DATA_FILE)):
        return None
    provenance = io.read_json(fs, path)
    return provenance if provenance.get("complete") else None


@contextlib.contextmanager
def local_journals(out: str):
    """A local directory holding `out`'s journals: `out` itself on a local disk; on an object store a
    temporary copy (the commit reads the records back in input order, which a GET per record would make slow)."""
    if not on_object_store(out):
        yield out
        return
    fs, root = resolve(out)
    with tempfile.TemporaryDirectory(prefix="regenerate-journals-") as local:
        for name in journal_files(out):
            with open(os.path.join(local, name), "wb") as f:
                f.write(io.read_bytes(fs, io.join(root, name)))
        yield local


def commit_corpus(out: str, expected_records: int, provenance: dict, lock: Lock | None = None) -> dict:
    """Write data.jsonl, rejects.jsonl and regenerate.json from the journals (atomically, the
    provenance last) and remove the journals. Returns the counts. ValueError if records are missing.
    `lock` (rank 0's) is checked before each write on an object store."""
    lock = lock or Lock.unheld()
    fs, root = resolve(out)
    with local_journals(out) as journal_dir:
        finished, duplicates = finished_records(journal_dir)
        if len(finished) != expected_records:
            raise ValueError(
                f"{out}: {len(finished)} of {expected_records} records are finished; rerun to finish the rest"
            )
        entries = sorted(finished.values(), key=lambda e: e.position)
        counts = count_entries(entries)
        counts["journal_duplicates"] = duplicates
        _write_corpus_files(fs, root, entries, lock)
    lock.check()
    atomic_write_json(io.join(root, PROVENANCE_FILE), {**provenance, "counts": counts, "complete": True}, fs)
    for name in journal_files(out):
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(io.join(root, name))
    return counts


def _write_corpus_files(fs, root: str, entries: list[FinishedRecord], lock: Lock) -> None:
    """data.jsonl and rejects.jsonl from the journal lines `entries` name: on a local disk through
    temporary files renamed into place; on an object store in place (visible once complete)."""
    in_place = io.in_place(fs)
    if in_place:
        abort_uploads(fs, root, (DATA_FILE, REJECTS_FILE))  # a killed commit's unfinished uploads
        lock.check()
    else:
        remove_temp_files(fs, root)
    finals = (io.join(root, DATA_FILE), io.join(root, REJECTS_FILE))
    paths = finals if in_place else tuple(temp_name(p) for p in finals)
    journals: dict[str, object] = {}
    try:
        with fs.open_output_stream(paths[0]) as data, fs.open_output_stream(paths[1]) as rejects:
            for entry in entries:
                journal = journals.get(entry.file) or journals.setdefault(entry.file, open(entry.file, "rb"))  # noqa: SIM115
                journal.seek(entry.offset)
                item = json.loads(journal.read(entry.length))
                if entry.status == "ok":
                    line = item["record"]
                    data.write((json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
                else:
                    line = {k: item[k] for k in ("position", "source", "reason", "detail", "id")}
                    rejects.write((json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
        if not in_place:
            for tmp, final in zip(paths, finals, strict=True):
                commit(fs, tmp, final)
    except BaseException as err:  # a full disk: no half-written data.jsonl (or temporary) stays behind
        for path in paths:  # on an object store, closing the stream completed the upload with what it held
            discard(fs, path)
        if isinstance(err, OSError):
            raise named_os_error(err, finals[0]) from err
        raise
    finally:
        for journal in journals.values():
            journal.close()


def count_entries(entries: list[FinishedRecord]) -> dict:
    """Records stored and rejected (by reason), answers, tokens, answers at the cap or cut."""
    counts = {
        "records": len(entries),
        "stored": 0,
        "rejected": 0,
        "rejected_by_reason": {},
        "answers": 0,
        "answer_tokens": 0,
        "prompt_tokens": 0,
        "answers_at_cap": 0,
        "answers_cut": 0,
        "records_cut_at_tool_turn": 0,
        "round_trip_tokens": 0,
        "round_trip_cut_tokens": 0,
    }
    for entry in entries:
        stats = entry.stats
        for key in ("round_trip_tokens", "round_trip_cut_tokens"):  # stored and rejected records alike
            counts[key] += stats.get(key, 0)
        if entry.status == "ok":
            counts["stored"] += 1
            counts["answers"] += stats.get("answers", 0)
            counts["answer_tokens"] += stats.get("answer_tokens", 0)
            counts["prompt_tokens"] += stats.get("prompt_tokens", 0)
            counts["answers_at_cap"] += stats.get("at_cap", 0)
            counts["answers_cut"] += stats.get("cut", 0)
            counts["records_cut_at_tool_turn"] += stats.get("turns_cut", 0)
        else:
            counts["rejected"] += 1
            by_reason = counts["rejected_by_reason"]
            by_reason[entry.reason] = by_reason.get(entry.reason, 0) + 1
    return counts
