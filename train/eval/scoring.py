"""Scoring: one pass over the data drafts every block with every model (`run_blocks`), scores chain and
DDTree τ per block (`score_drafts`, in a background thread when the drafter is on CUDA) and sums
them up overall and per length bucket (`summarize_model`).

A DFlash2 drafter is scored twice on the same blocks: its own proposals (the selector's walk for the
chain, the conditional tree of its q over the candidates for DDTree: `train.eval.selector`,
`train.eval.ddtree.selector_ddtree_taus`), which are what it serves and what its summary's
`overall` and `buckets` hold, and its unary proposals (the argmax and the tree of the head's
logits, as for DFlash), under `unary`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import torch
import xxhash
from torch import Tensor

from train.eval.acceptance import ChainBlocks, chain_blocks, summarize_blocks, summarize_by_group
from train.eval.anchors import block_anchors, block_targets
from train.eval.checkpoints import EvalModel
from train.eval.config import EvalConfig
from train.eval.ddtree import ddtree_taus, selector_ddtree_taus
from train.eval.drafting import Piece, Runtime, draft_topk_for_pieces, pack_pieces, split_pieces
from train.eval.selection import EvalData
from train.eval.selector import SelectorDrafts

# Forwards whose DDTree scoring may still be queued behind the GPU (each holds its top-k tensors).
_SCORING_BACKLOG = 4


@dataclasses.dataclass
class DraftScores:
    """One drafter's per-block results (rows aligned with a `BlockTable`)."""

    draft_ids_ND: Tensor  # int64: the drafter's argmax per block position 1..D
    top1_logprob_ND: Tensor  # float32: log q_k(argmax)
    ddtree_tau: dict[int, Tensor]  # budget -> int64 [N]
    ddtree_surrogate_tau: dict[int, Tensor]  # budget -> float64 [N]
    # A DFlash2 drafter's own proposals, the same fields: its selector's walk and log q of each step,
    # the conditional trees' τ (None for a DFlash drafter).
    selector: DraftScores | None = None

    def extra_metrics(self) -> dict[str, Tensor]:
        """The DDTree per-block values under the names the summaries use."""
        out = {}
        for b in sorted(self.ddtree_tau):
            out[f"ddtree_tau_{b}"] = self.ddtree_tau[b]
        for b in sorted(self.ddtree_surrogate_tau):
            out[f"ddtree_surrogate_tau_{b}"] = self.ddtree_surrogate_tau[b]
        return out

    def chain(self, table: BlockTable) -> ChainBlocks:
        return chain_blocks(self.draft_ids_ND, table.target_ids_ND, table.valid_len_N, self.top1_logprob_ND)

    @staticmethod
    def concat(parts: Sequence[DraftScores], n_draft: int, budgets: Sequence[int]) -> DraftScores:
        selectors = [p.selector for p in parts if p.selector is not None]
        assert len(selectors) in (0, len(parts)), "a model's blocks are all scored alike"
        if not parts:
            empty_long, empty_float = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
            return DraftScores(
                torch.zeros(0, n_draft, dtype=torch.long),
                torch.zeros(0, n_draft),
                {b: empty_long for b in budgets},
                {b: empty_float for b in budgets},
            )
        return DraftScores(
            torch.cat([p.draft_ids_ND for p in parts]),
            torch.cat([p.top1_logprob_ND for p in parts]),
            {b: torch.cat([p.ddtree_tau[b] for p in parts]) for b in budgets},
            {b: torch.cat([p.ddtree_surrogate_tau[b] for p in parts]) for b in budgets},
            DraftScores.concat(selectors, n_draft, budgets) if selectors else None,
        )

    def take(self, order_N: Tensor) -> DraftScores:
        return DraftScores(
            self.draft_ids_ND[order_N],
            self.top1_logprob_ND[order_N],
            {b: t[order_N] for b, t in self.ddtree_tau.items()},
            {b: t[order_N] for b, t in self.ddtree_surrogate_tau.items()},
            None if self.selector is None else self.selector.take(order_N),
        )


