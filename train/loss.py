"""The DFlash loss through the frozen lm_head, in chunks (docs/dflash.md "Loss").

    loss = sum(w * CE(lm_head(h), label)) / sum(w)           (+ kl_weight * the same average of KL)

Only block tokens with weight > 0 go through the head (the anchor position and padding never
do). Over a 248,320-token vocabulary full logits for 8k block tokens would take 8 GB in fp32, so
`ChunkedHeadLoss` walks the rows in chunks: per chunk it computes the logits, the loss, the
argmax and the gradient of the loss with respect to the chunk's hidden states (`dlogits @ W`),
keeps only that [M, D] gradient and drops the logits. Backward is then a multiply. The head costs
one forward matmul and one input-gradient matmul (no recomputation, no weight gradient: it is
frozen).

DFlash2 (`top_k` > 0): the same pass also keeps each row's top-k logits U and their ids C, and U is
differentiable: its gradient reaches the hidden states as sum_k dU_mk * head[C_mk], formed in
backward chunk by chunk from the k head rows (never a C x V tensor). The selector loss
(`train.selector_loss`) is built on them.

Optional soft term (ablation): KL(q || softmax(z / T)) * T^2 where q is the target's stored top-k
distribution renormalized over its k ids at temperature T, and the student is the full-vocabulary
softmax (so mass outside the teacher's top-k is pushed down). Labels are never perturbed.

Shape legend: M loss rows (weighted block tokens), C rows in a chunk, D hidden, V vocabulary,
k stored top-k, B rows, N blocks, K block size.
"""

from __future__ import annotations

import dataclasses

import torch

from train.blocks import Blocks
from train.selector_loss import SelectorStats, selector_terms

__all__ = ["LossOutput", "block_loss", "chunk_loss_and_grad", "ChunkedHeadLoss", "block_accuracy"]


