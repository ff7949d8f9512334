"""`TrainConfig`: every knob of `python -m train`, the `[train]` table of a config file.

    cfg = parse_cli(TrainConfig, ["configs/tiny.toml", "loss.gamma=5", "run_name=abl"], section="train")

Nested tables: `model` (drafter shape and target), `data` (`DataConfig`, the data stream of `train.data`),
`loss` (blocks and objective), `optim` (optimizer and schedule), `checkpoint`, `log`, `distributed`. Values that
depend on the block size (the default gamma) are resolved in `check`, so the saved config.json
holds the numbers that were used.

`RESUME_FREE_KEYS` lists the keys that may differ between a checkpoint and the run resuming it
(where to stop, how often to save, logging, how a step is spread over processes); any other
difference is refused by name.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

from common.config import ConfigError, config_to_dict, fail, flatten_dotted, knob, set_resolved
from train import buckets
from train.layer_types import SLIDING_ATTENTION, resolve_layer_types

__all__ = [
    "ModelConfig",
    "LossConfig",
    "OptimConfig",
    "CheckpointConfig",
    "LogConfig",
    "DistributedConfig",
    "TrainConfig",
    "RESUME_FREE_KEYS",
    "resume_conflicts",
    "INIT_RULES",
    "parse_init_rule",
]

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_NAME_CHARS = 128


# gamma per block size from the paper's Eq. 4 (via SpecForge / Model-Optimizer help texts).
_PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's decay for a block size; ValueError for a size it gives none for."""
    if block_size not in _PAPER_GAMMA:
        raise ValueError(
            f"no default loss gamma for block size {block_size} (known: {sorted(_PAPER_GAMMA)}); set loss.gamma"
        )
    return _PAPER_GAMMA[block_size]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The `data` table of the train config."""

    shards: str = knob(
        "artifacts/tiny/shards/train",
        help="shards dataset root (a local path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX)",
        path="data_in",
    )
    manifest: str = knob("manifest.json", help="manifest file name inside the shards root")
    verify_samples: bool = knob(
        True,
        help="check each sample's bytes against its xxh3-64 in the shard index on every read, and each index file "
        "against the manifest (about 7% of read+decode time; shards/FORMAT.md); shards written before format "
        "version 2 have none",
    )
    verify_checksums: bool = knob(
        False, help="also hash each whole shard file on its first open (slow: one more read of every 1 GiB shard)"
    )
    holdout_fraction: float = knob(
        0.01,
        help="share of samples held out for eval, chosen by a hash of the sample id (same for every seed)",
        min=0.0,
        max=0.5,
    )
    max_samples: int | None = knob(
        None, help="train on at most this many samples (a fixed, uniformly spread subset); none = all", min=1
    )
    min_loss_tokens: int = knob(
        0, help="leave out samples with fewer loss tokens (DFlash drops those with < 2 x block_size = 32)", min=0
    )
    boundaries: list[int] | None = knob(
        None,
        help="length-bucket upper edges, inclusive and strictly increasing; none = quantiles into num_buckets",
        min=1,
    )
    num_buckets: int = knob(
        8, help="number of quantile buckets when boundaries is none (equal repeated quantiles merge)", min=1, max=64
    )
    token_budget: int = knob(
        49152,
        help="max padded tokens per batch (= per optimizer step): batch size x longest sample in it; "
        "data parallel splits each batch over world_size x distributed.accumulation micro-batches",
        min=1,
    )
    max_batch_samples: int | None = knob(
        None, help="cap on samples per batch; none = only the token budget limits", min=1
    )
    oversize: str = knob(
        "fail",
        help="a sample longer than token_budget: fail at start, or skip it (counted in data_plan)",
        choices=["fail", "skip"],
    )
    seed: int = knob(0, help="seed of the per-epoch shuffle and interleaving offsets", min=0)
    prefetch_threads: int = knob(4, help="background threads that read and collate batches", min=1, max=64)
    prefetch_depth: int = knob(
        4, help="batches loaded ahead of the consumer (bounds host memory); >= prefetch_threads", min=1, max=256
    )
    fetch_threads: int = knob(
        0,
        help="concurrent sample reads within one batch; 0 = auto: 1 for a local dataset (read in turn, as the "
        "page cache serves it), 16 for an object store (one ranged GET per sample, so a batch waits about one "
        "request's latency instead of one per sample)",
        min=0,
        max=256,
    )
    pin_memory: bool = knob(True, help="collate into pinned host memory (only when CUDA is available)")
    on_corrupt: str = knob(
        "fail",
        help="an unreadable sample or shard: fail, or skip it (counted and logged with the file)",
        choices=["skip", "fail"],
    )

    def check(self) -> None:
        if self.boundaries is not None:
            try:
                buckets.check_boundaries(self.boundaries)
            except ValueError:
                fail("data.boundaries", f"must be strictly increasing positive lengths, got {self.boundaries}")
        if self.prefetch_depth < self.prefetch_threads:
            fail(
                "data.prefetch_depth",
                f"{self.prefetch_depth} is below data.prefetch_threads={self.prefetch_threads}; threads beyond the "
                "depth would idle",
            )


# The block size of each drafter class when model.block_size is unset: the paper's 16; the released DFlash2
# drafters (z-lab / Inco AI Qwen3.8-27B-DFlash2) use 8, and vLLM serves them with 7 speculative tokens.
DEFAULT_BLOCK_SIZE = {"dflash": 16, "dflash2": 8}
# The DFlash2 drafter's own fields: model.* knobs here, DrafterConfig fields and dflash_config keys of an export
# (train.drafter_config re-exports it).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SELECTOR_LOSS_KEYS = ("selector_weight", "selector_warmup_ratio", "selector_ramp_ratio")  # loss.* knobs, dflash2

INIT_RULES = ("first", "last", "spread")  # `model.init_from_target`'s named rules (train.target_init)


def parse_init_rule(value: str | None) -> str | list[int] | None:
    """None / "none" -> None; a rule name; or the comma-separated ids as ints (ValueError otherwise)."""
    if value is None or str(value).strip().lower() in ("", "none"):
        return None
    text = str(value).strip().lower()
    if text in INIT_RULES:
        return text
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"config key 'model.init_from_target': {value!r} is neither none, one of {', '.join(INIT_RULES)}, nor "
            "comma-separated layer ids"
        ) from None
    if any(i < 0 for i in ids):
        raise ValueError(f"config key 'model.init_from_target': layer ids must be >= 0, got {ids}")
    return ids


@dataclass(frozen=True)
class ModelConfig:
    """The drafter's shape; widths default to the target's (docs/dflash.md "Drafter")."""

    target: str | None = knob(
        None,
        help="target checkpoint directory (HF layout) for widths, rope, embedding and lm_head; none = the shards' "
        "provenance target.name_or_path",
        path="local_in",
    )
    allow_target_mismatch: bool = knob(
        False,
        help="train although model.target is not the target the shards were extracted from (its config hash, "
        "weights digest or embedding and head digest differ): for a deliberate copy, such as the same weights "
        "re-saved in another dtype; run.json records what differed (target.identity)",
    )
    arch: Literal["dflash", "dflash2"] = knob(
        "dflash",
        help="drafter class: dflash (the paper's) or dflash2 (a block convolution around every sublayer and a "
        "candidate selector over the head's top-k, train/dflash2.py; trained from the same shards with the "
        "selector loss, train/selector_loss.py); the conv_* and selector_* keys apply to dflash2 only",
    )
    num_layers: int = knob(5, help="drafter decoder layers", min=1, max=64)
    block_size: int | None = knob(
        None,
        help="tokens per block: the anchor plus block_size-1 drafted tokens; none = the class's published size: 16 "
        "for dflash (the paper), 8 for dflash2 (the released DFlash2 drafters)",
        min=2,
        max=128,
    )
    conv_kernel_size: int = knob(
        2,
        help="dflash2: taps of each block convolution (a row and the rows before it); 2 in every released drafter",
        min=1,
    )
    conv_group_size: int = knob(
        16, help="dflash2: channels that share one dynamic convolution coefficient; must divide the hidden size", min=1
    )
    selector_rank: int | None = knob(
        None,
        help="dflash2: width of the selector's token codes; none = min(256, hidden size) (256: the released drafters)",
        min=1,
    )
    selector_top_k: int = knob(
        16, help="dflash2: candidates (the target head's top-k) the selector ranks per block position", min=1
    )
    target_layer_ids: list[int] | None = knob(
        None,
        help="tap layer ids the drafter reads (id i = output of decoder layer i); none = the shards' taps "
        "(checked against them)",
        min=0,
    )
    mask_token_id: int | None = knob(
        None,
        help="mask token id; used only when neither the shards' provenance nor the target tokenizer has one (a "
        "conflict is an error)",
        min=0,
    )
    projection: str | None = knob(
        "auto",
        help="storage tier: which projected features fc reads; auto = the dataset's projection if it has one, "
        "none = full tap features only (a projected dataset is refused), or a projection checksum the dataset "
        "must have",
    )
    hidden_size: int | None = knob(
        None, help="drafter hidden size; none = the target's (the frozen embedding/lm_head must match it)", min=1
    )
    intermediate_size: int | None = knob(None, help="MLP width; none = the target's", min=1)
    num_attention_heads: int | None = knob(None, help="query heads; none = the target's", min=1)
    num_key_value_heads: int | None = knob(None, help="key/value heads; none = the target's", min=1)
    head_dim: int | None = knob(None, help="head dim; none = the target's", min=1)
    initializer_range: float | None = knob(
        None, help="init std of linear weights; none = the target's (0.02 for Qwen)", min=0.0
    )
    attention: Literal["auto", "flex", "sdpa"] = knob(
        "auto",
        help="attention kernel with the DFlash mask: flex (compiled on CUDA), sdpa with a dense mask, auto = flex "
        "where its CUDA kernel works for the head dim (16..256, Triton), else sdpa (train.kernels; the "
        "choice is logged)",
    )
    layer_types: list[str] | str = knob(
        "full",
        help="attention type per drafter layer: a list of full_attention / sliding_attention, or a preset: "
        "full, sliding, sliding_then_full (all sliding but the last: the published Qwen3.6 layout)",
    )
    sliding_window: int | None = knob(
        None,
        help="keys a sliding_attention query sees, its own position included (2048 in the published Qwen3.6 "
        "drafter); required with sliding layers",
        min=1,
    )
    sliding_in_block: Literal["causal", "bidirectional"] = knob(
        "causal",
        help="sliding_attention layers inside the block: causal (what vLLM and SGLang serve) or bidirectional "
        "(z-lab's earlier reference code: every layer non-causal, the window limits the context only); docs/serving.md",
    )
    rope_theta: float | None = knob(None, help="drafter rope theta; none = the target's", min=1.0)
    rope_scaling: dict | None = knob(
        None,
        help='drafter rope scaling as a table, e.g. {rope_type = "yarn", factor = 4.0, '
        "original_max_position_embeddings = 32768}; none = the target's (static types only)",
    )
    partial_rotary_factor: float = knob(
        1.0,
        help="share of each head's dims the drafter's rope rotates; 1.0 (all) by default, never the target's own "
        "factor (docs/serving.md, Rope)",
        min=0.01,
        max=1.0,
    )
    init_from: str | None = knob(
        None,
        help="warm start: a DFlash drafter directory (config.json + model.safetensors, e.g. a published drafter "
        "or an export), a training checkpoint or a run directory (its latest checkpoint) whose weights start the "
        "run; it must match this run's drafter exactly (taps, mask id, block, layer types, widths, rope). A DFlash "
        "drafter of the same widths may start a dflash2 run (any block size): the convolutions start as the "
        "identity, the selector fresh (train/warm_start.py)",
        path="local_in",
    )

    init_from_target: str = knob(
        "none",
        help="ablation: start each drafter layer from a target decoder layer: none (fresh, the published recipe), "
        "first, last, spread (first to last, evenly) or comma-separated target layer ids, one per drafter layer "
        "(train/target_init.py); the final norm comes from the target too. On the real target every rule did worse "
        "than none (docs/benchmarks-log-2026-11-30-to-2026-12-04.md, 'Real target')",
    )

    def resolve_block_size(self) -> None:
        """An unset block size becomes the class's (`DEFAULT_BLOCK_SIZE`)."""
        if self.block_size is None:
            set_resolved(self, "block_size", DEFAULT_BLOCK_SIZE[self.arch])

    def check(self) -> None:
        self.resolve_block_size()
        if self.arch == "dflash2" and self.conv_kernel_size > self.block_size:
            fail("model.conv_kernel_size", f"{self.conv_kernel_size} taps exceed the block of {self.block_size} rows")
        if self.arch == "dflash":
            changed = [k for k in DFLASH2_FIELDS if getattr(self, k) != getattr(ModelConfig, k)]
            if changed:
                fail(f"model.{changed[0]}", "a dflash2 setting, but model.arch is dflash (set model.arch=dflash2)")
        try:
            rule = parse_init_rule(self.init_from_target)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if rule is not None and self.init_from:
            fail("model.init_from_target", "set together with model.init_from: a run starts from one of them")
        if isinstance(rule, list) and len(rule) != self.num_layers:
            fail("model.init_from_target", f"{len(rule)} layer ids for model.num_layers={self.num_layers}")

        try:
            types = resolve_layer_types(self.layer_types, self.num_layers)
        except ValueError as exc:
            fail("model.layer_types", str(exc))
        if SLIDING_ATTENTION in types and self.sliding_window is None:
            fail("model.sliding_window", "required: model.layer_types has sliding_attention layers")
        if SLIDING_ATTENTION not in types and self.sliding_window is not None:
            fail(
                "model.sliding_window",
                f"set, but model.layer_types {self.layer_types!r} has no sliding_attention layer",
            )


