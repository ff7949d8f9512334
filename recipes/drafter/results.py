"""The numbers a drafter command's summary quotes, read back from the files its steps wrote (the
offline evaluation's JSON, speculative decoding's JSON), and how the summaries print them. A file
that is missing or unreadable reads as {}: its numbers print as n/a.
"""

from __future__ import annotations

from common.io import read_record

DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", None: "fp32"}
EVAL_KEYS = ("n_blocks", "tau", "all_accepted", "ddtree_tau_8", "ddtree_tau_16", "ddtree_tau_32", "ddtree_tau_64")


def num(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def pick_eval(overall: dict) -> dict:
    """An offline evaluation's headline numbers: blocks, τ, DDTree τ per budget, acceptance at k=1."""
    picked = {k: overall[k] for k in EVAL_KEYS if k in overall}
    acceptance = overall.get("position_acceptance") or []
    if acceptance:
        picked["acceptance_k1"] = acceptance[0]
    return picked


def eval_pair(path: str) -> tuple[dict, dict]:
    """(drafter, most-frequent-label baseline) headline numbers of an offline evaluation's JSON."""
    evaluation = read_record(path)
    checkpoints = evaluation.get("checkpoints") or [{}]
    return pick_eval(checkpoints[0].get("overall", {})), pick_eval(
        (evaluation.get("baseline") or {}).get("overall", {})
    )


def eval_unary(path: str) -> dict:
    """A DFlash2 checkpoint's unary headline numbers (the head's argmax and its tree, beside the selector's
    proposals in `overall`); {} for a DFlash checkpoint."""
    checkpoints = read_record(path).get("checkpoints") or [{}]
    return pick_eval((checkpoints[0].get("unary") or {}).get("overall", {}))


def pick_spec(spec: dict) -> dict:
    """Speculative decoding's headline numbers: τ, lossless, speed against target-only greedy decoding, and
    the path that speed was measured on (`train.serve.spec_target.decoding_path`)."""
    summary, config = spec.get("summary", {}), spec.get("config", {})
    agreement = spec.get("agreement", {})
    return {
        "prompts": summary.get("prompts"),
        "max_new_tokens": config.get("max_new_tokens"),
        "tau": summary.get("tau"),
        "stop_repeat": config.get("stop_repeat"),
        "device": config.get("device"),
        "dtype": config.get("dtype"),
        "lossless": summary.get("lossless"),
        "speedup": summary.get("speedup"),
        "spec_tokens_per_s": summary.get("spec", {}).get("decode_tokens_per_s"),
        "target_tokens_per_s": summary.get("baseline", {}).get("decode_tokens_per_s"),
        "offline_tau_at_rounds_bf16": agreement.get("offline_tau_at_rounds"),
        "decoding_path": spec.get("decoding_path"),
    }


def machine_line(machine: dict) -> str:
    where = f"GPU ({machine.get('gpu')})" if machine.get("device") == "cuda" else "CPU"
    return (
        f"{where}; {machine.get('cpu')}, {machine.get('cores')} usable cores, {machine.get('threads')} torch CPU "
        "threads, "
        f"torch {machine.get('torch')}"
    )


def timings_line(timings: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items())
