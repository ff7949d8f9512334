"""`python -m benchmarks.spec_round`: the costs of one speculative round at a target's real shape, and the
speed-up they project (a benchmark, not a test).

    python -m benchmarks.spec_round --out round.json      # Qwen3.6-27B shape, bf16, one GPU (about 2 minutes)
    python -m benchmarks.spec_round --shape tiny          # the same code at toy widths on a CPU, seconds

Random weights of the exact shape (speed does not depend on the values): the target of `benchmarks.extract`
(Qwen3.6-27B text: 48 Gated DeltaNet + 16 gated attention layers, hidden 5,120, vocabulary 248,320) and a drafter
of the published layout (`benchmarks.train` shape `27b-zlab`: 5 layers, 4 sliding + 1 full, 32/8 heads of 128,
five taps). Each time is a median after a warm-up, taken with `benchmarks.small_decode`'s functions:

    step        the target's one-token forward in greedy decoding
    verify Q    the target's forward of Q new tokens with tap features (Q = 16: the block's verify; smaller Q:
                the re-run of the accepted tokens below)
    snapshot    the copy of the cache a hybrid target's round makes before it verifies
    propose     the drafter's proposal of one block (16 new context positions)

Three variants:
    graphed     the static cache with its 1- and Q-token forwards replayed as CUDA graphs
                (`train.serve.static_target`) and the slot-cache drafter replayed as a graph
                (`train.serve.static_drafter`), without per-token states: for a full-attention target how
                `train.serve.specdecode` runs it; for a hybrid one the same kernels replayed with no state
                rollback (not a decoder: the reference the next row is read against). A round is propose + verify.
    rollback    "graphed, with rollback": the same graphs for a hybrid target with the per-token states of its
                Gated DeltaNet layers (`target.recurrent_states`): the verify keeps each layer's state after every
                position, and `keep` copies those of the accepted length into the cache (one captured graph of
                copies, timed as "rollback"). How `train.serve.specdecode` runs a hybrid target on a GPU. A round
                is propose + verify + rollback.
    eager       the dynamic cache with a copy of the cache before each verify: the eager fallback
                `train.serve.specdecode` takes for a recurrent layer kind it has no per-token states for (and
                what it ran for every hybrid target before): a round copies the cache (snapshot), verifies,
                and after a partial acceptance restores the copy and runs the accepted tokens again (a forward
                of τ tokens). A round is propose + snapshot + verify + re-run(τ).

Beside them, where the one-token step goes (`benchmarks.step_profile`, on the rollback variant's target): its
kernels per layer kind (Gated DeltaNet, attention, MLP, the 248,320-row head, the rest), the graphed step
minus those kernels (launches and idle), and the weight-streaming bound (weight bytes / the GPU's bandwidth).
`--compile MODE` compiles the graphed targets' layers as `train.serve.specdecode --compile` does (a hybrid
target's: all but the Gated DeltaNet modules).

Projection, labelled projected (measured costs, τ the variable): a round commits τ tokens on average, so
speed-up(τ) = τ · step / round(τ) against target-only greedy decoding on the same variant, and the break-even
τ is where that reaches 1. Beside it, the published anchor it is read against: `ANCHOR`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from benchmarks.extract import QWEN36_27B_TEXT, TINY_TEXT, build_random_target
from benchmarks.small_decode import sync, time_proposals, time_steps, time_verify
from benchmarks.step_profile import breakdown, format_breakdown
from benchmarks.train import SHAPES as DRAFTER_SHAPES
from benchmarks.train import drafter_config
from target.kernel_routing import external_kernels

# DFlash paper (arXiv 2602.06036 v2) Table 1, Transformers backend on one H200, temperature 0, HumanEval
# (/work/shared/reference/anchors-2026-12.md): measured end to end, not projected.
ANCHOR = {"target": "Qwen3-8B", "tau": 6.50, "speedup": 5.14, "machine": "one H200", "source": "DFlash paper, Table 1"}
BLOCK = 16
TAUS = tuple(range(2, 11))
SHAPES = {
    "qwen3.6-27b": dict(text=QWEN36_27B_TEXT, drafter=DRAFTER_SHAPES["27b-zlab"], layers=5),
    # The same architectures at toy widths, for a CPU in seconds: a hybrid Qwen3.5 target of 3 Gated DeltaNet
    # layers and 1 attention layer, and a 2-layer sliding-then-full drafter on three taps.
    "tiny": dict(
        text=dict(TINY_TEXT, num_hidden_layers=4, hidden_size=64, intermediate_size=128, vocab_size=2048),
        drafter=dict(
            DRAFTER_SHAPES["tiny-zlab"],
            hidden_size=64,
            intermediate_size=128,
            vocab_size=2048,
            num_target_layers=4,
            target_layer_ids=[0, 1, 2],
        ),
        layers=2,
    ),
}
VARIANTS = ("graphed", "rollback", "eager")
LABELS = {"graphed": "graphed", "rollback": "graphed, with rollback", "eager": "eager"}


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_round", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-27b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on CUDA, else fp32")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: graphed, rollback, eager")
    p.add_argument("--compile", default="off", choices=["off", "default", "max-autotune"], help="graphed layers")
    p.add_argument("--profile-steps", type=int, default=5, help="one-token steps profiled by layer kind (0: none)")
    p.add_argument("--sizes", default="1,2,4,8,16", help="verify sizes to time (the block's 16 always among them)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens timed for the one-token step")
    p.add_argument("--repeats", type=int, default=10, help="timed verifies per size")
    p.add_argument("--rounds", type=int, default=16, help="timed proposals")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.sizes = sorted({int(q) for q in args.sizes.split(",") if q.strip()} | {BLOCK})
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if min(args.sizes) < 1 or any(v not in VARIANTS for v in args.variants):
        p.error(f"--sizes: positive counts; --variants: of {', '.join(VARIANTS)}")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


# ----------------------------------------------------------------------------------------------
# Projection: pure arithmetic on measured costs


def interpolate(points: dict[int, float], x: float) -> float:
    """Linear between the measured sizes around `x`, the nearest measured value outside them."""
    sizes = sorted(points)
    if x <= sizes[0]:
        return points[sizes[0]]
    if x >= sizes[-1]:
        return points[sizes[-1]]
    hi = next(q for q in sizes if q >= x)
    lo = max(q for q in sizes if q <= x)
    if hi == lo:
        return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def round_ms(costs: dict, tau: float) -> float:
    """One round's cost at τ committed tokens: propose + verify of the block, plus the per-token states'
    rollback where the variant keeps them, or, where it snapshots (the eager fallback), the copy and the
    re-run of the τ accepted positions."""
    verify = {int(q): ms for q, ms in costs["verify_ms"].items()}
    total = costs["propose_ms"] + verify[BLOCK] + (costs.get("rollback_ms") or 0.0)
    if costs.get("snapshot_ms") is not None:
        total += costs["snapshot_ms"] + interpolate(verify, tau)
    return total


def break_even_tau(costs: dict) -> float | None:
    """The τ at which a round costs as much as τ target steps (speed-up 1), by bisection over 1..16;
    None where even a full block does not pay."""

    def gain(tau: float) -> float:
        return tau * costs["step_ms"] - round_ms(costs, tau)

    lo, hi = 1.0, float(BLOCK)
    if gain(hi) < 0:
        return None
    if gain(lo) >= 0:
        return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(mid) < 0 else (lo, mid)
    return hi


def project(costs: dict, taus=TAUS) -> dict:
    """The projected speed-up for each τ and the break-even τ, from one variant's measured costs."""
    rows = [
        {"tau": tau, "round_ms": round_ms(costs, tau), "speedup": tau * costs["step_ms"] / round_ms(costs, tau)}
        for tau in taus
    ]
    return {
        "rows": rows,
        "break_even_tau": break_even_tau(costs),
        "verify_over_step": costs["verify_ms"][BLOCK] / costs["step_ms"],
        "propose_over_step": costs["propose_ms"] / costs["step_ms"],
        "at_anchor_tau": ANCHOR["tau"] * costs["step_ms"] / round_ms(costs, ANCHOR["tau"]),
    }


