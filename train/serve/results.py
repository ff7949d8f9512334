"""What a speculative-decoding run reports, as pure functions of its `Generation`s: τ and speed
summaries (`summarize`, `summarize_peer`), the lossless check against target-only decoding
(`compare_generations`, `against_baseline`), one record per prompt (`generation_record`) and the
printed summary (`print_summary`, of the result dict the command writes).

τ (docs/dflash.md "Acceptance length (τ)"; a round's τ: `train.serve.decoding`): the reported τ
is the mean over prompts of the per-prompt mean over rounds; the histogram counts rounds by
τ = 1..B. (z-lab's benchmark counts a last round's committed tokens instead: the two differ only
when a response's last round accepted every draft up to its end.) Speed: tokens/s over the decode
phase (after the prefill and its first token) and over the wall time; the speed-up is the ratio of
target-only to speculative decode time (= the TPOT ratio of docs/dflash.md "Acceptance length (τ)");
`train.serve.specdecode_run.run_benchmark` runs both loops interleaved per prompt with the same
cache handling, after one warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from target.identity_check import allowed_line
from train.serve.decoding import Generation


def compare_generations(spec: Generation, base: Generation) -> dict:
    """Whether two continuations are identical, and where they first differ."""
    # strict=False: the continuations may differ in length (the shorter one's end is the mismatch, below)
    first = next((i for i, (a, b) in enumerate(zip(spec.tokens, base.tokens, strict=False)) if a != b), None)
    if first is None and len(spec.tokens) != len(base.tokens):
        first = min(len(spec.tokens), len(base.tokens))
    out = {"identical": first is None, "first_mismatch": first}
    if first is not None:
        for name, gen in (("margin", base), ("other_margin", spec)):
            if first < len(gen.margins):
                out[name] = gen.margins[first]
    return out


def tau_histogram(taus: Sequence[int], block_size: int) -> list[int]:
    """Counts of τ = 1..B (entry i counts τ = i + 1)."""
    counts = [0] * block_size
    for tau in taus:
        counts[tau - 1] += 1
    return counts


def mean_or_none(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are not None; None if there are none."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(specs: Sequence[Generation], bases: Sequence[Generation] | None, block_size: int) -> dict:
    """Aggregate τ and speed over prompts (τ: mean over prompts of the per-prompt means, docs/dflash.md "Acceptance
    length (τ)")."""
    all_taus = [t for g in specs for t in g.taus]
    new_tokens = sum(len(g.tokens) for g in specs)
    summary = {
        "prompts": len(specs),
        "rounds": len(all_taus),
        "new_tokens": new_tokens,
        "tau": mean_or_none([g.mean_tau for g in specs]),
        "tau_pooled": mean_or_none(all_taus),
        "tau_histogram": tau_histogram(all_taus, block_size),
        "tokens_per_round": (sum(len(g.tokens) - 1 for g in specs) / len(all_taus)) if all_taus else None,
        "spec": _speed(specs),
    }
    if bases is not None:
        summary.update(against_baseline(specs, bases, summary["spec"]))
        spec_decode, base_decode = summary["spec"]["decode_s"], summary["baseline"]["decode_s"]
        summary["speedup"] = base_decode / spec_decode if spec_decode > 0 else None
    return summary


def against_baseline(gens: Sequence[Generation], bases: Sequence[Generation], speed: dict) -> dict:
    """Target-only greedy decoding of the same prompts (`baseline`: its speed), whether `gens` equal it
    prompt by prompt (`lossless`, where they differ and the margins there) and the wall-clock speed-up
    of `gens` (whose speed is `speed`)."""
    baseline = _speed(bases)
    comparisons = [compare_generations(g, b) for g, b in zip(gens, bases, strict=True)]
    return {
        "baseline": baseline,
        "lossless": all(c["identical"] for c in comparisons),
        "mismatched_prompts": [i for i, c in enumerate(comparisons) if not c["identical"]],
        "mismatches": [dict(prompt=i, **c) for i, c in enumerate(comparisons) if not c["identical"]],
        "speedup_wall": baseline["wall_s"] / speed["wall_s"] if speed["wall_s"] > 0 else None,
    }


def _speed(gens: Sequence[Generation]) -> dict:
    prefill = sum(g.prefill_s for g in gens)
    decode = sum(g.decode_s for g in gens)
    tokens = sum(len(g.tokens) for g in gens)
    after_first = tokens - len(gens)  # the first token of each prompt comes from the prefill
    out = {
        "prefill_s": prefill,
        "decode_s": decode,
        "wall_s": prefill + decode,
        "tokens_per_s": tokens / (prefill + decode) if prefill + decode > 0 else None,
        "decode_tokens_per_s": after_first / decode if decode > 0 else None,
        "target_forwards": sum(g.target_forwards for g in gens),
    }
    if any(g.rounds for g in gens):
        out.update(
            draft_s=sum(g.draft_s for g in gens),
            verify_s=sum(g.verify_s for g in gens),
            rollback_s=sum(g.rollback_s for g in gens),
        )
    return out


def generation_record(index: int, spec: Generation, base: Generation | None) -> dict:
    record = {
        "index": index,
        "prompt_tokens": spec.prompt_len,
        "new_tokens": len(spec.tokens),
        "stop": spec.stop,
        "rounds": len(spec.rounds),
        "tau": spec.mean_tau,
        "taus": spec.taus,
        "spec": {
            k: getattr(spec, k)
            for k in ("prefill_s", "decode_s", "draft_s", "verify_s", "rollback_s", "target_forwards")
        },
    }
    if base is not None:
        record["baseline"] = {k: getattr(base, k) for k in ("prefill_s", "decode_s", "target_forwards")}
        record.update(compare_generations(spec, base))
    return record


def summarize_peer(gens: Sequence[Generation], bases: Sequence[Generation] | None) -> dict:
    """A peer baseline's speed (whole calls, wall clock) and, against target-only greedy decoding, its
    lossless check and wall-clock speed-up."""
    out = {"prompts": len(gens), "new_tokens": sum(len(g.tokens) for g in gens), "spec": _speed(gens)}
    if bases is not None:
        out.update(against_baseline(gens, bases, out["spec"]))
    return out


def print_summary(result: dict) -> None:
    """The printed summary of a run's result (`specdecode_run.run`'s dict: speculative, target-only,
    DDTree, peers, agreement)."""
    s = result["summary"]
    B = len(s["tau_histogram"])
    allowed = allowed_line(result.get("target_check"), "the drafter's")
    if allowed:
        print(allowed)
    architecture = (result.get("config") or {}).get("drafter_architecture")
    proposals = "its selector's walk" if architecture == "DFlash2DraftModel" else "the argmax of the target's head"
    print(
        f"prompts {s['prompts']}, rounds {s['rounds']}, new tokens {s['new_tokens']}, target cache: "
        f"{result['cache_mode']}, decoding path: {result.get('decoding_path', 'n/a')}"
        + (f"; drafter {architecture} (proposals: {proposals})" if architecture else "")
    )
    stopped = result.get("stopped")
    if stopped:
        print(
            f"stopped at the time limit: decoded {stopped['decoded']} of {stopped['of']} prompts; every figure below "
            "is over those"
        )
    print(
        f"τ (mean over prompts of per-prompt means, bonus included) = {s['tau']:.3f}   pooled over rounds "
        f"{s['tau_pooled']:.3f}"
    )
    width = max(s["tau_histogram"]) or 1
    for tau in range(1, B + 1):
        count = s["tau_histogram"][tau - 1]
        print(f"  τ={tau:>2} {count:>6} {'#' * math.ceil(40 * count / width) if count else ''}")
    spec = s["spec"]
    print(
        f"speculative: {spec['wall_s']:.2f} s wall ({spec['prefill_s']:.2f} prefill), "
        f"{spec['decode_tokens_per_s']:.1f} tok/s decode "
        f"(draft {spec['draft_s']:.2f} s, verify {spec['verify_s']:.2f} s, rollback {spec['rollback_s']:.2f} s)"
    )
    if "baseline" in s:
        base = s["baseline"]
        print(
            f"target only: {base['wall_s']:.2f} s wall ({base['prefill_s']:.2f} prefill), "
            f"{base['decode_tokens_per_s']:.1f} tok/s decode"
        )
        print(
            f"speed-up {s['speedup']:.2f}x decode, {s['speedup_wall']:.2f}x wall;  lossless: {s['lossless']}"
            + ("" if s["lossless"] else f" (prompts {s['mismatched_prompts']} differ)")
        )
        for m in s.get("mismatches", []):
            print(
                f"  prompt {m['prompt']}: first differs at generated token {m['first_mismatch']}; the target's "
                f"top-1 minus top-2 logit there: {m.get('margin', float('nan')):.4g} (target-only decoding), "
                f"{m.get('other_margin', float('nan')):.4g} (speculative verify)"
            )
    for n, run in result.get("verify_sweep", {}).items():
        per_round = 1000 * run["spec"]["verify_s"] / max(run["rounds"], 1)
        line = (
            f"verify {n} tokens: τ {run['tau']:.3f} (pooled {run['tau_pooled']:.3f}), {per_round:.2f} ms per verify, "
            f"{run['spec']['decode_tokens_per_s']:.1f} tok/s decode"
        )
        if "speedup" in run:
            line += (
                f", speed-up {run['speedup']:.2f}x decode, {run['speedup_wall']:.2f}x wall, lossless: {run['lossless']}"
            )
            if not run["lossless"]:
                line += f" (prompts {run['mismatched_prompts']} differ)"
        print(line)
    for budget, tree in result.get("ddtree", {}).items():
        line = f"DDTree budget {budget}: τ {tree['tau']:.3f}, {tree['spec']['decode_tokens_per_s']:.1f} tok/s decode"
        if "speedup" in tree:
            line += f", speed-up {tree['speedup']:.2f}x, lossless: {tree['lossless']}"
        print(line)
    for name, peer in result.get("peers", {}).items():
        line = f"{name} (transformers): {peer['spec']['wall_s']:.2f} s wall"
        if "speedup_wall" in peer:
            line += f", speed-up {peer['speedup_wall']:.2f}x wall against target-only greedy"
            line += f", lossless: {peer['lossless']}"
        print(line)
    a = result.get("agreement")
    if a and a.get("online_tau") is not None:
        print(
            f"agreement over {a['prompts']} greedy continuations ({a['rounds']} rounds, {a['anchors']} anchors, "
            f"features {a['feature_dtype']}):"
        )
        print(
            f"  online τ {a['online_tau']:.3f} | offline τ at the online round starts {a['offline_tau_at_rounds']:.3f} "
            f"({a['round_mismatches']} of {a['rounds']} rounds differ)"
        )
        print(f"  offline τ over the online schedule replayed offline {a['offline_tau_chained']:.3f}")
        print(
            f"  offline τ over all anchors {a['offline_tau_all']:.3f} (x{a['ratio_all']:.3f}), "
            f"harmonic {a['offline_tau_harmonic']:.3f} (x{a['ratio_harmonic']:.3f})"
        )
        if "offline_tau_corpus" in a:
            print(
                f"  offline τ on the corpus responses of the same prompts: all anchors {a['offline_tau_corpus']:.3f}, "
                f"online schedule {a['offline_tau_corpus_chained']:.3f}"
            )
        if "seconds" in a:
            print(f"  the agreement check took {a['seconds']:.1f} s")
