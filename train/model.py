"""The DFlash drafter (docs/dflash.md "Drafter") and the target's frozen embedding + lm_head.

The drafter is a stack of Qwen3-style decoder layers run over the block tokens only. The target's
tap features of the context are projected once (`fc`, then `hidden_norm`) and injected as extra
keys/values at every layer through that layer's own `k_proj`/`v_proj` (+ `k_norm`, + RoPE at the
context positions). The context never enters the residual stream and is never a query. Each layer
is `full_attention` or `sliding_attention` (`DrafterConfig.layer_types`); the attention rule of
each type is a `train.attention.MaskRule` (`DrafterConfig.mask_rules`).
Parameter names are the published ones (`fc`, `hidden_norm`, `layers.N.…`, `norm`), so a state
dict saves as a z-lab compatible `model.safetensors` with no renaming.

Shape legend (suffixes of tensor names):
    B batch (sequences)          S context length (tokens of the sequence)
    Q block tokens per row (= anchors x block_size)   P = S + Q positions
    D drafter hidden size        F = n_taps x target hidden (tap feature width)
    H query heads   G key/value heads   E head_dim   R rotary dims (<= E)
    V vocabulary    M selected block tokens (loss rows)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from target.identity import StoredHead, read_stored_head
from train.attention import MaskRule, attend, position_mask
from train.layer_types import FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_IN_BLOCK, resolve_layer_types

__all__ = [
    "DrafterConfig",
    "DFlashDrafter",
    "TargetHead",
    "RotaryEmbedding",
    "apply_rotary",
    "rope_settings",
    "target_rope",
]

# rope types whose frequencies depend only on the config (not on the running sequence length).
_STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def rope_settings(target_cfg: dict) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from a config with one rope (a drafter's).

    Reads both spellings: transformers 5 `rope_parameters` and the older top-level `rope_theta` /
    `rope_scaling` / `partial_rotary_factor`. Qwen3.6's M-RoPE (`mrope_section`) is ordinary 1-D
    RoPE for text, where the three position streams are equal, so its M-RoPE keys are dropped.
    A target's rope, in any of transformers' layouts, is read by `target_rope`.
    """
    params = target_cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        params = {}
    theta = target_cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError("config has no rope_theta (neither top level nor rope_parameters)")
    factor = target_cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    scaling = target_cfg.get("rope_scaling")
    if scaling is None:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            drop = {"rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
            scaling = {k: v for k, v in params.items() if k not in drop}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), (dict(scaling) if scaling else None), float(factor if factor is not None else 1.0)


# The drafter's rope theta for a target without rotary embeddings (GPT-2): vLLM's DFlash model sets
# the same when a draft config has none (`set_default_rope_theta(config, default_theta=1000000)`).
DEFAULT_ROPE_THETA = 1e6


def target_rope(target_cfg: dict) -> tuple[float, dict | None, str | None]:
    """(theta, static scaling or None, why it departs from the target or None) for a drafter of this target.

    Every layout transformers writes: top-level `rope_theta` / `rope_scaling`, `rope_parameters`,
    per-layer-type parameters ({"full_attention": {...}, "sliding_attention": {...}}, Gemma 3: the
    full-attention layers' rope, the global one, is taken), scaling types. A scaling that depends on
    the running length (dynamic, longrope) is dropped: the drafter's rope must be a fixed function of
    position. A target without rope gets `DEFAULT_ROPE_THETA`.
    """
    params = target_cfg.get("rope_parameters")
    why = None
    if isinstance(params, dict) and all(isinstance(v, dict) for v in params.values()) and params:
        kind = "full_attention" if "full_attention" in params else sorted(params)[0]
        why = f"the target's rope is per layer type ({', '.join(sorted(params))}): the drafter takes the {kind} one"
        target_cfg = {"rope_parameters": params[kind]}
    if target_cfg.get("rope_theta") is None and (target_cfg.get("rope_parameters") or {}).get("rope_theta") is None:
        return DEFAULT_ROPE_THETA, None, f"the target has no rope theta: the drafter uses {DEFAULT_ROPE_THETA:g}"
    theta, scaling, _ = rope_settings(target_cfg)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in _STATIC_ROPE_TYPES:
        return (
            theta,
            None,
            f"the target's rope scaling {kind!r} depends on the running length: the drafter's is unscaled",
        )
    return theta, scaling, why