def score_drafts(
    topk_logprobs_NDk: Tensor,
    topk_ids_NDk: Tensor,
    target_ids_ND: Tensor,
    valid_len_N: Tensor,
    budgets: Sequence[int],
    what: str,
    selector: SelectorDrafts | None = None,
) -> DraftScores:
    """Chain inputs and DDTree τ of a batch of blocks from the drafter's per-depth top-k (and from a
    DFlash2 drafter's selector drafts)."""
    if not torch.isfinite(topk_logprobs_NDk[..., 0]).all():
        raise ValueError(f"the drafter produced non-finite logits ({what})")
    taus = ddtree_taus(topk_logprobs_NDk, topk_ids_NDk, target_ids_ND, valid_len_N, budgets)
    own = None
    if selector is not None:
        tree = selector_ddtree_taus(selector.lattice, target_ids_ND, valid_len_N, budgets)
        own = DraftScores(
            draft_ids_ND=selector.walk_MD,
            top1_logprob_ND=selector.walk_logprob_MD,
            ddtree_tau={b: t.tau_N for b, t in tree.items()},
            ddtree_surrogate_tau={b: t.surrogate_tau_N for b, t in tree.items()},
        )
    return DraftScores(
        draft_ids_ND=topk_ids_NDk[..., 0].clone(),
        top1_logprob_ND=topk_logprobs_NDk[..., 0].clone(),
        ddtree_tau={b: t.tau_N for b, t in taus.items()},
        ddtree_surrogate_tau={b: t.surrogate_tau_N for b, t in taus.items()},
        selector=own,
    )


@dataclasses.dataclass
class BlockTable:
    """The evaluated blocks (shared by every drafter), sorted by (sample, anchor)."""

    sample_N: Tensor  # int64: position of the block's sample in EvalData
    anchor_N: Tensor  # int64
    valid_len_N: Tensor  # int64, 1..D
    target_ids_ND: Tensor  # int64: y_1..y_D
    bucket_N: Tensor  # int64

    @property
    def n_blocks(self) -> int:
        return int(self.sample_N.numel())

    def digest(self, sample_ids: Sequence[str]) -> str:
        """Identifies the exact blocks: which samples, which anchors, which valid lengths."""
        h = xxhash.xxh3_64()
        h.update("\n".join(sample_ids).encode("utf-8"))
        for t in (self.sample_N, self.anchor_N, self.valid_len_N):
            h.update(t.numpy().astype(np.int64).tobytes())
        return h.hexdigest()


