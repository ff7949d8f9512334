"""DFlash block-diffusion draft model for Hugging Face transformers (the `dflash.py` of an export).

This file is copied verbatim into every exported drafter directory as `dflash.py`, next to a
`config.json` whose `auto_map` is {"AutoModel": "dflash.DFlashDraftModel"}, so that

    drafter = AutoModel.from_pretrained(export_dir, trust_remote_code=True)

builds it. It imports only torch and transformers (never the training package).

What the model computes (DFlash, arXiv 2602.06036; the same semantics as the training model):

    c = hidden_norm(fc(target_hidden))          projected target context: one row per context token
    h = noise_embedding                         the target's embedding of the block [last verified token, MASK x (B-1)]:
                                                what its input embedding module returns (Gemma's scales by sqrt(hidden))
    every layer:  x = input_layernorm(h)
                  q = rope(q_norm(q_proj(x)))                    block queries only
                  k = rope(k_norm(k_proj([c | x])))             context keys and block keys, same weights
                  v = v_proj([c | x])
                  h = h + o_proj(attention(q, k, v))            per layer type, see below
                  h = h + mlp(post_attention_layernorm(h))
    out = norm(h)                               logits = the target's lm_head(out); block position k predicts token anchor+k

The context enters every layer only as extra keys/values (never as queries, never in the residual
stream). RoPE uses absolute positions: context token j at j, the block anchored at a at a..a+B-1;
with a partial rotary factor only the first head_dim*factor dims of each head rotate.

Attention per layer (`layer_attention`, read as vLLM and z-lab read it): a `full_attention` layer sees
all the context and its whole block (bidirectional); a `sliding_attention` layer sees the keys less
than `sliding_window` positions back, and is causal inside the block unless the config says
otherwise (`is_causal`, then `dflash_config.causal`, override every layer; a non-causal window is
symmetric). `config.json` of an export states the per-layer result in `dflash_config.layer_causal`.

Quick start (z-lab's README, unchanged): `drafter.spec_generate(input_ids=ids, max_new_tokens=N,
temperature=0.0, target=target, stop_token_ids=[eos])` returns the prompt and the continuation,
which at temperature 0 is the target's own greedy continuation.

Serving (one round; see `forward`): pass the new context features (target taps of the positions
not yet in the draft cache), the block embedding, and position ids covering [cached length, anchor +
B); with a `transformers.DynamicCache` as `past_key_values` the context K/V are kept across rounds.
After the call, `crop` the cache to the anchor position so that it holds only context entries.

Weights: `fc`, `hidden_norm`, `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`. No embedding and no lm_head: those are
the target's.

DFlash2 (`DFlash2DraftModel`, config `architectures: ["DFlash2DraftModel"]`; the published layout of
z-lab's and Inco AI's DFlash2 drafters): every layer also wraps its attention and its MLP in a grouped
dynamic two-tap block convolution (`attention_conv`, `mlp_conv`: `base_kernel` [2, T, D],
`kernel_projection` D -> 2*T*D/g), on the normed sublayer input and on the sublayer output before the
residual add,

    y[i] = sum_t (base[side, t] + dyn[i, side, t, group]) * x[i - t]      (x before the block's first row = 0)

with dyn = kernel_projection(normed input), over the rows of each block only; and a
`candidate_selector` (`predecessor_codebook`, `successor_codebook` [V, r], `hidden_projection` D -> r)
that re-ranks the top `selector_top_k` candidates b of the target head's logits U_j at each block
position j given the previous token a (the anchor at j = 1, then the previous choice):

    S_j(a, b) = U_j(b) + < predecessor_codebook[a] * hidden_projection(h_j), successor_codebook[b] >

`propose` walks the block greedily (argmax_b S_j(a, b), a <- the choice), or samples from
softmax(S_j(a, .) / T) over the candidates. Fields: `dflash_config.{conv_kernel_size, conv_group_size,
selector_rank, selector_top_k}` (required), `output_multiplier` and `final_logit_softcapping` (applied
to U, optional). Block embedding, both classes: with `dflash_config.input_embedding_scale` the raw
embedding table row times it (z-lab's newer loop), without it what the target's embedding module returns.

Shape legend: B batch, S new context tokens, Q block tokens, P = S + Q, K = all keys (cached + P),
D hidden, F = n_taps x target hidden, H query heads, G kv heads, E head dim, R rotary dims.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

__all__ = [
    "DFlashDraftModel", "DFlash2DraftModel", "dflash_setting", "rope_settings", "extract_context_feature",
    "layer_attention",
]

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
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


def layer_attention(config) -> list[tuple[int | None, bool]]:
    """(sliding window or None, causal inside the block) per layer.

    Causality: top-level `is_causal`, else `dflash_config.causal`, else causal exactly for
    sliding_attention layers (vLLM's `_dflash_layer_causal`). Window: `dflash_config.swa_window_size`,
    else `sliding_window`, for sliding_attention layers only.
    """
    n = int(config.num_hidden_layers)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported or len(layer_types) != n:
        raise ValueError(f"DFlash config: layer_types {layer_types} must be {n} entries of {SUPPORTED_LAYER_TYPES}")
    nested = getattr(config, "dflash_config", None) or {}
    override = getattr(config, "is_causal", None)
    override = nested.get("causal") if override is None else override
    window = None
    if "sliding_attention" in layer_types:
        top, swa = getattr(config, "sliding_window", None), nested.get("swa_window_size")
        if top is not None and swa is not None and int(top) != int(swa):
            raise ValueError(f"DFlash config: sliding_window {top} and dflash_config.swa_window_size {swa} disagree")
        window = swa if swa is not None else top
        if window is None:
            raise ValueError("DFlash config: sliding_attention layers need sliding_window (and use_sliding_window true)")
        window = int(window)
    return [(window if t == "sliding_attention" else None, bool(override) if override is not None else t == "sliding_attention")
            for t in layer_types]


def position_mask(q_pos_BQ: torch.Tensor, kv_pos_BK: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor | None:
    """Bool [B, 1, Q, K] (True = may attend) of one block after its context, or None if nothing is hidden."""
    if window is None and not causal:
        return None
    ahead_BQK = kv_pos_BK[:, None, :] - q_pos_BQ[:, :, None]
    visible_BQK = torch.ones_like(ahead_BQK, dtype=torch.bool)
    if causal:
        visible_BQK &= ahead_BQK <= 0
    if window is not None:
        visible_BQK &= -ahead_BQK < window
        if not causal:
            visible_BQK &= ahead_BQK < window
    return visible_BQK[:, None]


class _OneBlockMask:
    """The mask of one block after its context (`position_mask`), made once a layer's keys are known.

    A layer attends over the keys its cache hands back followed by this call's P = S + Q new ones.
    The cached keys are always the latest positions before the new context: all of them for a plain
    `DynamicCache`, the last `sliding_window - 1` (or fewer) for the sliding layers of a
    `DynamicCache(config=...)`; so with K keys the cached ones sit at first - (K - P) .. first - 1,
    where first is the position of the first new context token."""

    def __init__(self, position_ids_BP: torch.Tensor, S: int, rule: tuple[int | None, bool]):
        self.position_ids_BP, self.q_pos_BQ, self.rule = position_ids_BP, position_ids_BP[:, S:], rule
        self._by_keys: dict[int, torch.Tensor | None] = {}

    def for_keys(self, K: int) -> torch.Tensor | None:
        if K not in self._by_keys:
            cached = K - self.position_ids_BP.shape[1]
            if cached < 0:
                raise ValueError(f"the cache returned {K} keys, fewer than the {self.position_ids_BP.shape[1]} new ones")
            offsets = torch.arange(-cached, 0, device=self.position_ids_BP.device)
            cached_BC = self.position_ids_BP[:, :1] + offsets[None]
            kv_pos_BK = torch.cat((cached_BC, self.position_ids_BP), dim=1)
            self._by_keys[K] = position_mask(self.q_pos_BQ, kv_pos_BK, *self.rule)
        return self._by_keys[K]


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
        if isinstance(attention_mask, _OneBlockMask):
            attention_mask = attention_mask.for_keys(k_BGKE.shape[-2])
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
    layer_class = DFlashDecoderLayer

    def __init__(self, config) -> None:
        super().__init__(config)
        self.layer_attention = layer_attention(config)
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"DFlash config: hidden_act must be 'silu', got {config.hidden_act!r}")
        self.target_layer_ids = [int(i) for i in dflash_setting(config, "target_layer_ids")]
        self.mask_token_id = int(dflash_setting(config, "mask_token_id"))
        self.block_size = int(dflash_setting(config, "block_size", 16))
        target_hidden = int(getattr(config, "target_hidden_size", None) or config.hidden_size)
        self.fc = nn.Linear(len(self.target_layer_ids) * target_hidden, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
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
        attention_mask: None at inference (one block after all its context: each layer applies its
            own window and causality from the positions, cached keys at positions 0..cached-1);
            for several blocks at once (offline evaluation) {layer type: bool [B, 1, Q, cached + S + Q]}
            (True = may attend), or one such mask for every layer.
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
        masks = self._layer_masks(attention_mask, position_ids, S, past_key_values)
        for layer, mask in zip(self.layers, masks):
            h_BQD = layer(h_BQD, context_BSD, cos_BPR, sin_BPR, mask, past_key_values)
        return self.norm(h_BQD)

    def _layer_masks(self, attention_mask, position_ids: torch.Tensor, S: int, past_key_values) -> list:
        if isinstance(attention_mask, dict):
            return [attention_mask[t] for t in self.layer_types]
        if attention_mask is not None:
            return [attention_mask] * len(self.layers)
        # Built per layer once its keys are known: a cache may keep fewer than it has seen (the sliding
        # layers of `DynamicCache(config=...)` keep the last sliding_window - 1, as z-lab's loop makes them).
        by_rule: dict = {}
        for rule in self.layer_attention:
            if rule not in by_rule:
                by_rule[rule] = None if rule == (None, False) else _OneBlockMask(position_ids, S, rule)
        return [by_rule[rule] for rule in self.layer_attention]

    def compute_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits of drafted positions: the target's output head (`lm_head`) on `forward`'s hidden
        states (z-lab's `dflash_generate` calls this with the target's head), times
        `dflash_config.output_multiplier` and soft-capped by `final_logit_softcapping` where given."""
        logits = lm_head(hidden_states.to(lm_head.weight.dtype))
        multiplier = float(dflash_setting(self.config, "output_multiplier", 1.0))
        if multiplier != 1.0:
            logits = logits * multiplier
        cap = float(dflash_setting(self.config, "final_logit_softcapping", 0.0))
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    @property
    def attention_rules(self) -> dict[str, tuple[int | None, bool]]:
        """{layer type: (window, causal)} for building many-block masks (train.attention.MaskRule)."""
        return dict(zip(self.layer_types, self.layer_attention))

    # ------------------------------------------------------------------------------------------
    # z-lab's quick start: speculative generation with a Hugging Face target

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> torch.LongTensor:
        """[1, prompt + generated] token ids: the prompt, then up to `max_new_tokens` tokens, cut after
        the first stop token. The call of z-lab's README (`model.spec_generate(input_ids=...,
        max_new_tokens=..., temperature=..., target=..., stop_token_ids=[...])`).

        Each round: the drafter proposes block positions 1..B-1 from the target's tap features, the
        target verifies the block in one forward, the longest agreeing prefix plus the target's own
        next token is kept. Temperature 0 keeps exactly the target's greedy tokens; above 0 drafts
        are accepted by speculative (rejection) sampling, which keeps the target's distribution.
        `self.last_acceptance_lengths` holds the tokens each round added (its τ; the last round's is cut
        at the stop token or the budget, as in z-lab's `dflash_generate`).
        """
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate takes one prompt: input_ids [1, T], got {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"spec_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError("spec_generate: temperature and top_k must be >= 0 and top_p in (0, 1]")
        self.eval()
        session = _SpecSession(self, target, temperature, top_p, top_k)
        prompt = input_ids.to(session.device)
        stops = set(int(t) for t in (stop_token_ids or []))
        logits_1TV, features_1TF = session.target_forward(prompt)
        tokens = [session.sample(logits_1TV[:, -1])[0]]
        new_features_1SF, rounds = features_1TF, []
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            anchor_pos = prompt.shape[1] + len(tokens) - 1
            committed, new_features_1SF = session.round(tokens[-1], anchor_pos, new_features_1SF)
            kept = 0
            for token in committed[: max_new_tokens - len(tokens)]:
                tokens.append(token)
                kept += 1
                if token in stops:
                    break
            rounds.append(kept)
        self.last_acceptance_lengths = rounds
        return torch.cat((prompt, torch.tensor([tokens], dtype=prompt.dtype, device=prompt.device)), dim=1)


# ----------------------------------------------------------------------------------------------
# DFlash2: a block convolution around every sublayer and a candidate selector (module docstring)


def _conv_block(Q: int, block_size: int) -> int:
    """Rows of one block in a call of Q block rows: whole blocks, or one block cut short by the token budget."""
    if Q % block_size and Q > block_size:
        raise ValueError(f"DFlash2: {Q} block rows are neither whole blocks of {block_size} nor one shorter block")
    return block_size if Q % block_size == 0 else Q


def block_convolve(x_BQD: torch.Tensor, dyn_BQTG: torch.Tensor, base_TD: torch.Tensor, block: int) -> torch.Tensor:
    """sum_t (base[t] + dyn[:, :, t] per group) * (x shifted by t rows inside each block of `block` rows)."""
    B, Q, D = x_BQD.shape
    T, G = base_TD.shape[0], dyn_BQTG.shape[-1]
    x_BNKGg = x_BQD.view(B, Q // block, block, G, D // G)
    dyn_BNKTGx = dyn_BQTG.view(B, Q // block, block, T, G, 1)
    out = None
    for t in range(T):
        shifted = x_BNKGg if t == 0 else F.pad(x_BNKGg[:, :, :-t], (0, 0, 0, 0, t, 0))
        term = (base_TD[t].view(G, D // G).to(x_BQD.dtype) + dyn_BNKTGx[:, :, :, t]) * shifted
        out = term if out is None else out + term
    return out.view(B, Q, D)


class DFlash2GroupedConv(nn.Module):
    """The two convolutions around one sublayer: `prepare` (input side) and `finish` (output side)."""

    def __init__(self, width: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if kernel_size < 1 or group_size < 1 or width % group_size:
            raise ValueError(f"DFlash2 config: conv_group_size {group_size} must divide hidden_size {width}, "
                             f"conv_kernel_size {kernel_size} must be >= 1")
        self.kernel_size, self.groups = kernel_size, width // group_size
        base = torch.zeros(2, kernel_size, width)
        base[:, 0] = 1.0  # the identity until weights are loaded
        self.base_kernel = nn.Parameter(base)  # [side, tap, channel]
        self.kernel_projection = nn.Linear(width, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x_BQD: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, Q, _ = x_BQD.shape
        dyn_BQSTG = self.kernel_projection(x_BQD).view(B, Q, 2, self.kernel_size, self.groups)
        return block_convolve(x_BQD, dyn_BQSTG[:, :, 0], self.base_kernel[0], block), dyn_BQSTG[:, :, 1]

    def finish(self, x_BQD: torch.Tensor, dyn_BQTG: torch.Tensor, block: int) -> torch.Tensor:
        return block_convolve(x_BQD, dyn_BQTG, self.base_kernel[1], block)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        kernel, group = int(dflash_setting(config, "conv_kernel_size")), int(dflash_setting(config, "conv_group_size"))
        self.attention_conv = DFlash2GroupedConv(config.hidden_size, kernel, group)
        self.mlp_conv = DFlash2GroupedConv(config.hidden_size, kernel, group)
        self.block_size = int(dflash_setting(config, "block_size", 16))

    def forward(self, h_BQD, context_BSD, cos_BPR, sin_BPR, attention_mask, past_key_values) -> torch.Tensor:
        block = _conv_block(h_BQD.shape[1], self.block_size)
        x_BQD, dyn = self.attention_conv.prepare(self.input_layernorm(h_BQD), block)
        attn = self.self_attn(x_BQD, context_BSD, cos_BPR, sin_BPR, attention_mask, past_key_values)
        h_BQD = h_BQD + self.attention_conv.finish(attn, dyn, block)
        x_BQD, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(h_BQD), block)
        return h_BQD + self.mlp_conv.finish(self.mlp(x_BQD), dyn, block)


class DFlash2CandidateSelector(nn.Module):
    """S_j(a, b) over the top-k candidates b of each block position, given the previous token a."""

    def __init__(self, config) -> None:
        super().__init__()
        rank, self.top_k = int(dflash_setting(config, "selector_rank")), int(dflash_setting(config, "selector_top_k"))
        if rank < 1 or not 1 <= self.top_k <= config.vocab_size:
            raise ValueError(f"DFlash2 config: selector_rank {rank} must be >= 1 and selector_top_k {self.top_k} "
                             f"in 1..vocab_size")
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def scores(self, hidden_MD, unary_Mk, candidates_Mk, predecessor_M) -> torch.Tensor:
        """S(a, b) [M, k] in float32 for each row's predecessor a and candidates b."""
        dtype = self.successor_codebook.dtype
        gate_Mr = self.predecessor_codebook[predecessor_M] * self.hidden_projection(hidden_MD.to(dtype))
        pair_Mk = torch.einsum("mr,mkr->mk", gate_Mr, self.successor_codebook[candidates_Mk])
        return unary_Mk.float() + pair_Mk.float()

    def select(self, hidden_BLD, logits_BLV, anchor_B, temperature: float = 0.0):
        """(tokens [B, L], candidates [B, L, k], q [B, L, k] or None): position by position, the best (or
        a sampled) candidate after the previous choice; q = softmax(S / temperature) over the candidates."""
        unary_BLk, candidates_BLk = logits_BLV.float().topk(self.top_k, dim=-1)
        chosen, q_rows, previous_B = [], [], anchor_B
        for j in range(hidden_BLD.shape[1]):
            scores_Bk = self.scores(hidden_BLD[:, j], unary_BLk[:, j], candidates_BLk[:, j], previous_B)
            if temperature > 0:
                q_rows.append(torch.softmax(scores_Bk / temperature, dim=-1))
                index_B = torch.multinomial(q_rows[-1], 1)[:, 0]
            else:
                index_B = scores_Bk.argmax(-1)
            previous_B = candidates_BLk[:, j].gather(1, index_B[:, None])[:, 0]
            chosen.append(previous_B)
        return torch.stack(chosen, dim=1), candidates_BLk, torch.stack(q_rows, dim=1) if q_rows else None


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash2 drafter: `forward` as DFlash's; `propose` drafts through the candidate selector."""

    _no_split_modules = ["DFlash2DecoderLayer"]
    layer_class = DFlash2DecoderLayer

    def __init__(self, config) -> None:
        super().__init__(config)
        self.candidate_selector = DFlash2CandidateSelector(config)
        self.post_init()

    @torch.no_grad()
    def propose(self, hidden_states, anchor_ids, lm_head: nn.Module, temperature: float = 0.0):
        """(draft tokens [B, L], candidates [B, L, k], q [B, L, k] or None) for block positions 1..L from
        their hidden states [B, L, D] (`forward`'s rows after the anchor), the anchor tokens [B] and the
        target's head (z-lab's `DFlash2DraftModel.propose`)."""
        logits = self.compute_logits(hidden_states, lm_head)
        return self.candidate_selector.select(hidden_states, logits, anchor_ids, temperature)


class _SpecSession:
    """The state of one `spec_generate` call: the target's cache, the drafter's context cache."""

    def __init__(self, drafter: DFlashDraftModel, target: nn.Module, temperature: float, top_p: float, top_k: int):
        from transformers import DynamicCache

        self.drafter, self.target = drafter, target
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        module = target.get_input_embeddings()
        scale = dflash_setting(drafter.config, "input_embedding_scale")
        # The block embedding the drafter was made for: the raw table times the stated scale, else the module's.
        self.embed = module if scale is None else (lambda ids: F.embedding(ids, module.weight) * float(scale))
        self.head = getattr(target, "lm_head", None)
        if self.head is None:
            self.head = target.get_output_embeddings()
        self.device = module.weight.device
        # transformers 5.2x renamed the forward argument `past_key_values` to `cache`.
        self.cache_kwarg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        self.cache = None  # the target makes the cache its layers need (hybrid models: recurrent states too)
        self.draft_cache = DynamicCache()

    def target_forward(self, ids_1T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [1, T, V] float32, tap features [1, T, F]) of the next tokens, through the cache."""
        cached = self.cache.get_seq_length() if self.cache is not None else 0
        positions = torch.arange(cached, cached + ids_1T.shape[1], device=self.device)[None]
        out = self.target(input_ids=ids_1T, position_ids=positions, use_cache=True, output_hidden_states=True,
                          **{self.cache_kwarg: self.cache})
        returned = getattr(out, "cache", None)
        self.cache = returned if returned is not None else getattr(out, "past_key_values", None)
        return out.logits.float(), extract_context_feature(out.hidden_states, self.drafter.target_layer_ids)

    def probabilities(self, logits_NV: torch.Tensor) -> torch.Tensor:
        scores = logits_NV.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def sample(self, logits_NV: torch.Tensor) -> list[int]:
        if self.temperature == 0:
            return logits_NV.argmax(-1).tolist()
        return torch.multinomial(self.probabilities(logits_NV), 1)[:, 0].tolist()

    def round(self, anchor: int, anchor_pos: int, new_features_1SF: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """(tokens committed: accepted drafts + one target token, tap features of the verified positions)."""
        B = self.drafter.block_size
        block_1Q = torch.full((1, B), self.drafter.mask_token_id, dtype=torch.long, device=self.device)
        block_1Q[0, 0] = anchor
        first = self.draft_cache.get_seq_length()
        hidden_1QD = self.drafter(
            position_ids=torch.arange(first, anchor_pos + B, device=self.device)[None],
            noise_embedding=self.embed(block_1Q), target_hidden=new_features_1SF.to(self.device),
            past_key_values=self.draft_cache, use_cache=True,
        )
        _crop(self.draft_cache, anchor_pos)  # keep context entries only
        drafts, q_DV = self.draft(hidden_1QD[:, 1:], anchor)
        block_1Q[0, 1:] = torch.tensor(drafts, device=self.device)
        snapshot = None if _croppable(self.cache) else copy.deepcopy(self.cache)
        logits_1QV, features_1QF = self.target_forward(block_1Q)
        accepted, bonus = self.accept(drafts, q_DV, logits_1QV[0])
        keep = anchor_pos + 1 + accepted  # positions up to the last accepted draft are verified
        if snapshot is None:
            _crop(self.cache, keep)
        elif accepted < B - 1:  # a recurrent cache cannot be cut back: restore it and re-run the accepted tokens
            self.cache = snapshot
            _, features_1QF = self.target_forward(block_1Q[:, : accepted + 1])
        return drafts[:accepted] + [bonus], features_1QF[:, : accepted + 1]

    def draft(self, hidden_1DH: torch.Tensor, anchor: int) -> tuple[list[int], torch.Tensor | None]:
        """(draft tokens of block positions 1..B-1, the distribution [B-1, V] they were sampled from, None
        at temperature 0): DFlash's from its logits, DFlash2's from its selector over the candidates."""
        if isinstance(self.drafter, DFlash2DraftModel):
            anchor_1 = torch.tensor([anchor], device=hidden_1DH.device)
            tokens_1D, candidates_1Dk, q_1Dk = self.drafter.propose(hidden_1DH, anchor_1, self.head, self.temperature)
            if q_1Dk is None:
                return tokens_1D[0].tolist(), None
            vocab = self.target.get_input_embeddings().weight.shape[0]
            q_DV = q_1Dk.new_zeros(q_1Dk.shape[1], vocab).scatter(-1, candidates_1Dk[0], q_1Dk[0])
            return tokens_1D[0].tolist(), q_DV
        logits_DV = self.drafter.compute_logits(hidden_1DH[0], self.head).float()
        if self.temperature == 0:
            return logits_DV.argmax(-1).tolist(), None
        q_DV = self.probabilities(logits_DV)
        return torch.multinomial(q_DV, 1)[:, 0].tolist(), q_DV

    def accept(self, drafts: list[int], q_DV: torch.Tensor | None, target_logits_QV: torch.Tensor) -> tuple[int, int]:
        """(leading drafts accepted, the target's token after them); q_DV: the drafts' distribution (T > 0)."""
        if self.temperature == 0:
            greedy = target_logits_QV.argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
                accepted += 1
            return accepted, greedy[accepted]
        p_QV = self.probabilities(target_logits_QV)
        for k, token in enumerate(drafts):
            if torch.rand(()) * q_DV[k, token] >= p_QV[k, token]:
                residual = (p_QV[k] - q_DV[k]).clamp(min=0)
                residual = residual / residual.sum() if residual.sum() > 0 else p_QV[k]
                return k, int(torch.multinomial(residual, 1))
        return len(drafts), int(torch.multinomial(p_QV[len(drafts)], 1))


def _crop(cache, length: int) -> None:
    """Cut a cache back to `length` positions (a negative `crop` argument means the same in every transformers 5)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _croppable(cache) -> bool:
    """A cache that can be cut back to a length (attention layers only; recurrent states cannot: transformers
    5.25 calls a hybrid cache croppable, but its linear-attention layers refuse `crop` unless recording)."""
    layers = getattr(cache, "layers", [])
    if any(getattr(layer, "record_past", True) is False for layer in layers):
        return False
    flag = getattr(cache, "is_croppable", None)
    if flag is not None:
        return bool(flag)
    return all(type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer") for layer in layers)