def chunk_loss_and_grad(
    logits_CV: torch.Tensor,
    labels_C: torch.Tensor,
    w_C: torch.Tensor,
    soft_ids_Ck: torch.Tensor | None,
    soft_logprobs_Ck: torch.Tensor | None,
    kl_weight: float,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted loss sum, d(loss)/d(logits) [C, V] in the logits' dtype, argmax [C]) for one chunk.

    `w_C` are the already normalized weights (w / sum(w)), so the chunks' sums add up to the loss.
    Pure tensor code, so it can be torch.compile'd into a few fused kernels.
    """
    z_CV = logits_CV.float()
    lse_C = torch.logsumexp(z_CV, dim=-1)
    ce_C = lse_C - z_CV.gather(1, labels_C[:, None]).squeeze(1)
    grad_CV = torch.exp(z_CV - lse_C[:, None])
    grad_CV.scatter_add_(1, labels_C[:, None], torch.full_like(lse_C[:, None], -1.0))
    loss = (w_C * ce_C).sum()
    if kl_weight > 0.0:
        assert soft_ids_Ck is not None and soft_logprobs_Ck is not None
        zt_CV = z_CV / temperature
        lse_t_C = torch.logsumexp(zt_CV, dim=-1)
        teacher_Ck = torch.softmax(soft_logprobs_Ck.float() / temperature, dim=-1)
        student_logp_Ck = zt_CV.gather(1, soft_ids_Ck) - lse_t_C[:, None]
        kl_C = (teacher_Ck * (torch.log(teacher_Ck.clamp_min(1e-30)) - student_logp_Ck)).sum(-1) * temperature**2
        loss = loss + kl_weight * (w_C * kl_C).sum()
        # d(T^2 KL)/dz = T * (softmax(z/T) - q)
        soft_grad_CV = torch.exp(zt_CV - lse_t_C[:, None])
        soft_grad_CV.scatter_add_(1, soft_ids_Ck, -teacher_Ck)
        grad_CV = grad_CV + (kl_weight * temperature) * soft_grad_CV
    grad_CV = grad_CV * w_C[:, None]
    return loss, grad_CV.to(logits_CV.dtype), z_CV.argmax(dim=-1)


class ChunkedHeadLoss(torch.autograd.Function):
    """loss, argmax, top-k logits U [M, k], their ids [M, k] = f(hidden_MD) through a frozen head, never holding
    more than C x V logits; k = `top_k` (0: U and the ids are empty)."""

    @staticmethod
    def forward(
        ctx,
        hidden_MD,
        head_VD,
        labels_M,
        w_M,
        soft_ids_Mk,
        soft_logprobs_Mk,
        kl_weight,
        temperature,
        chunk_rows,
        chunk_fn,
        top_k=0,
    ):
        M, device = hidden_MD.shape[0], hidden_MD.device
        compute = hidden_MD.detach().to(head_VD.dtype)
        grad_MD = torch.zeros(hidden_MD.shape, dtype=torch.float32, device=device)
        preds_M = torch.empty(M, dtype=torch.long, device=device)
        unary_Mk = torch.empty(M, top_k, dtype=torch.float32, device=device)
        candidates_Mk = torch.empty(M, top_k, dtype=torch.long, device=device)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for start in range(0, M, chunk_rows):
            rows = slice(start, min(start + chunk_rows, M))
            logits_CV = compute[rows] @ head_VD.t()
            soft = (soft_ids_Mk[rows], soft_logprobs_Mk[rows]) if soft_ids_Mk is not None else (None, None)
            loss_c, dlogits_CV, preds_M[rows] = chunk_fn(
                logits_CV, labels_M[rows], w_M[rows], *soft, kl_weight, temperature
            )
            if top_k:
                values_Ck, candidates_Mk[rows] = logits_CV.topk(top_k, dim=-1)
                unary_Mk[rows] = values_Ck.float()
            total = total + loss_c
            grad_MD[rows] = (dlogits_CV @ head_VD).float()
            del logits_CV, dlogits_CV
        ctx.save_for_backward(grad_MD, candidates_Mk, head_VD)
        ctx.hidden_dtype, ctx.chunk_rows = hidden_MD.dtype, chunk_rows
        ctx.mark_non_differentiable(preds_M, candidates_Mk)
        return total, preds_M, unary_Mk, candidates_Mk

    @staticmethod
    def backward(ctx, grad_total, _grad_preds, grad_unary_Mk, _grad_candidates):
        grad_MD, candidates_Mk, head_VD = ctx.saved_tensors
        grad_MD = grad_MD * grad_total
        if grad_unary_Mk is not None and candidates_Mk.shape[1]:
            for start in range(0, grad_MD.shape[0], ctx.chunk_rows):
                rows = slice(start, start + ctx.chunk_rows)
                rows_CkD = head_VD[candidates_Mk[rows]]  # dU/dh of each candidate is its head row
                grad_MD[rows] += torch.bmm(grad_unary_Mk[rows, None].to(rows_CkD.dtype), rows_CkD)[:, 0].float()
        return (grad_MD.to(ctx.hidden_dtype),) + (None,) * 10


@dataclasses.dataclass
class LossOutput:
    # scalar with grad: sum(w * (CE + kl_weight * KL)) / sum(w), DFlash2: + selector weight * selector loss
    loss: torch.Tensor
    correct_K: torch.Tensor  # float [K]: per block position, how many weighted positions the argmax got right
    counted_K: torch.Tensor  # float [K]: per block position, how many positions had weight > 0
    streak_sum: torch.Tensor  # float: sum over kept blocks of leading correct positions 1..K-1
    num_blocks: int  # kept blocks
    selector: SelectorStats | None = None  # DFlash2: the selector's term and counts

    def accuracy(self, correct_K: torch.Tensor | None = None) -> list[float | None]:
        """Accuracy at block positions 1..K-1 (None where no position had weight); of the selector's
        teacher-forced choices with `correct_K` = its hits."""
        correct = (self.correct_K if correct_K is None else correct_K).tolist()
        counted = self.counted_K.tolist()
        return [(c / n if n > 0 else None) for c, n in zip(correct[1:], counted[1:], strict=True)]

    def mean_streak(self, streak_sum: torch.Tensor | None = None) -> float:
        total = self.streak_sum if streak_sum is None else streak_sum
        return float(total) / self.num_blocks if self.num_blocks else 0.0


def block_accuracy(correct_BNK: torch.Tensor, valid_BNK: torch.Tensor, keep_BN: torch.Tensor):
    """(hits per position [K], counts per position [K], sum of leading-correct streaks over kept blocks).

    A position without weight ends the streak: it cannot be judged, and at inference a block is
    accepted only up to its first miss.
    """
    hits_BNK = correct_BNK & valid_BNK
    streak_BN = torch.cumprod(hits_BNK[:, :, 1:].to(torch.int32), dim=-1).sum(-1)
    streak_sum = (streak_BN * keep_BN).sum().float()
    return hits_BNK.sum(dim=(0, 1)).float(), valid_BNK.sum(dim=(0, 1)).float(), streak_sum


def block_loss(
    hidden_BQD: torch.Tensor,
    head_VD: torch.Tensor,
    blocks: Blocks,
    *,
    chunk_rows: int = 1024,
    kl_weight: float = 0.0,
    kl_temperature: float = 1.0,
    chunk_fn=chunk_loss_and_grad,
    weight_total: torch.Tensor | None = None,
    selector: torch.nn.Module | None = None,
    selector_weight: float = 0.0,
) -> LossOutput:
    """The weighted block loss and its accuracy statistics. `blocks` must be on hidden's device.

    The loss is normalized by `weight_total`, default this batch's own sum of weights. A part of a
    data-parallel step passes the whole global batch's sum, so the parts' losses (and gradients)
    add up to the loss of the global batch. With a DFlash2 `selector` the loss adds `selector_weight`
    times the selector loss (`train.selector_loss`)."""
    B, Q, D = hidden_BQD.shape
    N = blocks.anchors_BN.shape[1]
    K = Q // N
    rows_M = blocks.loss_rows_M
    w_M = blocks.weights_BQ.reshape(-1).index_select(0, rows_M)
    w_M = w_M / (w_M.sum() if weight_total is None else weight_total)
    labels_M = blocks.labels_BQ.reshape(-1).index_select(0, rows_M)
    soft_ids = soft_logp = None
    if kl_weight > 0.0:
        if blocks.soft_ids_BQk is None:
            raise ValueError("loss.kl_weight > 0 needs the stored top-k targets (build blocks with soft_targets=True)")
        k = blocks.soft_ids_BQk.shape[-1]
        soft_ids = blocks.soft_ids_BQk.reshape(-1, k).index_select(0, rows_M)
        soft_logp = blocks.soft_logprobs_BQk.reshape(-1, k).index_select(0, rows_M)
    hidden_MD = hidden_BQD.reshape(-1, D).index_select(0, rows_M)
    loss, preds_M, unary_Mk, candidates_Mk = ChunkedHeadLoss.apply(
        hidden_MD,
        head_VD,
        labels_M,
        w_M,
        soft_ids,
        soft_logp,
        float(kl_weight),
        float(kl_temperature),
        int(chunk_rows),
        chunk_fn,
        selector.top_k if selector is not None else 0,
    )
    valid_BNK = torch.zeros(B * Q, dtype=torch.bool, device=hidden_BQD.device)
    valid_BNK[rows_M] = True
    valid_BNK = valid_BNK.view(B, N, K)
    correct_K, counted_K, streak_sum = _position_hits(preds_M == labels_M, rows_M, valid_BNK, blocks.keep_BN)
    stats = None
    if selector is not None:
        selector_loss, coverage, hits_M = selector_terms(
            selector, hidden_MD, unary_Mk, candidates_Mk, labels_M, w_M, blocks
        )
        hits_K, _, hits_streak = _position_hits(hits_M, rows_M, valid_BNK, blocks.keep_BN)
        stats = SelectorStats(selector_loss.detach(), loss.detach(), selector_weight, coverage, hits_K, hits_streak)
        loss = loss + selector_weight * selector_loss
    return LossOutput(loss, correct_K, counted_K, streak_sum, blocks.num_blocks, stats)


@torch.no_grad()
def _position_hits(hits_M: torch.Tensor, rows_M: torch.Tensor, valid_BNK: torch.Tensor, keep_BN: torch.Tensor):
    """`block_accuracy` of per-loss-row hits."""
    correct_flat = torch.zeros(valid_BNK.numel(), dtype=torch.bool, device=valid_BNK.device)
    correct_flat[rows_M] = hits_M
    return block_accuracy(correct_flat.view(valid_BNK.shape), valid_BNK, keep_BN)
