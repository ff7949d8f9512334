"""`ShardDataset`: random access to the samples of a committed dataset.

Only the manifest is read at construction. `ds[i]` opens (memory-maps, for local files) the one
shard that holds sample `i` and decodes only that sample's record batch. The length index comes
from the small per-shard index files and never touches a shard file.

Integrity, by default (`verify_samples=True`): every index file is checked against its checksum in
the manifest when it is loaded, and every sample's record batch bytes against their xxh3-64 in the
index before they are decoded (`shards/sample_checksums.py`); a mismatch raises ShardFormatError
naming the file, the sample and its row. Shards written before format version 2 have no
per-sample checksums: their samples are read unchecked, with one warning per dataset.
`verify_checksums=True` also hashes each whole shard file on its first open (slow on big shards).

On an object store a request that fails because the store does not answer (after pyarrow's own
retries) is retried again with backoff for a while (`common.objstore.retrying`), then raises
`StoreUnreachable`: a store that is gone is not reported as a damaged shard.

Thread safety: each thread keeps its own open readers (a small LRU per thread), so background
prefetch threads decode in parallel without locks; Arrow releases the GIL while decompressing.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import threading
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from common import io, objstore
from common.hashing import file_checksum
from shards.manifest import (
    MANIFEST_NAME,
    SAMPLE_CHECKSUM_ALGO_KEY,
    hidden_split_of,
    load_manifest,
    projection_of,
    read_index,
)
from shards.provenance import Provenance, provenance_of
from shards.quant import parse_encoding
from shards.sample_checksums import SampleRanges, decode_message
from shards.schema import Sample, ShardFormatError, decode_sample, shard_schema, shard_schema_matches

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _OpenShardFile:
    """One thread's handle on a shard file: the file (memory map or input file) and its IPC reader."""

    source: pa.NativeFile
    reader: pa.ipc.RecordBatchFileReader | None  # None: remote, samples read from their index ranges only


