"""The drafter's layer types (`model.layer_types`, `DrafterConfig.layer_types`): the names, the
named layouts, and `resolve_layer_types`, which turns a layout or a list into one type per layer.
Torch-free, so the training config checks a layout before torch loads (`--help`, a bad key).
"""

from __future__ import annotations

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "LAYER_TYPES",
    "LAYER_TYPE_PRESETS",
    "SLIDING_IN_BLOCK",
    "resolve_layer_types",
]

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# Named layouts for `model.layer_types`. "sliding_then_full" is the published Qwen3.5/3.6 z-lab layout
# (4 x sliding_attention + 1 x full_attention for 5 layers); "sliding" is every layer sliding.
LAYER_TYPE_PRESETS = {
    "full": lambda n: [FULL_ATTENTION] * n,
    "sliding": lambda n: [SLIDING_ATTENTION] * n,
    "sliding_then_full": lambda n: [SLIDING_ATTENTION] * (n - 1) + [FULL_ATTENTION],
}
# What a sliding_attention layer does inside its block: "causal" as vLLM and SGLang serve it (and
# z-lab's current model code by default), "bidirectional" as z-lab's earlier reference code (every
# layer non-causal; the window only limits the context). docs/serving.md has the sources.
SLIDING_IN_BLOCK = ("causal", "bidirectional")


def resolve_layer_types(spec: str | list[str] | None, num_layers: int) -> list[str]:
    """A list of `num_layers` layer types from a preset name or a list (ValueError naming the problem)."""
    if spec is None:
        return [FULL_ATTENTION] * num_layers
    if isinstance(spec, str):
        if spec not in LAYER_TYPE_PRESETS:
            raise ValueError(
                f"unknown layer_types preset {spec!r}; presets: {', '.join(LAYER_TYPE_PRESETS)}, or a list of "
                f"{', '.join(LAYER_TYPES)}"
            )
        return LAYER_TYPE_PRESETS[spec](num_layers)
    types = [str(t) for t in spec]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"layer_types {bad} unknown; each entry must be one of {', '.join(LAYER_TYPES)}")
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries but the drafter has {num_layers} layers")
    return types
