"""`ExtractConfig`: every knob of `python -m extract`, with help text and allowed values.

Loaded from the `[extract]` table of a TOML file plus `key=value` overrides (`common.config`) and
validated before any model is loaded. `check` also settles every key that has a default chosen
elsewhere: `layer_ids = "auto"` (the default) the published taps for the target's depth, read from its
config.json (`target.rules.auto_layer_ids`, logged with its reason), the storage settings left at
none the shard writer's defaults, and a storage tier's encoding its canonical name, so the saved config
and the provenance name the settings actually used. Checks that need the target's config (layer ids
below the layer count) run in `target.load.check_layer_ids` as soon as `config.json` is read, still
before any weights are touched; the chat template variables of a regenerated corpus are settled with
the corpus (`extract.checks.check_inputs`).

Keys split in two groups (see `DATASET_KEYS`): those that decide what the dataset holds (target,
corpus, taps, k, lengths, dtype, encoding) and runtime knobs (batch size, devices, threads...).
A resumed run must match the stored dataset keys exactly; runtime knobs may change between runs
(for example a smaller `tokens_per_batch` after an out-of-memory crash).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Literal

from common.config import ATTN_IMPLEMENTATIONS, fail, knob, set_resolved
from shards.projection import parse_projection_spec
from shards.quant import canonical_encoding, parse_encoding
from shards.schema import DEFAULT_ENCODING, DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL
from target.chat_template import check_chat_template
from target.rules import auto_layer_ids, config_depth, layer_ids_problem

log = logging.getLogger("extract")
HIDDEN_ENCODINGS = ("planes", "plain")  # the lossless ones; storage tiers: shards.quant.parse_encoding
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
ALLOWED_TEMPLATE_KWARG_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class ExtractConfig:
    # -- target ------------------------------------------------------------------------------
    target: str = knob(
        help="local directory of the target checkpoint (Hugging Face layout: config.json, weights, tokenizer)",
        path="local_in",
    )
    out_dir: str = knob(
        help="output directory, a local or mounted path (shared by all nodes); with `splits`, each split goes to "
        "out_dir/NAME",
        path="data_out",
    )
    trust_remote_code: bool = knob(
        False, help="allow code shipped with the checkpoint to run (only for checkpoints you trust)"
    )
    dtype: Literal["bfloat16", "float16", "float32"] = knob(
        "bfloat16", help="compute dtype of the target; stored hidden states are always bf16, log-probs float32"
    )
    attn_implementation: str = knob(
        "sdpa", help="attention kernel of the full-attention layers", choices=ATTN_IMPLEMENTATIONS
    )
    mask_token_id: int | None = knob(
        None,
        help="token id DFlash fills draft positions with, recorded in the provenance; default: the tokenizer's "
        "mask_token",
        min=0,
    )

    # -- corpus ------------------------------------------------------------------------------
    corpus: str = knob(
        "",
        help="corpus: a .jsonl/.parquet file, a directory of them, a glob, or a saved `datasets` directory",
        path="local_in",
    )
    splits: dict[str, str] = knob(
        factory=dict,
        help="several corpora in one run, {name = corpus path}; split NAME is written to out_dir/NAME (leave "
        "`corpus` empty)",
        path="local_in",
    )
    corpus_format: Literal["auto", "jsonl", "parquet", "datasets"] = knob(
        "auto",
        help="how to read the corpus; auto decides from the file suffix (a directory with dataset_info.json is "
        "`datasets`)",
    )
    streaming: bool = knob(True, help="read Parquet / datasets corpora as a stream (no cache copy, constant memory)")
    max_records: int | None = knob(
        None, help="read only the first N records of the corpus (smoke tests, benchmarks)", min=1
    )
    chat_template: str | None = knob(
        None,
        help="a Jinja chat template file that renders chat records instead of the tokenizer's own (a target without "
        "one: a base model); hashed into the provenance as the tokenizer's chat_template_hash",
        path="local_in",
    )
    chat_template_kwargs: dict = knob(
        factory=dict, help="extra variables for the chat template, e.g. {enable_thinking = false}"
    )

    # -- what is stored ------------------------------------------------------------------------
    layer_ids: list[int] | Literal["auto"] = knob(
        "auto",
        help="tap layers: id i = output of decoder layer i (0-based) = HF output_hidden_states[i+1]; auto = the "
        "published rule for the target's depth (5 taps from layer 1 to L-3, evenly; fewer under 10 layers: "
        "target.rules)",
    )
    topk: int = knob(32, help="how many of the target's top final-logit entries to store per token", min=1, max=4096)
    max_len: int = knob(3072, help="longest sample in tokens (see length_policy)", min=2, max=1 << 20)
    length_policy: Literal["truncate", "drop"] = knob(
        "truncate", help="samples over max_len are cut to max_len, or rejected"
    )
    min_loss_tokens: int = knob(
        32, help="reject samples with fewer loss (assistant) tokens than this (2 x block size 16)", min=0
    )
    hidden_encoding: str | None = knob(
        None,
        help="how shards store hidden states: planes / plain (lossless), or a storage tier quantized on the GPU: fp8, "
        "int4-gG, nf4-gG (shards/FORMAT.md, 'Storage tiers'); none = the shard writer's default (planes)",
    )
    projection: str | None = knob(
        None,
        help="storage tier: store P·h instead of the taps, P fitted by PCA on a calibration pass (pca:rank=R per tap, "
        "pca:variance=V), or a projection file to reuse; the export folds P into fc; none = the taps themselves",
    )
    calibration_samples: int = knob(
        256,
        help="with projection = pca:...: the first this many samples of the corpus make the calibration pass (on "
        "rank 0)",
        min=1,
    )

    # -- throughput ----------------------------------------------------------------------------
    tokens_per_batch: int = knob(
        8192, help="token budget of a micro-batch, counting padding (batch size x longest sample)", min=1
    )
    packing: bool = knob(
        False,
        help="one packed row per forward: the samples one after another, no padding, at most tokens_per_batch "
        "tokens; refused unless every layer keeps the samples apart (attention: transformers' document mask, SDPA "
        "once per sample; Gated DeltaNet layers: only fla's CUDA kernels; a probe forward checks it); not with a "
        "storage tier yet",
    )
    logits_chunk: int = knob(
        1024, help="positions per lm_head chunk; full-vocabulary logits exist for this many positions at once", min=1
    )
    sort_window: int = knob(8192, help="records read ahead and sorted by length before batching", min=1)
    inflight_batches: int = knob(
        4,
        help="micro-batches in flight (pinned host buffers, each on loan until its samples are written); bounds "
        "host memory",
        min=2,
        max=64,
    )
    writer_threads: int = knob(
        4,
        help="threads pyarrow uses to zstd-compress shards (one background thread writes; another unpacks results)",
        min=1,
        max=256,
    )
    launch_ahead_layers: int = knob(
        0,
        help="GPU: the host launches at most this many decoder layers ahead of the GPU and waits for it with the GIL "
        "released (0 = no limit: launches block in the driver once its queue is full)",
        min=0,
        max=4096,
    )
    gil_switch_interval: float | None = knob(
        None,
        help="sys.setswitchinterval during the extraction, in seconds (how soon a thread waiting for the GIL gets it); "
        "none = Python's own (5 ms)",
        min=1e-6,
        max=1.0,
    )
    shard_bytes: int | None = knob(
        None, help="size at which a shard file is closed, in bytes; none = the shard writer's default", min=1 << 10
    )
    zstd_level: int | None = knob(
        None,
        help="zstd level of the shards (1 fastest .. 22 smallest); none = the shard writer's default",
        min=1,
        max=22,
    )

    # -- devices -------------------------------------------------------------------------------
    device: str = knob("auto", help="auto (cuda:LOCAL_RANK if a GPU exists, else cpu), cpu, cuda, or cuda:N")
    gpus_per_replica: int = knob(
        1,
        help="GPUs one target replica spans (device_map); process r uses GPUs r*G .. r*G+G-1 of its node",
        min=1,
        max=64,
    )
    device_map: str | None = knob(
        None, help="accelerate device_map strategy when gpus_per_replica > 1 (default auto)", choices=DEVICE_MAPS
    )

    # -- behaviour -----------------------------------------------------------------------------
    on_error: Literal["skip", "fail"] = knob(
        "skip", help="on a bad record: skip it (counted, written to rejects.jsonl) or stop"
    )
    progress: bool = knob(True, help="show a progress bar (rank 0)")
    seed: int = knob(0, help="seed for torch (extraction itself draws no random numbers)", min=0)

    def check(self) -> None:
        if not self.target:
            fail("target", "must name the target checkpoint directory")
        if not self.out_dir:
            fail("out_dir", "must name the output directory")
        if self.corpus and self.splits:
            fail(
                "corpus",
                f"corpus = '{self.corpus}' is given, but the config also sets splits ({', '.join(self.splits)}), each "
                "written to out_dir/NAME. To extract only this corpus into out_dir, also pass splits={} (on the "
                "command "
                "line: 'splits={}'); to extract the splits, leave corpus empty",
            )
        if not self.corpus and not self.splits:
            fail(
                "corpus",
                "name the corpus to extract (corpus=PATH: a .jsonl/.parquet file, a directory or glob of them) "
                "or several in `splits` ({name = path}, each written to out_dir/NAME)",
            )
        for name, path in self.splits.items():
            if not isinstance(path, str) or not path:
                fail(f"splits.{name}", f"expected a corpus path, got {path!r}")
            if not name or "/" in name or name.startswith(".") or "\x00" in name:
                fail(
                    f"splits.{name}",
                    "split names become directory names: non-empty, no '/' or NUL, not starting with '.'",
                )
            if len(name.encode("utf-8")) > 128:  # filesystems stop at 255 bytes per name
                fail(
                    f"splits.{name[:40]}...",
                    f"a split name becomes a directory name: at most 128 bytes, got {len(name.encode('utf-8'))}",
                )
        self._resolve_layer_ids()
        if isinstance(self.layer_ids, list):  # else auto, left for a target that is not there: refused by name
            self._check_layer_ids()
        if self.tokens_per_batch < self.max_len:
            fail(
                "tokens_per_batch",
                f"{self.tokens_per_batch} is below max_len {self.max_len}; a longest sample must fit one micro-batch",
            )
        tiered = self.projection is not None or self.hidden_encoding not in (None, *HIDDEN_ENCODINGS)
        if self.packing and tiered:
            fail(
                "packing", "not with a storage tier (hidden_encoding / projection) yet: its error sums are kept per row"
            )
        if self.min_loss_tokens > self.max_len:
            fail("min_loss_tokens", f"{self.min_loss_tokens} exceeds max_len {self.max_len}; no sample could pass")
        check_chat_template(self.chat_template)
        for key, value in self.chat_template_kwargs.items():
            if not isinstance(value, ALLOWED_TEMPLATE_KWARG_TYPES):
                fail(f"chat_template_kwargs.{key}", f"expected a boolean, number or string, got {value!r}")
        if not (self.device in ("auto", "cpu", "cuda") or _is_cuda_index(self.device)):
            fail("device", f"{self.device!r} is not allowed; use auto, cpu, cuda or cuda:N")
        if self.device_map is not None and self.gpus_per_replica == 1:
            warnings.warn(
                "extract: device_map is set but gpus_per_replica is 1; the target stays on one device", stacklevel=2
            )
        if self.hidden_encoding is not None and self.hidden_encoding not in HIDDEN_ENCODINGS:
            try:
                set_resolved(self, "hidden_encoding", canonical_encoding(self.hidden_encoding))
            except ValueError:
                fail(
                    "hidden_encoding",
                    f"{self.hidden_encoding!r} is not allowed; allowed: planes, plain (lossless), fp8, int4-gG, nf4-gG "
                    "(G = 4-bit group size in 16..1024, int4 / nf4 alone = 64)",
                )
        if self.projection is not None and self.projection.startswith("pca:"):
            try:
                spec = parse_projection_spec(self.projection)
            except ValueError as err:
                fail("projection", str(err).removeprefix("projection: "))
            quant = parse_encoding(self.hidden_encoding or "planes")
            if spec.rank is not None and quant is not None and quant.four_bit and spec.rank % quant.group_size:
                fail(
                    "projection",
                    f"rank {spec.rank} per tap is not a multiple of {quant.name}'s group size {quant.group_size}",
                )
        if self.gpus_per_replica > 1 and self.device == "cpu":
            fail("gpus_per_replica", "spanning several GPUs needs a GPU device, but device = cpu")
        self._settle_storage_defaults()

    def _settle_storage_defaults(self) -> None:
        """Storage settings left at none -> the shard writer's defaults (named in the saved config)."""
        for key, default in (
            ("hidden_encoding", DEFAULT_ENCODING),
            ("zstd_level", DEFAULT_ZSTD_LEVEL),
            ("shard_bytes", DEFAULT_SHARD_BYTES),
        ):
            if getattr(self, key) is None:
                set_resolved(self, key, default)

    def _resolve_layer_ids(self) -> None:
        """`layer_ids = "auto"`: the published taps for the target's depth, read from its config.json
        (left as is where the target has none: the pipeline then refuses the target by name)."""
        if self.layer_ids != "auto" or not os.path.isfile(os.path.join(self.target, "config.json")):
            return
        try:
            num_layers = config_depth(self.target)
        except ValueError as exc:
            fail("layer_ids", f"auto: {exc}; give the tap ids as a list")
        ids, reason = auto_layer_ids(num_layers)
        log.info("layer_ids = auto: %s (%s)", ids, reason)
        set_resolved(self, "layer_ids", ids)

    def _check_layer_ids(self) -> None:
        if not self.layer_ids:
            fail("layer_ids", "needs at least one tap layer")
        if min(self.layer_ids) < 0:
            fail("layer_ids", f"{min(self.layer_ids)} is below the minimum 0")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            dupes = sorted({i for i in self.layer_ids if self.layer_ids.count(i) > 1})
            fail("layer_ids", f"ids must be unique; repeated: {dupes}")
        # Against the target's depth as soon as its config.json is there (before a drafter command's
        # first step, not minutes later when the target loads); an unreadable one is refused by name later.
        if os.path.isfile(os.path.join(self.target, "config.json")):
            try:
                problem = layer_ids_problem(self.layer_ids, config_depth(self.target))
            except ValueError:
                problem = None
            if problem:
                fail("layer_ids", problem)

    def split_configs(self) -> dict[str | None, ExtractConfig]:
        """One single-corpus config per output dataset: {None: self} or {name: config for out_dir/name}."""
        if not self.splits:
            return {None: self}
        return {
            name: dataclasses.replace(self, corpus=path, splits={}, out_dir=_join(self.out_dir, name))
            for name, path in self.splits.items()
        }


# Keys that decide the content of the dataset. A resume must match them exactly; the others are
# runtime knobs that may change between runs of the same dataset.
# The target and the corpus are compared by content digest (see extract.provenance), not by path, so a
# moved checkpoint or corpus still resumes.
DATASET_KEYS = (
    "dtype",
    "mask_token_id",
    "max_records",
    "chat_template_kwargs",
    "layer_ids",
    "topk",
    "max_len",
    "length_policy",
    "min_loss_tokens",
    "hidden_encoding",
    "projection",  # (calibration_samples is not: a resumed run keeps the dataset's projection file)
)


def dataset_keys(cfg: ExtractConfig) -> dict:
    """The dataset-defining part of a config, as plain data (stored in the manifest, compared on resume)."""
    return {key: getattr(cfg, key) for key in DATASET_KEYS}


def _is_cuda_index(device: str) -> bool:
    head, _, tail = device.partition(":")
    return head == "cuda" and tail.isdigit()


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name
