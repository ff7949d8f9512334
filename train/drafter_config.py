"""The drafter's shape: `DrafterConfig`, the published config fields (docs/dflash.md "Export format"),
derived from a target (`DrafterConfig.from_target`) and checked field by field; the rope a drafter
takes from its target (`target_rope`). `train.model` builds the drafter from it.
"""

from __future__ import annotations

import dataclasses

from train.attention import MaskRule
from train.config import DEFAULT_BLOCK_SIZE, DFLASH2_FIELDS, ModelConfig
from train.layer_types import FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_IN_BLOCK, resolve_layer_types

__all__ = [
    "DRAFTER_ARCHS",
    "DFLASH2_FIELDS",
    "DEFAULT_ROPE_THETA",
    "DrafterConfig",
    "MODEL_OVERRIDES",
    "dflash2_fields",
    "rope_settings",
    "target_rope",
]

# The `model` table's keys (`train.config.ModelConfig`) that set the drafter field of the same name where they are
# not none; the target's value otherwise (`DrafterConfig.from_target`).
MODEL_OVERRIDES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "initializer_range",
    "layer_types",
    "sliding_window",
    "sliding_in_block",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
)

# The drafter classes (`DrafterConfig.arch`); the fields only DFlash2 has are `DFLASH2_FIELDS` (train.config).
DRAFTER_ARCHS = ("dflash", "dflash2")

# The released DFlash2 drafters' selector rank (Qwen3.8-27B at hidden 5120, the z-lab fixture at 6656).
PUBLISHED_SELECTOR_RANK = 256

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
    # The drafter class: "dflash" (the paper's) or "dflash2" (`train.dflash2`: a convolution around every
    # sublayer and a candidate selector); the fields after it are DFlash2's and absent from a DFlash config.
    arch: str = "dflash"
    conv_kernel_size: int = 2  # taps of each block convolution (the row and the rows before it)
    conv_group_size: int = 16  # channels that share one dynamic coefficient
    selector_rank: int = 256  # width of the selector's token codes
    selector_top_k: int = 16  # candidates the selector ranks per block position

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
        if self.arch not in DRAFTER_ARCHS:
            raise ValueError(f"drafter config 'arch' must be one of {DRAFTER_ARCHS}, got {self.arch!r}")
        if self.arch == "dflash2":
            self._check_dflash2()

    def _check_dflash2(self) -> None:
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(
                f"drafter config 'conv_kernel_size' must be in 1..block_size ({self.block_size}), got "
                f"{self.conv_kernel_size}"
            )
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"drafter config 'conv_group_size' ({self.conv_group_size}) must divide hidden_size "
                f"({self.hidden_size})"
            )
        if self.selector_rank < 1:
            raise ValueError(f"drafter config 'selector_rank' must be >= 1, got {self.selector_rank}")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(
                f"drafter config 'selector_top_k' must be in 1..vocab_size ({self.vocab_size}), got "
                f"{self.selector_top_k}"
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
        cls, target_cfg: dict, model: ModelConfig, *, layer_ids: list[int], mask_token_id: int
    ) -> DrafterConfig:
        """A drafter for a target text config, shaped by a train config's `model` table: the target's widths and
        rope wherever the table leaves them unset (`MODEL_OVERRIDES`), its layer count, block size, layer types
        and class (a DFlash2 drafter's fields as `dflash2_fields` derives them). A hidden size other than the
        target's is allowed: `fc` then maps n_taps x target hidden -> drafter hidden, but the frozen embedding
        and lm_head are the target's, so they must match the drafter's width.

        Rope: the target's theta and (static) scaling (`target_rope`), but rotary over the whole head
        (model.partial_rotary_factor, 1.0 by default): the drafter's heads are its
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
            num_hidden_layers=model.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(target_cfg.get("num_key_value_heads") or heads),
            head_dim=int(target_cfg.get("head_dim") or hidden // heads),
            vocab_size=int(target_cfg["vocab_size"]),
            target_layer_ids=list(layer_ids),
            num_target_layers=int(target_cfg["num_hidden_layers"]),
            mask_token_id=int(mask_token_id),
            block_size=model.block_size or DEFAULT_BLOCK_SIZE[model.arch],
            rms_norm_eps=float(target_cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=1.0,
            max_position_embeddings=int(target_cfg.get("max_position_embeddings") or 40960),
            hidden_act="silu",
            initializer_range=float(target_cfg.get("initializer_range") or 0.02),
        )
        values.update({k: getattr(model, k) for k in MODEL_OVERRIDES if getattr(model, k) is not None})
        if model.arch == "dflash2":
            values.update(dflash2_fields(model, values["hidden_size"])[0])
        if values["hidden_size"] != hidden:
            values["target_hidden_size"] = hidden
        return cls(**values)

    def to_dict(self) -> dict:
        """The fields; a DFlash drafter's without the DFlash2 ones, so its files read as before DFlash2 existed."""
        values = dataclasses.asdict(self)
        if self.arch == "dflash":
            for name in ("arch", *DFLASH2_FIELDS):
                values.pop(name)
        return values

    @classmethod
    def from_dict(cls, data: dict) -> DrafterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def dflash2_fields(model, hidden: int) -> tuple[dict, str]:
    """(the DFlash2 fields of a drafter of width `hidden`, one line saying where each comes from) for a train
    config's `model` table (`train.config.ModelConfig`); ValueError naming the key for a group size that does
    not divide the width. The rank left unset is min(256, hidden)."""
    if hidden % model.conv_group_size:
        raise ValueError(
            f"config key 'model.conv_group_size': {model.conv_group_size} does not divide the drafter's hidden size "
            f"{hidden}; set it to a divisor of {hidden}"
        )
    rank, rank_why = model.selector_rank, "model.selector_rank"
    if rank is None:
        rank = min(PUBLISHED_SELECTOR_RANK, hidden)
        rank_why = (
            f"the released drafters' {PUBLISHED_SELECTOR_RANK}"
            if rank == PUBLISHED_SELECTOR_RANK
            else f"the hidden size: the selector's gate P(h) spans at most {hidden} directions, so a higher rank "
            f"only adds codebook columns; the released drafters use {PUBLISHED_SELECTOR_RANK} at hidden 5120"
        )
    block_why = (
        "the released drafters' size" if model.block_size == DEFAULT_BLOCK_SIZE["dflash2"] else "model.block_size"
    )
    why = (
        f"block size {model.block_size} ({block_why}), block convolutions of {model.conv_kernel_size} taps with one "
        f"coefficient per {model.conv_group_size} channels, selector over the top {model.selector_top_k} "
        f"candidates, rank {rank} ({rank_why})"
    )
    fields = dict(
        arch="dflash2",
        conv_kernel_size=model.conv_kernel_size,
        conv_group_size=model.conv_group_size,
        selector_rank=rank,
        selector_top_k=model.selector_top_k,
    )
    return fields, why
