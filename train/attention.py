"""The DFlash training attention mask (docs/dflash.md "Attention mask"), as a flex_attention `BlockMask` and as a
dense bool mask for SDPA, per layer type, plus `attend`, which runs either.

Keys/values of one row are `[S context positions | N blocks x B block tokens]`; queries are the
N x B block tokens. Query `q` belongs to block `n = q // B`, anchored at `anchor[n]`, at offset
`o = q % B`, so at position `anchor[n] + o`; context key `kv` sits at position `kv`:

    allow(q, kv) = keep[n] and ( (kv < S and kv < anchor[n])            # context strictly before the anchor
                                or (kv >= S and (kv - S) // B == n) )    # its own block
                   and the layer's `MaskRule`:
                       window W:  q_pos - kv_pos < W                      # W keys back, own position included
                       causal:    inside the block, kv offset <= q offset
                       window and not causal: also kv_pos - q_pos < W     # symmetric, as flash-attention's (W-1, W-1)

It sees no other block, and a padding block (keep = False) sees nothing. The context comparison is
strict because the anchor's own target hidden state does not exist yet at inference (the anchor is
the bonus token the target just produced).

Layer types (`DrafterConfig.layer_types`): a `full_attention` layer is `MaskRule()` (bidirectional
in its block, all earlier context); a `sliding_attention` layer is `MaskRule(window=sliding_window,
causal=...)`, causal inside the block by default as vLLM and SGLang serve it (docs/serving.md). A
model with several layer types takes a dict {layer type: mask} (`build_layer_masks`).

At inference (one block after all the context, `position_mask`) the same rules reduce to positions:
visible iff (not causal or kv_pos <= q_pos) and (no window or |q_pos - kv_pos| < W, one-sided when
causal).

Shape legend: B batch, N blocks per row, K block size, Q = N*K queries, S context, P = S + Q keys,
H query heads, G kv heads, E head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

__all__ = [
    "MaskRule",
    "mask_mod_for",
    "build_block_mask",
    "build_dense_mask",
    "build_layer_masks",
    "position_mask",
    "visible_pairs",
    "attend",
    "flex_attention_fn",
]


@dataclasses.dataclass(frozen=True)
class MaskRule:
    """What one layer's queries see beyond the DFlash mask rule: a sliding window and in-block causality."""

    window: int | None = None  # keys at most window-1 positions before the query (None: no window)
    causal: bool = False  # inside the block, a query sees only block tokens at or before its own offset

    def __post_init__(self) -> None:
        assert self.window is None or self.window >= 1, self.window


FULL = MaskRule()


