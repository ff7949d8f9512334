"""The drafter command's defaults derived from the target and the machine, each with its reason
(printed at the start, recorded in OUT/drafter.json), and the settings of each scale. The rules are
stated once in docs/dflash.md, "Defaults derived from the target".

    device               cuda when torch sees a GPU, else cpu
    dtype                float32 on a CPU and for a small target (<= 2 GB of weights) on a GPU; else bfloat16
                         (float16 on a GPU without it)
    attn_implementation  sdpa where the target's transformers class supports it, else eager
    taps                 extraction's layer_ids = "auto" (target.rules.auto_layer_ids)
    drafter depth        train's model.num_layers (target.rules.drafter_layers)
    drafter class        train's model.arch: `arch` (DFlash unless asked), its block size the class's
    mask token           extraction's automatic choice (extract.corpus.mask_token), recorded in the shards

A derived default is passed to a stage only where neither the config file's table nor the user's
`STAGE.key=value` sets that key; the record says whose value stands.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
)

from recipes.drafter.config import DrafterRecipeConfig
from recipes.drafter.machine import device_with_reason
from recipes.drafter.plan import config_keys, setting_key
from target.rules import auto_layer_ids, config_depth, drafter_layers

# The stages that run the target's forward, and so take its dtype, attention kernel and chat template.
TARGET_STAGES = ("regenerate", "extract", "specdecode")
DEVICE_STAGES = ("regenerate", "extract", "train", "eval", "specdecode")
# On a GPU, a target whose weights take at most this much (about 1 B parameters in bf16) runs in float32
# (configs/smollm2-135m.toml: a 135 M target in float32 on an H200 cost little; bf16 verify passes differ
# from bf16 one-token decoding at near-ties).
SMALL_TARGET_BYTES = 2 * 10**9

# Why the drafter class is what it is (train's model.arch; its block size follows it: train.config).
ARCH_WHY = {
    "dflash": "the default (arch=dflash2 trains DFlash2; it becomes the default only where it wins: "
    "docs/benchmarks.md)",
    "dflash2": "arch=dflash2: convolutions around every sublayer and a candidate selector, block 8 (the released "
    "DFlash2 drafters')",
}

# Settings of each scale, as stage defaults (a config table or STAGE.key=value wins).
SCALE_DEFAULTS = {
    "full": {
        "eval": ["max_anchors=16"],  # 16 anchors per held-out answer: an unbiased τ at a fraction of the cost
        "specdecode": ["num_prompts=0", "agreement=true"],
    },
    "smoke": {
        "regenerate": ["max_new_tokens=64"],
        "train": ["optim.max_steps=20", "data.token_budget=2048", "loss.num_anchors=16"],
        "eval": ["max_anchors=16"],
        "specdecode": ["num_prompts=0", "max_new_tokens=32", "agreement=true"],
    },
}


@dataclasses.dataclass(frozen=True)
class Derived:
    """One derived default: what it is, its value, why, and the stage settings it becomes."""

    what: str
    value: object
    reason: str
    settings: tuple[str, ...] = ()  # STAGE.key=value words
    yours: tuple[str, ...] = ()  # the user's or the config file's settings of the same keys, which stand

    def line(self) -> str:
        stands = f"  [yours stands: {', '.join(self.yours)}]" if self.yours else ""
        return f"  {self.what:<20}{self.value!s:<22}{self.reason}{stands}"


def weight_bytes(target: str) -> int:
    """The bytes of the target's weight files (safetensors or PyTorch bins) as stored."""
    names = [n for n in os.listdir(target) if n.endswith((".safetensors", ".bin"))]
    return sum(os.path.getsize(os.path.join(target, n)) for n in names)


