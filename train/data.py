"""The training data stream: shards -> length-bucketed, token-budget, stride-interleaved batches.

    stream = DataStream(cfg.data, expected=expected_fields)   # refuses an incompatible dataset
    save_json(run_dir / "data_plan.json", stream.data_plan())
    stream.load_state_dict(checkpoint_state)                   # optional: resume exactly
    for batch in stream:                                       # endless; batch.epoch tells the epoch
        wait = stream.last_wait                                # seconds blocked in that next()
        ...                                                    # batch.state goes into the checkpoint

What happens, in order:
1. Sample selection from the shard index alone (`train/samples.py`; no hidden state is read):
   held-out samples (`is_holdout`, a seed-independent hash of the sample id, shared with eval),
   samples with too few loss tokens, samples longer than the token budget (`oversize`), then
   `max_samples` (a nested, uniformly spread subset: the smallest values of a second id hash).
2. Scheduling (`train/buckets.py`, pure): buckets from configured or quantile boundaries, a fixed
   batch size per bucket so the padded size stays within the budget, a shuffle per (seed, epoch),
   stride-based interleaving of the buckets' batches.
3. Loading: background threads read and collate whole batches (`Batch`, right padding) into pinned
   memory when CUDA is available; batches reach the consumer in plan order whatever the threads
   do, so the stream is a pure function of (dataset, config, position).

Data parallel (`split=buckets.RankSplit`): the plan stays the one global plan; each of its
batches is dealt into world_size x accumulation parts by tokens (`buckets.split_by_tokens`) and
the stream reads and collates only this rank's parts, yielding a `Share` (one `Batch` per
accumulation step) instead of a `Batch`. Every rank yields a share for every global batch, even
one whose parts are all empty, so the ranks stay in step.

A position is a small JSON-able dict (`Batch.state`, `DataStream.state_dict()`); loading it into a
stream on the same dataset and schedule resumes at exactly the next batch. A state from another
dataset, sample selection, seed, budget or boundaries is refused with the field named. Checkpoint
the `state` of the last batch trained on, not `state_dict()`, which has moved on if the loop
fetched ahead.

Errors in the loader threads reach the consumer in `next()`. Unreadable or inconsistent data
(OSError, ValueError, Arrow errors) follows `on_corrupt`: "fail" raises `DataLoadError` naming the
sample id and shard file and pointing at `python -m shards verify`; "skip" drops the sample, records
it in `corrupt_samples` and logs the file (a batch left empty is skipped whole). A damaged index is
a `DataLoadError` at start. An object store that stops answering is not damage: the reader waits for
it (`common.objstore.retrying`), then `StoreUnreachable` stops the run (rerunning resumes). Any
other exception is re-raised with a note naming the sample and shard.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import torch

from common.io import is_local
from common.objstore import StoreUnreachable
from shards import ShardDataset
from shards.quant import QuantizedHidden
from shards.schema import ShardFormatError
from train import buckets
from train.config import DataConfig  # noqa: F401 - the `data` table, re-exported for its users
from train.samples import check_compatible, select_samples, selection_digest
from train.stored_features import collate_compact

__all__ = [
    "DataConfig",
    "Batch",
    "Share",
    "DataStream",
    "DataLoadError",
    "collate",
    "STATE_VERSION",
]

log = logging.getLogger(__name__)

STATE_VERSION = 1


# ----------------------------------------------------------------------------------------------
# Config


# ----------------------------------------------------------------------------------------------
# Batch


@dataclasses.dataclass
class Batch:
    """One training batch, right-padded (the contract of docs/ARCHITECTURE.md)."""

    input_ids: torch.Tensor  # int64 [B, S] (padding: 0)
    loss_mask: torch.Tensor  # bool [B, S] (False on padding)
    # bf16 [B, S, W]; quantized datasets: train.stored_features.CompactHidden (.to(device) -> that tensor)
    hidden: torch.Tensor
    topk_ids: torch.Tensor  # int64 [B, S, k]
    topk_logprobs: torch.Tensor  # float32 [B, S, k]
    lengths: torch.Tensor  # int64 [B]
    sample_ids: list[str]
    bucket: int
    epoch: int
    state: dict  # data position *after* this batch; resuming from it yields the next batch

    TENSOR_FIELDS = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs", "lengths")

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclasses.dataclass
class Share:
    """One rank's part of a global batch: one micro-batch per accumulation step (docs/ARCHITECTURE.md).

    `rows[m]` are the positions of `parts[m]`'s samples in the global batch (plan order), which
    fix their anchors (drawn per global row), so a sample trains the same whatever the split."""

    parts: list[Batch | None]  # None: an empty part (fewer samples than parts, or all unreadable)
    rows: list[np.ndarray]  # int64 positions in the global batch, per part
    global_lengths: np.ndarray  # int64 tokens of every sample of the global batch, plan order
    sample_ids: list[str]  # every sample of the global batch, plan order
    bucket: int
    epoch: int
    state: dict  # data position *after* this global batch (the same on every rank)

    @classmethod
    def of_batch(cls, batch: Batch) -> Share:
        """A whole batch as the single part of a one-part split (the plain single-process case)."""
        lengths = batch.lengths.numpy().astype(np.int64)
        return cls(
            [batch],
            [np.arange(lengths.size, dtype=np.int64)],
            lengths,
            list(batch.sample_ids),
            batch.bucket,
            batch.epoch,
            batch.state,
        )


class DataLoadError(ValueError):
    """The dataset is damaged: a sample could not be read or did not match the index (names the sample
    id and shard file), or an index file is (points at `python -m shards verify`)."""


def verify_hint(root: str) -> str:
    return f"`python -m shards verify {root}` checks every file of the dataset"


# ----------------------------------------------------------------------------------------------
# Collation


def collate(samples: list[dict], sample_ids: list[str], *, bucket: int, epoch: int, state: dict, pin: bool) -> Batch:
    """Right-pad samples (dicts of `ShardDataset.torch`) into one `Batch`; padding is zero/False.
    Quantized hidden states (`QuantizedHidden`, from `ShardDataset.compact`) stay compact: the batch
    holds a `train.stored_features.CompactHidden`, dequantized on the device by the step."""
    assert samples, "a batch needs at least one sample"
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    B, S = len(samples), max(lengths)
    W = int(samples[0]["hidden"].shape[1])
    k = int(samples[0]["topk_ids"].shape[1])

    def empty(*shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    compact = isinstance(samples[0]["hidden"], QuantizedHidden)
    input_ids_BS = empty(B, S, dtype=torch.int64)
    loss_mask_BS = empty(B, S, dtype=torch.bool)
    hidden_BSW = (
        collate_compact([s["hidden"] for s in samples], S, pin) if compact else empty(B, S, W, dtype=torch.bfloat16)
    )
    topk_ids_BSk = empty(B, S, k, dtype=torch.int64)
    topk_logprobs_BSk = empty(B, S, k, dtype=torch.float32)
    for i, (sample, T) in enumerate(zip(samples, lengths, strict=True)):
        # Fill the padding tail explicitly rather than zeroing everything first: the hidden block
        # is most of the batch's bytes and would otherwise be written twice.
        for out, name in (
            (input_ids_BS, "input_ids"),
            (loss_mask_BS, "loss_mask"),
            *(() if compact else ((hidden_BSW, "hidden"),)),
            (topk_ids_BSk, "topk_ids"),
            (topk_logprobs_BSk, "topk_logprobs"),
        ):
            out[i, :T].copy_(sample[name])
            out[i, T:].zero_()
    return Batch(
        input_ids=input_ids_BS,
        loss_mask=loss_mask_BS,
        hidden=hidden_BSW,
        topk_ids=topk_ids_BSk,
        topk_logprobs=topk_logprobs_BSk,
        lengths=torch.tensor(lengths, dtype=torch.int64),
        sample_ids=list(sample_ids),
        bucket=int(bucket),
        epoch=int(epoch),
        state=state,
    )


# ----------------------------------------------------------------------------------------------
# The stream


def _fetch_threads(cfg: DataConfig, dataset) -> int:
    """`data.fetch_threads`, with auto (0) resolved: 16 on an object store, else 1."""
    if cfg.fetch_threads:
        return cfg.fetch_threads
    fs = getattr(dataset, "fs", None)
    return 1 if fs is None or is_local(fs) else 16


def _open_dataset(cfg: DataConfig):
    return ShardDataset(
        cfg.shards, manifest_name=cfg.manifest, verify_checksums=cfg.verify_checksums, verify_samples=cfg.verify_samples
    )


class DataStream:
    """Endless, exactly resumable iterator of `Batch`es over a shards dataset (see the file docstring)."""

    def __init__(
        self, cfg: DataConfig, dataset=None, *, expected: dict | None = None, split: buckets.RankSplit | None = None
    ):
        self.cfg = cfg
        self.split = split if split is not None and split.num_parts > 1 else None
        self.dataset = dataset if dataset is not None else _open_dataset(cfg)
        if expected is not None:
            check_compatible(self.dataset.manifest, expected)
        try:
            index = self.dataset.index
        except ShardFormatError as exc:
            raise DataLoadError(f"{exc}; {verify_hint(cfg.shards)}") from None
        all_ids = [str(s) for s in index.column("sample_id").to_pylist()]
        all_lengths = np.asarray(index.column("n_tokens").to_numpy(), dtype=np.int64)
        self._shard_of = index.column("shard").to_pylist()
        self.selection = select_samples(all_ids, all_lengths, index.column("n_loss_tokens").to_numpy(), cfg)
        self._dataset_index = self.selection.indices
        self.sample_ids = [all_ids[i] for i in self._dataset_index]
        self.lengths = all_lengths[self._dataset_index]
        if self.lengths.size == 0:
            raise ValueError(
                f"no training samples left in '{cfg.shards}' after selection (excluded: {self.selection.excluded})"
            )
        boundaries = (
            cfg.boundaries if cfg.boundaries is not None else buckets.quantile_boundaries(self.lengths, cfg.num_buckets)
        )
        self.layout = buckets.bucket_layout(self.lengths, boundaries, cfg.token_budget, cfg.max_batch_samples)
        self._digest = selection_digest(self.sample_ids, self.lengths)
        self._pin = bool(cfg.pin_memory and torch.cuda.is_available())
        self._plans: dict[int, buckets.EpochPlan] = {}
        self._epoch, self._batch = 0, 0  # position of the next batch handed to the consumer
        self._executor: ThreadPoolExecutor | None = None
        self._fetch_threads = _fetch_threads(cfg, self.dataset)
        self._fetcher: ThreadPoolExecutor | None = None  # concurrent sample reads within a batch (object stores)
        self._pending: collections.deque[tuple[tuple[int, int], Future]] = collections.deque()
        self._submit_at = (0, 0)
        self._corrupt_lock = threading.Lock()
        self.corrupt_samples: dict[str, set[str]] = {}  # shard file -> ids skipped as unreadable (on_corrupt="skip")
        self.last_wait = 0.0  # seconds the last __next__ spent blocked
        self.total_wait = 0.0

    # -- plan ---------------------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        return self.layout.steps_per_epoch

    def plan(self, epoch: int) -> buckets.EpochPlan:
        """The epoch's batches (indices into `self.sample_ids`), cached for the current and next epoch."""
        if epoch not in self._plans:
            self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
            self._plans[epoch] = buckets.plan_epoch(self.layout, self.cfg.seed, epoch)
        return self._plans[epoch]

    def data_plan(self) -> dict:
        """What `runs/NAME/data_plan.json` holds: the buckets and what one epoch is made of."""
        layout, plan = self.layout, self.plan(0)
        padded = buckets.padded_tokens(self.lengths, plan.batches)
        return {
            "version": STATE_VERSION,
            "shards": self.cfg.shards,
            "selection_digest": self._digest,
            "samples_in_index": len(self._shard_of),
            "samples": int(self.lengths.size),
            "tokens": int(self.lengths.sum()),
            "excluded": dict(self.selection.excluded),
            "boundaries": list(layout.boundaries),
            "boundaries_from": "config" if self.cfg.boundaries is not None else f"quantiles of {self.cfg.num_buckets}",
            "token_budget": layout.token_budget,
            "max_batch_samples": layout.max_batch_samples,
            "seed": self.cfg.seed,
            "steps_per_epoch": self.steps_per_epoch,
            "planned_padding_efficiency": float(self.lengths.sum() / padded.sum()),
            "planned_budget_use": float(padded.mean() / layout.token_budget),
            "longest_same_bucket_run": buckets.longest_run(plan.bucket_of_batch),
            "max_prefix_share_deviation_after_50": buckets.prefix_share_deviation(plan.bucket_of_batch, min_prefix=50),
            "buckets": buckets.bucket_summary(self.lengths, layout, plan),
        }

    # -- position -----------------------------------------------------------------------------

    def _identity(self) -> dict:
        """What a saved position must share with this stream to be resumable here."""
        return {
            "version": STATE_VERSION,
            "selection_digest": self._digest,
            "samples": int(self.lengths.size),
            "seed": self.cfg.seed,
            "token_budget": self.layout.token_budget,
            "boundaries": list(self.layout.boundaries),
            "max_batch_samples": self.layout.max_batch_samples,
        }

    def _state_at(self, epoch: int, batch: int) -> dict:
        return {**self._identity(), "epoch": epoch, "batch": batch, "plan_digest": self.plan(epoch).digest}

    def _after(self, epoch: int, batch: int) -> tuple[int, int]:
        return (epoch, batch + 1) if batch + 1 < self.steps_per_epoch else (epoch + 1, 0)

    def state_dict(self) -> dict:
        """The position of the next batch `next()` will return."""
        return self._state_at(self._epoch, self._batch)

    def progress(self, state: dict | None = None) -> float:
        """Epochs done as a fraction (0.0 at the start, 1.0 after one epoch)."""
        state = state if state is not None else self.state_dict()
        return state["epoch"] + state["batch"] / self.steps_per_epoch

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (a `Batch.state` or `state_dict()`); refuse a foreign one."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"data state: version {found!r} is not supported (expected {STATE_VERSION})")
        mine = self._identity()
        for key, why in (
            (
                "selection_digest",
                "another dataset or sample selection (shards, holdout_fraction, max_samples, min_loss_tokens, "
                "oversize)",
            ),
            ("samples", "another dataset or sample selection"),
            ("seed", "another data.seed"),
            ("token_budget", "another data.token_budget"),
            ("boundaries", "other bucket boundaries (data.boundaries / num_buckets)"),
            ("max_batch_samples", "another data.max_batch_samples"),
        ):
            if key not in state:
                raise ValueError(f"data state: field '{key}' is missing")
            if state[key] != mine[key]:
                raise ValueError(
                    f"data state: field '{key}' is {state[key]!r} but this stream has {mine[key]!r}: it was saved "
                    f"with {why}"
                )
        epoch, batch = state.get("epoch"), state.get("batch")
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(batch, int) and 0 <= batch < self.steps_per_epoch):
            raise ValueError(
                f"data state: position epoch={epoch!r}, batch={batch!r} is outside 0..{self.steps_per_epoch - 1}"
            )
        if state.get("plan_digest") != self.plan(epoch).digest:
            raise ValueError(
                f"data state: the plan of epoch {epoch} rebuilt here differs from the saved one "
                f"(plan_digest {state.get('plan_digest')!r} vs {self.plan(epoch).digest!r}); a numpy RNG change?"
            )
        self._stop_workers()
        self._epoch, self._batch = epoch, batch
        self._submit_at = (epoch, batch)

    # -- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> DataStream:
        return self

    def __next__(self) -> Batch:
        start = time.perf_counter()
        try:
            while True:
                self._top_up()
                position, future = self._pending.popleft()
                assert position == (self._epoch, self._batch), (position, self._epoch, self._batch)
                try:
                    batch = future.result()
                except BaseException:
                    self._stop_workers()
                    raise
                self._epoch, self._batch = self._after(*position)
                self._top_up()
                if batch is not None:  # None: every sample of that batch was skipped as corrupt
                    return batch
        finally:
            self.last_wait = time.perf_counter() - start
            self.total_wait += self.last_wait

    def _top_up(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.cfg.prefetch_threads, thread_name_prefix="data")
            self._submit_at = (self._epoch, self._batch)
        while len(self._pending) < self.cfg.prefetch_depth:
            epoch, j = self._submit_at
            plan = self.plan(epoch)
            members = plan.batches[j]
            job = dict(
                dataset_indices=self._dataset_index[members].tolist(),
                sample_ids=[self.sample_ids[m] for m in members.tolist()],
                lengths=self.lengths[members].tolist(),
                bucket=int(plan.bucket_of_batch[j]),
                epoch=epoch,
                state=self._state_at(*self._after(epoch, j)),
            )
            load = self._load_batch if self.split is None else self._load_share
            self._pending.append(((epoch, j), self._executor.submit(load, **job)))
            self._submit_at = self._after(epoch, j)

    def _load_samples(self, dataset_indices, sample_ids, lengths) -> list:
        """The samples of one batch (None for one skipped as corrupt), in order; read concurrently
        with `fetch_threads` > 1 (on an object store every read is a request with its own latency)."""
        jobs = list(zip(dataset_indices, sample_ids, lengths, strict=True))
        if self._fetch_threads <= 1 or len(jobs) <= 1:
            return [self._load_sample(*job) for job in jobs]
        if self._fetcher is None:
            with self._corrupt_lock:
                if self._fetcher is None:
                    self._fetcher = ThreadPoolExecutor(max_workers=self._fetch_threads, thread_name_prefix="fetch")
        return list(self._fetcher.map(lambda job: self._load_sample(*job), jobs))

    def _load_batch(self, dataset_indices, sample_ids, lengths, bucket, epoch, state) -> Batch | None:
        samples, kept_ids = [], []
        for sid, sample in zip(sample_ids, self._load_samples(dataset_indices, sample_ids, lengths), strict=True):
            if sample is not None:
                samples.append(sample)
                kept_ids.append(sid)
        if not samples:
            return None
        return collate(samples, kept_ids, bucket=bucket, epoch=epoch, state=state, pin=self._pin)

    def _load_share(self, dataset_indices, sample_ids, lengths, bucket, epoch, state) -> Share:
        """Read and collate only this rank's parts of the global batch (`self.split`)."""
        parts = buckets.split_by_tokens(lengths, self.split.num_parts)
        batches, rows = [], []
        for positions in (parts[p] for p in self.split.mine):
            positions = positions.tolist()
            fetched = self._load_samples(
                [dataset_indices[p] for p in positions],
                [sample_ids[p] for p in positions],
                [lengths[p] for p in positions],
            )
            loaded = list(zip(positions, fetched, strict=True))
            loaded = [(pos, sample) for pos, sample in loaded if sample is not None]
            rows.append(np.asarray([pos for pos, _ in loaded], dtype=np.int64))
            batches.append(
                collate(
                    [s for _, s in loaded],
                    [sample_ids[pos] for pos, _ in loaded],
                    bucket=bucket,
                    epoch=epoch,
                    state=state,
                    pin=self._pin,
                )
                if loaded
                else None
            )
        return Share(batches, rows, np.asarray(lengths, dtype=np.int64), list(sample_ids), bucket, epoch, state)

    def _load_sample(self, i: int, sample_id: str, n_tokens: int) -> dict | None:
        try:
            sample = (
                self._compact_sample(i) if getattr(self.dataset, "quant", None) is not None else self.dataset.torch(i)
            )
            T = int(sample["input_ids"].shape[0])
            if n_tokens != T:
                raise ValueError(f"sample has {T} tokens but the index says {n_tokens}")
            return sample
        except StoreUnreachable:
            raise  # not damage: the store is gone for longer than the reader waits
        except (OSError, ValueError, pa.ArrowException) as exc:  # what unreadable or inconsistent data raises
            return self._on_corrupt(i, sample_id, exc)
        except Exception as exc:
            exc.add_note(f"while reading sample {sample_id} (dataset index {i}) from shard '{self._shard_name(i)}'")
            raise

    def _compact_sample(self, i: int) -> dict:
        """A quantized sample as stored (codes and scales; dequantized later, on the step's device)."""
        sample = self.dataset.compact(i)
        return {
            "input_ids": torch.from_numpy(np.array(sample.input_ids)),
            "loss_mask": torch.from_numpy(sample.loss_mask != 0),
            "hidden": sample.hidden,
            "topk_ids": torch.from_numpy(np.array(sample.topk_ids)),
            "topk_logprobs": torch.from_numpy(np.array(sample.topk_logprobs)),
        }

    def _on_corrupt(self, i: int, sample_id: str, exc: Exception) -> None:
        shard = self._shard_name(i)
        if self.cfg.on_corrupt == "fail":
            raise DataLoadError(
                f"cannot read sample {sample_id} (dataset index {i}) from shard '{shard}' in '{self.cfg.shards}': "
                f"{type(exc).__name__}: {exc}; {verify_hint(self.cfg.shards)} (data.on_corrupt='skip' trains "
                "without the unreadable samples)"
            ) from None
        with self._corrupt_lock:
            skipped = self.corrupt_samples.setdefault(shard, set())
            skipped.add(sample_id)
            count = len(skipped)
        # The first skip of a shard is a warning; more from the same file would flood the log.
        level = logging.WARNING if count == 1 else logging.DEBUG
        log.log(
            level,
            "skipping unreadable sample %s of shard '%s' (%d skipped from this file): %s: %s",
            sample_id,
            shard,
            count,
            type(exc).__name__,
            exc,
        )
        return None

    def _shard_name(self, i: int) -> str:
        shard = self._shard_of[i]
        if isinstance(shard, int):
            entries = self.dataset.manifest.get("shards", [])
            if 0 <= shard < len(entries) and isinstance(entries[shard], dict) and "file" in entries[shard]:
                return str(entries[shard]["file"])
        return str(shard)

    # -- shutdown -----------------------------------------------------------------------------

    def _stop_workers(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._executor = None
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True, cancel_futures=True)
        self._fetcher = None
        self._pending.clear()

    def close(self) -> None:
        """Stop the background threads; the position stays, so iterating again restarts them."""
        self._stop_workers()

    def __enter__(self) -> DataStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
