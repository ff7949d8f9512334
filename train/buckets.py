"""Pure batch scheduling for the training data stream: length buckets, token-budget batches and
stride-based proportional interleaving. No I/O, no tensors: sample lengths in, batch order out.

Why interleave by stride: under a token budget a bucket of long samples yields many small batches
(the old runs: 20% of the samples made 52% of the batches). Ordered sequentially or at random,
such a bucket produces long runs of same-length batches and the loss turns bimodal ("fluffy").
Giving batch `j` of bucket `b` the key `(j + offset_b) / n_b` and sorting by key makes every bucket
drain at the same rate through the epoch: after any prefix of `m` batches, bucket `b` has produced
`m * n_b / N` batches give or take the number of buckets.

Conventions
- `boundaries` are inclusive upper edges, strictly increasing: bucket `i` holds lengths `L` with
  `boundaries[i-1] < L <= boundaries[i]`; the last bucket holds every `L > boundaries[-1]`.
  So `len(boundaries) + 1` buckets; a bucket may be empty.
- Each bucket has a fixed batch size `budget // longest sample in the bucket` (optionally capped),
  so a batch's padded size (batch size x its longest sample) never exceeds the budget, and the
  number of batches per epoch does not depend on the shuffle: `steps_per_epoch` is exact.
- A sample longer than the budget cannot form any batch: `bucket_layout` raises a ValueError that
  names the count, the longest length and the budget (the stream can drop such samples first, see
  `DataConfig.oversize`).
- Randomness comes only from `(seed, epoch)` through numpy's PCG64; an epoch plan is a pure
  function of (lengths, layout, seed, epoch).

Data parallel: one global batch of that plan is dealt by tokens into world_size x accumulation
parts (`RankSplit`, `split_by_tokens`, `split_summary`), so the plan itself never depends on the
world size.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = [
    "BucketLayout",
    "EpochPlan",
    "quantile_boundaries",
    "check_boundaries",
    "assign_buckets",
    "bucket_layout",
    "plan_epoch",
    "interleave_order",
    "longest_run",
    "prefix_share_deviation",
    "padded_tokens",
    "bucket_summary",
    "epoch_rng",
    "RankSplit",
    "split_by_tokens",
    "split_summary",
]

# Separate streams of the (seed, epoch) generator, so adding a use never shifts another.
_SHUFFLE_STREAM = 1
_OFFSET_STREAM = 2


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Which bucket each sample is in and how many samples a batch of each bucket holds."""

    boundaries: tuple[int, ...]
    token_budget: int
    bucket_of_sample: np.ndarray  # int64 [N], bucket id of each sample
    batch_sizes: tuple[int, ...]  # per bucket; 0 for an empty bucket
    max_batch_samples: int | None = None

    @property
    def num_buckets(self) -> int:
        return len(self.boundaries) + 1

    @property
    def samples_per_bucket(self) -> np.ndarray:
        return np.bincount(self.bucket_of_sample, minlength=self.num_buckets)

    @property
    def batches_per_bucket(self) -> np.ndarray:
        counts = self.samples_per_bucket
        sizes = np.maximum(np.asarray(self.batch_sizes, dtype=np.int64), 1)
        return -(-counts // sizes)  # ceil; an empty bucket gives 0

    @property
    def steps_per_epoch(self) -> int:
        return int(self.batches_per_bucket.sum())


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """The batches of one epoch in training order; `batches[i]` holds sample indices."""

    epoch: int
    batches: list[np.ndarray]  # int64 sample indices per batch
    bucket_of_batch: np.ndarray  # int64 [num_batches]

    def __len__(self) -> int:
        return len(self.batches)

    @functools.cached_property
    def digest(self) -> str:
        """A short hash of the exact order, to prove on resume that the same plan was rebuilt."""
        sizes = np.asarray([len(b) for b in self.batches], dtype=np.int64)
        flat = np.concatenate(self.batches).astype(np.int64) if self.batches else np.zeros(0, np.int64)
        return xxhash.xxh3_64_hexdigest(sizes.tobytes() + b"|" + flat.tobytes())


# ----------------------------------------------------------------------------------------------
# Buckets


def quantile_boundaries(lengths: np.ndarray, num_buckets: int) -> list[int]:
    """Boundaries that split `lengths` into `num_buckets` groups of about equal sample count.

    Repeated quantiles collapse (a length mix with few distinct values gives fewer buckets), and a
    boundary at or above the longest sample is dropped because it would only leave an empty last
    bucket."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or num_buckets == 1:
        return []
    qs = np.arange(1, num_buckets) / num_buckets
    edges = np.quantile(lengths, qs, method="inverted_cdf").astype(np.int64)
    longest = int(lengths.max())
    return sorted({int(e) for e in edges if e < longest})


def check_boundaries(boundaries: Sequence[int]) -> list[int]:
    """`boundaries` as a list, or a ValueError if they are not positive and strictly increasing."""
    values = [int(b) for b in boundaries]
    if any(b < 1 for b in values):
        raise ValueError(f"data.boundaries must be positive lengths, got {values}")
    if any(a >= b for a, b in itertools.pairwise(values)):
        raise ValueError(f"data.boundaries must be strictly increasing, got {values}")
    return values


def assign_buckets(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Bucket id of each length: the first bucket whose inclusive upper edge holds it."""
    edges = np.asarray(check_boundaries(boundaries), dtype=np.int64)
    return np.searchsorted(edges, np.asarray(lengths, dtype=np.int64), side="left").astype(np.int64)


def bucket_layout(
    lengths: np.ndarray,
    boundaries: Sequence[int],
    token_budget: int,
    max_batch_samples: int | None = None,
) -> BucketLayout:
    """Assign buckets and fix each bucket's batch size so that no batch can exceed the budget."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if token_budget < 1:
        raise ValueError(f"data.token_budget must be >= 1, got {token_budget}")
    if max_batch_samples is not None and max_batch_samples < 1:
        raise ValueError(f"data.max_batch_samples must be >= 1, got {max_batch_samples}")
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"every sample needs at least one token; found length {int(lengths.min())}")
    oversize = lengths > token_budget
    if oversize.any():
        raise ValueError(
            f"{int(oversize.sum())} sample(s) are longer than data.token_budget={token_budget} "
            f"(longest {int(lengths.max())} tokens) and fit in no batch: raise data.token_budget "
            f"or set data.oversize='skip' to leave them out"
        )
    bucket_of_sample = assign_buckets(lengths, boundaries)
    num_buckets = len(boundaries) + 1
    longest = np.zeros(num_buckets, dtype=np.int64)
    np.maximum.at(longest, bucket_of_sample, lengths)
    sizes = []
    for b in range(num_buckets):
        size = token_budget // int(longest[b]) if longest[b] else 0
        if max_batch_samples is not None:
            size = min(size, max_batch_samples)
        sizes.append(size)
    return BucketLayout(
        boundaries=tuple(int(x) for x in boundaries),
        token_budget=int(token_budget),
        bucket_of_sample=bucket_of_sample,
        batch_sizes=tuple(sizes),
        max_batch_samples=max_batch_samples,
    )


# ----------------------------------------------------------------------------------------------
# One epoch


def epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """The generator of one use (`stream`) in one epoch; PCG64 seeded from (seed, epoch, stream)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, stream])))


