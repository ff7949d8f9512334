"""Training blocks: anchor sampling, block inputs, labels and loss weights (docs/dflash.md "Anchors", "Attention mask",
"Loss").

For a sequence with tokens x[0..L-1] and an anchor a, the block is

    block ids    [x[a], MASK, MASK, ..., MASK]          (K = block_size tokens)
    positions    a, a+1, ..., a+K-1                     (absolute, same frame as the context 0..S-1)
    label at k   topk_ids[a+k-1, 0]   for k = 1..K-1    (the target's own top-1 for the token at a+k;
                                                          ablation: the data token x[a+k])
    weight at k  exp(-(k-1)/gamma)    for k >= 1, 0 at k = 0 (the anchor carries no loss),
                 0 where a+k >= L (past the end) or loss_mask[a+k] is 0 (not a response token).
    predecessor  x[a] at k = 1, the label at k-1 for k >= 2: the token before position k on the path the
                 target would take (DFlash2's selector is teacher-forced with it; train/selector_loss.py)

Anchor rule: a is a candidate iff loss_mask[a] and loss_mask[a+1] (so a+1 < L). The anchor is a
response token because at inference it is the token the target just produced; requiring a+1 to be
a response token guarantees every block has at least one weighted label. Blocks near the end are
kept (their labels past the end get weight 0), as in SpecForge HEAD, so short answers still train.
Up to `num_anchors` anchors per sequence are drawn uniformly without replacement (iid uniform
keys, top-n) from a seeded generator, then sorted; rows with fewer candidates are padded with
`keep = False` blocks that see nothing and carry no weight. Optionally `max_blocks` caps the
blocks of a whole batch (each row's count scaled down proportionally): under a token budget a
batch of many short samples would otherwise carry several times the block tokens (and memory)
of a batch of a few long ones.

How a run builds its blocks is one frozen `BlockSpec`, made once from the drafter's config (block size, mask
token) and the train config's `loss` table (anchors, gamma, labels, soft targets, block cap): its fields come from
two configs, and tests and benchmarks state one without a whole train config.

Everything here runs on CPU tensors of the batch before they move to the device: the labels and
weights are gathered here, so the [B, S, k] top-k arrays never need to go to the GPU.

Shape legend: B rows, S padded length, N blocks per row, K block size, Q = N*K, P = S + Q, k top-k.
"""

from __future__ import annotations

import dataclasses

import torch

from train.alignment import block_input_ids, block_positions, label_rows
from train.config import LossConfig, default_gamma  # noqa: F401 - default_gamma is part of this module's API (__all__)
from train.drafter_config import DrafterConfig

__all__ = [
    "Blocks",
    "BlockSpec",
    "make_blocks",
    "position_weights",
    "default_gamma",
    "anchor_candidates",
    "anchors_per_row",
    "sample_anchors",
    "step_generator",
]


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k for k = 0..K-1: 0 at the anchor, exp(-(k-1)/gamma) after it. float32 [K]."""
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.float()


def step_generator(seed: int, step: int) -> torch.Generator:
    """The anchor generator of one optimizer step: a pure function of (seed, step), so resume is exact."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63 - 1))


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """How one run's blocks are built (`make_blocks`); `of` reads it from the run's configs."""

    block_size: int  # K
    mask_token_id: int
    num_anchors: int  # per sequence, at most
    gamma: float  # position decay of the loss weights
    labels: str = "target"  # "target": the target's top-1; "data": the data token (ablation)
    soft_targets: bool = False  # also gather the target top-k behind each label (the KL ablation)
    max_blocks: int | None = None  # cap on the blocks of a whole batch

    def __post_init__(self) -> None:
        if self.labels not in ("target", "data"):
            raise ValueError(f"labels must be 'target' or 'data', got {self.labels!r}")

    @classmethod
    def of(cls, drafter_cfg: DrafterConfig, loss: LossConfig) -> BlockSpec:
        """The blocks of a drafter trained with a (checked) `loss` table."""
        return cls(
            block_size=drafter_cfg.block_size,
            mask_token_id=drafter_cfg.mask_token_id,
            num_anchors=loss.num_anchors,
            gamma=loss.gamma,
            labels=loss.labels,
            soft_targets=loss.kl_weight > 0,
            max_blocks=loss.max_blocks,
        )


