"""`python -m train.serve.export CHECKPOINT OUT_DIR [key=value | --key value ...]`: export a training
checkpoint as a Hugging Face DFlash drafter directory (the format: `train.export_format.layout`).

    python -m train.serve.export runs/NAME exports/NAME              # the run's latest checkpoint
    python -m train.serve.export runs/NAME/checkpoints/step-00001000 exports/NAME dtype=float32
    make export CKPT=runs/NAME OUT=exports/NAME

The options are read before torch loads (`train.serve.cli`), so `--help` and a usage error answer at
once. Exit statuses: docs/ARCHITECTURE.md, "Exit status".
"""

from __future__ import annotations

import json
import sys

from common.config import ConfigError
from common.interrupts import run_main
from train.layer_types import SLIDING_ATTENTION
from train.serve.cli import ExportConfig, parse_export_args, usage_error

TARGET_CHECK_WORDS = {
    "same": "the run's target (checked)",
    "allowed": "NOT the run's target, allowed by allow_target_mismatch (dflash_export.json says what differs)",
    "unchecked": "not checked (no target directory, or the run records no target identity)",
}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_export_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        return usage_error("train.serve.export", exc)
    return export(args)


def export(args: ExportConfig) -> int:
    """Write the export and print what it holds, which target it is for, and how to load it."""
    from transformers.utils import logging as hf_logging

    from train.export_format.layout import (
        CONFIG_FILE,
        INFO_FILE,
        drafter_config_from_export,
        export_checkpoint,
        resolve_checkpoint,
        serving_warnings,
        target_warnings,
    )

    hf_logging.disable_progress_bar()
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            dtype=args.dtype,
            target=args.target,
            projection=args.projection,
            allow_target_mismatch=args.allow_target_mismatch,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = json.loads((out / CONFIG_FILE).read_text())
    nested = config["dflash_config"]
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out} ({config['architectures'][0]})")
    print(
        f"  {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, block {config['block_size']}, "
        f"target_layer_ids {nested['target_layer_ids']}, mask {nested['mask_token_id']}, {args.dtype}"
    )
    if "selector_top_k" in nested:
        print(
            f"  DFlash2: convolution {nested['conv_kernel_size']} taps in groups of {nested['conv_group_size']}, "
            f"selector rank {nested['selector_rank']} over the top {nested['selector_top_k']} candidates"
        )
    if "input_embedding_scale" in nested:
        print(f"  input_embedding_scale {nested['input_embedding_scale']:.6g} (the target's embedding scale)")
    if SLIDING_ATTENTION in config["layer_types"]:
        print(
            f"  layer_types {config['layer_types']}, sliding_window {config['sliding_window']}, "
            f"causal per layer {config['dflash_config']['layer_causal']}"
        )
    check = json.loads((out / INFO_FILE).read_text())["target_check"]
    print(f"  target {check.get('target')}: {TARGET_CHECK_WORDS[check['status']]}")
    for warning in serving_warnings(drafter_config_from_export(config)) + target_warnings(check.get("target")):
        print(f"  warning: {warning}")
    print(f"  load: AutoModel.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("export", main))
