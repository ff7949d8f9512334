"""Decoding speed of a small target at batch 1, the way speculative decoding and its baselines run it:
the eager forward on transformers' dynamic cache against the static cache with CUDA graphs
(train.serve.static_target), and transformers' own `generate` (dynamic and static cache). Random
weights at SmolLM2-135M's shape (speed does not depend on the values), so it needs no download.

    python -m benchmarks.small_decode [--dtype float32] [--tokens 128] [--compile] [--verify-sizes 2,4,8,16]
        [--out result.json]

`--compile` adds the same graphs with the target's decoder layers compiled by inductor while they are
captured (train.serve.fusion), in its default mode and in max-autotune.

Prints per variant: ms per 1-token step, ms per verify forward of each of `--verify-sizes` tokens (what
`train.serve.specdecode --verify-tokens` trades against tokens per round), and whether each greedy
continuation equals the eager one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import time

import torch

from common.interrupts import run_main

DRAFTER_NAMES = {"dflash": "DFlash", "dflash2": "DFlash2"}
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TAPS = [1, 8, 14, 21, 27]


def random_target(dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from target.load import reach_text_parts

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_SHAPE)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return reach_text_parts(model, None)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_steps(target, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    from train.serve.decoding import greedy_generate

    greedy_generate(target, prompt, 8)  # warm-up
    sync(target.device)
    gen = greedy_generate(target, prompt, tokens)
    return gen.decode_s / max(1, len(gen.tokens) - 1) * 1e3, gen.tokens


def time_verify(target, prompt: list[int], block: int, repeats: int = 20) -> float:
    """Median ms of one forward of `block` new tokens with tap features after `prompt`, the cache put back
    after each: cut back where it can be (`crop`), else restored from a copy made before (`snapshot`: the
    recurrent states of a hybrid target), outside the timed region either way."""
    from train.serve.spec_target import cache_mode_for, crop_cache

    _, _, cache = target.forward(torch.tensor([prompt]), None, taps=True, last_only=True)
    snapshot = cache_mode_for(cache, target.target.text_config) == "snapshot"
    kept = copy.deepcopy(cache) if snapshot else None
    ids = torch.randint(100, min(40000, target.vocab_size), (1, block))
    times = []
    for _ in range(repeats):
        sync(target.device)
        t0 = time.perf_counter()
        _, feats, cache = target.forward(ids, cache, taps=True)
        feats.sum().item()
        times.append(time.perf_counter() - t0)
        if snapshot:
            cache = copy.deepcopy(kept)
        else:
            crop_cache(cache, len(prompt))
    times.sort()
    return times[len(times) // 2] * 1e3


def verify_times(target, prompt: list[int], sizes: list[int]) -> dict[int, float]:
    return {q: time_verify(target, prompt, q) for q in sizes}


def time_generate(target, prompt: list[int], tokens: int, static: bool) -> tuple[float, list[int]]:
    from train.serve.peers import hf_generate

    hf_generate(target, prompt, 8, static=static)
    hf_generate(target, prompt, tokens, static=static)  # a static cache compiles on its first full-length call
    gen = hf_generate(target, prompt, tokens, static=static)
    return gen.decode_s / max(1, len(gen.tokens)) * 1e3, gen.tokens


def smollm2_drafter(layers: int):
    """A drafter config of SmolLM2-135M's widths with `layers` layers (the demo's layout: sliding, last full)."""
    from train.model import DrafterConfig

    return DrafterConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        target_layer_ids=TAPS,
        num_target_layers=30,
        mask_token_id=3,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        sliding_window=2048,
    )


def time_proposals(target, prompt: list[int], cfg, *, static: bool, rounds: int = 24) -> tuple[float, str]:
    """(median ms of one proposal, how it ran): a drafter of config `cfg` (DFlash or DFlash2, random weights,
    exported in the target's dtype and loaded as serving loads it), 16 new context features per round; eager
    on a dynamic cache, or `static` (train.serve.static_drafter: slot cache, CUDA graph)."""
    import tempfile

    from train.dflash2 import build_drafter
    from train.export_format.layout import export_drafter, load_exported
    from train.serve.decoding import DFlashProposer
    from train.serve.static_drafter import StaticDFlashProposer

    dtype = target.embed_VD.dtype
    with torch.device(target.device):  # a 27B-shape drafter (1.7 B parameters) initialises in seconds on a GPU
        state = build_drafter(cfg).state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        export_drafter(state, cfg, tmp, dtype=str(dtype).removeprefix("torch."))
        drafter = load_exported(tmp, dtype=dtype, device=str(target.device))
    if static:
        proposer = StaticDFlashProposer(drafter, target, max_len=1024)
        note = f"slot cache, CUDA graph {proposer.graph_note}"
    else:
        proposer, note = DFlashProposer(drafter, target), "eager, dynamic cache"
    _, features, _ = target.forward(torch.tensor([prompt]), None, taps=True)
    F = features.shape[-1]
    times = []
    for attempt in range(2):  # the first pass warms up
        proposer.reset()
        proposer.propose(features, 5, len(prompt))
        position = len(prompt)
        for _ in range(rounds):
            new = torch.randn((1, 16, F), device=target.device, dtype=features.dtype)
            sync(target.device)
            t0 = time.perf_counter()
            proposer.propose(new, 5, position + 16)
            sync(target.device)
            if attempt:
                times.append(time.perf_counter() - t0)
            position += 16
    times.sort()
    return times[len(times) // 2] * 1e3, note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--proposals-only", action="store_true", help="time only the DFlash and DFlash2 proposals")
    parser.add_argument(
        "--tf32", action="store_true", help="float32 matrix products on TF32 tensor cores, every variant alike"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also the graphs with compiled target layers (default and max-autotune)",
    )
    parser.add_argument(
        "--verify-sizes", default="16", help="verify forwards to time, comma-separated token counts (each graphed)"
    )
    args = parser.parse_args(argv)
    sizes = sorted({int(q) for q in args.verify_sizes.split(",") if q.strip()})
    if not sizes or min(sizes) < 1:
        parser.error(f"--verify-sizes: positive token counts, got {args.verify_sizes!r}")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    from train.serve.spec_target import SpecTarget
    from train.serve.static_target import StaticSpecTarget

    dtype = getattr(torch, args.dtype)
    target = random_target(dtype, args.device)
    prompt = torch.randint(100, 40000, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    eager = SpecTarget(target, TAPS, [2])
    rows = {}
    if not args.proposals_only:
        ms, ref = time_steps(eager, prompt, args.tokens)
        rows["eager dynamic cache"] = {"step_ms": ms, "verify_ms": verify_times(eager, prompt, sizes), "same": True}
        for backend in (None, "default", "max-autotune") if args.compile else (None,):
            t0 = time.perf_counter()
            static = StaticSpecTarget(target, TAPS, [2], max_len=1024, graph_sizes=(1, *sizes), compile_mode=backend)
            setup = time.perf_counter() - t0
            ms, toks = time_steps(static, prompt, args.tokens)
            rows["static cache + CUDA graphs" + (f", compiled {backend}" if backend else "")] = {
                "step_ms": ms,
                "verify_ms": verify_times(static, prompt, sizes),
                "same": toks == ref,
                "graphs": static.graph_note,
                "setup_s": setup,
            }
    for layers, arch, static_drafter in itertools.product((2, 5), ("dflash", "dflash2"), (False, True)):
        name = f"{DRAFTER_NAMES[arch]} proposal, {layers}-layer drafter" + (", graphed" if static_drafter else "")
        cfg = dataclasses.replace(smollm2_drafter(layers), arch=arch)  # DFlash2 at the same block size (16)
        try:
            ms, note = time_proposals(eager, prompt, cfg, static=static_drafter)
            rows[name] = {"propose_ms": ms, "how": note}
        except Exception as exc:  # noqa: BLE001 - a benchmark row that fails says why
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if not args.proposals_only:
        for name, is_static in (("transformers generate", False), ("transformers generate, static cache", True)):
            try:
                ms, toks = time_generate(eager, prompt, args.tokens, is_static)
                rows[name] = {"step_ms": ms, "same": toks == ref}
            except Exception as exc:  # noqa: BLE001 - a benchmark row that fails says why
                rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    shape = "SmolLM2-135M shape (random weights)"
    precision = ", TF32 matrix products" if args.tf32 else ""
    print(f"{args.device} {args.dtype}{precision}, {shape}, {args.tokens} tokens after a 200-token prompt")
    for name, row in rows.items():
        if "error" in row:
            print(f"  {name:<38} error: {row['error']}")
            continue
        if "propose_ms" in row:
            print(f"  {name:<38} {row['propose_ms']:8.2f} ms / proposal (16 new context positions; {row['how']})")
            continue
        verify = "  ".join(f"{ms:6.2f} ms / {q}-token verify" for q, ms in row.get("verify_ms", {}).items())
        print(f"  {name:<38} {row['step_ms']:8.2f} ms / token  {verify}  same tokens: {row['same']}")
    for name, row in rows.items():
        if "graphs" in row:
            print(f"  {name}: graphs {row['graphs']}, set up in {row['setup_s']:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": args.device,
                    "dtype": args.dtype,
                    "tf32": args.tf32,
                    "compile": args.compile,
                    "tokens": args.tokens,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.small_decode", main))