# ----------------------------------------------------------------------------------------------
# Measurements


def time_snapshot(target, prompt: list[int], repeats: int = 5) -> float:
    """Median ms of the cache copy a hybrid target's round makes before verifying (train.serve.specdecode)."""
    _, _, cache = target.forward(torch.tensor([prompt]), None, taps=False, last_only=True)
    times = []
    for _ in range(repeats):
        sync(target.device)
        t0 = time.perf_counter()
        copy.deepcopy(cache)
        sync(target.device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def time_rollback(target, prompt: list[int], block: int = BLOCK, repeats: int = 10) -> float:
    """Median ms of `keep` after a `block`-token verify, keeping half of it (the per-token states of a
    hybrid target copied into its cache; any kept length but all costs the same)."""
    _, _, cache = target.forward(torch.tensor([prompt]), None, taps=True, last_only=True)
    ids = torch.randint(100, min(40000, target.vocab_size), (1, block))
    times = []
    for _ in range(repeats):
        _, _, cache = target.forward(ids, cache, taps=True)
        sync(target.device)
        t0 = time.perf_counter()
        target.keep(cache, block // 2)
        sync(target.device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def step_breakdown(spec, prompt: list[int], step_ms, device_name: str, steps: int) -> dict:
    """`benchmarks.step_profile.breakdown` of `spec`'s one-token step, its graphs set aside (profiled eagerly)."""
    graphs, spec.graphs = getattr(spec, "graphs", {}), {}
    try:
        return breakdown(spec, prompt, step_ms, device_name, steps)
    finally:
        spec.graphs = graphs


def measure(name: str, fn, *args, **kwargs):
    """fn's result, or {"error": ...} with the reason: a row that fails says why and the others go on."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a benchmark row that fails says why
        print(f"  {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def variant_target(variant: str, target, taps: list[int], stop: list[int], sizes: list[int], compile_mode=None):
    """(the target as the variant runs it, a note on how)."""
    from train.serve.spec_target import SpecTarget
    from train.serve.static_target import StaticSpecTarget

    if variant == "eager":
        spec = SpecTarget(target, taps, stop)
        spec.per_token = None  # the eager fallback: a copy of the cache, and a re-run
        return spec, "eager, dynamic cache, snapshot + re-run"
    static = StaticSpecTarget(
        target, taps, stop, max_len=1024, graph_sizes=sizes, compile_mode=compile_mode, rollback=variant == "rollback"
    )
    if variant == "rollback" and static.per_token is None:
        raise ValueError(f"no per-token states for this target ({static.rollback_note or 'no recurrent layer'})")
    return static, f"static cache, CUDA graphs {static.graph_note}"


def measure_variant(variant: str, target, drafter_cfg, prompt: list[int], args) -> dict:
    """One variant's costs: step, every verify size, (eager) the snapshot, and the proposal."""
    taps, stop = drafter_cfg.target_layer_ids, [int(target.tokenizer.eos_token_id or 0)]
    t0 = time.perf_counter()
    compile_mode = None if args.compile == "off" else args.compile
    built = measure(f"{variant} target", variant_target, variant, target, taps, stop, args.sizes, compile_mode)
    if isinstance(built, dict):
        return built
    spec, how = built
    out = {"how": how, "setup_s": time.perf_counter() - t0}
    step = measure(f"{variant} step", time_steps, spec, prompt, args.tokens)
    out["step_ms"] = step if isinstance(step, dict) else step[0]
    out["verify_ms"] = {
        q: measure(f"{variant} verify {q}", time_verify, spec, prompt, q, args.repeats) for q in args.sizes
    }
    if variant == "eager":
        out["snapshot_ms"] = measure("eager snapshot", time_snapshot, spec, prompt)
    if variant == "rollback":
        out["rollback_ms"] = measure("rollback", time_rollback, spec, prompt, repeats=args.repeats)
        if args.profile_steps:
            name = device_name(args.device)
            out["breakdown"] = measure(
                "step breakdown", step_breakdown, spec, prompt, out["step_ms"], name, args.profile_steps
            )
    proposal = measure(
        f"{variant} proposal",
        time_proposals,
        spec,
        prompt,
        drafter_cfg,
        static=variant in ("graphed", "rollback"),
        rounds=args.rounds,
    )
    out["propose_ms"], out["propose_how"] = (proposal, None) if isinstance(proposal, dict) else proposal
    return out


def costs_complete(costs: dict) -> bool:
    numbers = [costs.get("step_ms"), costs.get("propose_ms"), *(costs.get("verify_ms") or {}).values()]
    numbers += [costs[k] for k in ("snapshot_ms", "rollback_ms") if k in costs]
    return bool(costs.get("verify_ms")) and all(isinstance(x, float) for x in numbers)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shape = SHAPES[args.shape]
    if args.shape != "tiny" and not args.device.startswith("cuda"):
        print("benchmarks.spec_round: the qwen3.6-27b shape needs a GPU; use --shape tiny on a CPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    target, n_params = build_random_target(shape["text"], args.device, dtype)
    drafter_cfg = drafter_config(shape["drafter"], layers=shape["layers"])
    sync(args.device)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(512, shape["text"]["vocab_size"], (args.prompt_len,), generator=gen).tolist()
    kernels = external_kernels(target.model)
    print(f"{device_name(args.device)}, {args.dtype}; external kernels transformers binds: {kernels or 'none'}")
    variants, projections = {}, {}
    for variant in args.variants:
        variants[variant] = measure_variant(variant, target, drafter_cfg, prompt, args)
        if costs_complete(variants[variant]):
            projections[variant] = project(variants[variant])
        print(format_variant(variant, variants[variant], projections.get(variant)), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m benchmarks.spec_round " + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": args.shape,
        "device": device_name(args.device),
        "delta_rule_kernels": kernels,
        "dtype": args.dtype,
        "parameters": n_params,
        "drafter": {
            "layers": shape["layers"],
            "layer_types": drafter_cfg.layer_types,
            "taps": drafter_cfg.target_layer_ids,
        },
        "prompt_len": args.prompt_len,
        "build_s": build_s,
        "variants": variants,
        "projection": projections,
        "anchor": ANCHOR,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0 if projections else 1


def format_variant(name: str, costs: dict, projection: dict | None) -> str:
    def ms(x) -> str:
        return f"{x:.3f} ms" if isinstance(x, float) else f"error ({(x or {}).get('error', 'not run')})"

    if "error" in costs:
        return f"{LABELS.get(name, name)}: {costs['error']}"
    lines = [
        f"{LABELS.get(name, name)} ({costs['how']}; set up in {costs['setup_s']:.1f} s):",
        f"  one-token step   {ms(costs['step_ms'])}",
    ]
    lines += [f"  verify {q:>2} tokens {ms(t)}" for q, t in costs["verify_ms"].items()]
    if "snapshot_ms" in costs:
        lines.append(f"  cache snapshot   {ms(costs['snapshot_ms'])}")
    if "rollback_ms" in costs:
        lines.append(
            f"  rollback         {ms(costs['rollback_ms'])} (the per-token states of the accepted length kept)"
        )
    lines.append(f"  proposal         {ms(costs['propose_ms'])} ({costs.get('propose_how')})")
    if projection:
        be = projection["break_even_tau"]
        lines.append(
            f"  verify / step {projection['verify_over_step']:.2f}x, "
            f"proposal / step {projection['propose_over_step']:.2f}x; "
            f"break-even τ {'never within a block' if be is None else f'{be:.2f}'}"
        )
        lines.append(
            "  projected speed-up: " + ", ".join(f"τ {r['tau']} {r['speedup']:.2f}x" for r in projection["rows"])
        )
        lines.append(
            f"  at the anchor's τ {ANCHOR['tau']}: {projection['at_anchor_tau']:.2f}x projected "
            f"(published: {ANCHOR['target']} {ANCHOR['speedup']}x on {ANCHOR['machine']}, measured)"
        )
    if "breakdown" in costs:
        lines.append(format_breakdown(costs["breakdown"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
