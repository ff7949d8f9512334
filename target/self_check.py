"""The target's self-check: on a few tokens, before anything is extracted, trained or decoded, that the
target computes what the stages will store and use (`self_check(target) -> SelfCheck`).

    parts    the embedding, decoder, its layers, final norm and head were found (`target.load`)
    weights  every tensor the model expects was in its weight files, none had another shape
             (transformers' loading info; `load_target` refuses otherwise, so this records it)
    layers   every decoder layer returns one hidden state per token, [1, T, hidden]: a tap stores
             that (Gemma-3n's layers return stacked streams)
    logits   the log-probabilities extraction stores, from the decoder's last hidden state through
             `Target.logits_fn`, equal the model's own forward's log_softmax (`model(ids).logits`)
    cache    a 16-token block through the cache after a prefill equals the full recompute of the
             same tokens: what speculative decoding's verify pass computes against what the target
             computes (a hybrid family whose cached forward differs is reported lossless by a short
             run and is not at 128 tokens)

Tolerance of `logits` and `cache` (docs/own-target.md, "The self-check"): the largest difference of
log-probabilities over the whole vocabulary and every checked position may be at most

    max(FLOOR[dtype] x max(1, largest |log-probability|), 4 x noise)

FLOOR is the rounding of the compute dtype (float32 2e-6, about 16 units in the last place; float16
2e-3, bfloat16 1.6e-2, about 2), scaled by the size of the values compared because rounding is
relative; `noise` is
the same difference between two full forwards of different lengths at their shared positions (exactly
zero in exact arithmetic: it measures how much this target's own rounding moves with the shapes of
its kernels on this device). On the matrix's tiny random targets in float32 on a CPU a correct cache
differs by at most 1e-6 and a wrong one by 4e-5 (Jamba) to 6e-3 (MiniMax); in bfloat16 only errors
above bf16 rounding are visible, and `dtype=float32` checks a target exactly.

A failing check is one line with the numbers (`SelfCheck.refusal`). `cache` is the one a user may
accept (`SelfCheck.refusal(accept_cache=True)` warns instead): the drafter is still trained on the
target's true outputs, but speculative decoding through this target's cache is not exactly its own
greedy decoding.

Shape legend: T tokens, V vocabulary, K checked block.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from target.load import Target, layer_output
from target.static_cache import cache_kwarg

__all__ = [
    "Check",
    "SelfCheck",
    "SelfCheckFailed",
    "self_check",
    "check_logits",
    "check_cache",
    "FLOOR",
    "BLOCK",
    "ACCEPT_CACHE_KEY",
]

FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NOISE_FACTOR = 4.0
BLOCK = 16  # the block DFlash verifies (block size 16)
PREFIX = 16  # tokens before the block
ACCEPT_CACHE_KEY = "allow_cache_mismatch"
_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step, "
    "and every step counts when the road is long and the weather is cold."
)


class SelfCheckFailed(ValueError):
    """A target refused by its self-check: the one line with the numbers, and `reason`, the same without
    them (docs/architectures.md's refused table quotes it)."""

    def __init__(self, line: str, reason: str):
        super().__init__(line)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    line: str  # what was checked and found, with the numbers
    value: float | None = None  # the largest difference measured
    tolerance: float | None = None
    acceptable: bool = False  # a user may accept the risk (recorded)
    reason: str = ""  # what failed, without the numbers (a failed check only)


@dataclasses.dataclass(frozen=True)
class SelfCheck:
    target: str
    dtype: str
    device: str
    tokens: int
    seconds: float
    checks: tuple[Check, ...]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def refusal(self, accept_cache: bool = False) -> SelfCheckFailed | None:
        """The error that refuses this target, one line (None: it passes, or only accepted checks failed)."""
        blocking = [c for c in self.failed if not (c.acceptable and accept_cache)]
        if not blocking:
            return None
        first = blocking[0]
        hint = f"; set {ACCEPT_CACHE_KEY}=true to accept it" if first.acceptable else ""
        line = f"target '{self.target}' failed its self-check ({self.dtype}, {self.device}): {first.line}{hint}"
        return SelfCheckFailed(line, f"its self-check: {first.reason}{hint}")

    def lines(self) -> list[str]:
        return [f"  {'ok' if c.ok else 'FAILED':<7}{c.name:<9}{c.line}" for c in self.checks]

    @classmethod
    def from_record(cls, record: dict) -> SelfCheck:
        checks = tuple(Check(**c) for c in record["checks"])
        fields = ("target", "dtype", "device", "tokens", "seconds")
        return cls(**{k: record[k] for k in fields}, checks=checks)

    def record(self, accept_cache: bool = False) -> dict:
        accepted = [c.name for c in self.failed if c.acceptable and accept_cache]
        return {
            "target": self.target,
            "dtype": self.dtype,
            "device": self.device,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 2),
            "passed": not self.failed,
            "accepted": accepted,
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }


def probe_ids(target: Target, n: int) -> torch.Tensor:
    """[1, n] token ids: a fixed English text through the target's tokenizer, else (too few tokens, no
    tokenizer) seeded random ids of its vocabulary."""
    ids: list[int] = []
    if target.tokenizer is not None:
        ids = list(target.tokenizer(_PROBE_TEXT * 4, add_special_tokens=False)["input_ids"])
    if len(ids) < n:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, target.vocab_size, (1, n), generator=generator)
    return torch.tensor([ids[:n]], dtype=torch.long)


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)


def _difference(a_TV: torch.Tensor, b_TV: torch.Tensor) -> float:
    """The largest |a - b| of two log-probability tables over the positions where both are finite; inf
    where one is finite and the other is not (a NaN the other path does not make is a difference too).
    A position the model's own forward leaves non-finite (a poisoned token) is extraction's to reject."""
    b_TV = b_TV.to(a_TV.device)
    finite_a, finite_b = torch.isfinite(a_TV).all(-1), torch.isfinite(b_TV).all(-1)
    if not torch.equal(finite_a, finite_b):
        return float("inf")
    if not bool(finite_a.any()):
        return 0.0
    return float((a_TV[finite_a] - b_TV[finite_a]).abs().max())


def _tolerance(dtype: torch.dtype, logits_TV: torch.Tensor, noise: float) -> float:
    values = _log_probs(logits_TV)
    values = values[torch.isfinite(values)]
    scale = max(1.0, float(values.abs().max())) if values.numel() else 1.0  # the size of the values compared
    return max(FLOOR.get(dtype, FLOOR[torch.float32]) * scale, NOISE_FACTOR * noise)


def _model_logits(target: Target, ids_1T: torch.Tensor, **kwargs):
    out = target.model(input_ids=ids_1T.to(target.input_device), **kwargs)
    return out, (out.logits if hasattr(out, "logits") else out[0])[0]