def resolve_dtype(asked: str, device: str, target: str) -> tuple[str, str]:
    if asked != "auto":
        return asked, "your setting"
    if device == "cpu":
        return "float32", "a CPU: float32 is exact and, without bf16 matrix units, as fast"
    size = weight_bytes(target)
    if size <= SMALL_TARGET_BYTES:
        return "float32", (
            f"a small target ({size / 1e9:.2f} GB of weights) is bound by kernel launches on a GPU: float32 costs it "
            "little and keeps bf16 near-ties out of the lossless check"
        )
    if torch.cuda.is_bf16_supported():
        return "bfloat16", "a GPU with bf16: the published drafters' dtype"
    return "float16", "a GPU without bf16"


def target_class(target: str):
    """The transformers class the stages load the target with (causal LM, else image-text-to-text)."""
    config = AutoConfig.from_pretrained(target, trust_remote_code=False)
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING):
        if type(config) in mapping:
            return mapping[type(config)]
    return None


def resolve_attention(asked: str, target: str) -> tuple[str, str]:
    if asked != "auto":
        return asked, "your setting"
    cls = target_class(target)
    if cls is None:
        return "sdpa", "transformers' default (no causal-LM class known for this config)"
    if getattr(cls, "_supports_sdpa", False):
        return "sdpa", f"{cls.__name__} supports SDPA"
    return "eager", f"{cls.__name__} does not support SDPA (transformers says so)"


def set_by_user(cfg: DrafterRecipeConfig, stage: str, key: str) -> list[str]:
    """The user's STAGE.key=value or the config table's value of `key` for `stage`, as words."""
    words = [f"{stage}.{w}" for w in cfg.overrides.get(stage, []) if setting_key(w) == key]
    if key in (config_keys(cfg.config, stage) or set()):
        words.insert(0, f"[{stage}] {key} in {cfg.config}")
    return words


def derive(cfg: DrafterRecipeConfig) -> list[Derived]:
    """Every derived default of `cfg`'s target on this machine."""
    depth = config_depth(cfg.target)
    device, device_why = device_with_reason(cfg.device)
    dtype, dtype_why = resolve_dtype(cfg.dtype, device, cfg.target)
    attention, attention_why = resolve_attention(cfg.attn_implementation, cfg.target)
    taps, taps_why = auto_layer_ids(depth)
    layers, layers_why = drafter_layers(depth)
    items = [
        ("device", device, device_why, DEVICE_STAGES, "device"),
        ("dtype", dtype, dtype_why, TARGET_STAGES, "dtype"),
        ("attn_implementation", attention, attention_why, TARGET_STAGES, "attn_implementation"),
        ("taps (layer_ids)", taps, taps_why, ("extract",), ""),  # extraction's own default: layer_ids = "auto"
        ("drafter layers", layers, layers_why, ("train",), "model.num_layers"),
        ("drafter class", cfg.arch, ARCH_WHY[cfg.arch], ("train",), "model.arch"),
    ]
    out = []
    for what, value, reason, stages, key in items:
        settings = tuple(f"{s}.{key}={value}" for s in stages) if key else ()
        yours = [w for s in stages for w in set_by_user(cfg, s, key or "layer_ids")]
        out.append(Derived(what, value, reason, settings, tuple(yours)))
    mask_why = "extraction picks it: the tokenizer's mask token, else the first special token unused by the template"
    out.append(Derived("mask token", "auto", mask_why + " and the prompts (recorded in the shards)"))
    return out


def stage_defaults(cfg: DrafterRecipeConfig, derived: list[Derived]) -> dict[str, list[str]]:
    """{stage: key=value}: the scale's settings, your chat template, then the derived defaults."""
    out = {stage: list(words) for stage, words in SCALE_DEFAULTS[cfg.scale].items()}
    if cfg.chat_template:
        for stage in TARGET_STAGES:
            out.setdefault(stage, []).append(f"chat_template={cfg.chat_template}")
    for item in derived:
        for word in item.settings:
            stage, _, setting = word.partition(".")
            out.setdefault(stage, []).append(setting)
    return out


def value_of(derived: list[Derived], what: str):
    return next(d.value for d in derived if d.what == what)
