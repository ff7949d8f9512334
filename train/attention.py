"""The DFlash training attention mask (dflash.md §3.5), as a flex_attention `BlockMask` and as a
dense bool mask for SDPA, plus `attend`, which runs either.

Keys/values of one row are `[S context positions | N blocks x B block tokens]`; queries are the
N x B block tokens. Query `q` belongs to block `n = q // B`, anchored at `anchor[n]`:

    allow(q, kv) = keep[n] and ( (kv < S and kv < anchor[n])            # context strictly before the anchor
                                or (kv >= S and (kv - S) // B == n) )    # its own block, bidirectional

It sees no other block, and a padding block (keep = False) sees nothing. The comparison is strict
because the anchor's own target hidden state does not exist yet at inference (the anchor is the
bonus token the target just produced).

Shape legend: B batch, N blocks per row, K block size, Q = N*K queries, S context, P = S + Q keys,
H query heads, G kv heads, E head dim.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["mask_mod_for", "build_block_mask", "build_dense_mask", "attend", "flex_attention_fn"]


def mask_mod_for(anchors_BN: torch.Tensor, keep_BN: torch.Tensor, context_len: int, block_size: int):
    """The §3.5 rule as a flex `mask_mod(b, h, q_idx, kv_idx) -> bool`."""
    S, K = context_len, block_size

    def dflash_mask(b, h, q_idx, kv_idx):
        block = q_idx // K
        sees_context = (kv_idx < S) & (kv_idx < anchors_BN[b, block])
        sees_own_block = (kv_idx >= S) & ((kv_idx - S) // K == block)
        return (sees_context | sees_own_block) & keep_BN[b, block]

    return dflash_mask


def build_block_mask(
    anchors_BN: torch.Tensor, keep_BN: torch.Tensor, context_len: int, block_size: int, *, compile_mask: bool | None = None
):
    """A flex `BlockMask` over [B, 1, N*K, S + N*K] (mask creation is compiled on CUDA by default)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, N = anchors_BN.shape
    Q = N * block_size
    device = anchors_BN.device
    if compile_mask is None:
        compile_mask = device.type == "cuda"
    return create_block_mask(
        mask_mod_for(anchors_BN, keep_BN, context_len, block_size), B, None, Q, context_len + Q,
        device=device, _compile=compile_mask,
    )


def build_dense_mask(anchors_BN: torch.Tensor, keep_BN: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
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
    allowed_BQP = (sees_context_BQP | sees_block_QP[None]) & keep_BQ[:, :, None]
    return allowed_BQP[:, None]


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
    compiled = q_BHQE.device.type == "cuda" and not torch.compiler.is_compiling()
    return flex_attention_fn(compiled)(q_BHQE, k_BGPE, v_BGPE, block_mask=mask, enable_gqa=True)