class ShardDataset:
    """The samples of the dataset at `root` (a local path or any `pyarrow.fs` URI), in manifest order."""

    def __init__(
        self,
        root: str,
        manifest_name: str = MANIFEST_NAME,
        verify_checksums: bool = False,
        max_open_shards: int = 64,
        verify_samples: bool = True,
    ):
        self.root_uri = str(root)
        self.fs, self.root = io.resolve(root)
        self.manifest_name = manifest_name
        self.manifest: dict = load_manifest(self.fs, self.root, manifest_name)
        self.provenance: Provenance = provenance_of(self.manifest)
        self.encoding: str = self.manifest["encoding"]
        self.hidden_width: int = self.manifest["hidden_width"]
        self.topk: int = self.manifest["topk"]
        self.hidden_split: int = hidden_split_of(self.manifest)
        self.quant = parse_encoding(self.encoding)  # None for the lossless encodings
        self.projection: dict | None = projection_of(self.manifest)  # None unless the features are projected
        self.shards: list[dict] = self.manifest["shards"]
        self.verify_checksums = verify_checksums
        self.verify_samples = verify_samples
        self.max_open_shards = max_open_shards
        self._schema = shard_schema(
            self.encoding, self.hidden_width, self.topk, hidden_split=self.hidden_split
        )  # decodes checked samples
        self._starts = list(itertools.accumulate((e["samples"] for e in self.shards), initial=0))
        self._local = threading.local()
        self._lock = threading.Lock()
        self._checked_shards: set[int] = set()
        # Remote shards checked once (size, schema, samples): one handle each, shared by threads (read_at).
        self._shared_sources: collections.OrderedDict = collections.OrderedDict()
        self._index: pa.Table | None = None
        self._position_of_id: dict[str, int] | None = None
        self._ranges: dict[int, SampleRanges] = {}  # shard -> its samples' byte ranges and checksums
        if verify_samples:
            self._warn_unchecked_shards()

    def _warn_unchecked_shards(self) -> None:
        unchecked = [e["file"] for e in self.shards if SAMPLE_CHECKSUM_ALGO_KEY not in e]
        if unchecked:
            log.warning(
                "%s: %d of %d shards (e.g. %s) were written before per-sample checksums (format version 1); their "
                "samples "
                "are read without a per-sample check. `python -m shards verify` checks their whole-file checksums.",
                io.join(self.root, self.manifest_name),
                len(unchecked),
                len(self.shards),
                unchecked[0],
            )

    def __getstate__(self) -> dict:
        # Open readers, locks and thread-locals stay behind (e.g. when sent to a worker process).
        state = {k: v for k, v in self.__dict__.items() if k not in ("_local", "_lock", "fs", "_shared_sources")}
        state["_checked_shards"] = set(self._checked_shards)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.fs = io.resolve(self.root_uri)[0]
        self._shared_sources = collections.OrderedDict()
        self._local = threading.local()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sizes and the index

    def __len__(self) -> int:
        return self._starts[-1]

    def __repr__(self) -> str:
        return (
            f"ShardDataset({self.root!r}, samples={len(self)}, shards={len(self.shards)}, encoding={self.encoding!r})"
        )

    @property
    def index(self) -> pa.Table:
        """[sample_id, n_tokens, n_loss_tokens, shard, row] per sample, in dataset order; `shard`
        is the position in `manifest["shards"]`. Reads only the index files."""
        with self._lock:
            if self._index is None:
                self._index = self._load_index()
            return self._index

    @property
    def n_tokens(self) -> np.ndarray:
        """int32 [len(ds)]: tokens per sample, in dataset order."""
        return self.index.column("n_tokens").to_numpy()

    def _load_index(self) -> pa.Table:
        # Index files are small; reading them concurrently hides latency on remote filesystems.
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            tables = list(pool.map(self._read_shard_index, range(len(self.shards))))
        if not tables:
            return pa.table(
                {
                    "sample_id": pa.array([], pa.string()),
                    "n_tokens": pa.array([], pa.int32()),
                    "n_loss_tokens": pa.array([], pa.int32()),
                    "shard": pa.array([], pa.int32()),
                    "row": pa.array([], pa.int32()),
                }
            )
        return pa.concat_tables(tables)

    def _read_shard_index(self, shard: int) -> pa.Table:
        entry = self.shards[shard]
        table = read_index(self.fs, self.root, entry, check_checksum=self.verify_checksums or self.verify_samples)
        if self.verify_samples and SAMPLE_CHECKSUM_ALGO_KEY in entry:
            # A plain dict store: atomic, and a race only loads the same small table twice.
            self._ranges[shard] = SampleRanges.from_index(
                table, entry["bytes"], io.join(self.root, entry["index_file"])
            )
        return pa.table(
            {
                "sample_id": table.column("sample_id"),
                "n_tokens": table.column("n_tokens"),
                "n_loss_tokens": table.column("n_loss_tokens"),
                "shard": pa.array(np.full(table.num_rows, shard, dtype=np.int32)),
                "row": table.column("row"),
            }
        )

    # ------------------------------------------------------------------ samples

    def locate(self, i: int) -> tuple[int, int]:
        """(shard position, row in shard) of sample `i`; negative `i` counts from the end."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a dataset of {n} samples")
        i %= n
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def __getitem__(self, i: int) -> Sample:
        shard, row = self.locate(int(i))
        return self._read(shard, row)

    def get(self, sample_id: str) -> Sample:
        """The sample with this id (KeyError if the dataset has none)."""
        with self._lock:
            if self._position_of_id is None:
                ids = self._index_unlocked().column("sample_id").to_pylist()
                self._position_of_id = {sid: pos for pos, sid in enumerate(ids)}
        if sample_id not in self._position_of_id:
            raise KeyError(f"sample id {sample_id!r} is not in {self.root}/{self.manifest_name}")
        return self[self._position_of_id[sample_id]]

    def _index_unlocked(self) -> pa.Table:
        if self._index is None:
            self._index = self._load_index()
        return self._index

    def __iter__(self) -> Iterator[Sample]:
        """All samples in a stable order: manifest shard order, then row order."""
        for shard, entry in enumerate(self.shards):
            for row in range(entry["samples"]):
                yield self._read(shard, row)

    def compact(self, i: int) -> Sample:
        """Sample `i` with hidden states as stored: a `QuantizedHidden` (codes and scales, views of the
        decoded buffers) for a quantized dataset, which the trainer moves to its device as is and
        dequantizes there; the uint16 bf16 bits of a lossless dataset."""
        shard, row = self.locate(int(i))
        return self._read(shard, row, compact=True)

    def torch(self, i: int, hidden_out=None) -> dict:
        """Sample `i` as torch tensors: input_ids int32 [T], loss_mask bool [T], hidden bf16 [T, W],
        topk_ids int32 [T, k], topk_logprobs float32 [T, k].

        Tensors share the decoded buffers (hidden is a bf16 view of the uint16 bit patterns); the
        only copies are zstd's decompression and, for "planes", joining the two byte planes.
        Quantized datasets are dequantized here, on the CPU (the trainer uses `compact` instead).
        With `hidden_out` (a C-contiguous CPU bf16 tensor [>= T, W], e.g. one row of a pinned batch
        buffer) the hidden states are decoded straight into it and "hidden" is `hidden_out[:T]`.
        """
        import torch

        if hidden_out is None:
            sample = self[i]
            hidden = _tensor(sample.hidden).view(torch.bfloat16)
        else:
            if hidden_out.dtype != torch.bfloat16 or hidden_out.device.type != "cpu" or not hidden_out.is_contiguous():
                raise ValueError(
                    f"hidden_out: need a contiguous CPU bfloat16 tensor, got {hidden_out.dtype} on {hidden_out.device}"
                )
            sample = self._read(*self.locate(int(i)), hidden_out=hidden_out.view(torch.uint16).numpy())
            hidden = hidden_out[: sample.n_tokens]
        return {
            "input_ids": _tensor(sample.input_ids),
            "loss_mask": torch.from_numpy(sample.loss_mask != 0),
            "hidden": hidden,
            "topk_ids": _tensor(sample.topk_ids),
            "topk_logprobs": _tensor(sample.topk_logprobs),
        }

    def samples_holding(self, token_id: int, limit: int = 3) -> list[str]:
        """Ids of the first `limit` samples whose input_ids hold `token_id`, in dataset order. Reads
        only the input_ids column of each shard (Arrow's IPC reader fetches the buffers of the selected
        column alone: about 4 bytes a token, a small share of the file)."""
        found: list[str] = []
        for shard, entry in enumerate(self.shards):
            path = io.join(self.root, entry["file"])
            rows = objstore.retrying(
                functools.partial(self._rows_holding, path, token_id),
                where=self._uri(path),
                clock=objstore.outage_clock(self.fs),
            )
            ids = self.index.column("sample_id")
            found += [str(ids[self._starts[shard] + row]) for row in rows[: limit - len(found)]]
            if len(found) >= limit:
                break
        return found

    def _rows_holding(self, path: str, token_id: int) -> list[int]:
        options = pa.ipc.IpcReadOptions(included_fields=[self._schema.get_field_index("input_ids")])
        try:
            source = pa.memory_map(path, "r") if io.is_local(self.fs) else self.fs.open_input_file(path)
            with source, pa.ipc.open_file(source, options=options) as reader:
                return [
                    row
                    for row in range(reader.num_record_batches)
                    if bool((reader.get_batch(row).column(0).values.to_numpy() == token_id).any())
                ]
        except (pa.ArrowException, OSError) as err:
            if objstore.error_kind(err) == "transient":
                raise
            raise ShardFormatError(f"{path}: not a readable Arrow IPC file ({err})") from None

    # ------------------------------------------------------------------ shard files

    def _read(self, shard: int, row: int, hidden_out: np.ndarray | None = None, compact: bool = False) -> Sample:
        ranges = self._sample_ranges(shard)
        opened = self._reader(shard)
        path = io.join(self.root, self.shards[shard]["file"])
        try:
            if ranges is None:
                assert opened.reader is not None  # a shard without index ranges is read through its footer
                batch = opened.reader.get_batch(row)
            else:
                if io.is_local(self.fs):
                    data = ranges.read(opened.source, row, path)
                else:  # a remote handle may be shared by threads: no seek
                    data = objstore.retrying(
                        lambda: ranges.read_at(opened.source, row, path),
                        where=self._uri(path),
                        clock=objstore.outage_clock(self.fs),
                    )
                ranges.check(data, row, path)  # ShardFormatError naming file, sample and row
                batch = decode_message(data, self._schema)
            batch.validate(full=True)  # damaged offsets would otherwise crash or mislead the decoding
        except objstore.StoreUnreachable:
            raise
        except (pa.ArrowException, OSError) as err:  # pyarrow raises OSError for damaged zstd data
            raise ShardFormatError(f"{path}: row {row} cannot be read: {err}") from None
        try:
            sample = decode_sample(
                batch, self.encoding, self.hidden_width, self.topk, hidden_out, self.hidden_split, compact=compact
            )
        except (pa.ArrowException, OSError, ShardFormatError) as err:
            raise ShardFormatError(f"{path}: row {row} cannot be decoded: {err}") from None
        if ranges is not None and sample.sample_id != ranges.sample_id(row):
            raise ShardFormatError(
                f"{path}: row {row} holds sample {sample.sample_id}, the index says {ranges.sample_id(row)}"
            )
        return sample

    def _sample_ranges(self, shard: int) -> SampleRanges | None:
        """The shard's per-sample byte ranges and checksums (loading its index once), or None when
        samples are not checked: `verify_samples` is off, or the shard predates per-sample checksums."""
        if not self.verify_samples or SAMPLE_CHECKSUM_ALGO_KEY not in self.shards[shard]:
            return None
        if shard not in self._ranges:
            self._read_shard_index(shard)
        return self._ranges[shard]

    def _reader(self, shard: int) -> _OpenShardFile:
        cache = getattr(self._local, "readers", None)
        if cache is None:
            cache = self._local.readers = collections.OrderedDict()
        if shard in cache:
            cache.move_to_end(shard)
            return cache[shard]
        reader = self._open(shard)
        cache[shard] = reader
        if len(cache) > self.max_open_shards:
            cache.popitem(last=False)
        return reader

    def _open(self, shard: int) -> _OpenShardFile:
        entry = self.shards[shard]
        path = io.join(self.root, entry["file"])
        if not io.is_local(self.fs) and self._sample_ranges(shard) is not None:
            with self._lock:
                shared = self._shared_sources.get(shard)
            if shared is not None:
                # Remote, checked reads: the file was checked once (by any thread) and every thread reads
                # its samples' ranges with `read_at` through one handle: no further HEAD or footer reads.
                return _OpenShardFile(shared, None)
        info = objstore.retrying(
            lambda: self.fs.get_file_info(path), where=self._uri(path), clock=objstore.outage_clock(self.fs)
        )
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{path}: shard file listed in the manifest is missing")
        if info.size != entry["bytes"]:
            raise ShardFormatError(
                f"{path}: {info.size} bytes on disk, manifest says {entry['bytes']} (truncated or overwritten)"
            )
        with self._lock:
            if self.verify_checksums and shard not in self._checked_shards:
                self._check_checksum(entry["file"], entry["checksum"])
                self._checked_shards.add(shard)
        try:
            source, reader = objstore.retrying(
                lambda: self._open_ipc(path), where=self._uri(path), clock=objstore.outage_clock(self.fs)
            )
        except objstore.StoreUnreachable:
            raise
        except (pa.ArrowException, OSError) as err:  # pyarrow raises OSError for damaged data too
            raise ShardFormatError(f"{path}: not a readable Arrow IPC file ({err})") from None
        if not shard_schema_matches(reader.schema, self.encoding, self.hidden_width, self.topk, self.hidden_split):
            raise ShardFormatError(
                f"{path}: the file's schema does not match the manifest's layout (damaged, or another dataset's file)"
            )
        if reader.num_record_batches != entry["samples"]:
            raise ShardFormatError(
                f"{path}: {reader.num_record_batches} samples in the file, manifest says {entry['samples']}"
            )
        if not io.is_local(self.fs):
            with self._lock:
                self._shared_sources[shard] = source
                if len(self._shared_sources) > 4096:
                    self._shared_sources.popitem(last=False)
        return _OpenShardFile(source, reader)

    def _open_ipc(self, path: str) -> tuple[pa.NativeFile, pa.ipc.RecordBatchFileReader]:
        source = pa.memory_map(path, "r") if io.is_local(self.fs) else self.fs.open_input_file(path)
        return source, pa.ipc.open_file(source)

    def _uri(self, path: str) -> str:
        return objstore.store_uri(self.fs, path)

    def _check_checksum(self, file: str, expected: str) -> None:
        path = io.join(self.root, file)
        actual = file_checksum(self.fs, path)
        if actual != expected:
            raise ShardFormatError(
                f"{path}: checksum {actual} does not match the manifest's {expected} (corrupted file)"
            )


def _tensor(array: np.ndarray):
    """A torch tensor sharing `array`'s memory; copied only if that memory is read-only (a file
    mapping, which torch could not protect from writes)."""
    import torch

    return torch.from_numpy(array if array.flags.writeable else array.copy())
