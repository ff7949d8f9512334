"""`TrainConfig`: every knob of `python -m train`, the `[train]` table of a config file.

    cfg = parse_cli(TrainConfig, ["configs/tiny.toml", "loss.gamma=5", "run_name=abl"], section="train")

Nested tables: `model` (drafter shape and target), `data` (the data stream, `train.data.DataConfig`),
`loss` (blocks and objective), `optim` (optimizer and schedule), `checkpoint`, `log`. Values that
depend on the block size (the default gamma) are resolved in `check`, so the saved config.json
holds the numbers that were used.

`RESUME_FREE_KEYS` lists the keys that may differ between a checkpoint and the run resuming it
(where to stop, how often to save, logging); any other difference is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from common.config import fail, flatten_dotted, knob
from train.blocks import default_gamma
from train.data import DataConfig

__all__ = ["ModelConfig", "LossConfig", "OptimConfig", "CheckpointConfig", "LogConfig", "TrainConfig", "RESUME_FREE_KEYS", "resume_conflicts"]

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_NAME_CHARS = 128


@dataclass
class ModelConfig:
    """The drafter's shape; widths default to the target's (dflash.md §1.7)."""

    target: str | None = knob(
        None, help="target checkpoint directory (HF layout) for widths, rope, embedding and lm_head; none = the shards' provenance target.name_or_path"
    )
    num_layers: int = knob(5, help="drafter decoder layers", min=1, max=64)
    block_size: int = knob(16, help="tokens per block: the anchor plus block_size-1 drafted tokens", min=2, max=128)
    target_layer_ids: list[int] | None = knob(
        None, help="tap layer ids the drafter reads (id i = output of decoder layer i); none = the shards' taps (checked against them)", min=0
    )
    mask_token_id: int | None = knob(
        None, help="mask token id; used only when neither the shards' provenance nor the target tokenizer has one (a conflict is an error)", min=0
    )
    hidden_size: int | None = knob(None, help="drafter hidden size; none = the target's (the frozen embedding/lm_head must match it)", min=1)
    intermediate_size: int | None = knob(None, help="MLP width; none = the target's", min=1)
    num_attention_heads: int | None = knob(None, help="query heads; none = the target's", min=1)
    num_key_value_heads: int | None = knob(None, help="key/value heads; none = the target's", min=1)
    head_dim: int | None = knob(None, help="head dim; none = the target's", min=1)
    initializer_range: float | None = knob(None, help="init std of linear weights; none = the target's (0.02 for Qwen)", min=0.0)
    attention: Literal["auto", "flex", "sdpa"] = knob(
        "auto", help="attention kernel with the DFlash mask: flex (compiled on CUDA), sdpa with a dense mask, auto = flex on CUDA, sdpa on CPU (flex has no CPU backward)"
    )


@dataclass
class LossConfig:
    """Anchors, labels and the objective (dflash.md §3.4-§3.6); the non-default values are ablations."""

    num_anchors: int = knob(512, help="blocks per sequence, sampled without replacement from eligible response positions", min=1)
    max_blocks: int | None = knob(
        None, help="cap on blocks per batch (all rows); rows' anchor counts shrink proportionally beyond it; bounds the memory of batches of many short samples; none = no cap", min=1
    )
    gamma: float | None = knob(None, help="position decay w_k = exp(-(k-1)/gamma); none = paper value for the block size (7 for 16, 5 for 10, 4 for 8)", min=0.01)
    labels: Literal["target", "data"] = knob("target", help="label of block position k: the target's stored top-1 for token a+k (default) or the data token itself (ablation)")
    kl_weight: float = knob(0.0, help="weight of the soft top-k KL term against the stored top-k log-probs (ablation; 0 = off)", min=0.0)
    kl_temperature: float = knob(1.0, help="temperature of the soft KL term (teacher and student)", min=0.05, max=100.0)
    chunk_rows: int = knob(1024, help="block tokens per lm_head chunk: full-vocabulary logits exist for this many rows at once", min=1)


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine to 0 (dflash.md §3.7)."""

    lr: float = knob(6e-4, help="peak learning rate", min=0.0, max=1.0)
    weight_decay: float = knob(0.0, help="AdamW weight decay", min=0.0)
    betas: list[float] = knob(factory=lambda: [0.9, 0.999], help="AdamW betas", min=0.0, max=1.0)
    eps: float = knob(1e-8, help="AdamW epsilon", min=0.0)
    warmup_ratio: float = knob(0.04, help="share of all steps with linear warmup", min=0.0, max=1.0)
    grad_clip: float = knob(1.0, help="clip the total gradient norm to this (logged before clipping)", min=0.0)
    epochs: float = knob(6.0, help="epochs to train; the schedule spans epochs x steps_per_epoch steps", min=0.0)
    max_steps: int | None = knob(None, help="train this many steps instead (the schedule then spans max_steps)", min=1)
    max_nonfinite_in_row: int = knob(10, help="abort after this many consecutive skipped non-finite steps", min=1)

    def check(self) -> None:
        if len(self.betas) != 2:
            fail("optim.betas", f"expected two numbers, got {self.betas}")


