"""The work of `python -m train.serve.specdecode` (`run`, given the options `train.serve.cli` read):
check the target against the one the drafter was exported for, load both, pick their
implementations (`maybe_static`, `proposer_for`: the static-cache, CUDA-graph ones of
`train.serve.static_target` / `train.serve.static_drafter` where they can work, else the
dynamic-cache ones), decode every prompt speculatively and target-only, interleaved
(`run_benchmark`; DDTree and the peer baselines too when asked), add the agreement of offline and
online τ (`--agreement`, `train.serve.agreement`), print the summary and write the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from common.hashing import template_digest
from target.arch import check_architecture
from target.chat_template import with_chat_template
from target.identity import target_identity
from target.identity_check import OVERRIDE_KEY, check_target
from target.load import DTYPES, Target, load_target
from train.export_format.layout import INFO_FILE, load_exported
from train.serve.agreement import agreement, corpus_offline_tau
from train.serve.cli import DEFAULT_PROMPTS, SpecDecodeConfig
from train.serve.decoding import DFlashProposer, Generation, Proposer, greedy_generate, speculative_generate
from train.serve.peers import peer_generate
from train.serve.prompts import prompts_from_jsonl, prompts_from_shards, stop_token_ids
from train.serve.results import generation_record, print_summary, summarize, summarize_peer
from train.serve.spec_target import FALLBACK, SpecTarget, decoding_path
from train.serve.static_drafter import StaticDFlashProposer
from train.serve.static_target import StaticSpecTarget, static_cache_length
from train.serve.tree_decode import ddtree_generate


def run_benchmark(
    target: SpecTarget,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    baseline: bool = True,
    warmup: bool = True,
    progress: bool = False,
    tree_budgets: Sequence[int] = (),
    stop_repeat: int = 0,
    peers: Sequence[str] = (),
    prompt_lookup_tokens: int = 10,
    peer_prompts: int = 0,
    verify_tokens: int = 0,
    verify_sweep: Sequence[int] = (),
    stop_at: float | None = None,
    reserve_share: float = 0.0,
) -> dict:
    """Speculative and (interleaved, per prompt) target-only greedy decoding of every prompt; with
    `tree_budgets`, DDTree verification at each budget too (`ddtree`: one summary per budget); with
    `peers`, transformers' own decoding too (`train.serve.peers`; `peers`: one summary each, its
    lossless check and its wall-clock speed-up against target-only greedy decoding).
    `stop_repeat` > 0 ends every response where it starts looping (`train.serve.decoding.Ending`);
    `verify_tokens` > 0 verifies only that many block positions per round (`speculative_generate`);
    `verify_sweep` decodes every prompt again at each of these verify sizes (`verify_sweep`: one summary
    each, checked against the same target-only decoding), so one run prices several sizes.
    With `stop_at` (a `time.monotonic()` value) no prompt after the first starts unless it would end by then
    (`another_fits`) with `reserve_share` of the decoding time so far left for what runs after the loop (the
    agreement's pass); the figures are then over the prompts decoded, and `stopped` says how many of how many."""
    from tqdm.auto import tqdm

    if peers and stop_repeat:
        raise ValueError("the peer baselines cannot end responses where they start looping (stop_repeat)")

    if warmup and prompts:  # first calls allocate and pick kernels; keep that out of the timings
        for n in (verify_tokens, *verify_sweep):
            speculative_generate(
                target, proposer, prompts[0], min(max_new_tokens, 2 * proposer.block_size), verify_tokens=n
            )
        if baseline:
            greedy_generate(target, prompts[0], min(max_new_tokens, 8))
        for name in peers:
            peer_generate(name, target, prompts[0], min(max_new_tokens, 2 * proposer.block_size), prompt_lookup_tokens)
    specs, bases, records = [], [], []
    trees: dict[int, list[Generation]] = {int(b): [] for b in tree_budgets}
    peer_runs: dict[str, list[Generation]] = {name: [] for name in peers}
    sweeps: dict[int, list[Generation]] = {int(n): [] for n in verify_sweep}
    took: list[float] = []  # seconds per prompt, everything it decoded
    for i, prompt in enumerate(tqdm(prompts, desc="specdecode", unit="prompt", disable=not progress)):
        if stop_at is not None and took and not another_fits(stop_at, took, reserve_share):
            break
        began = time.monotonic()
        base = greedy_generate(target, prompt, max_new_tokens, stop_repeat=stop_repeat) if baseline else None
        spec = speculative_generate(
            target, proposer, prompt, max_new_tokens, stop_repeat=stop_repeat, verify_tokens=verify_tokens
        )
        for n, gens in sweeps.items():
            gens.append(
                speculative_generate(target, proposer, prompt, max_new_tokens, stop_repeat=stop_repeat, verify_tokens=n)
            )
        for budget, gens in trees.items():
            gens.append(ddtree_generate(target, proposer, prompt, max_new_tokens, budget, stop_repeat=stop_repeat))
        for name, gens in peer_runs.items():
            if not peer_prompts or i < peer_prompts:
                gens.append(peer_generate(name, target, prompt, max_new_tokens, prompt_lookup_tokens))
        specs.append(spec)
        bases.append(base)
        records.append(generation_record(i, spec, base))
        took.append(time.monotonic() - began)
    result = {
        "summary": summarize(specs, bases if baseline else None, proposer.block_size),
        "prompts": records,
        "cache_mode": target.cache_mode,
        "decoding_path": decoding_path(target),
        "generations": specs,
    }
    if len(specs) < len(prompts):
        result["stopped"] = {"decoded": len(specs), "of": len(prompts), "why": "time limit"}
    if trees:
        result["ddtree"] = {
            str(b): summarize(g, bases if baseline else None, proposer.block_size) for b, g in trees.items()
        }
    if sweeps:
        result["verify_sweep"] = {
            str(n): summarize(g, bases if baseline else None, proposer.block_size) for n, g in sweeps.items()
        }
    if peer_runs:
        result["peers"] = {
            name: summarize_peer(g, bases[: len(g)] if baseline else None) for name, g in peer_runs.items()
        }
    return result


def another_fits(stop_at: float, took: Sequence[float], reserve_share: float) -> bool:
    """Whether one more prompt ends by `stop_at`: its estimate is 1.5 times the longest of the last four (answers
    differ in length; the first prompts also decode the peers), with `reserve_share` of the time so far kept back."""
    return time.monotonic() + 1.5 * max(took[-4:]) + reserve_share * sum(took) <= stop_at


def maybe_static(args, target: SpecTarget, prompts, block_size: int) -> tuple[SpecTarget, str | None]:
    """The target on a static cache with CUDA graphs (train.serve.static_target) where `static_cache`
    asks for it and it can work (a hybrid target: where its per-token states can be kept); else the
    target as given (note None)."""
    wanted = args.static_cache == "on" or (args.static_cache == "auto" and target.device.type == "cuda")
    if not wanted:
        return target, None
    layer_types = getattr(target.target.text_config, "layer_types", None) or []
    recurrent = any(t not in ("full_attention", "sliding_attention") for t in layer_types)
    if args.budgets or (recurrent and target.per_token is None):
        if args.static_cache == "on":
            raise ValueError(
                "static_cache=on: not with DDTree budgets or a target whose recurrent layers keep no "
                f"per-token states ({target.rollback_note})"
            )
        return target, None
    limit = int(getattr(target.target.text_config, "max_position_embeddings", 1 << 20))
    length = static_cache_length(prompts, args.max_new_tokens, block_size, limit)
    static = StaticSpecTarget(
        target.target,
        target.layer_ids,
        sorted(target.stop_ids),
        max_len=length,
        graph_sizes=tuple(sorted({1, args.verify_tokens or block_size, *args.sweep})),
        compile_mode=args.compile_mode,
    )
    return static, f"{static.graph_note} ({length} positions)"


def proposer_for(drafter: nn.Module, target: SpecTarget, context_cache: bool) -> tuple[Proposer, str | None]:
    """The drafter on a slot cache with its rounds as a CUDA graph (train.serve.static_drafter) beside a
    static-cache target; else on a dynamic cache. (proposer, note: how the static one runs, or None)."""
    if isinstance(target, StaticSpecTarget) and context_cache:
        static = StaticDFlashProposer(drafter, target, max_len=target.max_len)
        return static, static.graph_note
    return DFlashProposer(drafter, target, context_cache=context_cache), None


def check_drafter_target(drafter_dir: str, target_dir: str, allowed: bool) -> dict:
    """The target checked against the one the drafter was exported for (its dflash_export.json;
    target.identity): ValueError naming both unless the same or `allowed`."""
    info_file = Path(drafter_dir) / INFO_FILE
    try:
        recorded = json.loads(info_file.read_text()).get("target_identity") if info_file.is_file() else None
    except ValueError as exc:
        raise ValueError(f"'{info_file}' is not valid JSON: {exc}") from None
    made = f"the drafter '{drafter_dir}' was exported for"
    return check_target(target_identity(target_dir), recorded, made=made, key=OVERRIDE_KEY, allowed=allowed)


def check_embedding_scale(drafter: nn.Module, drafter_dir: str, target_scale: float) -> None:
    """ValueError when the export states an `input_embedding_scale` other than the target's embedding scale:
    our loop embeds the block with the target's module, engines with the raw table times the stated scale,
    so the two would draft differently (an export made for another target)."""
    stated = (getattr(drafter.config, "dflash_config", None) or {}).get("input_embedding_scale")
    if stated is not None and abs(float(stated) - target_scale) > 1e-6 * max(1.0, abs(target_scale)):
        raise ValueError(
            f"'{drafter_dir}' states dflash_config.input_embedding_scale {stated}, but the target's embedding "
            f"module scales its rows by {target_scale:.6g}: the drafter was exported for another target"
        )


# The agreement's pass over the decoded prompts (one teacher-forced forward each and the drafter at every
# anchor), as a share of their decoding time: kept back when a time limit ends the decoding early (an estimate).
AGREEMENT_SHARE = 0.15


def run(args: SpecDecodeConfig, started: float | None = None) -> int:
    """The work of `python -m train.serve.specdecode` (which reads `args`; `started`: its `time.monotonic()` at
    the start, from which `time_limit_s` counts); returns its exit status (docs/ARCHITECTURE.md, "Exit status")."""
    if args.threads:
        torch.set_num_threads(args.threads)
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    try:
        return _run(args, time.monotonic() if started is None else started)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before


@dataclasses.dataclass
class Inputs:
    """What a run decodes with."""

    target_check: dict  # the target against the one the drafter was exported for
    drafter: nn.Module
    target_obj: Target  # the loaded target
    target: SpecTarget  # its cached forwards (dynamic cache; `maybe_static` may replace it)
    tokenizer: object  # the target's, with the chat template the prompts were rendered with
    prompts: list
    samples: list | None  # the shard samples the prompts come from (--data), else None


def load_inputs(args: SpecDecodeConfig) -> Inputs:
    """The drafter, the target and the prompts; ValueError on a bad input (naming it)."""
    dtype = DTYPES[args.dtype]
    target_check = check_drafter_target(args.drafter, args.target, args.allow_target_mismatch)
    drafter = load_exported(args.drafter, dtype=dtype, device=args.device, trust_remote_code=args.trust_remote_code)
    check_embedding_scale(drafter, args.drafter, check_architecture(args.target).embed_scale)
    target_obj = load_target(
        args.target, dtype=args.dtype, attn_implementation=args.attn_implementation, device=args.device
    )
    target = SpecTarget(target_obj, drafter.target_layer_ids, stop_token_ids(target_obj))
    tokenizer = with_chat_template(target_obj.tokenizer, args.chat_template)
    if target_obj.hidden_size != int(drafter.config.hidden_size):
        raise ValueError(
            f"drafter hidden_size {drafter.config.hidden_size} != target hidden_size {target_obj.hidden_size}"
        )
    for name, n in [("verify_tokens", args.verify_tokens)] + [("verify_sweep", n) for n in args.sweep]:
        if n > int(drafter.block_size):
            raise ValueError(f"{name} {n} is more than the drafter's block size {drafter.block_size}")
    samples = None
    if args.data:
        prompts, samples = prompts_from_shards(args.data, args.num_prompts or None)
    else:
        path = args.prompts or DEFAULT_PROMPTS
        if not Path(path).is_file():
            raise ValueError(f"prompts file '{path}' does not exist (give --prompts or --data)")
        prompts = prompts_from_jsonl(path, tokenizer, args.num_prompts or None, thinking=args.thinking)
    return Inputs(target_check, drafter, target_obj, target, tokenizer, prompts, samples)


def _run(args: SpecDecodeConfig, started: float) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        inputs = load_inputs(args)
        target, static_note = maybe_static(args, inputs.target, inputs.prompts, int(inputs.drafter.block_size))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if target.rollback_note:
        print(f"target: {FALLBACK}: {target.rollback_note}", file=sys.stderr)
    if static_note:
        print(f"target: static KV cache, CUDA graphs {static_note}")
    proposer, drafter_note = proposer_for(inputs.drafter, target, not args.no_context_cache)
    if drafter_note:
        print(f"drafter: slot cache, CUDA graph {drafter_note}")
    try:
        result = run_benchmark(
            target,
            proposer,
            inputs.prompts,
            args.max_new_tokens,
            baseline=not args.no_baseline,
            progress=True,
            tree_budgets=args.budgets,
            stop_repeat=args.stop_repeat,
            peers=args.peer_names if args.peer_baselines else (),
            prompt_lookup_tokens=args.prompt_lookup_tokens,
            peer_prompts=args.peer_prompts,
            verify_tokens=args.verify_tokens,
            verify_sweep=args.sweep,
            stop_at=started + args.time_limit_s if args.time_limit_s else None,
            reserve_share=AGREEMENT_SHARE if args.agreement else 0.0,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    generations = result.pop("generations")
    if args.agreement:  # on the very rounds the benchmark decoded, not a second decoding
        result["agreement"] = _agreement(args, target, inputs, generations)
    result["config"] = _run_record(args, inputs, proposer.block_size, static_note, drafter_note)
    result["target_check"] = inputs.target_check
    print_summary(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"results: {args.out}")
    return _lossless_status(result)


def _agreement(args: SpecDecodeConfig, target: SpecTarget, inputs: Inputs, generations) -> dict:
    """`train.serve.agreement` on the benchmark's own generations, with the seconds it adds to a run."""
    started = time.perf_counter()
    found = agreement(
        target,
        inputs.drafter,
        inputs.prompts[: len(generations)],
        args.max_new_tokens,
        feature_dtype=torch.bfloat16 if args.agreement_bf16 else None,
        progress=True,
        generations=generations,
        stop_repeat=args.stop_repeat,
    )
    if inputs.samples is not None:
        found.update(corpus_offline_tau(inputs.drafter, target, inputs.samples))
    found["seconds"] = time.perf_counter() - started
    return found


def _run_record(args: SpecDecodeConfig, inputs: Inputs, block_size: int, static_note, drafter_note) -> dict:
    """The result's `config`: what was decoded, and how."""
    import transformers

    return {
        "target": str(args.target),
        "drafter": str(args.drafter),
        "drafter_architecture": type(inputs.drafter).__name__,  # DFlash2DraftModel: proposals from its selector
        "prompts": args.prompts or (None if args.data else DEFAULT_PROMPTS),
        "chat_template": args.chat_template,
        "chat_template_hash": template_digest(inputs.tokenizer),
        "data": args.data,
        "num_prompts": len(inputs.prompts),
        "time_limit_s": args.time_limit_s or None,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "attn_implementation": args.attn_implementation,
        "attn_implementation_used": getattr(inputs.target_obj.model.config, "_attn_implementation", None),
        "allow_target_mismatch": args.allow_target_mismatch,
        "tf32": args.tf32,
        "compile": args.compile_mode if static_note else None,  # only the static-cache target compiles
        "verify_tokens": args.verify_tokens or block_size,
        "verify_sweep": args.sweep,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "thinking": args.thinking,
        "block_size": block_size,
        "context_cache": not args.no_context_cache,
        "tree_budgets": args.budgets,
        "stop_repeat": args.stop_repeat,
        "peer_baselines": args.peer_names if args.peer_baselines else [],
        "static_cache": static_note,
        "static_drafter": drafter_note,
        "prompt_lookup_tokens": args.prompt_lookup_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _lossless_status(result: dict) -> int:
    """1 (and the reason on stderr) when a decoding of ours differed from target-only greedy decoding;
    the peers' own checks are reported only."""
    ours = {"speculative": result["summary"]}
    ours.update({f"DDTree budget {b}": tree for b, tree in result.get("ddtree", {}).items()})
    ours.update({f"verify {n} tokens": run for n, run in result.get("verify_sweep", {}).items()})
    differing = [name for name, s in ours.items() if not s.get("lossless", True)]
    if differing:
        print(
            f"error: speculative output differs from target-only greedy decoding ({', '.join(differing)})",
            file=sys.stderr,
        )
        return 1
    return 0