@dataclass(frozen=True)
class LossConfig:
    """Anchors, labels and the objective (docs/dflash.md "Anchors", "Attention mask", "Loss"); the non-default values
    are ablations."""

    num_anchors: int = knob(
        512, help="blocks per sequence, sampled without replacement from eligible response positions", min=1
    )
    max_blocks: int | None = knob(
        None,
        help="cap on blocks per batch (all rows; per optimizer step when data parallel); rows' anchor counts "
        "shrink proportionally beyond it; bounds the memory of batches of many short samples; none = no cap",
        min=1,
    )
    gamma: float | None = knob(
        None,
        help="position decay w_k = exp(-(k-1)/gamma); none = paper value for the block size (7 for 16, 5 for 10, "
        "4 for 8)",
        min=0.01,
    )
    labels: Literal["target", "data"] = knob(
        "target",
        help="label of block position k: the target's stored top-1 for token a+k (default) or the data token "
        "itself (ablation)",
    )
    kl_weight: float = knob(
        0.0, help="weight of the soft top-k KL term against the stored top-k log-probs (ablation; 0 = off)", min=0.0
    )
    kl_temperature: float = knob(1.0, help="temperature of the soft KL term (teacher and student)", min=0.05, max=100.0)
    chunk_rows: int = knob(
        1024, help="block tokens per lm_head chunk: full-vocabulary logits exist for this many rows at once", min=1
    )
    selector_weight: float = knob(
        1.0,
        help="dflash2: weight of the selector loss (cross-entropy over the head's top-k candidates where the label "
        "is one of them, teacher-forced predecessors; train/selector_loss.py) once warmed up; 1.0 as SpecForge "
        "and NeMo",
        min=0.0,
    )
    selector_warmup_ratio: float = knob(
        0.0,
        help="dflash2: share of all steps at the start with selector weight 0 (the selector still runs)",
        min=0.0,
        max=1.0,
    )
    selector_ramp_ratio: float = knob(
        0.0,
        help="dflash2: share of all steps after the warm-up over which the selector weight rises linearly to "
        "loss.selector_weight; 0 = at once",
        min=0.0,
        max=1.0,
    )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine to 0 (docs/dflash.md "Optimizer and schedule")."""

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


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = knob(1000, help="save a checkpoint every this many steps (and always at the end)", min=1)
    keep_last: int = knob(3, help="keep this many most recent checkpoints", min=1)


@dataclass(frozen=True)
class LogConfig:
    progress: bool = knob(True, help="show a tqdm progress bar")
    wandb: bool = knob(False, help="also log to Weights & Biases (the run continues without it if wandb is absent)")
    wandb_project: str = knob("dflash-offline", help="wandb project")
    wandb_mode: Literal["offline", "online"] = knob(
        "offline", help="wandb mode; offline writes under the run directory"
    )


@dataclass(frozen=True)
class DistributedConfig:
    """Data parallel (`torchrun --nproc-per-node N -m train ...`; docs/ARCHITECTURE.md). The tokens
    of an optimizer step are fixed by data.token_budget whatever the world size: each global batch is
    split by tokens into world_size x accumulation micro-batches, so runs that differ only here are
    the same ablation."""

    accumulation: int = knob(
        1,
        help="micro-batches per process per optimizer step (gradient accumulation); 1 GPU with N matches N GPUs with 1",
        min=1,
        max=1024,
    )
    backend: Literal["auto", "nccl", "gloo"] = knob(
        "auto", help="torch.distributed backend for gradients: auto = nccl on CUDA, gloo on CPU"
    )
    timeout_s: float = knob(
        600.0,
        help="a collective waiting longer than this fails the run (a hung or lost rank); checkpoints stay, rerun "
        "resumes",
        min=1.0,
    )
    ddp_compile: Literal["outer", "inner"] = knob(
        "outer",
        help="with compile=true: outer = torch.compile(DDP(drafter)), Dynamo cuts the graph at the gradient "
        "buckets so the all-reduce "
        "overlaps the backward; inner = DDP(torch.compile(drafter)), one graph, the all-reduce after the backward "
        "(a fallback)",
    )
    bucket_mb: int = knob(
        250,
        help="DDP gradient bucket size in MiB: all-reduce granularity, overlapped with backward (under "
        "torch.compile each bucket is one graph piece: few large buckets)",
        min=1,
        max=4096,
    )


@dataclass(frozen=True)
class TrainConfig:
    run_name: str | None = knob(
        None, help="run directory name under out_dir (a plain name); none = run-YYYYmmdd-HHMMSS"
    )
    out_dir: str = knob("runs", help="directory that holds the run directories", path="dir_out")
    seed: int = knob(0, help="seed of the drafter init and of the anchor sampling", min=0)
    device: Literal["auto", "cpu", "cuda"] = knob("auto", help="auto = cuda when available")
    precision: Literal["auto", "bf16", "fp32"] = knob(
        "auto", help="bf16 autocast with fp32 master weights, or fp32; auto = bf16 on CUDA, fp32 on CPU"
    )
    compile: bool = knob(
        False,
        help="torch.compile the drafter and the loss chunk (needs Triton on CUDA, a C++ compiler on CPU; refused "
        "with the reason where it cannot work)",
    )
    resume: str = knob(
        "auto",
        help="auto: continue from the run's latest checkpoint if there is one; never: refuse an existing run; or "
        "a checkpoint directory",
    )
    stop_after: int | None = knob(None, help="stop after this step (the schedule is unchanged; resume later)", min=1)
    model: ModelConfig = knob(factory=ModelConfig, help="drafter")
    data: DataConfig = knob(factory=DataConfig, help="data stream")
    loss: LossConfig = knob(factory=LossConfig, help="blocks and objective")
    optim: OptimConfig = knob(factory=OptimConfig, help="optimizer and schedule")
    checkpoint: CheckpointConfig = knob(factory=CheckpointConfig, help="checkpoints")
    log: LogConfig = knob(factory=LogConfig, help="logging")
    distributed: DistributedConfig = knob(
        factory=DistributedConfig, help="data parallel over several processes / GPUs / nodes"
    )

    def check(self) -> None:
        if self.run_name is not None and (not _PLAIN_NAME.match(self.run_name) or self.run_name in (".", "..")):
            fail(
                "run_name",
                f"{self.run_name!r} must be a plain name: ASCII letters, digits, '.', '_' and '-', starting with a "
                "letter or digit",
            )
        # a directory name; filesystems stop at 255 bytes
        if self.run_name is not None and len(self.run_name) > MAX_NAME_CHARS:
            fail("run_name", f"{len(self.run_name)} characters; at most {MAX_NAME_CHARS}")
        if self.model.arch == "dflash":
            changed = [k for k in SELECTOR_LOSS_KEYS if getattr(self.loss, k) != getattr(LossConfig, k)]
            if changed:
                fail(f"loss.{changed[0]}", "a dflash2 setting, but model.arch is dflash (set model.arch=dflash2)")
        self.model.resolve_block_size()  # a default model table (none in the file) was never checked
        if self.loss.gamma is None:
            try:
                set_resolved(self.loss, "gamma", default_gamma(self.model.block_size))
            except ValueError as exc:
                fail("loss.gamma", str(exc))
        if self.model.attention == "flex" and self.device == "cpu":
            fail("model.attention", "flex has no backward on CPU; use sdpa or auto")


# Keys (dotted prefixes) that a resumed run may change.
RESUME_FREE_KEYS = (
    "resume",
    "stop_after",
    "run_name",
    "out_dir",
    "log",
    "checkpoint",
    "compile",
    "data.prefetch_threads",
    "data.prefetch_depth",
    "data.pin_memory",
    "data.verify_checksums",
    "data.verify_samples",
    "distributed",
)


def resume_conflicts(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between two config dicts, except the resume-free ones.

    A key the checkpoint does not have (a knob added after it was written) is no conflict when it
    holds its default now, nor when it is a `model.` key: the drafter those build is compared with
    the checkpoint's own drafter_config.json on load (`train.prepare.Run.load`).
    """
    a, b = flatten_dotted(saved), flatten_dotted(current)
    defaults = flatten_dotted(config_to_dict(TrainConfig()))
    keys = sorted(set(a) | set(b))
    free = lambda k: any(k == p or k.startswith(p + ".") for p in RESUME_FREE_KEYS)  # noqa: E731
    added = lambda k: k not in a and k in b and (b[k] == defaults.get(k, object()) or k.startswith("model."))  # noqa: E731
    return [
        f"{k}: checkpoint {a.get(k, '<absent>')!r} vs now {b.get(k, '<absent>')!r}"
        for k in keys
        if not free(k) and not added(k) and a.get(k) != b.get(k)
    ]
