"""`python -m benchmarks.tiny_threads`: the tiny default's CPU work per torch thread count.

The evidence behind `common.device.small_model_threads()` (at most 4 threads for the tiny default's
models): on a random-weight target of the tiny default's shape (`recipes.tiny.TinyConfig`: 8 layers,
hidden 128, vocabulary 4096), it times, for each thread count, interleaved over several rounds,

  train:  one training step of the tiny build (forward, backward, AdamW) on a 1,024-token batch,
          with the build's CPU precision (bf16 autocast where the CPU has bf16 instructions)
  decode: the greedy regeneration's work, 128 prompts of 24 tokens: prefill + 32 decoding steps

and prints the fastest and the median time per thread count, as a table and as JSON (`--out`).

    python -m benchmarks.tiny_threads                       # 1, 2, 4, ... up to the usable cores
    python -m benchmarks.tiny_threads --threads 1,2,4,8,16 --out threads.json

Not a test: numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

from common.interrupts import run_main

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the demo and the tiny build run; read when torch loads

import torch  # noqa: E402

from common.device import describe_machine, usable_cores  # noqa: E402
from extract.regenerate.local import cache_of  # noqa: E402
from recipes.tiny.config import TinyConfig, resolve_precision  # noqa: E402
from recipes.tiny.target import next_token_loss  # noqa: E402

TRAIN_ROWS, TRAIN_WIDTH = 4, 256
DECODE_ROWS, DECODE_PROMPT, DECODE_STEPS = 128, 24, 32


def build_model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = TinyConfig()
    config = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def time_train_step(model, optimizer, ids_BT: torch.Tensor, use_bf16: bool) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
        logits_BTV = model(input_ids=ids_BT).logits
    next_token_loss(logits_BTV, ids_BT).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def time_decode(model, prompts_BT: torch.Tensor) -> float:
    cache_kwarg = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )  # as greedy_batch
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(input_ids=prompts_BT, use_cache=True, logits_to_keep=1)
        for _ in range(DECODE_STEPS):
            next_B1 = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=next_B1, use_cache=True, **{cache_kwarg: cache_of(out)})
    return time.perf_counter() - start


def measure(thread_counts: list[int], rounds: int) -> dict:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    use_bf16 = resolve_precision("auto") == "bf16"
    generator = torch.Generator().manual_seed(0)
    train_ids = torch.randint(10, 4000, (TRAIN_ROWS, TRAIN_WIDTH), generator=generator)
    prompts = torch.randint(10, 4000, (DECODE_ROWS, DECODE_PROMPT), generator=generator)
    times: dict[int, dict[str, list[float]]] = {n: {"train": [], "decode": []} for n in thread_counts}
    for _ in range(rounds):
        for n in thread_counts:
            torch.set_num_threads(n)
            model.train()
            time_train_step(model, optimizer, train_ids, use_bf16)  # warm-up at this thread count
            times[n]["train"].append(min(time_train_step(model, optimizer, train_ids, use_bf16) for _ in range(3)))
            model.eval()
            times[n]["decode"].append(time_decode(model, prompts))
    rows = [
        {
            "threads": n,
            **{
                f"{kind}_{stat}_s": round(fn(ts), 4)
                for kind, ts in kinds.items()
                for stat, fn in (("min", min), ("median", statistics.median))
            },
        }
        for n, kinds in times.items()
    ]
    return {
        "precision": "bf16" if use_bf16 else "fp32",
        "rounds": rounds,
        "machine": describe_machine(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "rows": rows,
    }


def default_thread_counts() -> list[int]:
    cores, counts, n = usable_cores(), [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [cores]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--threads", default="", help="comma-separated thread counts (default: 1, 2, 4, ... and the usable cores)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the thread counts")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        counts = [int(t) for t in args.threads.split(",") if t.strip()] or default_thread_counts()
    except ValueError:
        parser.error(f"--threads: expected comma-separated integers, got {args.threads!r}")
    if any(n < 1 for n in counts) or args.rounds < 1:
        parser.error("--threads and --rounds must be positive")
    result = measure(counts, args.rounds)
    machine = result["machine"]
    print(
        f"tiny default, CPU work per torch thread count ({result['precision']}; {machine['cpu']}, "
        f"{machine['cores']} usable cores; "
        f"fastest / median of {args.rounds} rounds)"
    )
    print(f"{'threads':>8} {'train step (1,024 tokens)':>28} {'decode (128 x (24 + 32) tokens)':>34}")
    for row in result["rows"]:
        print(
            f"{row['threads']:>8} {row['train_min_s']:>14.3f} / {row['train_median_s']:.3f} s"
            f" {row['decode_min_s']:>20.3f} / {row['decode_median_s']:.3f} s"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.tiny_threads", main))