@torch.inference_mode()
def check_logits(target: Target, ids_1T: torch.Tensor, full_TV: torch.Tensor, noise: float) -> tuple[Check, Check]:
    """(layers, logits): every decoder layer's output shape on the decoder forward extraction runs, and
    the log-probabilities extraction stores against the model's own (`full_TV`, its forward's logits)."""
    T, H = ids_1T.shape[1], target.hidden_size
    shapes: dict[int, tuple] = {}

    def keep_shape(i: int):
        def hook(module, args, output) -> None:  # noqa: ARG001 (returns None: the output stays as it is)
            shapes[i] = tuple(layer_output(output).shape)

        return hook

    hooks = [layer.register_forward_hook(keep_shape(i)) for i, layer in enumerate(target.layers)]
    try:
        out = target.decoder(input_ids=ids_1T.to(target.input_device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    odd = {i: s for i, s in shapes.items() if s != (1, T, H)}
    if odd:
        i, shape = next(iter(odd.items()))
        layers = Check(
            "layers",
            False,
            f"decoder layer {i} returns {list(shape)}, not one hidden state per token [1, {T}, {H}] (stacked "
            "streams?): a tap cannot store it",
            reason="a decoder layer returns more than one hidden state per token, which a tap cannot store",
        )
    else:
        layers = Check("layers", True, f"all {target.num_layers} decoder layers return [1, T, {H}]")
    hidden_TH = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[0]
    stored_TV = _log_probs(target.logits_fn(hidden_TH.to(target.output_device)))
    reference_TV = _log_probs(full_TV)
    diff = _difference(stored_TV, reference_TV)
    tolerance = _tolerance(target.lm_head.weight.dtype, full_TV, noise)
    top_same = bool(torch.equal(stored_TV.argmax(-1).cpu(), reference_TV.argmax(-1).cpu()))
    path = getattr(target.logits_fn, "path", "the target's logits function")
    line = (
        f"stored log-probabilities ({path}) against the model's own forward: max difference {diff:.2e} "
        f"(tolerance {tolerance:.1e}), top-1 {'equal' if top_same else 'DIFFERS'} at {T} positions"
    )
    reason = "the log-probabilities extraction would store are not the model's own forward's"
    return layers, Check("logits", diff <= tolerance, line, diff, tolerance, reason=reason)


@torch.inference_mode()
def check_cache(target: Target, ids_1T: torch.Tensor, full_TV: torch.Tensor, noise: float) -> Check:
    """A BLOCK-token block through the cache after a prefill against the full forward's last BLOCK positions."""
    T = ids_1T.shape[1]
    prefix = T - BLOCK
    name = cache_kwarg(target.model)
    try:
        out, _ = _model_logits(target, ids_1T[:, :prefix], use_cache=True)
        cache = getattr(out, "cache", None)
        cache = cache if cache is not None else getattr(out, "past_key_values", None)
        if cache is None:
            raise ValueError(f"{type(out).__name__} carries no cache")
        _, block_KV = _model_logits(target, ids_1T[:, prefix:], **{name: cache, "use_cache": True})
    except (TypeError, ValueError, AttributeError, RuntimeError, IndexError, KeyError) as exc:
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return Check(
            "cache",
            False,
            f"a forward through its cache fails ({problem}): speculative decoding verifies blocks through the cache",
            reason="its forward through a cache fails (speculative decoding verifies blocks through the cache)",
        )
    diff = _difference(_log_probs(block_KV), _log_probs(full_TV[prefix:]))
    tolerance = _tolerance(target.lm_head.weight.dtype, full_TV, noise)
    line = (
        f"a {BLOCK}-token block through the cache after {prefix} tokens against the full recompute: max "
        f"log-probability difference {diff:.2e} (tolerance {tolerance:.1e})"
    )
    reason = f"a {BLOCK}-token block through its cache differs from the full recompute beyond rounding"
    return Check("cache", diff <= tolerance, line, diff, tolerance, acceptable=True, reason=reason)


def parts_check(target: Target) -> Check:
    names = {id(m): n for n, m in target.model.named_modules()}
    embed = target.decoder.get_input_embeddings()

    def where(module) -> str:
        return names.get(id(module), type(module).__name__) or type(module).__name__

    line = (
        f"embedding {where(embed)}, {target.num_layers} layers in {where(target.layers)}, final norm "
        f"{where(target.final_norm)}, head {where(target.lm_head)}"
    )
    return Check("parts", True, line)


def weights_check(target: Target) -> Check:
    loading = target.loading or {}
    if not loading:
        return Check("weights", True, "not loaded from a directory: nothing to compare")
    unexpected = loading.get("unexpected_keys") or []
    extra = f"; {len(unexpected)} stored tensors unused (e.g. {unexpected[0]})" if unexpected else ""
    return Check("weights", True, f"every tensor the model expects was loaded, none initialised{extra}")


@torch.inference_mode()
def self_check(target: Target, ids_1T: torch.Tensor | None = None, *, cache: bool = True) -> SelfCheck:
    """Every check on `ids_1T` (default: `probe_ids`, PREFIX + BLOCK tokens); `cache=False` leaves out
    the cache check (extraction's own check: it stores full forwards only)."""
    start = time.perf_counter()
    ids_1T = probe_ids(target, PREFIX + BLOCK) if ids_1T is None else ids_1T
    T = ids_1T.shape[1]
    assert T > BLOCK, T
    _, full_TV = _model_logits(target, ids_1T, use_cache=False)
    _, shorter_SV = _model_logits(target, ids_1T[:, : T - BLOCK // 2], use_cache=False)
    shared = shorter_SV.shape[0]
    noise = _difference(_log_probs(shorter_SV), _log_probs(full_TV[:shared]))
    noise = 0.0 if noise == float("inf") else noise
    layers, logits = check_logits(target, ids_1T, full_TV, noise)
    checks = (parts_check(target), weights_check(target), layers, logits)
    if cache:
        checks += (check_cache(target, ids_1T, full_TV, noise),)
    dtype = str(target.lm_head.weight.dtype).replace("torch.", "")
    device = str(target.input_device)
    return SelfCheck(target.path, dtype, device, T, time.perf_counter() - start, checks)
