"""One optimizer step: `train_step(run, batch, step)` and what it needs.

Fetching is the loop's (`train.loop`); a step takes the batch it was given: sample anchors and
build blocks on the host (seeded by (seed, step), so resume needs no generator state), forward
through the drafter with the DFlash mask, the chunked loss through the frozen lm_head, backward,
grad norm before clipping, then either an AdamW update or, if the loss or the gradient is not
finite, a skipped step (no update; the loop logs it with the batch's sample ids and stops the run
after `optim.max_nonfinite_in_row` in a row). The learning rate is a plain function of the step
(`lr_at`).

Data parallel (`torchrun --nproc-per-node N -m train ...`, `train.distributed`): a step is one
global batch of the one global plan, split by tokens into world_size x accumulation parts; each
rank runs its parts as micro-steps (gradients all-reduced after the last), and every host-side
decision (anchors, loss normalization, skipping a non-finite step) is taken from values that are
the same on every rank, so the ranks stay in step and identical. `StepResult` holds the step's
values reduced over ranks.

`step_functions` builds what the step calls: the drafter (in DDP, compiled or not) and the loss
chunk. A step reads its run through `StepRun` (what `train.prepare.Run` holds), so this module does
not import the one that sets a run up.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import numpy as np
import torch

from common.schedule import warmup_cosine
from train.blocks import Blocks, BlockSpec, anchor_candidates, anchors_per_row, make_blocks, step_generator
from train.config import TrainConfig
from train.data import Batch, Share
from train.distributed import Dist
from train.drafter_config import DrafterConfig
from train.kernels import KernelPlan
from train.loss import LossOutput, block_loss, chunk_loss_and_grad
from train.model import TargetHead
from train.selector_loss import SelectorStats, selector_weight_at

__all__ = [
    "lr_at",
    "train_step",
    "step_functions",
    "compile_step_functions",
    "make_part_blocks",
    "StepResult",
    "StepRun",
]


class StepRun(Protocol):
    """What a step reads from its run and updates (`train.prepare.Run` is one)."""

    cfg: TrainConfig
    drafter_cfg: DrafterConfig
    block_spec: BlockSpec  # how its blocks are built: `BlockSpec.of(drafter_cfg, cfg.loss)`
    drafter: torch.nn.Module
    forward: torch.nn.Module  # the drafter, in DDP and/or compiled (`step_functions`)
    chunk_fn: object  # the loss chunk, compiled or not (`step_functions`)
    head: TargetHead
    optimizer: torch.optim.Optimizer
    kernels: KernelPlan
    dist: Dist
    total_steps: int
    warmup_steps: int

    @property
    def device(self) -> torch.device: ...

    def placeholder(self) -> tuple[Batch, Blocks]:
        """A part that adds exactly zero gradient (DDP needs every rank's backward)."""
        ...


def lr_at(step: int, total_steps: int, warmup_steps: int, peak: float) -> float:
    """Learning rate of 1-based `step`: linear warmup to `peak` over `warmup_steps`, then cosine to 0 at
    `total_steps`."""
    return warmup_cosine(step - 1, total_steps, warmup_steps, peak)


@dataclasses.dataclass
class StepResult:
    """One optimizer step; sizes and statistics are of the whole global batch (summed over ranks)."""

    loss: float | None
    grad_norm: float | None
    lr: float
    skipped: bool
    skip_reason: str | None
    stats: LossOutput | None
    block_tokens: int
    blocks: list[Blocks] = dataclasses.field(
        default_factory=list
    )  # this rank's host-side blocks, one per part it ran (FLOP counts)
    tokens: int = 0  # real (unpadded) context tokens
    samples: int = 0
    padded_tokens: int = 0
    wait: float = 0.0  # the longest any rank waited for its data this step


def compile_step_functions(drafter: torch.nn.Module):
    """torch.compile the drafter and the loss chunk for training on batches of varying shape.

    Batches come from length buckets, so shapes change from step to step: compile with dynamic
    shapes from the first step (one compile instead of a static one followed by a dynamic one),
    and allow enough cached graphs for the few shape families that remain.
    """
    from torch._dynamo import config as dynamo_config
    from torch._inductor import config as inductor_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
    # torch 2.11's Inductor asserts in its memory-coalescing tiling analysis on some dynamic-shape
    # kernels of this model (seen on an H200: AssertionError in tiling_utils.get_pw_red_splits);
    # the analysis only picks tile shapes, so turning it off costs little and avoids the crash.
    if hasattr(inductor_config.triton, "coalesce_tiling_analysis"):
        inductor_config.triton.coalesce_tiling_analysis = False
    return torch.compile(drafter, dynamic=True), torch.compile(chunk_loss_and_grad, dynamic=True)


def step_functions(drafter: torch.nn.Module, dist: Dist, compile: bool, ddp_compile: str = "outer"):
    """(forward module, loss chunk function): the drafter in DDP when there is a process group (its
    weights broadcast from rank 0), compiled around or inside DDP (`distributed.ddp_compile`)."""
    if compile and ddp_compile == "inner":
        compiled, chunk_fn = compile_step_functions(drafter)
        return dist.wrap(compiled), chunk_fn
    module = dist.wrap(drafter)
    return compile_step_functions(module) if compile else (module, chunk_loss_and_grad)


def train_step(run: StepRun, batch: Batch | Share, step: int, wait: float = 0.0) -> StepResult:
    """One optimizer step on one global batch (or a skipped one); see the module docstring.

    `batch` is a whole batch (one process, no accumulation) or this rank's `Share` of the global
    batch; `wait` is how long this rank waited for it (reduced into the step's fetch time)."""
    cfg = run.cfg
    lr = lr_at(step, run.total_steps, run.warmup_steps, cfg.optim.lr)
    share = batch if isinstance(batch, Share) else Share.of_batch(batch)
    whole = len(share.parts) == 1 and run.dist.world_size == 1  # the global batch is one micro-batch: no reductions
    host_blocks = _share_blocks(run, share, step)
    ran = [b for b in host_blocks if b is not None]
    if whole:
        weight_total, has_loss = None, bool(ran) and ran[0].loss_rows_M.numel() > 0
    else:
        # Every part's loss is normalized by the global batch's weight, so the parts add up to its loss.
        total = float(run.dist.sum([sum(float(b.weights_BQ.double().sum()) for b in ran)])[0])
        weight_total, has_loss = torch.tensor(total, dtype=torch.float32, device=run.device), total > 0
    if not has_loss:
        sizes = _reduce_sizes(run, share, ran, wait, whole)
        return StepResult(None, None, lr, True, "no loss positions in batch", None, blocks=ran, **sizes)
    selector_weight = _selector_weight(run, step)
    parts_stats = []
    for m, (part, blocks) in enumerate(zip(share.parts, host_blocks, strict=True)):
        last = m == len(share.parts) - 1
        has_rows = blocks is not None and blocks.loss_rows_M.numel() > 0
        if not has_rows and not (last and run.dist.world_size > 1):
            continue
        if not has_rows:  # DDP's all-reduce needs every rank's backward: run one that contributes exactly zero
            part, blocks = run.placeholder()
        with run.dist.grad_sync(last):
            stats = _forward_backward(run, part, blocks, weight_total, selector_weight)
        if has_rows:
            parts_stats.append(stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.optim.grad_clip)
    if whole:
        stats = parts_stats[0]
        loss_value, norm_value = float(stats.loss.detach()), float(grad_norm)  # the step's one host sync
        sizes = _reduce_sizes(run, share, ran, wait, whole)
    else:
        stats, loss_value, norm_value, sizes = _reduce_step(
            run, share, ran, parts_stats, grad_norm, wait, selector_weight
        )
    # Every rank decides from the same reduced numbers, so a non-finite step is skipped on all of them.
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        run.optimizer.zero_grad(set_to_none=True)
        reason = "non-finite loss" if not math.isfinite(loss_value) else "non-finite gradient"
        return StepResult(loss_value, norm_value, lr, True, reason, stats, blocks=ran, **sizes)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_value, norm_value, lr, False, None, stats, blocks=ran, **sizes)