def mask_mod_for(
    anchors_BN: torch.Tensor, keep_BN: torch.Tensor, context_len: int, block_size: int, rule: MaskRule = FULL
):
    """The DFlash mask rule under `rule` as a flex `mask_mod(b, h, q_idx, kv_idx) -> bool`."""
    S, K = context_len, block_size
    window, causal = rule.window, rule.causal

    def dflash_mask(b, h, q_idx, kv_idx):  # noqa: ARG001 (flex's mask_mod signature: every head alike)
        block = q_idx // K
        anchor = anchors_BN[b, block]
        sees_context = (kv_idx < S) & (kv_idx < anchor)
        sees_own_block = (kv_idx >= S) & ((kv_idx - S) // K == block)
        if window is not None or causal:
            q_off, kv_off = q_idx % K, (kv_idx - S) % K
            if window is not None:
                sees_context = sees_context & (anchor + q_off - kv_idx < window)
                ahead = kv_off - q_off
                sees_own_block = sees_own_block & (-ahead < window)
                if not causal:
                    sees_own_block = sees_own_block & (ahead < window)
            if causal:
                sees_own_block = sees_own_block & (kv_off <= q_off)
        return (sees_context | sees_own_block) & keep_BN[b, block]

    return dflash_mask


def build_block_mask(
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    context_len: int,
    block_size: int,
    rule: MaskRule = FULL,
    *,
    compile_mask: bool | None = None,
):
    """A flex `BlockMask` over [B, 1, N*K, S + N*K] (mask creation is compiled on CUDA by default)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, N = anchors_BN.shape
    Q = N * block_size
    device = anchors_BN.device
    if compile_mask is None:
        compile_mask = device.type == "cuda"
    return create_block_mask(
        mask_mod_for(anchors_BN, keep_BN, context_len, block_size, rule),
        B,
        None,
        Q,
        context_len + Q,
        device=device,
        _compile=compile_mask,
    )


def build_dense_mask(
    anchors_BN: torch.Tensor, keep_BN: torch.Tensor, context_len: int, block_size: int, rule: MaskRule = FULL
) -> torch.Tensor:
    """The same rule as a dense bool [B, 1, Q, S + Q] (True = may attend)."""
    B, N = anchors_BN.shape
    S, K = context_len, block_size
    Q = N * K
    device = anchors_BN.device
    block_Q = torch.arange(Q, device=device) // K
    kv_P = torch.arange(S + Q, device=device)
    anchor_BQ = anchors_BN[:, block_Q]
    keep_BQ = keep_BN[:, block_Q]
    sees_context_BQP = (kv_P < S)[None, None, :] & (kv_P[None, None, :] < anchor_BQ[:, :, None])
    sees_block_QP = (kv_P >= S)[None, :] & ((kv_P - S).div(K, rounding_mode="floor")[None, :] == block_Q[:, None])
    if rule.window is not None or rule.causal:
        q_off_Q = torch.arange(Q, device=device) % K
        ahead_QP = ((kv_P - S) % K)[None, :] - q_off_Q[:, None]  # kv offset - q offset (used inside the block)
        if rule.window is not None:
            q_pos_BQ = anchor_BQ + q_off_Q[None, :]
            sees_context_BQP = sees_context_BQP & (q_pos_BQ[:, :, None] - kv_P[None, None, :] < rule.window)
            sees_block_QP = sees_block_QP & (-ahead_QP < rule.window)
            if not rule.causal:
                sees_block_QP = sees_block_QP & (ahead_QP < rule.window)
        if rule.causal:
            sees_block_QP = sees_block_QP & (ahead_QP <= 0)
    allowed_BQP = (sees_context_BQP | sees_block_QP[None]) & keep_BQ[:, :, None]
    return allowed_BQP[:, None]


def build_layer_masks(
    kernel: str,
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    context_len: int,
    block_size: int,
    rules: dict[str, MaskRule],
) -> dict:
    """{layer type: mask} for a drafter's layer types (`DrafterConfig.mask_rules`): a flex `BlockMask`
    per rule with kernel "flex", a dense bool mask with "sdpa". Layer types with the same rule share one."""
    assert kernel in ("flex", "sdpa"), kernel
    build = build_block_mask if kernel == "flex" else build_dense_mask
    by_rule: dict[MaskRule, object] = {}
    for rule in rules.values():
        if rule not in by_rule:
            by_rule[rule] = build(anchors_BN, keep_BN, context_len, block_size, rule)
    return {layer_type: by_rule[rule] for layer_type, rule in rules.items()}


def position_mask(q_pos_BQ: torch.Tensor, kv_pos_BP: torch.Tensor, rule: MaskRule) -> torch.Tensor | None:
    """Inference (one block after all its context): bool [B, 1, Q, P] from absolute positions, or
    None when `rule` hides nothing there (no window, not causal)."""
    if rule.window is None and not rule.causal:
        return None
    ahead_BQP = kv_pos_BP[:, None, :] - q_pos_BQ[:, :, None]
    visible_BQP = torch.ones_like(ahead_BQP, dtype=torch.bool)
    if rule.causal:
        visible_BQP &= ahead_BQP <= 0
    if rule.window is not None:
        visible_BQP &= -ahead_BQP < rule.window
        if not rule.causal:
            visible_BQP &= ahead_BQP < rule.window
    return visible_BQP[:, None]


def visible_pairs(anchors_BN: torch.Tensor, keep_BN: torch.Tensor, block_size: int, rule: MaskRule) -> int:
    """(query, key) pairs the mask allows, summed over the kept blocks (for FLOP counts)."""
    K = block_size
    anchors = anchors_BN[keep_BN].to(torch.int64)  # [M]
    q_off = torch.arange(K, device=anchors.device)
    context_MK = anchors[:, None].expand(-1, K)
    own = torch.full((K,), K, dtype=torch.int64, device=anchors.device)
    if rule.window is not None:
        context_MK = torch.minimum(context_MK, (rule.window - 1 - q_off).clamp(min=0)[None, :])
        kv_off, qo = torch.meshgrid(q_off, q_off, indexing="ij")
        ahead = kv_off - qo
        inside = (-ahead < rule.window) & ((ahead <= 0) if rule.causal else (ahead < rule.window))
        own = inside.sum(0)
    elif rule.causal:
        own = q_off + 1
    return int(context_MK.sum()) + int(own.sum()) * int(anchors.numel())


@functools.lru_cache(maxsize=2)
def flex_attention_fn(compiled: bool):
    """flex_attention itself (unfused: fine on CPU for tiny shapes) or its torch.compile'd kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    # Batches vary in length; let dynamo mark shapes dynamic instead of recompiling per shape.
    from torch._dynamo import config as dynamo_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=None)


def _sdpa(q_BHQE, k_BGPE, v_BGPE, mask_B1QP) -> torch.Tensor:
    if mask_B1QP is None:
        return F.scaled_dot_product_attention(q_BHQE, k_BGPE, v_BGPE, enable_gqa=True)
    # A row that may see nothing (padding block) would softmax over all -inf and give NaN, whose
    # gradient poisons every weight. Let such rows see everything, then zero their output, which
    # matches flex (0 for an empty row) and gives them exactly zero gradient.
    empty_B1Q1 = ~mask_B1QP.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q_BHQE, k_BGPE, v_BGPE, attn_mask=mask_B1QP | empty_B1Q1, enable_gqa=True)
    return out.masked_fill(empty_B1Q1, 0.0)


def attend(q_BHQE: torch.Tensor, k_BGPE: torch.Tensor, v_BGPE: torch.Tensor, mask) -> torch.Tensor:
    """Attention of block queries over [context | block] keys with GQA; `mask` chooses the kernel.

    A `BlockMask` runs flex_attention (compiled on CUDA), a bool tensor runs SDPA with that mask,
    None runs SDPA with everything visible (inference: all context precedes the block).
    """
    if mask is None or isinstance(mask, torch.Tensor):
        return _sdpa(q_BHQE, k_BGPE, v_BGPE, mask)
    # Inside a torch.compile'd model the plain op is captured and fused with the rest; outside
    # it, CUDA needs the compiled kernel (the unfused fallback materializes every score).
    on_cuda = q_BHQE.device.type == "cuda"
    compiled = on_cuda and not torch.compiler.is_compiling()
    # For fewer than 128 block queries inductor would pick its flex-decoding kernel, an inference
    # kernel whose BLOCK_M (queries x GQA group, rounded up to a power of two) must divide the
    # 128-token mask block: with 96 queries and groups of 2 no config is left and compilation fails
    # ("No choices exist for backend"). Training always wants the main flex kernel.
    options = {"FORCE_USE_FLEX_ATTENTION": True} if on_cuda else None
    return flex_attention_fn(compiled)(q_BHQE, k_BGPE, v_BGPE, block_mask=mask, enable_gqa=True, kernel_options=options)
