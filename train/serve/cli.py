"""The command lines of serving, `python -m train.serve.export` and `python -m train.serve.specdecode`, as
configs read by the grammar every entry point shares (`common.config.parse_command`:
positional values, `key=value`, or `--key value`). Built without torch, so that `--help` and a
usage error answer before the heavy modules load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.config import ATTN_IMPLEMENTATIONS, ConfigError, fail, knob, parse_command
from target.chat_template import check_chat_template

DEFAULT_PROMPTS = "artifacts/tiny/corpus/heldout.jsonl"
# The peer baselines a run can decode beside ours (`train.serve.peers`), in the order they run.
PEERS = ("generate", "prompt_lookup", "generate_static")

EXPORT_USAGE = """usage: python -m train.serve.export CHECKPOINT OUT_DIR [key=value | --key value ...]

Export a training checkpoint as a Hugging Face DFlash drafter directory (docs/dflash.md "Export format")."""

SPECDECODE_USAGE = """usage: python -m train.serve.specdecode --target DIR --drafter DIR [key=value | --key value ...]

Real greedy speculative decoding with a target and an exported DFlash drafter, against target-only
greedy decoding, and the agreement of offline chain τ with the online τ."""


@dataclass(frozen=True)
class ExportConfig:
    """`python -m train.serve.export CHECKPOINT OUT_DIR`."""

    checkpoint: str = knob(
        help="checkpoint directory (step-XXXXXXXX) or run directory (latest checkpoint)", path="local_in"
    )
    out_dir: str = knob(help="directory to write the Hugging Face export into", path="dir_out")
    dtype: Literal["bfloat16", "float16", "float32"] = knob(
        "bfloat16", help="weight dtype in model.safetensors (published: bfloat16)"
    )
    target: str | None = knob(
        None, help="target checkpoint directory for bos/eos ids and a shape check (default: the run's)", path="local_in"
    )
    projection: str | None = knob(
        None,
        help="drafters trained on projected features: the projection file to fold into fc (default: the training "
        "dataset's)",
        path="local_in",
    )
    allow_target_mismatch: bool = knob(
        False,
        help="export for a target other than the one the run trained with (config hash, weights digest or "
        "embedding and head digest differ): for a deliberate copy, such as the same weights re-saved in another "
        "dtype; dflash_export.json records what differed",
    )


@dataclass(frozen=True)
class SpecDecodeConfig:
    """`python -m train.serve.specdecode --target DIR --drafter DIR`."""

    target: str = knob(help="target checkpoint directory (Hugging Face layout)", path="local_in")
    drafter: str = knob(help="exported drafter directory (python -m train.serve.export)", path="local_in")
    trust_remote_code: bool = knob(
        False,
        help="build the drafter with the dflash.py its directory ships (runs that code); default: this project's "
        "model code",
    )
    prompts: str | None = knob(
        None,
        help=f'JSONL of {{"messages": [...]}} records, rendered with the chat template, or {{"text": ...}} records, '
        f"tokenized as given (base models) (default: {DEFAULT_PROMPTS})",
        path="local_in",
    )
    chat_template: str | None = knob(
        None,
        help="a Jinja chat template file that renders the prompts instead of the tokenizer's own (a target without "
        "one: a base model); its hash is recorded with the result",
        path="local_in",
    )
    data: str | None = knob(
        None, help="shard dataset: prompts = the tokens before each sample's first response", path="data_in"
    )
    max_new_tokens: int = knob(256, help="tokens generated per prompt", min=1)
    num_prompts: int = knob(16, help="use the first N prompts; 0 = all", min=0)
    time_limit_s: float = knob(
        0.0,
        help="seconds from the command's start within which it ends: it decodes as many of the prompts as fit (no "
        "prompt starts that would not end in time, the first always runs), then reports on those and says how many "
        "of how many it decoded; 0 = no limit",
        min=0.0,
    )
    out: str | None = knob(None, help="write the results as JSON here", path="file_out")
    agreement: bool = knob(False, help="also compare offline chain τ with the online τ")
    agreement_bf16: bool = knob(False, help="round the offline features to bf16, as shards store them")
    no_baseline: bool = knob(False, help="skip target-only decoding (no speed-up, no lossless check)")
    static_cache: Literal["auto", "on", "off"] = knob(
        "auto",
        help="the target on a static KV cache with CUDA graphs for its 1-token and block forwards "
        "(train.serve.static_target), for target-only and speculative decoding alike, and the drafter on a slot "
        "cache with its rounds as one CUDA graph (train.serve.static_drafter); auto = on with CUDA, "
        "unless DDTree budgets are given or the target has recurrent layers",
    )
    compile: Literal["auto", "off", "default", "max-autotune"] = knob(
        "auto",
        help="with the static cache on CUDA: compile the target's decoder layers (inductor, this mode) while its CUDA "
        "graphs are captured, so replays run fused kernels (train.serve.fusion). The target-only reference replays "
        "the same graphs, so the speed-up is against the fastest baseline we have; auto = default; max-autotune "
        "tunes longer for faster kernels (what each costs and gains: docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "
        "'Real target')",
    )
    verify_tokens: int = knob(
        0,
        help="block positions each round verifies: the anchor and the first N-1 drafts (0 = the block size). "
        "A round then commits at most N tokens from a verify forward of N rows: on a GPU, float32 products of 16 "
        "rows cost about twice a one-token step, so a drafter that rarely gets past its first drafts can pay more "
        "with a shorter verify (still lossless)",
        min=0,
    )
    verify_sweep: str = knob(
        "",
        help="also decode every prompt at each of these verify sizes, e.g. 2,4,8 (one summary each, each checked "
        "lossless against the same target-only decoding): prices several sizes with one compile and one baseline",
    )
    peer_baselines: bool = knob(
        False,
        help="also decode every prompt with transformers' own generate: plain greedy and prompt-lookup decoding "
        "(the speed-ups any user gets without a drafter), each checked against target-only greedy decoding",
    )
    peers: str = knob(
        "generate,prompt_lookup,generate_static",
        help="peer baselines: which of them, comma-separated (generate, prompt_lookup, generate_static: `generate` "
        "with a static cache, which compiles again for every prompt shape)",
    )
    peer_prompts: int = knob(
        0,
        help="peer baselines: decode only the first N prompts with them (0 = all); their speed-up is against "
        "target-only greedy decoding of the same prompts",
        min=0,
    )
    prompt_lookup_tokens: int = knob(
        10, help="peer baseline: prompt_lookup_num_tokens of transformers' prompt-lookup decoding", min=1, max=64
    )
    dtype: Literal["float32", "bfloat16", "float16"] = knob("float32", help="target and drafter dtype")
    attn_implementation: str = knob(
        "sdpa",
        help="the target's attention implementation in transformers (Gemma2 and gpt-oss have no sdpa one: eager; "
        "auto: transformers' choice for the target); the result records the one used",
        choices=ATTN_IMPLEMENTATIONS,
    )
    allow_target_mismatch: bool = knob(
        False,
        help="decode with a target other than the one the drafter was exported for (config hash, weights digest or "
        "embedding and head digest differ): for a deliberate copy, such as the same weights re-saved in another "
        "dtype; the result records what differed",
    )
    tf32: bool = knob(
        False,
        help="CUDA, float32: matrix products on TF32 tensor cores for every decoding of the run alike (target-only "
        "reference, verify, drafter), so the lossless check compares like with like. Faster, but not lossless: "
        "on SmolLM2-135M, 12 of 164 HumanEval answers differed from target-only greedy decoding at near-ties "
        "(top-2 margins 0.0002-0.016; float32: 164 of 164 identical), so a speed measurement only",
    )
    device: str = knob("cpu", help="torch device of the target and the drafter")
    threads: int = knob(0, help="torch CPU threads (0 = torch's default)", min=0)
    thinking: bool = knob(
        False, help="render prompts with enable_thinking=True (default: non-thinking, as the published drafters)"
    )
    no_context_cache: bool = knob(False, help="recompute the drafter's context every round (checks the cache)")
    tree_budgets: str = knob(
        "", help="also verify DDTrees of these node budgets, e.g. 8,32 (stretch goal; not for hybrid targets)"
    )
    stop_repeat: int = knob(
        0,
        help="end each response where it starts looping: after its last N >= max(this, p) tokens repeat the p before "
        "them (p <= 64; the rule recipes.tiny cuts its regenerated answers by); 0 = off",
        min=0,
    )

    def check(self) -> None:
        if self.prompts is not None and self.data is not None:
            fail("data", "give prompts or data, not both")
        check_chat_template(self.chat_template)
        check_positive_ints("tree_budgets", self.tree_budgets, "budget")
        check_positive_ints("verify_sweep", self.verify_sweep, "size")
        unknown = [name for name in self.peer_names if name not in PEERS]
        if unknown or not self.peer_names:
            fail("peers", f"{self.peers!r}: give one or more of {', '.join(PEERS)}")

    @property
    def peer_names(self) -> list[str]:
        """The peer baselines `peers` names, in the order of `PEERS`."""
        asked = [name.strip() for name in self.peers.split(",") if name.strip()]
        return [name for name in PEERS if name in asked] + [name for name in asked if name not in PEERS]

    @property
    def compile_mode(self) -> str | None:
        """The `train.serve.fusion` mode the static-cache target compiles with, or None."""
        return {"auto": "default", "off": None}.get(self.compile, self.compile)

    @property
    def sweep(self) -> list[int]:
        """The verify sizes of `verify_sweep`, in order, each once."""
        return list(dict.fromkeys(int(n) for n in self.verify_sweep.split(",") if n.strip()))

    @property
    def budgets(self) -> list[int]:
        """The DDTree node budgets of `tree_budgets`, in order."""
        return [int(b) for b in self.tree_budgets.split(",") if b.strip()]


def check_positive_ints(key: str, text: str, noun: str) -> None:
    """ConfigError naming `key` unless `text` is comma-separated integers, each >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(key, f"must be comma-separated integers, got {text!r}")
    if any(v < 1 for v in values):
        fail(key, f"every {noun} must be >= 1, got {text!r}")


def parse_export_args(argv: list[str]) -> ExportConfig:
    return parse_command(ExportConfig, argv, positional=["checkpoint", "out_dir"], usage=EXPORT_USAGE)


def parse_specdecode_args(argv: list[str]) -> SpecDecodeConfig:
    return parse_command(SpecDecodeConfig, argv, usage=SPECDECODE_USAGE)


def usage_error(command: str, exc: ConfigError) -> int:
    """What an entry point does with a bad command line: say so, naming the key, and exit 2."""
    import sys

    print(f"{command}: {exc} (--help lists the keys)", file=sys.stderr)
    return 2
