"""The DFlash drafter (docs/dflash.md "Drafter") and the target's frozen embedding + lm_head.

The drafter is a stack of Qwen3-style decoder layers run over the block tokens only. The target's
tap features of the context are projected once (`fc`, then `hidden_norm`) and injected as extra
keys/values at every layer through that layer's own `k_proj`/`v_proj` (+ `k_norm`, + RoPE at the
context positions). The context never enters the residual stream and is never a query. Each layer
is `full_attention` or `sliding_attention` (`DrafterConfig.layer_types`); the attention rule of
each type is a `train.attention.MaskRule` (`DrafterConfig.mask_rules`).
Parameter names are the published ones (`fc`, `hidden_norm`, `layers.N.…`, `norm`), so a state
dict saves as a z-lab compatible `model.safetensors` with no renaming. The drafter's shape is a
`train.drafter_config.DrafterConfig`; DFlash2 (`train.dflash2`) builds on these classes.

Shape legend (suffixes of tensor names):
    B batch (sequences)          S context length (tokens of the sequence)
    Q block tokens per row (= anchors x block_size)   P = S + Q positions
    D drafter hidden size        F = n_taps x target hidden (tap feature width)
    H query heads   G key/value heads   E head_dim   R rotary dims (<= E)
    V vocabulary    M selected block tokens (loss rows)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from target.identity import StoredHead, read_stored_head
from train.attention import MaskRule, attend, position_mask
from train.drafter_config import DrafterConfig

__all__ = ["DFlashDrafter", "TargetHead", "RotaryEmbedding", "apply_rotary"]

# ----------------------------------------------------------------------------------------------
# RoPE


def _rope_inv_freq(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2], attention scaling) for the config's rope settings."""
    dim = cfg.rotary_dim
    if cfg.rope_scaling is None:
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    # Scaled variants: transformers' own formulas, so the drafter matches what serving engines compute.
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(cfg.rope_scaling)
    kind = params.pop("rope_type", params.pop("type", "default"))
    params.update(rope_type=kind, rope_theta=cfg.rope_theta, partial_rotary_factor=cfg.partial_rotary_factor)
    hf = Qwen3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=params,
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf, None)
    assert inv_freq.numel() * 2 == dim, (inv_freq.shape, dim)
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """cos/sin [B, P, R] for absolute positions (R = rotary dims; the rest of each head passes through)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = _rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids_BP: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BPh = position_ids_BP[..., None].float() * self.inv_freq.float()
        angles_BPR = torch.cat((freqs_BPh, freqs_BPh), dim=-1)
        return (angles_BPR.cos() * self.attention_scaling).to(dtype), (angles_BPR.sin() * self.attention_scaling).to(
            dtype
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x_BhTE: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of every head (partial rotary as in Qwen3.5/3.6); the rest pass through."""
    rot = cos_BTR.shape[-1]
    cos, sin = cos_BTR[:, None], sin_BTR[:, None]
    if rot == x_BhTE.shape[-1]:
        return x_BhTE * cos + _rotate_half(x_BhTE) * sin
    x_rot, x_pass = x_BhTE[..., :rot], x_BhTE[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


# ----------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalize in float32, scale by `weight` (initialized to 1)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA with per-head q/k RMSNorm; keys/values = [projected context | block tokens]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x_BQD, context_BSD, cos_BPR, sin_BPR, attn_mask) -> torch.Tensor:
        B, Q, _ = x_BQD.shape
        S = context_BSD.shape[1]
        # One projection over [context | block]: the same k/v weights serve both (docs/dflash.md "Drafter").
        kv_in_BPD = torch.cat((context_BSD.to(x_BQD.dtype), x_BQD), dim=1) if S else x_BQD
        q_BHQE = self.q_norm(self.q_proj(x_BQD).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        k_BGPE = self.k_norm(self.k_proj(kv_in_BPD).view(B, S + Q, self.kv_heads, self.head_dim)).transpose(1, 2)
        v_BGPE = self.v_proj(kv_in_BPD).view(B, S + Q, self.kv_heads, self.head_dim).transpose(1, 2)
        q_BHQE = apply_rotary(q_BHQE, cos_BPR[:, S:], sin_BPR[:, S:])
        k_BGPE = apply_rotary(k_BGPE, cos_BPR, sin_BPR)
        # The fp32 norm weights promote q/k to fp32 and flex_attention ignores autocast: run the
        # attention in the compute dtype (that of cos/sin) explicitly.
        dtype = cos_BPR.dtype
        out_BHQE = attend(q_BHQE.to(dtype), k_BGPE.to(dtype), v_BGPE.to(dtype), attn_mask)
        return self.o_proj(out_BHQE.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h_BQD, context_BSD, cos_BPR, sin_BPR, attn_mask) -> torch.Tensor:
        # The context is not normed here: it was normed once by hidden_norm (docs/dflash.md "Drafter").
        h_BQD = h_BQD + self.self_attn(self.input_layernorm(h_BQD), context_BSD, cos_BPR, sin_BPR, attn_mask)
        return h_BQD + self.mlp(self.post_attention_layernorm(h_BQD))


class DFlashDrafter(nn.Module):
    """`drafter(noise_embedding_BQD, target_hidden_BSF, position_ids_BP, attn_mask) -> hidden_BQD`.

    `position_ids_BP` holds the positions of the S context tokens, then of the Q block tokens.
    `attn_mask` is {layer type: flex `BlockMask` or dense bool [B, 1, Q, S+Q] (True = may attend)}
    (`train.attention.build_layer_masks`), a single such mask when every layer is full_attention,
    or None: one block after all its context, as at inference (sliding layers still apply their
    window and in-block causality, from the positions). The output is the final-normed hidden
    state; logits are the target's `lm_head` of it (`TargetHead.logits`).
    """

    layer_class = DecoderLayer

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        self._mask_rules = cfg.mask_rules
        self._one_mask_fits_all = all(rule == MaskRule() for rule in self._mask_rules.values())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF `post_init` for Qwen3: linear weights ~ N(0, initializer_range), biases 0, norms 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def project_context(self, target_hidden_BSF: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(target_hidden_BSF.device.type):
            target_hidden_BSF = target_hidden_BSF.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(target_hidden_BSF))

    def forward(self, noise_embedding_BQD, target_hidden_BSF, position_ids_BP, attn_mask=None) -> torch.Tensor:
        B, Q, _ = noise_embedding_BQD.shape
        S = target_hidden_BSF.shape[1]
        assert position_ids_BP.shape == (B, S + Q), (position_ids_BP.shape, B, S, Q)
        context_BSD = self.project_context(target_hidden_BSF)
        # The residual stream stays in the master dtype (fp32); under autocast only the matmuls run in
        # the compute dtype, which is the frozen embedding's (bf16 on GPU).
        autocast = torch.is_autocast_enabled(noise_embedding_BQD.device.type)
        compute_dtype = noise_embedding_BQD.dtype if autocast else self.fc.weight.dtype
        h_BQD = noise_embedding_BQD.to(self.fc.weight.dtype)
        cos_BPR, sin_BPR = self.rotary_emb(position_ids_BP, compute_dtype)
        masks = self.layer_masks(attn_mask, position_ids_BP, S)
        for layer, layer_type in zip(self.layers, self.config.layer_types, strict=True):
            h_BQD = layer(h_BQD, context_BSD, cos_BPR, sin_BPR, masks[layer_type])
        return self.norm(h_BQD)

    def layer_masks(self, attn_mask, position_ids_BP: torch.Tensor, context_len: int) -> dict:
        """{layer type: mask} from what `forward` was given.

        A dict is taken as it is (`train.attention.build_layer_masks`; a missing type is a KeyError
        in `forward`); None means one block after all of its context (inference), whose per-type
        masks follow from the positions; a single mask is accepted only when every layer is a plain
        full_attention layer, so that a mask built for one rule never reaches layers of another.
        """
        if isinstance(attn_mask, dict):
            return attn_mask
        if attn_mask is None:
            q_pos_BQ = position_ids_BP[:, context_len:]
            return {t: position_mask(q_pos_BQ, position_ids_BP, rule) for t, rule in self._mask_rules.items()}
        assert self._one_mask_fits_all, (
            f"layer types {list(self._mask_rules)} need one mask each (train.attention.build_layer_masks)"
        )
        return {t: attn_mask for t in self._mask_rules}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ----------------------------------------------------------------------------------------------
# The target's frozen embedding and lm_head


class TargetHead(nn.Module):
    """The target's embedding and lm_head, frozen (buffers, so no optimizer or checkpoint sees them).

    `embed` returns what the target's input embedding module returns: the table row times
    `embed_scale` (sqrt(hidden_size) for Gemma, 1 for most families), multiplied in the table's
    dtype as transformers does; the drafter's block embedding is that (docs/serving.md,
    "Embedding and head")."""

    def __init__(self, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor, embed_scale: float = 1.0) -> None:
        super().__init__()
        assert embed_VD.ndim == 2 and lm_head_VD.shape == embed_VD.shape, (embed_VD.shape, lm_head_VD.shape)
        self.register_buffer("embed_VD", embed_VD.detach(), persistent=False)
        # A tied head is the same storage; keep it shared so memory is not doubled.
        self.register_buffer("lm_head_VD", lm_head_VD.detach(), persistent=False)
        self.embed_scale = float(embed_scale)

    @classmethod
    def from_pretrained(
        cls,
        target_dir: str,
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
        stored: StoredHead | None = None,
    ) -> TargetHead:
        """The two tensors the target's accessors reach, read without building the model; `stored`:
        those already read (`target.identity.read_stored_head`), not read again."""
        stored = stored or read_stored_head(target_dir, trust_remote_code)
        if stored is None:
            raise ValueError(
                f"target '{target_dir}' holds no safetensors weights: the embedding and head are read from them"
            )
        embed = stored.embed_VD.to(dtype)
        head = embed if stored.arch.tied else stored.lm_head_VD.to(dtype)
        return cls(embed, head, stored.arch.embed_scale)

    @property
    def vocab_size(self) -> int:
        return self.embed_VD.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_VD.shape[1]

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.embed_VD)
        if self.embed_scale == 1.0:
            return rows
        # The scale rounded to the table's dtype first, as the module does; a Python number, so no device copy.
        return rows * torch.tensor(self.embed_scale, dtype=rows.dtype).item()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits (for small inputs, evaluation and tests; training uses `train.loss`)."""
        return F.linear(hidden.to(self.lm_head_VD.dtype), self.lm_head_VD)