@dataclasses.dataclass
class DrafterConfig:
    """The published DFlash config fields (docs/dflash.md "Export format") that define the drafter's shape."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    target_hidden_size: int | None = None  # None = hidden_size (the published drafters)
    layer_types: list[str] | None = None  # one per layer; None = all full_attention
    sliding_window: int | None = None  # keys a sliding_attention query sees, its own position included
    sliding_in_block: str = "causal"  # a sliding layer inside its block: "causal" or "bidirectional"
    # Storage tier: fc reads projected features P·h ({checksum, in_width, out_width} of the dataset's
    # projection, shards/projection.py); the export folds P into fc. None = the taps themselves.
    projection: dict | None = None

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.layer_types = resolve_layer_types(self.layer_types, int(self.num_hidden_layers))
        if self.sliding_window is not None:
            self.sliding_window = int(self.sliding_window)
        self.check()

    def check(self) -> None:
        """ValueError naming the field for a shape that cannot work."""
        positive = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "num_target_layers",
            "block_size",
        )
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"drafter config '{name}' must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"drafter config 'block_size' must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"drafter config 'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
                f"'num_key_value_heads' ({self.num_key_value_heads})"
            )
        if not self.target_layer_ids:
            raise ValueError("drafter config 'target_layer_ids' is empty")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"drafter config 'target_layer_ids' has duplicates: {self.target_layer_ids}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"drafter config 'target_layer_ids' {bad} outside 0..{self.num_target_layers - 1}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"drafter config 'mask_token_id' {self.mask_token_id} outside the vocabulary 0..{self.vocab_size - 1}"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                f"drafter config 'partial_rotary_factor' must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(
                f"drafter config: rotary dims head_dim*partial_rotary_factor = {self.rotary_dim} must be even and >= 2"
            )
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in _STATIC_ROPE_TYPES:
            raise ValueError(
                f"drafter config 'rope_scaling': rope_type {kind!r} is not supported (supported: "
                f"{', '.join(_STATIC_ROPE_TYPES)})"
            )
        if self.projection is not None:
            full = self.n_taps * (self.target_hidden_size or self.hidden_size)
            if (
                not isinstance(self.projection, dict)
                or self.projection.get("in_width") != full
                or not self.projection.get("out_width")
            ):
                raise ValueError(
                    f"drafter config 'projection' must map the {full} tap features (n_taps x target hidden), got "
                    f"{self.projection!r}"
                )
        if self.hidden_act != "silu":
            raise ValueError(f"drafter config 'hidden_act' must be 'silu' (Qwen3 MLP), got {self.hidden_act!r}")
        if self.sliding_in_block not in SLIDING_IN_BLOCK:
            raise ValueError(
                f"drafter config 'sliding_in_block' must be one of {SLIDING_IN_BLOCK}, got {self.sliding_in_block!r}"
            )
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(
                f"drafter config 'sliding_window' must be >= 1 with sliding_attention layers, got {self.sliding_window}"
            )
        if SLIDING_ATTENTION not in self.layer_types and self.sliding_window is not None:
            raise ValueError(
                "drafter config 'sliding_window' is set but no layer is sliding_attention (set layer_types)"
            )

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def mask_rules(self) -> dict[str, MaskRule]:
        """{layer type: the attention rule of that type's layers} for the types this drafter has."""
        rules = {FULL_ATTENTION: MaskRule()}
        rules[SLIDING_ATTENTION] = MaskRule(window=self.sliding_window, causal=self.sliding_in_block == "causal")
        return {t: rules[t] for t in dict.fromkeys(self.layer_types)}

    @property
    def layer_causal(self) -> list[bool]:
        """Per layer: is the layer causal inside its block (what serving engines call `causal`)."""
        rules = self.mask_rules
        return [rules[t].causal for t in self.layer_types]

    @property
    def feature_width(self) -> int:
        """F: the width of one token's stored tap features (of the projected ones, with a projection)."""
        if self.projection is not None:
            return int(self.projection["out_width"])
        return self.n_taps * (self.target_hidden_size or self.hidden_size)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_target(
        cls,
        target_cfg: dict,
        layer_ids: list[int],
        *,
        num_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int,
        **widths: Any,
    ) -> "DrafterConfig":
        """A drafter for a target text config: the target's widths and rope unless `widths` override them.

        `widths` may set hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
        head_dim, initializer_range, layer_types (a list or a preset name), sliding_window,
        sliding_in_block, rope_theta, rope_scaling, partial_rotary_factor (None values are
        ignored). A hidden size other than the target's is allowed: `fc` then maps n_taps x target
        hidden -> drafter hidden, but the frozen embedding and lm_head are the target's, so they
        must match the drafter's width.

        Rope: the target's theta and (static) scaling (`target_rope`), but rotary over the whole head
        (partial_rotary_factor 1.0) unless `widths` says otherwise: the drafter's heads are its
        own, SGLang rotates every head dim of a DFlash drafter whatever its config says, and the
        published Qwen3.6 drafter rotates all of them too (docs/serving.md, "Rope"). The MLP is
        SiLU whatever the target's activation: the drafter is a Qwen3 stack of its own, and SGLang's
        DFlash model refuses any other (docs/serving.md). `target_cfg` has the canonical key
        spellings (`target.checkpoint.text_config`); a target without `intermediate_size` (GPT-2)
        gets 4 x hidden.
        """
        theta, scaling, _ = target_rope(target_cfg)
        hidden = int(target_cfg["hidden_size"])
        heads = int(target_cfg["num_attention_heads"])
        values = dict(
            hidden_size=hidden,
            intermediate_size=int(target_cfg.get("intermediate_size") or 4 * hidden),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(target_cfg.get("num_key_value_heads") or heads),
            head_dim=int(target_cfg.get("head_dim") or hidden // heads),
            vocab_size=int(target_cfg["vocab_size"]),
            target_layer_ids=list(layer_ids),
            num_target_layers=int(target_cfg["num_hidden_layers"]),
            mask_token_id=int(mask_token_id),
            block_size=block_size,
            rms_norm_eps=float(target_cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=1.0,
            max_position_embeddings=int(target_cfg.get("max_position_embeddings") or 40960),
            hidden_act="silu",
            initializer_range=float(target_cfg.get("initializer_range") or 0.02),
        )
        values.update({k: v for k, v in widths.items() if v is not None})
        if values["hidden_size"] != hidden:
            values["target_hidden_size"] = hidden
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


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

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
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
        for layer, layer_type in zip(self.layers, self.config.layer_types):
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
    ) -> "TargetHead":
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