@dataclass
class CheckpointConfig:
    every: int = knob(1000, help="save a checkpoint every this many steps (and always at the end)", min=1)
    keep_last: int = knob(3, help="keep this many most recent checkpoints", min=1)


@dataclass
class LogConfig:
    progress: bool = knob(True, help="show a tqdm progress bar")
    wandb: bool = knob(False, help="also log to Weights & Biases (the run continues without it if wandb is absent)")
    wandb_project: str = knob("dflash-offline", help="wandb project")
    wandb_mode: Literal["offline", "online"] = knob("offline", help="wandb mode; offline writes under the run directory")


@dataclass
class TrainConfig:
    run_name: str | None = knob(None, help="run directory name under out_dir (a plain name); none = run-YYYYmmdd-HHMMSS")
    out_dir: str = knob("runs", help="directory that holds the run directories")
    seed: int = knob(0, help="seed of the drafter init and of the anchor sampling", min=0)
    device: Literal["auto", "cpu", "cuda"] = knob("auto", help="auto = cuda when available")
    precision: Literal["auto", "bf16", "fp32"] = knob("auto", help="bf16 autocast with fp32 master weights, or fp32; auto = bf16 on CUDA, fp32 on CPU")
    compile: bool = knob(False, help="torch.compile the drafter and the loss chunk (CUDA)")
    resume: str = knob(
        "auto", help="auto: continue from the run's latest checkpoint if there is one; never: refuse an existing run; or a checkpoint directory"
    )
    stop_after: int | None = knob(None, help="stop after this step (the schedule is unchanged; resume later)", min=1)
    model: ModelConfig = knob(factory=ModelConfig, help="drafter")
    data: DataConfig = knob(factory=DataConfig, help="data stream")
    loss: LossConfig = knob(factory=LossConfig, help="blocks and objective")
    optim: OptimConfig = knob(factory=OptimConfig, help="optimizer and schedule")
    checkpoint: CheckpointConfig = knob(factory=CheckpointConfig, help="checkpoints")
    log: LogConfig = knob(factory=LogConfig, help="logging")

    def check(self) -> None:
        if self.run_name is not None and (not _PLAIN_NAME.match(self.run_name) or self.run_name in (".", "..")):
            fail("run_name", f"{self.run_name!r} must be a plain name: ASCII letters, digits, '.', '_' and '-', starting with a letter or digit")
        if self.run_name is not None and len(self.run_name) > MAX_NAME_CHARS:  # a directory name; filesystems stop at 255 bytes
            fail("run_name", f"{len(self.run_name)} characters; at most {MAX_NAME_CHARS}")
        if self.loss.gamma is None:
            try:
                self.loss.gamma = default_gamma(self.model.block_size)
            except ValueError as exc:
                fail("loss.gamma", str(exc))
        if self.model.attention == "flex" and self.device == "cpu":
            fail("model.attention", "flex has no backward on CPU; use sdpa or auto")


# Keys (dotted prefixes) that a resumed run may change.
RESUME_FREE_KEYS = (
    "resume", "stop_after", "run_name", "out_dir", "log", "checkpoint", "compile",
    "data.prefetch_threads", "data.prefetch_depth", "data.pin_memory", "data.verify_checksums",
    "data.verify_samples",
)


def resume_conflicts(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between two config dicts, except the resume-free ones."""
    a, b = flatten_dotted(saved), flatten_dotted(current)
    keys = sorted(set(a) | set(b))
    free = lambda k: any(k == p or k.startswith(p + ".") for p in RESUME_FREE_KEYS)  # noqa: E731
    return [f"{k}: checkpoint {a.get(k, '<absent>')!r} vs now {b.get(k, '<absent>')!r}" for k in keys if not free(k) and a.get(k) != b.get(k)]

