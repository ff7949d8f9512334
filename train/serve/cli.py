"""The command lines of serving, `python -m train.export` and `python -m train.specdecode`: built
without torch, so that `--help` and a usage error answer before the heavy modules load.
"""

from __future__ import annotations

import argparse

from common.config import dtype_spelling

DEFAULT_PROMPTS = "artifacts/tiny/corpus/heldout.jsonl"
EXPORT_DTYPES = ("bfloat16", "float16", "float32")
EXPORT_DESCRIPTION = (
    'Export a training checkpoint as a Hugging Face DFlash drafter directory (docs/dflash.md "Export format").'
)
SPECDECODE_DESCRIPTION = (
    "Real greedy speculative decoding with a target and an exported DFlash drafter, against target-only\n"
    "greedy decoding, and the agreement of offline chain τ with the online τ."
)


def export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.export", description=EXPORT_DESCRIPTION)
    parser.add_argument("checkpoint", help="checkpoint directory (step-XXXXXXXX) or run directory (latest checkpoint)")
    parser.add_argument("out_dir", help="directory to write the Hugging Face export into")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        type=dtype_spelling,
        choices=EXPORT_DTYPES,
        help="weight dtype in model.safetensors (published: bfloat16); bf16, fp16, fp32 name the same types",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="target checkpoint directory for bos/eos ids and a shape check (default: the run's)",
    )
    parser.add_argument(
        "--projection",
        default=None,
        help="drafters trained on projected features: the projection file to fold into fc (default: the training "
        "dataset's)",
    )
    return parser


def parse_specdecode_args(argv: list[str] | None) -> argparse.Namespace:
    """The options of `python -m train.specdecode`, checked (argparse's usage error on a bad one)."""
    parser = argparse.ArgumentParser(prog="python -m train.specdecode", description=SPECDECODE_DESCRIPTION)
    parser.add_argument("--target", required=True, help="target checkpoint directory (Hugging Face layout)")
    parser.add_argument("--drafter", required=True, help="exported drafter directory (python -m train.export)")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="build the drafter with the dflash.py its directory ships (runs that code); default: this project's "
        "model code",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prompts", default=None, help=f'JSONL of {{"messages": [...]}} records (default: {DEFAULT_PROMPTS})'
    )
    source.add_argument(
        "--data", default=None, help="shard dataset: prompts = the tokens before each sample's first response"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=16, help="use the first N prompts; 0 = all")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--agreement", action="store_true", help="also compare offline chain τ with the online τ")
    parser.add_argument(
        "--agreement-bf16", action="store_true", help="round the offline features to bf16, as shards store them"
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip target-only decoding (no speed-up, no lossless check)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        type=dtype_spelling,
        choices=("float32", "bfloat16", "float16"),
        help="target and drafter dtype; bf16, fp16, fp32 name the same types",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument(
        "--thinking",
        action="store_true",
        help="render prompts with enable_thinking=True (default: non-thinking, as the published drafters)",
    )
    parser.add_argument(
        "--no-context-cache", action="store_true", help="recompute the drafter's context every round (checks the cache)"
    )
    parser.add_argument(
        "--tree-budgets",
        default="",
        help="also verify DDTrees of these node budgets, e.g. 8,32 (stretch goal; not for hybrid targets)",
    )
    parser.add_argument(
        "--stop-repeat",
        type=int,
        default=0,
        help="end each response where it starts looping: after its last N >= max(this, p) tokens repeat the p before "
        "them (p <= 64; the rule extract.tiny cuts its regenerated answers by); 0 = off",
    )
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.num_prompts < 0:
        parser.error("--max-new-tokens must be >= 1 and --num-prompts >= 0")
    if args.stop_repeat < 0:
        parser.error("--stop-repeat must be >= 0")
    try:
        args.tree_budgets = [int(b) for b in args.tree_budgets.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--tree-budgets must be comma-separated integers, got {args.tree_budgets!r}")
    if any(b < 1 for b in args.tree_budgets):
        parser.error("--tree-budgets must be >= 1")
    return args
