"""Batched drafting: the anchors of a sequence evaluated many blocks per forward under the training mask,
several short sequences per forward, context trimmed to the last anchor; only the top-k log-probs
per depth leave the device (`draft_topk_for_pieces`), and for a DFlash2 drafter its selector's walk
and per-parent distributions over its candidates (`train.eval.selector`). `Runtime` is the trainer's
own kernel choice (`train.kernels`).

Shape legend: T tokens of a sample, F tap feature width, A anchors of a piece, D draft positions
(block_size - 1), K block size, R rows of a forward, N blocks per row, S context, Q = N*K, P = S+Q,
M kept blocks of a forward, k kept top-k per depth, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from train.alignment import block_input_ids, block_positions
from train.eval.checkpoints import EvalModel
from train.eval.config import EvalConfig
from train.eval.ddtree import draft_topk
from train.eval.selector import SelectorDrafts, selector_drafts
from train.kernels import EVAL_KEYS, KernelPlan, OnKernels, choose_kernels


@dataclasses.dataclass
class Runtime(OnKernels):
    kernels: KernelPlan  # device, autocast dtype and attention kernel, chosen as the trainer chooses them
    # DDTree scoring in a CPU thread while the device drafts the next forward (the default on CUDA).
    score_in_background: bool = False

    @classmethod
    def from_config(cls, cfg: EvalConfig, head_dims: Sequence[int]) -> Runtime:
        """The runtime for drafters of these head dims (flex only if it works for all of them)."""
        kernels = choose_kernels(
            cfg.device, cfg.precision, cfg.attention, False, head_dims, training=False, keys=EVAL_KEYS
        )
        return cls(kernels, score_in_background=kernels.device.type == "cuda")

    @property
    def attention(self) -> str:
        return self.kernels.attention

    def blocks_per_forward(self, cfg: EvalConfig) -> int:
        if cfg.blocks_per_forward is not None:
            return cfg.blocks_per_forward
        return 512 if self.device.type == "cuda" else 128

    @property
    def head_dtype(self) -> torch.dtype:
        return self.autocast_dtype or torch.float32

    def autocast(self):
        return self.kernels.autocast()


@dataclasses.dataclass
class Piece:
    """Some anchors of one sample: one row of a forward."""

    sample: int  # position in EvalData
    input_ids_T: Tensor
    hidden_TF: Tensor
    anchors_A: Tensor
    valid_len_A: Tensor
    target_ids_AD: Tensor

    @property
    def n_blocks(self) -> int:
        return int(self.anchors_A.numel())


def split_pieces(piece: Piece, max_blocks: int) -> list[Piece]:
    """The piece in consecutive runs of at most `max_blocks` anchors (each keeps only the context it needs)."""
    parts = []
    for start in range(0, piece.n_blocks, max_blocks):
        rows = slice(start, start + max_blocks)
        parts.append(
            dataclasses.replace(
                piece,
                anchors_A=piece.anchors_A[rows],
                valid_len_A=piece.valid_len_A[rows],
                target_ids_AD=piece.target_ids_AD[rows],
            )
        )
    return parts


def pack_pieces(pieces: Iterable[Piece], max_blocks: int) -> Iterator[list[Piece]]:
    """Consecutive pieces grouped into forwards of at most `max_blocks` blocks (pieces are never split here)."""
    group: list[Piece] = []
    total = 0
    for piece in pieces:
        assert 0 < piece.n_blocks <= max_blocks, (piece.n_blocks, max_blocks)
        if group and total + piece.n_blocks > max_blocks:
            yield group
            group, total = [], 0
        group.append(piece)
        total += piece.n_blocks
    if group:
        yield group


@dataclasses.dataclass
class ForwardInputs:
    hidden_RSF: Tensor
    block_ids_RQ: Tensor
    position_ids_RP: Tensor
    anchors_RN: Tensor
    keep_RN: Tensor


def forward_inputs(pieces: Sequence[Piece], block_size: int, mask_token_id: int) -> ForwardInputs:
    """The rows of one forward: context features up to the last anchor, one block per anchor."""
    R, K = len(pieces), block_size
    N = max(p.n_blocks for p in pieces)
    # Blocks see context positions < their anchor only, so nothing at or after the last anchor is needed.
    S = max(1, max(int(p.anchors_A.max()) for p in pieces))
    F = pieces[0].hidden_TF.shape[1]
    hidden_RSF = torch.zeros(R, S, F, dtype=pieces[0].hidden_TF.dtype)
    anchors_RN = torch.zeros(R, N, dtype=torch.long)
    keep_RN = torch.zeros(R, N, dtype=torch.bool)
    anchor_ids_RN = torch.full((R, N), int(mask_token_id), dtype=torch.long)  # padding blocks: all mask tokens
    for r, piece in enumerate(pieces):
        n, t = piece.n_blocks, min(S, piece.hidden_TF.shape[0])
        hidden_RSF[r, :t] = piece.hidden_TF[:t]
        anchors_RN[r, :n] = piece.anchors_A
        keep_RN[r, :n] = True
        anchor_ids_RN[r, :n] = piece.input_ids_T.long()[piece.anchors_A]
    block_ids_RNK = block_input_ids(anchor_ids_RN, K, mask_token_id)
    block_pos_RQ = block_positions(anchors_RN, K).view(R, N * K)
    position_ids_RP = torch.cat((torch.arange(S).expand(R, S), block_pos_RQ), dim=1)
    return ForwardInputs(hidden_RSF, block_ids_RNK.view(R, N * K), position_ids_RP, anchors_RN, keep_RN)


@torch.no_grad()
def draft_topk_for_pieces(
    model: EvalModel, pieces: Sequence[Piece], runtime: Runtime, topk: int, chunk_rows: int
) -> tuple[Tensor, Tensor, SelectorDrafts | None]:
    """The drafter's top-k log-probs (float32) and ids (int64), each [M, D, k] on the CPU, for every
    block of the pieces in order, and a DFlash2 drafter's selector drafts (else None). Full-vocabulary
    logits exist for ~chunk_rows block tokens at a time."""
    K = model.block_size
    inputs = forward_inputs(pieces, K, model.mask_token_id)
    device = runtime.device
    moved = ForwardInputs(*(getattr(inputs, f.name).to(device, non_blocking=True) for f in dataclasses.fields(inputs)))
    mask = runtime.kernels.mask(moved.anchors_RN, moved.keep_RN, moved.hidden_RSF.shape[1], K, model.mask_rules)
    R, N = moved.anchors_RN.shape
    with runtime.autocast():
        hidden_RQD = model.model(model.head.embed(moved.block_ids_RQ), moved.hidden_RSF, moved.position_ids_RP, mask)
        # Block position 0 (the anchor) predicts nothing; keep positions 1..K-1 of the real blocks.
        drafts_MDH = hidden_RQD.view(R, N, K, -1)[:, :, 1:][moved.keep_RN]
        anchor_ids_M = moved.block_ids_RQ.view(R, N, K)[:, :, 0][moved.keep_RN]
        selector = getattr(model.model, "candidate_selector", None)
        chunk_blocks = max(1, chunk_rows // (K - 1))
        k = min(topk, int(model.head.vocab_size))
        values, ids, chosen = [], [], []
        for start in range(0, drafts_MDH.shape[0], chunk_blocks):
            rows = slice(start, start + chunk_blocks)
            logits_CDV = model.head.logits(drafts_MDH[rows])
            lp_CDk, ids_CDk = draft_topk(logits_CDV, k)
            values.append(lp_CDk.cpu())
            ids.append(ids_CDk.cpu())
            if selector is not None:
                chosen.append(selector_drafts(selector, drafts_MDH[rows], logits_CDV, anchor_ids_M[rows]).to("cpu"))
    return torch.cat(values), torch.cat(ids), SelectorDrafts.concat(chosen) if chosen else None
