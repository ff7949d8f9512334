"""Drafter layers started from the target's own decoder layers (`model.init_from_target`), an ablation.

A DFlash drafter has the target's widths, so each of its decoder layers has the shapes of a target
layer (for a target with plain attention layers: Llama, Qwen3). `init_from_target` copies, for drafter
layer i, the norms, attention projections and MLP of target layer `ids[i]`, and the target's final
norm into the drafter's (its output goes through the target's lm_head). What the target has no
counterpart for stays at the fresh initialization and is named in the run's record: the context
projection `fc`, `hidden_norm`, and the per-head q/k norms of a target without them (Llama).

The published drafters start fresh (`docs/dflash.md`, "Training recipe": SpecForge copies nothing;
how z-lab initialized is not public). Against that, on the real target (SmolLM2-135M-Instruct, the
demo's shards and drafter), every rule did worse in offline chain τ
(docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "Real target"). The fresh start stays the default; this stays
as the ablation that shows it (for another target, another data size or longer training it may differ).

Rules for choosing the target layers, for n drafter layers of an L-layer target:
  "first"  0 .. n-1            "last"  L-n .. L-1
  "spread" round-half-up(i (L-1) / (n-1)): the first and the last layer and evenly between
  "3,10,17"                    the ids themselves, one per drafter layer
A target layer that is not a plain attention layer of the drafter's shapes (a Gated DeltaNet layer of
Qwen3.6, a gated attention with a wider q_proj) is refused with the tensor that does not fit.
"""

from __future__ import annotations

import os

import torch

from target.checkpoint import load_tensors, stored_name, tensor_names, text_config
from train.config import INIT_RULES
from train.model import DFlashDrafter

__all__ = ["target_layer_choice", "init_from_target"]

KEY = "model.init_from_target"
# Drafter tensor suffix under layers.{i}. -> the same suffix under the target's model.layers.{j}.
LAYER_TENSORS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
# Copied where the target has them, else left at the fresh initialization (and recorded).
OPTIONAL_LAYER_TENSORS = (
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
)
FINAL_NORM = "model.norm.weight"


def target_layer_choice(rule: str | list[int], num_layers: int, num_target_layers: int) -> list[int]:
    """The target layer each of `num_layers` drafter layers starts from (see the module docstring)."""
    n, L = int(num_layers), int(num_target_layers)
    if isinstance(rule, list):
        ids = list(rule)
        if len(ids) != n:
            raise ValueError(f"config key '{KEY}': {len(ids)} layer ids for a drafter of {n} layers")
    elif rule == "first":
        ids = list(range(n))
    elif rule == "last":
        ids = list(range(L - n, L))
    elif rule == "spread":
        ids = [0] if n == 1 else [int((i * (L - 1)) / (n - 1) + 0.5) for i in range(n)]
    else:
        raise ValueError(f"config key '{KEY}': unknown rule {rule!r} (one of {', '.join(INIT_RULES)} or layer ids)")
    if n > L and not isinstance(rule, list):
        raise ValueError(f"config key '{KEY}': a drafter of {n} layers from a target of {L}: use explicit ids")
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise ValueError(f"config key '{KEY}': target layers {bad} do not exist (the target has {L}: 0 .. {L - 1})")
    return ids


def init_from_target(drafter: DFlashDrafter, target_dir: str | os.PathLike, rule: str | list[int]) -> dict:
    """Copy the chosen target layers into `drafter` (in place); returns the record for run.json."""
    num_target_layers = int(text_config(target_dir)["num_hidden_layers"])
    ids = target_layer_choice(rule, len(drafter.layers), num_target_layers)
    stored = tensor_names(target_dir)
    state = drafter.state_dict()
    wanted: dict[str, str] = {}  # drafter name -> target name
    left: list[str] = []
    for i, j in enumerate(ids):
        for suffix in LAYER_TENSORS + OPTIONAL_LAYER_TENSORS:
            mine = f"layers.{i}.{suffix}"
            if mine not in state:
                continue
            theirs = f"model.layers.{j}.{suffix}"
            if stored_name(theirs, stored) is not None:
                wanted[mine] = theirs
            elif suffix in LAYER_TENSORS:
                raise ValueError(
                    f"config key '{KEY}': target layer {j} has no '{theirs}' (not a plain attention layer of the "
                    "drafter's kind; choose other layers, or none)"
                )
            else:
                left.append(mine)
    wanted["norm.weight"] = FINAL_NORM
    tensors = load_tensors(target_dir, sorted(set(wanted.values())))
    with torch.no_grad():
        for mine, theirs in wanted.items():
            source = tensors[theirs]
            if tuple(source.shape) != tuple(state[mine].shape):
                raise ValueError(
                    f"config key '{KEY}': target tensor '{theirs}' has shape {tuple(source.shape)}, the drafter's "
                    f"'{mine}' {tuple(state[mine].shape)}"
                )
            state[mine].copy_(source.to(state[mine].dtype))
    fresh = sorted(set(state) - set(wanted))
    return {
        "target_layers": ids,
        "rule": rule if isinstance(rule, str) else "ids",
        "copied": len(wanted),
        "left_at_init": fresh,
        "optional_absent": left,
    }