def interleave_order(batches_per_bucket: Sequence[int], offsets: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(bucket, j) of every batch in stride-interleaved order.

    Batch `j` of bucket `b` gets the key `(j + offsets[b]) / n_b`, with `offsets[b]` in [0, 1);
    batches are sorted by key, ties broken by bucket id (then j), so the order is deterministic.

    The bound this gives: up to key x, bucket b has placed x * n_b batches, off by at most one.
    A prefix of m batches ends at some key x, so m = x * N off by at most K (the bucket count),
    and bucket b's count in it is m * n_b / N off by at most K."""
    counts = [int(n) for n in batches_per_bucket]
    bucket = np.concatenate([np.full(n, b, dtype=np.int64) for b, n in enumerate(counts)] or [np.zeros(0, np.int64)])
    j = np.concatenate([np.arange(n, dtype=np.int64) for n in counts] or [np.zeros(0, np.int64)])
    if bucket.size == 0:
        return bucket, j
    n_b = np.asarray(counts, dtype=np.float64)[bucket]
    key = (j + np.asarray(offsets, dtype=np.float64)[bucket]) / n_b
    order = np.lexsort((j, bucket, key))
    return bucket[order], j[order]


def plan_epoch(layout: BucketLayout, seed: int, epoch: int) -> EpochPlan:
    """Shuffle within each bucket from (seed, epoch), cut into batches, interleave by stride."""
    shuffle_rng = epoch_rng(seed, epoch, _SHUFFLE_STREAM)
    per_bucket: list[list[np.ndarray]] = []
    for b in range(layout.num_buckets):
        members = np.flatnonzero(layout.bucket_of_sample == b)
        members = members[shuffle_rng.permutation(members.size)]
        size = max(layout.batch_sizes[b], 1)
        per_bucket.append([members[i : i + size] for i in range(0, members.size, size)])
    offsets = epoch_rng(seed, epoch, _OFFSET_STREAM).random(layout.num_buckets)
    bucket_order, j_order = interleave_order([len(x) for x in per_bucket], offsets)
    batches = [per_bucket[b][j] for b, j in zip(bucket_order.tolist(), j_order.tolist(), strict=True)]
    assert len(batches) == layout.steps_per_epoch
    return EpochPlan(epoch=epoch, batches=batches, bucket_of_batch=bucket_order)


# ----------------------------------------------------------------------------------------------
# Data parallel: one global batch split into parts (ranks x accumulation steps)


@dataclasses.dataclass(frozen=True)
class RankSplit:
    """Which parts of every global batch one rank trains on.

    A global batch (one optimizer step) is dealt into `num_parts = world_size x accumulation`
    parts; micro-step `m` of rank `r` takes part `m * world_size + r`. The plan itself never
    depends on the split, so runs with any world size and accumulation see the same global batches.
    """

    num_parts: int
    mine: tuple[int, ...]  # part indices of this rank, one per accumulation step, in micro-step order

    @classmethod
    def of(cls, rank: int, world_size: int, accumulation: int) -> RankSplit:
        if not (world_size >= 1 and accumulation >= 1 and 0 <= rank < world_size):
            raise ValueError(f"bad split: rank {rank}, world size {world_size}, accumulation {accumulation}")
        return cls(world_size * accumulation, tuple(m * world_size + rank for m in range(accumulation)))


def split_by_tokens(lengths: Sequence[int], num_parts: int) -> list[np.ndarray]:
    """Positions 0..n-1 of one batch's samples dealt into `num_parts` parts of near-equal tokens.

    Longest sample first, each to the part with the fewest tokens so far (ties: fewer samples,
    then the lower part index); positions ascending inside a part. Deterministic, a pure function
    of the lengths. A batch with fewer samples than parts leaves parts empty."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens = np.zeros(num_parts, dtype=np.int64)
    counts = np.zeros(num_parts, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(num_parts)]
    for pos in np.argsort(-lengths, kind="stable").tolist():
        part = min(range(num_parts), key=lambda p: (tokens[p], counts[p], p))
        members[part].append(pos)
        tokens[part] += lengths[pos]
        counts[part] += 1
    return [np.asarray(sorted(m), dtype=np.int64) for m in members]


def split_summary(lengths: np.ndarray, plan: EpochPlan, split: RankSplit, world_size: int) -> dict:
    """How one epoch's global batches fall to the ranks: per rank samples and tokens, the worst
    step's imbalance (largest rank's tokens / mean rank's tokens) and the steps that leave a part empty."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rank_tokens = np.zeros(world_size, dtype=np.int64)
    rank_samples = np.zeros(world_size, dtype=np.int64)
    worst, empty_steps = 1.0, 0
    for members in plan.batches:
        parts = split_by_tokens(lengths[members], split.num_parts)
        step_tokens = np.zeros(world_size, dtype=np.int64)
        for index, part in enumerate(parts):
            rank = index % world_size
            step_tokens[rank] += int(lengths[members[part]].sum())
            rank_samples[rank] += part.size
        rank_tokens += step_tokens
        empty_steps += int(any(part.size == 0 for part in parts))
        worst = max(worst, float(step_tokens.max() / step_tokens.mean()))
    return {
        "parts_per_step": split.num_parts,
        "split": "by tokens: longest sample first, to the part with the fewest tokens",
        "epoch0_tokens_per_rank": rank_tokens.tolist(),
        "epoch0_samples_per_rank": rank_samples.tolist(),
        "epoch0_worst_step_imbalance": worst,
        "epoch0_steps_with_an_empty_part": empty_steps,
    }


# ----------------------------------------------------------------------------------------------
# Measures of a schedule (used by tests, the plan summary and the bench)


def longest_run(bucket_of_batch: Sequence[int]) -> int:
    """Length of the longest run of consecutive batches from the same bucket."""
    seq = np.asarray(bucket_of_batch)
    if seq.size == 0:
        return 0
    change = np.flatnonzero(np.diff(seq) != 0)
    edges = np.concatenate([[-1], change, [seq.size - 1]])
    return int(np.diff(edges).max())


def prefix_share_deviation(bucket_of_batch: Sequence[int], min_prefix: int = 1) -> float:
    """Largest |share of bucket b among the first m batches - its share over the epoch|, over all
    buckets and all prefixes m >= min_prefix."""
    seq = np.asarray(bucket_of_batch, dtype=np.int64)
    if seq.size < min_prefix or seq.size == 0:
        return 0.0
    num_buckets = int(seq.max()) + 1
    onehot = np.zeros((seq.size, num_buckets), dtype=np.int64)
    onehot[np.arange(seq.size), seq] = 1
    counts_mb = np.cumsum(onehot, axis=0)
    m = np.arange(1, seq.size + 1)[:, None]
    overall_b = counts_mb[-1] / seq.size
    dev_mb = np.abs(counts_mb / m - overall_b)
    return float(dev_mb[min_prefix - 1 :].max())


def padded_tokens(lengths: np.ndarray, batches: Sequence[np.ndarray]) -> np.ndarray:
    """Padded size (batch size x longest sample) of each batch."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.asarray([len(b) * int(lengths[b].max()) for b in batches], dtype=np.int64)


def bucket_summary(lengths: np.ndarray, layout: BucketLayout, plan: EpochPlan) -> list[dict]:
    """One JSON-able row per bucket: its length range, samples, tokens, batch size, batches per
    epoch, shares of samples and of batches, and the padding efficiency of `plan`'s batches."""
    lengths = np.asarray(lengths, dtype=np.int64)
    K = layout.num_buckets
    samples_b, batches_b = layout.samples_per_bucket, layout.batches_per_bucket
    tokens_b = np.bincount(layout.bucket_of_sample, weights=lengths, minlength=K).astype(np.int64)
    padded_b = np.bincount(plan.bucket_of_batch, weights=padded_tokens(lengths, plan.batches), minlength=K).astype(
        np.int64
    )
    lower = [1, *(b + 1 for b in layout.boundaries)]
    upper = [*layout.boundaries, None]
    rows = []
    for b in range(K):
        members = lengths[layout.bucket_of_sample == b]
        rows.append(
            {
                "bucket": b,
                "range": [lower[b], upper[b]],  # inclusive; None = no upper edge
                "samples": int(samples_b[b]),
                "tokens": int(tokens_b[b]),
                "min_len": int(members.min()) if members.size else None,
                "max_len": int(members.max()) if members.size else None,
                "batch_size": int(layout.batch_sizes[b]),
                "batches_per_epoch": int(batches_b[b]),
                "share_of_samples": float(samples_b[b] / max(samples_b.sum(), 1)),
                "share_of_batches": float(batches_b[b] / max(batches_b.sum(), 1)),
                "padding_efficiency": float(tokens_b[b] / padded_b[b]) if padded_b[b] else None,
            }
        )
    return rows
