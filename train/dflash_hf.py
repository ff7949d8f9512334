"""DFlash block-diffusion draft model for Hugging Face transformers (the `dflash.py` of an export).

This file is copied verbatim into every exported drafter directory as `dflash.py`, next to a
`config.json` whose `auto_map` is {"AutoModel": "dflash.DFlashDraftModel"}, so that

    drafter = AutoModel.from_pretrained(export_dir, trust_remote_code=True)

builds it. It imports only torch and transformers (never the training package).

What the model computes (DFlash, arXiv 2602.06036; the same semantics as the training model):

    c = hidden_norm(fc(target_hidden))          projected target context: one row per context token
    h = noise_embedding                         the target's embedding of the block [last verified token, MASK x (B-1)]
    every layer:  x = input_layernorm(h)
                  q = rope(q_norm(q_proj(x)))                    block queries only
                  k = rope(k_norm(k_proj([c | x])))             context keys and block keys, same weights
                  v = v_proj([c | x])
                  h = h + o_proj(attention(q, k, v))            no causal mask: the block is bidirectional
                  h = h + mlp(post_attention_layernorm(h))
    out = norm(h)                               logits = the target's lm_head(out); block position k predicts token anchor+k

The context enters every layer only as extra keys/values (never as queries, never in the residual
stream). RoPE uses absolute positions: context token j at j, the block anchored at a at a..a+B-1;
with a partial rotary factor only the first head_dim*factor dims of each head rotate.

Serving (one round; see `forward`): pass the new context features (target taps of the positions
not yet in the draft cache), the block embedding, and position ids covering [cached length, anchor +
B); with a `transformers.DynamicCache` as `past_key_values` the context K/V are kept across rounds.
After the call, `crop` the cache to the anchor position so that it holds only context entries.

Weights: `fc`, `hidden_norm`, `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`. No embedding and no lm_head: those are
the target's.

Shape legend: B batch, S new context tokens, Q block tokens, P = S + Q, K = all keys (cached + P),
D hidden, F = n_taps x target hidden, H query heads, G kv heads, E head dim, R rotary dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

__all__ = ["DFlashDraftModel", "dflash_setting", "rope_settings", "extract_context_feature"]

SUPPORTED_LAYER_TYPES = ("full_attention",)
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def dflash_setting(config, name: str, default=None):
    """A DFlash field from `config.dflash_config`, else from the top level (both spellings are published)."""
    nested = getattr(config, "dflash_config", None) or {}
    if name in nested and nested[name] is not None:
        return nested[name]
    value = getattr(config, name, None)
    return default if value is None else value


def rope_settings(config) -> tuple[float, dict | None, float]:
    """(rope_theta, scaling parameters or None, partial_rotary_factor) from a config object.

    transformers 5 folds rope_theta / rope_scaling / partial_rotary_factor into `rope_parameters`;
    older versions keep them at the top level. Both are read.
    """
    params = getattr(config, "rope_parameters", None)
    params = dict(params) if isinstance(params, dict) else {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("DFlash config has no rope_theta (neither in rope_parameters nor at the top level)")
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    scaling = getattr(config, "rope_scaling", None)
    if not isinstance(scaling, dict) or not scaling:
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        scaling = None
    return float(theta), (dict(scaling) if scaling else None), float(1.0 if factor is None else factor)


def extract_context_feature(hidden_states, layer_ids) -> torch.Tensor:
    """Tap features from `output_hidden_states`: id i is the output of decoder layer i = hidden_states[i + 1]."""
    return torch.cat([hidden_states[layer_id + 1] for layer_id in layer_ids], dim=-1)


class DFlashRMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalize in float32, cast back, scale by `weight`."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DFlashRotaryEmbedding(nn.Module):
    """cos/sin [B, P, R] at absolute positions; inverse frequencies computed once per device.

    No buffer on purpose: a non-persistent buffer built in __init__ would be created on the meta
    device by `from_pretrained` and need special re-initialization; this stays correct anywhere.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.theta, self.scaling, self.partial_factor = rope_settings(config)
        self.rotary_dim = int(config.head_dim * self.partial_factor)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"DFlash config: head_dim * partial_rotary_factor = {self.rotary_dim} must be even and >= 2")
        kind = (self.scaling or {}).get("rope_type", (self.scaling or {}).get("type", "default"))
        if kind not in STATIC_ROPE_TYPES:
            raise ValueError(f"DFlash config: rope_type {kind!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)})")
        self._cache: dict = {}

    def _inv_freq(self, device: torch.device) -> tuple[torch.Tensor, float]:
        key = str(device)
        if key not in self._cache:
            self._cache[key] = self._compute_inv_freq(device)
        return self._cache[key]

    def _compute_inv_freq(self, device: torch.device) -> tuple[torch.Tensor, float]:
        dim = self.rotary_dim
        if self.scaling is None:
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            return (1.0 / (self.theta ** exponents)).to(device), 1.0
        # Scaled RoPE: transformers' own formulas, which serving engines follow too.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = dict(self.scaling)
        kind = params.pop("rope_type", params.pop("type", "default"))
        params.update(rope_type=kind, rope_theta=self.theta, partial_rotary_factor=self.partial_factor)
        shim = Qwen3Config(
            hidden_size=self.config.hidden_size, num_attention_heads=self.config.num_attention_heads,
            head_dim=self.config.head_dim, max_position_embeddings=self.config.max_position_embeddings,
            rope_parameters=params,
        )
        inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](shim, None)
        assert inv_freq.numel() * 2 == dim, (inv_freq.shape, dim)
        return inv_freq.float().to(device), float(scale)

    def forward(self, position_ids_BP: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = self._inv_freq(position_ids_BP.device)
        freqs_BPh = position_ids_BP[..., None].float() * inv_freq
        angles_BPR = torch.cat((freqs_BPh, freqs_BPh), dim=-1)
        return (angles_BPR.cos() * scale).to(dtype), (angles_BPR.sin() * scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x_BhTE: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of every head; the remaining dims pass through unchanged."""
    rot = cos_BTR.shape[-1]
    cos, sin = cos_BTR[:, None], sin_BTR[:, None]
    if rot == x_BhTE.shape[-1]:
        return x_BhTE * cos + _rotate_half(x_BhTE) * sin
    x_rot, x_pass = x_BhTE[..., :rot], x_BhTE[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def _attention(q_BHQE: torch.Tensor, k_BGKE: torch.Tensor, v_BGKE: torch.Tensor, mask) -> torch.Tensor:
    """SDPA over [context | block] keys with GQA. `mask`: None (all visible), bool [B, 1, Q, K] (True =
    may attend) or additive float. A query row with no visible key outputs 0 (padding blocks)."""
    groups = q_BHQE.shape[1] // k_BGKE.shape[1]
    if groups > 1:
        k_BGKE = k_BGKE.repeat_interleave(groups, dim=1)
        v_BGKE = v_BGKE.repeat_interleave(groups, dim=1)
    if mask is None or mask.dtype != torch.bool:
        return F.scaled_dot_product_attention(q_BHQE, k_BGKE, v_BGKE, attn_mask=mask)
    # A fully masked row would softmax to NaN; let it see everything and zero its output instead.
    empty_B1Q1 = ~mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q_BHQE, k_BGKE, v_BGKE, attn_mask=mask | empty_B1Q1)
    return out.masked_fill(empty_B1Q1, 0.0)


class DFlashMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """GQA with per-head q/k RMSNorm; keys/values are [projected context | block tokens]."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x_BQD, context_BSD, cos_BPR, sin_BPR, attention_mask, past_key_values) -> torch.Tensor:
        B, Q, _ = x_BQD.shape
        S = context_BSD.shape[1]
        kv_in_BPD = torch.cat((context_BSD.to(x_BQD.dtype), x_BQD), dim=1) if S else x_BQD
        q_BHQE = self.q_norm(self.q_proj(x_BQD).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        k_BGPE = self.k_norm(self.k_proj(kv_in_BPD).view(B, S + Q, self.kv_heads, self.head_dim)).transpose(1, 2)
        v_BGPE = self.v_proj(kv_in_BPD).view(B, S + Q, self.kv_heads, self.head_dim).transpose(1, 2)
        q_BHQE = apply_rotary(q_BHQE, cos_BPR[:, S:], sin_BPR[:, S:])
        k_BGPE = apply_rotary(k_BGPE, cos_BPR, sin_BPR)
        # The fp32 norm weights may promote q/k; attend in the dtype of the rotary tables.
        dtype = cos_BPR.dtype
        q_BHQE, k_BGPE, v_BGPE = q_BHQE.to(dtype), k_BGPE.to(dtype), v_BGPE.to(dtype)
        if past_key_values is not None:
            # Appends this call's context and block K/V; the caller crops the block entries away.
            k_BGKE, v_BGKE = past_key_values.update(k_BGPE, v_BGPE, self.layer_idx)
        else:
            k_BGKE, v_BGKE = k_BGPE, v_BGPE
        out_BHQE = _attention(q_BHQE, k_BGKE, v_BGKE, attention_mask)
        return self.o_proj(out_BHQE.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, h_BQD, context_BSD, cos_BPR, sin_BPR, attention_mask, past_key_values) -> torch.Tensor:
        # The context is not normed here: hidden_norm normed it once, for every layer.
        attn = self.self_attn(self.input_layernorm(h_BQD), context_BSD, cos_BPR, sin_BPR, attention_mask, past_key_values)
        h_BQD = h_BQD + attn
        return h_BQD + self.mlp(self.post_attention_layernorm(h_BQD))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter. `forward(...)` returns the final-normed hidden states of the block tokens."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config) -> None:
        super().__init__(config)
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
        if unsupported:
            raise ValueError(f"DFlash config: layer_types {unsupported} are not supported by this model file (only full_attention)")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"DFlash config: hidden_act must be 'silu', got {config.hidden_act!r}")
        self.target_layer_ids = [int(i) for i in dflash_setting(config, "target_layer_ids")]
        self.mask_token_id = int(dflash_setting(config, "mask_token_id"))
        self.block_size = int(dflash_setting(config, "block_size", 16))
        target_hidden = int(getattr(config, "target_hidden_size", None) or config.hidden_size)
        self.fc = nn.Linear(len(self.target_layer_ids) * target_hidden, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Hidden states [B, Q, D] of the Q block tokens (apply the target's lm_head for logits).

        position_ids [B, S + Q]: positions of the S new context tokens, then of the block tokens.
        noise_embedding [B, Q, D]: the target's input embedding of the block ids.
        target_hidden [B, S, F]: tap features of the S new context tokens (S may be 0).
        attention_mask: None at inference (the block sees all context and itself); for several
            blocks at once (offline evaluation) a bool [B, 1, Q, cached + S + Q], True = may attend.
        past_key_values: a `transformers.DynamicCache` (or anything with `update(k, v, layer_idx)`)
            holding earlier context K/V; this call appends its own context and block entries.
            `cache=` is accepted too (the transformers 5 spelling).
        use_cache: accepted for the published call signature; a cache that is passed is always used.
        """
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel.forward needs noise_embedding and target_hidden")
        if past_key_values is None:
            past_key_values = kwargs.get("cache")
        B, Q, _ = noise_embedding.shape
        S = target_hidden.shape[1]
        if tuple(position_ids.shape) != (B, S + Q):
            raise ValueError(f"position_ids must be [B, S + Q] = [{B}, {S + Q}] (new context then block), got {tuple(position_ids.shape)}")
        weight_dtype = self.fc.weight.dtype
        context_BSD = self.hidden_norm(self.fc(target_hidden.to(weight_dtype)))
        h_BQD = noise_embedding.to(weight_dtype)
        cos_BPR, sin_BPR = self.rotary_emb(position_ids, weight_dtype)
        for layer in self.layers:
            h_BQD = layer(h_BQD, context_BSD, cos_BPR, sin_BPR, attention_mask, past_key_values)
        return self.norm(h_BQD)