def _selector_weight(run: StepRun, step: int) -> float | None:
    """The selector loss's weight at `step` (`train.selector_loss.selector_weight_at`); None without a selector."""
    if run.drafter_cfg.arch != "dflash2":
        return None
    loss = run.cfg.loss
    return selector_weight_at(
        step, run.total_steps, loss.selector_weight, loss.selector_warmup_ratio, loss.selector_ramp_ratio
    )


def _share_blocks(run: StepRun, share: Share, step: int) -> list[Blocks | None]:
    """The blocks of each of this rank's parts (None for an empty part), as rows of the global batch.

    Keys and anchor quotas are drawn for the whole global batch from (seed, step) and each part
    takes its rows, so a sample's anchors do not depend on the split; with one part this is exactly
    `make_blocks` on the whole batch. A block cap (`loss.max_blocks`) needs every row's candidate
    count: summed over ranks."""
    spec = run.block_spec
    B, S = len(share.global_lengths), int(share.global_lengths.max())
    counts_B = torch.zeros(B, dtype=torch.int64)
    for part, rows in zip(share.parts, share.rows, strict=True):
        if part is not None:
            counts_B[torch.from_numpy(rows)] = anchor_candidates(part.loss_mask, part.lengths).sum(dim=1)
    if spec.max_blocks is not None and run.dist.world_size > 1:
        counts_B = torch.from_numpy(run.dist.sum(counts_B.numpy()).astype(np.int64))
    quota_B = anchors_per_row(counts_B, spec.num_anchors, spec.max_blocks)
    keys_BS = torch.rand((B, S), generator=step_generator(run.cfg.seed, step))
    out = []
    for part, rows in zip(share.parts, share.rows, strict=True):
        if part is None:
            out.append(None)
            continue
        index = torch.from_numpy(rows)
        out.append(make_part_blocks(run, part, keys_BS=keys_BS[index], quota_B=quota_B[index]))
    return out


