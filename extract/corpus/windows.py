"""Windows: the corpus's records -> windows of this rank's samples, read ahead in a thread.

`read_windows` takes `sort_window` records at a time, tokenizes them (`rendering.SampleBuilder`; a
record that breaks the tokenizer becomes an `unexpected_error` reject, not a crash), keeps the ones
this rank owns and turns a repeated sample (same tokens and loss mask) into a `duplicate` reject.
`Prefetch` runs it in a background thread a few windows ahead, so tokenization overlaps the
forwards; an error in the thread is raised in the consumer.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections.abc import Iterator

from extract.config import ExtractConfig
from extract.corpus.files import CorpusFiles
from extract.corpus.reading import iter_records
from extract.corpus.records import DUPLICATE
from extract.corpus.rendering import Reject, SampleBuilder
from extract.corpus.streams import CorpusError
from extract.ranks import Ranks

UNEXPECTED = "unexpected_error"


@dataclasses.dataclass
class Window:
    span: float  # input positions this window covers (for the progress bar)
    records_owned: int
    samples: list  # TokenizedSample, deduplicated, this rank's
    rejects: list  # Reject, this rank's (including duplicates)


def read_windows(cfg: ExtractConfig, corpus: CorpusFiles, builder: SampleBuilder, ranks: Ranks) -> Iterator[Window]:
    """Windows of `sort_window` records each: this rank's samples (deduplicated over the whole run) and rejects."""
    records = iter_records(corpus, streaming=cfg.streaming, max_records=cfg.max_records)
    seen: dict[str, int] = {}
    end = 0
    while True:
        chunk = list(itertools.islice(records, cfg.sort_window))
        if not chunk:
            return
        window = Window(chunk[-1].position + 1 - end, 0, [], [])
        end = chunk[-1].position + 1
        for result in _build_guarded(builder, chunk):
            if not ranks.owns(result.sample_id, result.position):
                continue
            window.records_owned += 1
            if isinstance(result, Reject):
                window.rejects.append(result)
            elif result.sample_id in seen:
                window.rejects.append(
                    Reject(
                        result.position,
                        result.source,
                        DUPLICATE,
                        f"same tokens and loss mask as position {seen[result.sample_id]}",
                        result.sample_id,
                    )
                )
            else:
                seen[result.sample_id] = result.position
                window.samples.append(result)
        yield window


def _build_guarded(builder: SampleBuilder, chunk: list) -> list:
    """`builder.build`, but a record that breaks the tokenizer becomes a reject, not a crash."""
    try:
        return builder.build(chunk)
    except CorpusError:
        raise
    except Exception:  # noqa: BLE001 - find the record(s) responsible, one by one
        out = []
        for raw in chunk:
            try:
                out.extend(builder.build([raw]))
            except CorpusError:
                raise
            except Exception as err:  # noqa: BLE001
                out.append(Reject(raw.position, raw.source, UNEXPECTED, f"{type(err).__name__}: {err}"))
        return out


class Prefetch:
    """Runs an iterator in a thread, `depth` items ahead (tokenization overlaps the forwards)."""

    def __init__(self, iterator: Iterator, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iterator,), name="extract-read", daemon=True)
        self._thread.start()

    def _run(self, iterator) -> None:
        try:
            for item in iterator:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
            self._put(("error", err))

    def _put(self, entry) -> bool:
        """Queue `entry` unless the consumer has gone away (then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        while True:
            kind, value = self._queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value

    def close(self) -> None:
        self._stop.set()
