"""Fused kernels inside the captured CUDA graphs of speculative decoding: `torch.compile` (inductor)
applied only while a fixed-shape forward is warmed up and captured, so a replay runs a third of the
kernels (each norm, rotary embedding and gated activation one Triton kernel instead of five or six).

A small target on a GPU is bound by its kernels' fixed costs, not by arithmetic: SmolLM2-135M runs
~1,200 kernels per forward, and even replayed from a graph each costs a few microseconds. Fusing
them is what transformers' own `generate(cache_implementation="static")` gets from compiling.

Why only during capture: every other forward of the same model (the prompt's prefill of any length,
the agreement check's teacher-forced passes, the peer baselines) runs the eager code, so the compiler
sees exactly the captured shapes (1 and each verify size of new tokens) and never recompiles per prompt.
Each decoder layer is compiled on its own, so the tap hooks (layer id i = output of decoder layer i)
stay outside the compiled code, exactly as extraction runs them.

Only the target is compiled. The drafter's round (train.serve.static_drafter) compiled the same way
failed its capture ("operation failed due to a previous error during capture";
docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "Real target"), and its graphed round already costs a fraction of
the target's verify.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

# How each `compile` choice compiles: (backend, inductor mode). Our own CUDA graphs wrap the compiled
# code, so inductor's cudagraph modes are never used; "max-autotune" also times Triton templates
# against cuBLAS for every matrix product (float32 products of 16 rows leave most of the GPU idle in
# cuBLAS). "aot_eager" traces as inductor does without generating kernels (the CPU tests).
COMPILE_MODES = {
    "default": ("inductor", None),
    "max-autotune": ("inductor", "max-autotune-no-cudagraphs"),
    "aot_eager": ("aot_eager", None),
}


def check_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: give one of {', '.join(COMPILE_MODES)}")
    return mode


def _compile(fn: Callable, mode: str) -> Callable:
    backend, inductor_mode = COMPILE_MODES[check_mode(mode)]
    return torch.compile(fn, backend=backend, mode=inductor_mode, dynamic=False)


@contextlib.contextmanager
def compiled_layers(layers: Sequence[nn.Module], mode: str, shapes: int = 2) -> Iterator[None]:
    """Each module's `forward` compiled (fixed shapes) for the duration of the block, then restored.

    Every layer is a recompilation of the same code (they differ in `layer_idx`, a constant to the
    compiler), so the recompilation limit is raised to cover them for the `shapes` input shapes
    captured; a limit hit anyway raises (where torch can say so) instead of leaving layers eager."""
    check_mode(mode)
    originals = [layer.__dict__.get("forward") for layer in layers]
    limit = max(torch._dynamo.config.recompile_limit, 2 * max(shapes, 2) * len(layers) + 8)
    patch = {"recompile_limit": limit, "accumulated_recompile_limit": max(256, 8 * limit)}
    # Not with suppressed errors: torch then refuses the flag, and every compile would fail its config check.
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit") and not torch._dynamo.config.suppress_errors:
        patch["fail_on_recompile_limit_hit"] = True
    with torch._dynamo.config.patch(**patch):
        try:
            for layer in layers:
                layer.forward = _compile(type(layer).forward.__get__(layer), mode)
            yield
        finally:
            for layer, original in zip(layers, originals, strict=True):
                if original is None:
                    del layer.forward
                else:
                    layer.forward = original
