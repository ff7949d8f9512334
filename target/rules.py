"""Defaults derived from the target's depth, shared by the stages and the recipes (the rules are
stated, with their sources, in docs/dflash.md "Defaults derived from the target"). Torch-free: a
config check reads the depth from config.json before any model code loads.

    config_depth(target_dir)        the text decoder's layer count, read from config.json
    nested_text_config(config)      the text decoder's table in a multimodal or wrapper config, or None
    auto_layer_ids(num_layers)      (tap ids, reason): the published spread with auto_tap_count taps
    layer_ids_problem(ids, L)       what keeps tap ids from naming decoder layers of an L-layer target, or None
    tap_layer_ids(num_layers, n)    n taps from layer 1 to layer L-3, evenly (z-lab's rule)
    auto_tap_count(num_layers)      5 (the published drafters'); one per two layers below 10 layers
    drafter_layers(num_layers)      (drafter depth, reason): 5 (published); L // 4 (at least 1) below 20 layers
    recurrent_layer_kinds(config)   the kinds of layer that carry a recurrent state (a hybrid target), or []

config.json is read with the standard library here (its `{"__float__": "Infinity"}` objects, which
transformers writes for non-finite floats, are kept as they are: no layer count or layer kind is one);
`target.checkpoint.read_config` reads it as transformers does, for everything else.
"""

from __future__ import annotations

import json
import os

PUBLISHED_TAPS = 5  # every published DFlash drafter: [1, 9, 17, 25, 33] of 36, [1, 16, 31, 46, 61] of 64
PUBLISHED_DRAFTER_LAYERS = 5
# Where multimodal and wrapper checkpoints keep the text decoder's own config.
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")
DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# Layer kinds that are attention (a cache of keys and values that a verify pass can cut back).
ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "attention")
LAYER_KIND_KEYS = ("layer_types", "layers_block_type", "block_types")


def config_depth(target_dir: str) -> int:
    """The text decoder's layer count from `target_dir`/config.json (a nested text config first, as
    transformers' `get_text_config` reads it); ValueError naming the file when there is none."""
    path = os.path.join(target_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the target's depth from {path}: {exc}") from None
    config = nested_text_config(config) or config
    for key in DEPTH_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    raise ValueError(f"{path} names no layer count (none of {', '.join(DEPTH_KEYS)})")


def nested_text_config(config: dict) -> dict | None:
    """The text decoder's own config table inside a multimodal or wrapper checkpoint's config.json
    (the first of TEXT_CONFIG_KEYS that holds one), or None when the top level is the decoder's.
    The one rule `target.checkpoint.text_config` and `config_depth` both read the layout by."""
    for key in TEXT_CONFIG_KEYS:
        if isinstance(config.get(key), dict):
            return config[key]
    return None


def auto_tap_count(num_layers: int) -> int:
    """Five taps, as every published drafter reads; a target under 10 layers gets one tap per two
    layers (8 layers: 4), so that the taps stay spread over its depth instead of taking every layer."""
    return max(1, min(PUBLISHED_TAPS, num_layers // 2))


def tap_layer_ids(num_layers: int, n_taps: int) -> list[int]:
    """z-lab's `build_target_layer_ids`: `round(1 + i * (L - 4) / (n - 1))` for i < n, evenly from
    layer 1 to layer L-3, rounded as Python rounds (ties to even); one tap is the middle layer L // 2.
    (36 layers, 5 taps: [1, 9, 17, 25, 33]; 64 layers: [1, 16, 31, 46, 61]; 8 layers, 4 taps:
    [1, 2, 4, 5].) Where the target is too shallow for n distinct ids in [1, L-3], the range widens
    to L-2 and then to layer 0; never the last layer, whose Hugging Face hidden state is post-norm."""
    if not 1 <= n_taps <= num_layers - 1:
        raise ValueError(f"n_taps must be between 1 and {num_layers - 1} for {num_layers} layers, got {n_taps}")
    if n_taps == 1:
        return [min(num_layers // 2, num_layers - 2)]
    first, last = 1, num_layers - 3
    if last - first + 1 < n_taps:
        first, last = (1, num_layers - 2) if num_layers - 2 >= n_taps else (0, num_layers - 2)
    ids = [round(first + i * (last - first) / (n_taps - 1)) for i in range(n_taps)]
    assert len(set(ids)) == n_taps and max(ids) < num_layers - 1, ids
    return ids


def auto_layer_ids(num_layers: int) -> tuple[list[int], str]:
    """The taps `layer_ids = "auto"` resolves to, and why (printed and recorded where it is used)."""
    if num_layers == 1:
        return [0], "a one-layer target: its only layer"
    n = auto_tap_count(num_layers)
    ids = tap_layer_ids(num_layers, n)
    if n == PUBLISHED_TAPS:
        why = "five taps, as the published drafters"
    else:
        why = f"{n} tap{'s' if n > 1 else ''}, one per two layers"
    return ids, f"{why}, spread evenly from layer 1 to layer L-3 of {num_layers} (z-lab's build_target_layer_ids)"


def layer_ids_problem(layer_ids: list[int], num_layers: int) -> str | None:
    """Why `layer_ids` cannot be taps of a target of `num_layers` decoder layers (None: they can)."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if not bad:
        return None
    return (
        f"{bad} out of range: the target has {num_layers} decoder layers, so ids must lie in 0..{num_layers - 1}; "
        f'layer_ids = "auto" picks {auto_layer_ids(num_layers)[0]} for it (docs/dflash.md, "Tap layers")'
    )


def drafter_layers(num_layers: int) -> tuple[int, str]:
    """The drafter's depth for a target of `num_layers`, and why: the published 5 for targets of 20
    layers or more (Qwen3-4B/8B: 36, Qwen3.6-27B: 64); a quarter of the target's depth (at least one)
    below, so that a draft round stays cheap next to the target's verify pass (8 layers: 2)."""
    depth = max(1, min(PUBLISHED_DRAFTER_LAYERS, num_layers // 4))
    if depth == PUBLISHED_DRAFTER_LAYERS:
        return depth, f"the published drafters' 5 layers (target of {num_layers} layers, 20 or more)"
    return (
        depth,
        f"a quarter of the target's {num_layers} layers (under 20: the published 5 would cost a round too much)",
    )


def recurrent_layer_kinds(config: dict) -> list[str]:
    """The kinds of the text decoder's layers that carry a recurrent state, sorted: Gated DeltaNet or
    lightning `linear_attention`, `mamba`, LFM2's `conv`, RecurrentGemma's `recurrent`, read from
    `layer_types` (or the other names families give that list); a config with `mamba_*` settings and
    no such list (Falcon-H1, Jamba: every layer or every other one has a Mamba mixer) is `["mamba"]`.
    Empty for a target of attention layers only."""
    config = nested_text_config(config) or config
    kinds = next((config[key] for key in LAYER_KIND_KEYS if isinstance(config.get(key), list)), [])
    found = sorted({k for k in kinds if isinstance(k, str) and k not in ATTENTION_LAYER_KINDS})
    if not found and any(key.startswith("mamba_") for key in config):
        found = ["mamba"]
    return found
