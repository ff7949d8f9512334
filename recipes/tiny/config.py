"""`TinyConfig`: how `python -m recipes.tiny` builds the tiny default (the `[tiny]` table of a config
file). The tap layer ids it recommends for its target follow `target.rules.tap_layer_ids`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from common.config import fail, knob
from common.repeat import REPEAT_MAX_PERIOD


@dataclass(frozen=True)
class TinyConfig:
    """How `python -m recipes.tiny` builds the tiny default (section `[tiny]` of a config file)."""

    out_dir: str = knob("artifacts/tiny", help="where target/, corpus/ and build.json go", path="dir_out")
    target: Literal["auto", "shipped", "train"] = knob(
        "auto",
        help="shipped = the corpus and trained target shipped in recipes/tiny/shipped/ (one reference build, so "
        "every machine's demo starts from the same target; its answers are still regenerated here); train = build "
        "the corpus from this Python's documentation and train the target here (another machine rounds "
        "differently: another target, other demo numbers); auto = keep a target=train build already in out_dir "
        "(so make extract and make demo use the target you trained), else shipped",
    )
    seed: int = knob(0, help="seed of the corpus draw, the held-out split, the model init and the batch order", min=0)
    heldout_fraction: float = knob(
        0.06,
        help="share of corpus records held out (offline evaluation, speculative-decoding prompts)",
        min=0.01,
        max=0.5,
    )
    vocab_size: int = knob(
        4096, help="tokenizer size, special tokens included (an upper bound on a small corpus)", min=300, max=65536
    )
    hidden_size: int = knob(128, help="target hidden width", min=16, max=4096)
    intermediate_size: int = knob(384, help="target MLP width", min=16, max=16384)
    num_layers: int = knob(8, help="target decoder layers", min=2, max=64)
    num_heads: int = knob(2, help="attention query heads", min=1, max=64)
    num_kv_heads: int = knob(1, help="attention key/value heads (divides num_heads)", min=1, max=64)
    head_dim: int = knob(64, help="width of one attention head", min=8, max=256)
    n_taps: int = knob(
        4, help="how many tap layer ids to recommend (evenly spread, never the last layer)", min=1, max=16
    )
    steps: int = knob(1000, help="optimizer steps of target training", min=0)
    batch_tokens: int = knob(
        1024, help="padded tokens per training batch (sequences of similar length are batched together)", min=64
    )
    max_len: int = knob(
        512,
        help="training sequences are cut to their first max_len tokens. The regenerated answers (prompt + at most "
        "regen_max_new_tokens) stay below 512 tokens, so 512 trains the target where it is used: 4.4 passes over "
        "what is "
        "left instead of 3.5 over 2048-token samples, in the same time; held-out next-token accuracy 0.26 against 0.24 "
        "over the first 512 tokens, 0.17 against 0.15 on answer tokens",
        min=16,
    )
    lr: float = knob(3e-3, help="peak AdamW learning rate (linear warmup, cosine decay to 10%)", min=0.0, max=1.0)
    warmup_steps: int = knob(40, help="learning-rate warmup steps", min=0)
    weight_decay: float = knob(0.1, help="AdamW weight decay on matrices", min=0.0, max=1.0)
    regen_max_new_tokens: int = knob(
        256, help="cap on each target-regenerated answer (greedy answers that hit it are truncated)", min=1, max=4096
    )
    regen_batch: int = knob(
        128,
        help="prompts per batch of the greedy regeneration (left-padded; larger is faster on CPU up to ~128)",
        min=1,
    )
    regen_stop_repeat: int = knob(
        16,
        help="cut a regenerated answer where it starts looping: once its last n >= max(this, p) tokens repeat the "
        "p tokens "
        f"before them (any period p <= {REPEAT_MAX_PERIOD}); 0 = answers end only at the stop token or the cap",
        min=0,
        max=4096,
    )
    device: Literal["auto", "cpu", "cuda"] = knob(
        "auto", help="where the target trains and answers; auto = cuda when torch sees a GPU"
    )
    precision: Literal["auto", "fp32", "bf16"] = knob(
        "auto",
        help="training compute: bf16 autocast (fast where the CPU has bf16 instructions), fp32, or auto "
        "(bf16 on a GPU or a CPU with bf16 instructions, else fp32)",
    )
    threads: int = knob(
        0, help="torch CPU threads; 0 = common.device.small_model_threads() (OMP_NUM_THREADS, else at most 4)", min=0
    )
    force: bool = knob(False, help="rebuild even when a matching build exists")

    def check(self) -> None:
        if self.target != "train":
            for name in training_knobs_off_default({name: getattr(self, name) for name in TRAINING_KNOBS}):
                fail(name, f"sets how the target is trained, and target={self.target} trains nothing: add target=train")
        if self.num_heads % self.num_kv_heads:
            fail("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.n_taps > self.num_layers - 1:
            fail("n_taps", f"at most num_layers - 1 = {self.num_layers - 1} (the last layer is never a tap)")


# The knobs that decide the corpus and the target, i.e. what target=shipped takes from the shipped build.
TRAINING_KNOBS = (
    "seed",
    "heldout_fraction",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "n_taps",
    "steps",
    "batch_tokens",
    "max_len",
    "lr",
    "warmup_steps",
    "weight_decay",
    "precision",
)


def training_knobs_off_default(values: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{knob: (value, default)} for each training knob in `values` that differs from its default, in
    `TRAINING_KNOBS` order (what target=shipped cannot honour, and what a build to ship must not have)."""
    defaults = {f.name: f.default for f in fields(TinyConfig)}
    return {k: (values[k], defaults[k]) for k in TRAINING_KNOBS if k in values and values[k] != defaults[k]}


def resolve_precision(precision: str, device_type: str = "cpu") -> str:
    """'bf16' on a GPU and where the CPU has native bf16 math (autocast is then about twice as fast), else 'fp32'."""
    if precision != "auto":
        return precision
    if device_type == "cuda":
        return "bf16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "fp32"