def make_part_blocks(run: StepRun, batch: Batch, **given) -> Blocks:
    """`train.blocks.make_blocks` on one part with the run's settings; `given`: its keys and quotas."""
    return make_blocks(
        batch.input_ids,
        batch.loss_mask,
        batch.lengths,
        batch.topk_ids,
        run.block_spec,
        generator=None,
        topk_logprobs_BSk=batch.topk_logprobs,
        **given,
    )


def _forward_backward(
    run: StepRun, batch: Batch, blocks: Blocks, weight_total: torch.Tensor | None, selector_weight: float | None
) -> LossOutput:
    blocks = blocks.to(run.device, non_blocking=True)
    hidden_BSF = batch.hidden.to(run.device, non_blocking=True)
    cfg, K = run.cfg, run.drafter_cfg.block_size
    mask = run.kernels.mask(blocks.anchors_BN, blocks.keep_BN, hidden_BSF.shape[1], K, run.drafter_cfg.mask_rules)
    with run.kernels.autocast():
        out_BQD = run.forward(run.head.embed(blocks.block_ids_BQ), hidden_BSF, blocks.position_ids_BP, mask)
        stats = block_loss(
            out_BQD,
            run.head.lm_head_VD,
            blocks,
            chunk_rows=cfg.loss.chunk_rows,
            kl_weight=cfg.loss.kl_weight,
            kl_temperature=cfg.loss.kl_temperature,
            chunk_fn=run.chunk_fn,
            weight_total=weight_total,
            # DFlash2: the selector runs outside the (DDP, compiled) forward; its weights' gradients are
            # all-reduced with the rest, since they get theirs in the same backward.
            selector=run.drafter.candidate_selector if selector_weight is not None else None,
            selector_weight=selector_weight or 0.0,
        )
    stats.loss.backward()
    return stats