def _sample_pieces(data: EvalData, order: np.ndarray, cfg: EvalConfig, n_draft: int) -> Iterator[Piece]:
    """Pieces of the samples at EvalData positions `order`, read in background threads."""
    dataset = data.dataset

    def load(position: int):
        i = int(data.indices[position])
        try:
            return dataset.torch(i)
        except (OSError, ValueError, pa.ArrowException) as exc:  # what unreadable or inconsistent data raises
            raise ValueError(
                f"cannot read sample {data.sample_ids[position]} (dataset index {i}) of '{data.root}': "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    with ThreadPoolExecutor(max_workers=cfg.load_threads, thread_name_prefix="eval-data") as pool:
        window: list[tuple[int, Future]] = []
        queue = iter(order.tolist())
        for position in queue:
            window.append((position, pool.submit(load, position)))
            if len(window) >= 2 * cfg.load_threads:
                break
        while window:
            position, future = window.pop(0)
            nxt = next(queue, None)
            if nxt is not None:
                window.append((nxt, pool.submit(load, nxt)))
            sample = future.result()
            anchors_A, valid_len_A = block_anchors(
                sample["loss_mask"],
                n_draft,
                min_valid_len=cfg.min_valid_len,
                max_anchors=cfg.max_anchors,
                seed=cfg.seed,
                sample_id=data.sample_ids[position],
            )
            yield Piece(
                position,
                sample["input_ids"],
                sample["hidden"],
                anchors_A,
                valid_len_A,
                block_targets(sample["topk_ids"][:, 0], anchors_A, n_draft),
            )


def _progress(cfg: EvalConfig, total: int):
    from tqdm import tqdm

    return tqdm(total=total, disable=not cfg.progress, unit="sample", dynamic_ncols=True, file=sys.stderr)


def run_blocks(
    models: Sequence[EvalModel], data: EvalData, cfg: EvalConfig, runtime: Runtime, bucket_of_sample: np.ndarray
) -> tuple[BlockTable, list[DraftScores]]:
    """Draft every block of `data` with every model (one pass over the data) and score the drafts."""
    block_sizes = {m.block_size for m in models}
    if len(block_sizes) != 1:
        raise ValueError(f"checkpoints have different block sizes {sorted(block_sizes)}; per-position metrics need one")
    n_draft = block_sizes.pop() - 1
    budgets = sorted(set(cfg.budgets))
    # Longest first: similar lengths share forwards, and an out-of-memory shows up at once.
    order = np.argsort(-data.lengths, kind="stable")
    blocks: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # per forward: sample, anchor, valid length, targets
    parts: list[list[Future | DraftScores]] = [[] for _ in models]
    scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-score") if runtime.score_in_background else None
    bar = _progress(cfg, data.n_samples)
    per_forward = runtime.blocks_per_forward(cfg)
    n_blocks = 0
    try:

        def pieces() -> Iterator[Piece]:
            for piece in _sample_pieces(data, order, cfg, n_draft):
                bar.update(1)
                if piece.n_blocks:
                    yield from split_pieces(piece, per_forward)

        for group in pack_pieces(pieces(), per_forward):
            # Only the per-block fields are kept: a piece holds its whole sample's hidden states.
            blocks.append(
                (
                    torch.cat([torch.full((p.n_blocks,), p.sample, dtype=torch.long) for p in group]),
                    torch.cat([p.anchors_A for p in group]),
                    torch.cat([p.valid_len_A for p in group]),
                    torch.cat([p.target_ids_AD for p in group]),
                )
            )
            _, _, valid_len, target_ids = blocks[-1]
            what = f"samples {sorted({data.sample_ids[p.sample] for p in group})[:3]}"
            for m, model in enumerate(models):
                lp, ids, chosen = draft_topk_for_pieces(model, group, runtime, cfg.topk, cfg.chunk_rows)
                args = (lp, ids, target_ids, valid_len, budgets, what, chosen)
                parts[m].append(scorer.submit(score_drafts, *args) if scorer else score_drafts(*args))
                if scorer and len(parts[m]) > _SCORING_BACKLOG:
                    # One worker finishes in order: waiting here bounds the top-k tensors still queued.
                    parts[m][-_SCORING_BACKLOG - 1].result()
            n_blocks += len(valid_len)
            bar.set_postfix(blocks=n_blocks, refresh=False)
        scores = [
            DraftScores.concat([p.result() if isinstance(p, Future) else p for p in ps], n_draft, budgets)
            for ps in parts
        ]
    finally:
        bar.close()
        if scorer is not None:
            scorer.shutdown(wait=True, cancel_futures=True)

    columns = (
        [torch.cat(c) for c in zip(*blocks, strict=True)]
        if blocks
        else [
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, n_draft, dtype=torch.long),
        ]
    )
    sample_N, anchor_N, valid_len_N, target_ids_ND = columns
    # Back to (sample, anchor) order, so the result does not depend on the processing order.
    order_N = torch.from_numpy(np.lexsort((anchor_N.numpy(), sample_N.numpy())))
    sample_N = sample_N[order_N]
    table = BlockTable(
        sample_N=sample_N,
        anchor_N=anchor_N[order_N],
        valid_len_N=valid_len_N[order_N],
        target_ids_ND=target_ids_ND[order_N],
        bucket_N=torch.from_numpy(np.asarray(bucket_of_sample, dtype=np.int64))[sample_N],
    )
    return table, [s.take(order_N) for s in scores]


# ----------------------------------------------------------------------------------------------
# Summaries


def summarize_model(table: BlockTable, scores: DraftScores, buckets: Sequence[dict]) -> dict:
    """{'proposals': what was scored, 'overall': summary, 'buckets': [summary per bucket]}; summaries as
    `summarize_blocks` plus the DDTree means and n_samples (samples with at least one block). For a
    DFlash2 drafter the summaries are of its selector's proposals, and 'unary' holds {'overall',
    'buckets'} of its unary ones (module docstring)."""
    if scores.selector is not None:
        own = _summaries(table, scores.selector, buckets)
        return {"proposals": "selector", **own, "unary": _summaries(table, scores, buckets)}
    return {"proposals": "argmax", **_summaries(table, scores, buckets)}


def _summaries(table: BlockTable, scores: DraftScores, buckets: Sequence[dict]) -> dict:
    chain = scores.chain(table)
    extra = scores.extra_metrics()
    overall = summarize_blocks(chain, extra)
    overall["n_samples"] = int(table.sample_N.unique().numel())
    ids = [int(b["bucket"]) for b in buckets]
    per_bucket = summarize_by_group(chain, table.bucket_N, ids, extra)
    out_buckets = []
    for b in buckets:
        summary = per_bucket[int(b["bucket"])]
        summary["n_samples"] = int(table.sample_N[table.bucket_N == int(b["bucket"])].unique().numel())
        out_buckets.append(summary)
    return {"overall": overall, "buckets": out_buckets}