@dataclasses.dataclass
class Blocks:
    """The block side of one batch. All tensors on the same device."""

    anchors_BN: torch.Tensor  # int64, anchor position of each block (0 for padding blocks)
    keep_BN: torch.Tensor  # bool, False for padding blocks
    block_ids_BQ: torch.Tensor  # int64, [x[a], MASK...] per block; all MASK for padding blocks
    position_ids_BP: torch.Tensor  # int64, context 0..S-1 then a..a+K-1 per block
    labels_BQ: torch.Tensor  # int64, label of each block token (0 where weight is 0)
    weights_BQ: torch.Tensor  # float32, loss weight of each block token
    loss_rows_M: torch.Tensor  # int64, flat indices into B*Q of the tokens with weight > 0
    num_blocks: int  # kept (non-padding) blocks, counted on the host
    predecessors_BQ: torch.Tensor  # int64, the token before each block token: x[a] at k = 1, the label of k-1 after
    soft_ids_BQk: torch.Tensor | None = None  # int64, target top-k ids behind each label (KL ablation)
    soft_logprobs_BQk: torch.Tensor | None = None  # float32, their log-probs

    def to(self, device, non_blocking: bool = False) -> Blocks:
        moved = {
            f.name: (v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }
        return Blocks(**moved)


def anchor_candidates(loss_mask_BS: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: positions a with loss_mask[a] and loss_mask[a+1], a+1 < length."""
    B, S = loss_mask_BS.shape
    inside_BS = torch.arange(S)[None, :] < lengths_B[:, None]
    mask_BS = loss_mask_BS.bool() & inside_BS
    next_BS = torch.zeros_like(mask_BS)
    next_BS[:, :-1] = mask_BS[:, 1:]
    return mask_BS & next_BS


def anchors_per_row(counts_B: torch.Tensor, num_anchors: int, max_blocks: int | None) -> torch.Tensor:
    """How many anchors each row gets: min(num_anchors, its candidates), scaled down proportionally
    (floor, at least 1 where a row has any) when the batch would exceed `max_blocks` in total."""
    quota_B = counts_B.clamp(max=num_anchors)
    total = int(quota_B.sum())
    if max_blocks is not None and total > max_blocks:
        quota_B = torch.minimum(quota_B, (quota_B * max_blocks // total).clamp(min=1))
    return quota_B


def sample_anchors(
    candidates_BS: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None,
    max_blocks: int | None = None,
    *,
    keys_BS: torch.Tensor | None = None,
    quota_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors_BN, keep_BN): up to `num_anchors` candidates per row, uniform without replacement, sorted.

    N = the largest row quota (at least 1, so shapes never collapse); see `anchors_per_row`.
    The rows' random keys and quotas are drawn here from `generator`, or given (`keys_BS` [B, >= S],
    `quota_B`): a part of a data-parallel batch takes its rows of the global batch's keys and quotas.
    """
    B, S = candidates_BS.shape
    if quota_B is None:
        quota_B = anchors_per_row(candidates_BS.sum(dim=1), num_anchors, max_blocks)
    N = max(1, int(quota_B.max()) if B else 0)
    keys_BS = torch.rand((B, S), generator=generator) if keys_BS is None else keys_BS[:, :S]
    keys_BS = torch.where(candidates_BS, keys_BS, torch.full_like(keys_BS, -1.0))
    chosen_BN = keys_BS.topk(N, dim=1).indices
    keep_BN = torch.arange(N)[None, :] < quota_B[:, None]
    # Sort the kept anchors by position (padding sorts last): neighbouring blocks then share
    # context tiles, which lets flex skip more of the mask.
    order_key_BN = torch.where(keep_BN, chosen_BN, torch.full_like(chosen_BN, S + 1))
    order_BN = order_key_BN.argsort(dim=1)
    anchors_BN = torch.where(keep_BN, chosen_BN.gather(1, order_BN), torch.zeros_like(chosen_BN))
    return anchors_BN, keep_BN


def make_blocks(
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    topk_ids_BSk: torch.Tensor,
    spec: BlockSpec,
    *,
    generator: torch.Generator | None,
    topk_logprobs_BSk: torch.Tensor | None = None,
    keys_BS: torch.Tensor | None = None,
    quota_B: torch.Tensor | None = None,
) -> Blocks:
    """Sample anchors and build the block inputs, labels and weights of one batch (CPU tensors) as `spec` says.
    `keys_BS` / `quota_B`: see `sample_anchors`."""
    B, S = input_ids_BS.shape
    K, mask_token_id = spec.block_size, spec.mask_token_id
    candidates_BS = anchor_candidates(loss_mask_BS, lengths_B)
    anchors_BN, keep_BN = sample_anchors(
        candidates_BS, spec.num_anchors, generator, spec.max_blocks, keys_BS=keys_BS, quota_B=quota_B
    )
    N = anchors_BN.shape[1]
    offsets_K = torch.arange(K)

    first_BN = input_ids_BS.long().gather(1, anchors_BN)
    padding_BN = torch.full_like(first_BN, int(mask_token_id))  # a padding block is all mask tokens
    block_ids_BNK = block_input_ids(torch.where(keep_BN, first_BN, padding_BN), K, mask_token_id)

    target_pos_BNK = block_positions(anchors_BN, K)  # the token each block position predicts
    in_seq_BNK = target_pos_BNK < lengths_B[:, None, None]
    safe_pos_BNK = target_pos_BNK.clamp(max=S - 1)
    label_mask_BNK = loss_mask_BS.bool().gather(1, safe_pos_BNK.view(B, -1)).view(B, N, K)
    valid_BNK = keep_BN[:, :, None] & in_seq_BNK & label_mask_BNK & (offsets_K >= 1)
    weights_BNK = position_weights(K, spec.gamma)[None, None, :] * valid_BNK

    # Clamped rows only serve positions whose weight is 0 (the anchor itself, past the sequence).
    row_BNK = label_rows(target_pos_BNK).clamp(min=0, max=S - 1)
    if spec.labels == "target":
        labels_BNK = topk_ids_BSk[:, :, 0].long().gather(1, row_BNK.view(B, -1)).view(B, N, K)
    else:
        labels_BNK = input_ids_BS.long().gather(1, safe_pos_BNK.view(B, -1)).view(B, N, K)
    # The label of k-1 whether or not k-1 carries weight (a prompt token inside the block still precedes k).
    predecessors_BNK = torch.cat((first_BN[:, :, None], labels_BNK[:, :, :-1]), dim=-1)
    predecessors_BNK[:, :, 1] = first_BN
    labels_BNK = torch.where(valid_BNK, labels_BNK, torch.zeros_like(labels_BNK))

    soft_ids = soft_logprobs = None
    if spec.soft_targets:
        assert topk_logprobs_BSk is not None
        k = topk_ids_BSk.shape[-1]
        index_BQk = row_BNK.view(B, -1, 1).expand(-1, -1, k)
        soft_ids = topk_ids_BSk.long().gather(1, index_BQk)
        soft_logprobs = topk_logprobs_BSk.float().gather(1, index_BQk)

    context_pos_BS = torch.arange(S).expand(B, S)
    position_ids_BP = torch.cat((context_pos_BS, target_pos_BNK.view(B, -1)), dim=1)
    return Blocks(
        anchors_BN=anchors_BN,
        keep_BN=keep_BN,
        block_ids_BQ=block_ids_BNK.view(B, -1),
        position_ids_BP=position_ids_BP,
        labels_BQ=labels_BNK.view(B, -1),
        weights_BQ=weights_BNK.view(B, -1).float(),
        loss_rows_M=valid_BNK.view(-1).nonzero().view(-1),
        num_blocks=int(keep_BN.sum()),
        predecessors_BQ=predecessors_BNK.reshape(B, -1),
        soft_ids_BQk=soft_ids,
        soft_logprobs_BQk=soft_logprobs,
    )