def _local_sizes(share: Share, ran: list[Blocks], wait: float, K: int) -> list[float]:
    """[real tokens, samples, padded tokens, block tokens, wait] of this rank's parts."""
    parts = [p for p in share.parts if p is not None]
    return [
        float(sum(p.real_tokens for p in parts)),
        float(sum(len(p.sample_ids) for p in parts)),
        float(sum(p.padded_tokens for p in parts)),
        float(sum(b.num_blocks * K for b in ran)),
        float(wait),
    ]


def _sizes_from(rows_RN: np.ndarray) -> dict:
    """StepResult's size fields from the gathered `_local_sizes` of every rank (wait: the largest)."""
    tokens, samples, padded, block_tokens, _ = rows_RN.sum(axis=0)
    return {
        "tokens": int(tokens),
        "samples": int(samples),
        "padded_tokens": int(padded),
        "block_tokens": int(block_tokens),
        "wait": float(rows_RN[:, 4].max()),
    }


def _reduce_sizes(run: StepRun, share: Share, ran: list[Blocks], wait: float, whole: bool) -> dict:
    local = _local_sizes(share, ran, wait, run.drafter_cfg.block_size)
    return _sizes_from(np.asarray([local]) if whole else run.dist.gather(local))


def _reduce_step(
    run: StepRun,
    share: Share,
    ran: list[Blocks],
    parts_stats: list[LossOutput],
    grad_norm,
    wait: float,
    selector_weight: float | None,
):
    """(stats, loss, grad norm, sizes) of the global batch: one gather of every rank's sums."""
    K = run.drafter_cfg.block_size
    loss = sum((s.loss.detach().double() for s in parts_stats), torch.zeros((), dtype=torch.float64, device=run.device))
    loss_value, norm_value = float(loss), float(grad_norm)
    sums = [_sum(parts_stats, lambda s: s.streak_sum), float(sum(s.num_blocks for s in parts_stats))]
    sums += _sum(parts_stats, lambda s: s.correct_K, K) + _sum(parts_stats, lambda s: s.counted_K, K)
    if selector_weight is not None:
        sums += [_sum(parts_stats, lambda s: s.selector.unary_loss), _sum(parts_stats, lambda s: s.selector.loss)]
        sums += [_sum(parts_stats, lambda s: s.selector.coverage), _sum(parts_stats, lambda s: s.selector.streak_sum)]
        sums += _sum(parts_stats, lambda s: s.selector.correct_K, K)
    local = [
        loss_value if math.isfinite(loss_value) else 0.0,
        float(not math.isfinite(loss_value)),
        float(not math.isfinite(norm_value)),
        *sums,
        *_local_sizes(share, ran, wait, K),
    ]
    rows = run.dist.gather(local)
    summed = rows.sum(axis=0)
    loss_value = float(summed[0]) if rows[:, 1].max() == 0 else math.nan
    if rows[:, 2].max() > 0:
        norm_value = math.nan
    reduced = summed[3 : 3 + len(sums)]  # `sums` of the whole global batch, in the same order
    scalar = lambda i: torch.tensor(float(reduced[i]))  # noqa: E731
    per_position = lambda i: torch.from_numpy(reduced[i : i + K])  # noqa: E731
    stats = LossOutput(torch.tensor(loss_value), per_position(2), per_position(2 + K), scalar(0), int(reduced[1]))
    if selector_weight is not None:
        at = 2 + 2 * K
        stats.selector = SelectorStats(
            scalar(at + 1), scalar(at), selector_weight, scalar(at + 2), per_position(at + 4), scalar(at + 3)
        )
    return stats, loss_value, norm_value, _sizes_from(rows[:, 3 + len(sums) :])


def _sum(parts_stats: list[LossOutput], value, size: int | None = None):
    """The parts' sum of `value(stats)`: a float, or a list of `size` floats for a [size] tensor."""
    if size is None:
        return sum(float(value(s)) for s in parts_stats)
    return sum((value(s).double().cpu() for s in parts_stats), torch.zeros(size, dtype=torch.float64)).tolist()
