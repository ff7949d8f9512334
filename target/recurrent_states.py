"""Per-token states of a hybrid target's Gated DeltaNet layers: what lets speculative decoding cut a
hybrid target's cache back after a partial acceptance with no copy of the cache and no re-run.

A Gated DeltaNet layer (Qwen3.5 / 3.6, Qwen3-Next: transformers' `*GatedDeltaNet`, layer type
"linear_attention") carries two states per sequence that no count can cut back: the recurrent state
[1, H, K, V] and its short causal convolution's window, the last W inputs [1, D, W]. During a
*recorded* forward of T tokens (a speculative verify) each such layer keeps
  - the recurrent state after every position: the delta rule runs token by token through the function
    transformers calls for its own one-token step (fla's fused recurrent kernel on CUDA where fla is
    installed, transformers' torch loop elsewhere), chained, in place of the chunked kernel; every
    step's state is kept (fla 0.6's kernels return the final state only);
  - the convolution's input [old window | the T new inputs], whose columns v .. v+W-1 are the window
    after v tokens.
Keeping the first v of the T tokens (`keep`) copies state v-1 and window v into the cache layer: two
copies per layer. The one-token forward and the prompt's run as transformers runs them.

How it reaches into transformers (as little as it can; the same in transformers 5.17 to 5.25):
  - the modeling module's `torch_chunk_gated_delta_rule` global (what the layer calls for a multi-token
    forward) is rebound once to a function that passes every call through unchanged, except inside a
    recorded forward;
  - a forward pre-hook on each Gated DeltaNet module tells that function which layer is calling;
  - the cache object's `update_conv_state` (on the instance, not its class) hands its result to the record.
`PerTokenStates.for_target` checks every recurrent layer kind before decoding starts, and a probe forward
checks that each layer left a complete record. A layer kind it does not know (a layer type other than
full / sliding / linear attention, or a module whose forward does not call those functions) gives no
`PerTokenStates` but a one-line reason, and decoding falls back to copying the cache before each verify.

Shape legend: T tokens of the forward, H heads, K/V head widths, D convolution channels, W window.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator

import torch
from torch import nn

from target.load import Target

ATTENTION_KINDS = ("full_attention", "sliding_attention")
RECURRENT_KIND = "linear_attention"
CHUNK_NAME = "torch_chunk_gated_delta_rule"  # the layer's multi-token delta rule (fla's chunk kernel on CUDA)
STEP_NAME = "torch_recurrent_gated_delta_rule"  # its one-token delta rule (fla's fused recurrent kernel on CUDA)
# The chunked function's positional parameters (transformers' and fla's API), for calls that pass any by position.
CHUNK_PARAMS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state")

_calling: list = [None]  # (recorder, layer index) of the Gated DeltaNet forward running now, while recording


def _calls_delta_rule(module: nn.Module) -> bool:
    """Whether `module`'s forward calls its modeling module's chunked and one-token delta rules (the
    Gated DeltaNet layers of transformers 5.17 to 5.25)."""
    forward = inspect.unwrap(type(module).forward)
    names = set(getattr(getattr(forward, "__code__", None), "co_names", ()))
    home = sys.modules.get(type(module).__module__)
    return {CHUNK_NAME, STEP_NAME} <= names and all(callable(getattr(home, n, None)) for n in (CHUNK_NAME, STEP_NAME))


def recurrent_mixers(target: Target) -> tuple[dict[int, nn.Module], str | None]:
    """({layer index: its Gated DeltaNet module}, None), or ({}, the one-line reason) where a recurrent
    layer is of a kind this module cannot keep per-token states for. ({}, None): no recurrent layer."""
    layer_types = list(getattr(target.text_config, "layer_types", None) or [])
    unknown = sorted({str(t) for t in layer_types} - {*ATTENTION_KINDS, RECURRENT_KIND})
    if unknown:
        return {}, f"layer kind {', '.join(repr(t) for t in unknown)} is not one it knows ({RECURRENT_KIND} is)"
    mixers = {}
    for i, kind in enumerate(layer_types):
        if kind != RECURRENT_KIND:
            continue
        found = [m for m in target.layers[i].children() if _calls_delta_rule(m)]
        if len(found) != 1:
            names = ", ".join(type(m).__name__ for m in target.layers[i].children())
            return {}, f"layer {i} ({kind}: {names}) calls no Gated DeltaNet delta rule it knows"
        mixers[i] = found[0]
    return mixers, None


def delta_rule_per_token(step, query, key, value, *, g, beta, initial_state, **kwargs):
    """(outputs [B, T, H, V], the recurrent state after each of the T positions) of the delta rule run one
    token at a time through `step` (transformers' one-token function), each state feeding the next."""
    kwargs.pop("chunk_size", None)
    kwargs["output_final_state"] = True
    # One copy of each input here, not one per token: a kernel that wants contiguous inputs (fla's)
    # would copy a strided slice at every call, and a slice along T of a contiguous [1, T, ...] is contiguous.
    query, key, value, g, beta = (x.contiguous() for x in (query, key, value, g, beta))
    outputs, states, state = [], [], initial_state
    for t in range(query.shape[1]):
        one = slice(t, t + 1)
        out, state = step(query[:, one], key[:, one], value[:, one], g=g[:, one], beta=beta[:, one],
                          initial_state=state, **kwargs)  # fmt: skip
        outputs.append(out)
        states.append(state)
    return torch.cat(outputs, dim=1), states


def _per_token_chunk(chunk, home):
    """`chunk` (a modeling module's chunked delta rule), run per token inside a recorded forward."""

    @functools.wraps(chunk, updated=())  # (a module-like kernel wrapper's __dict__ stays its own)
    def chunk_or_per_token(*args, **kwargs):
        caller, _calling[0] = _calling[0], None
        if caller is None:
            return chunk(*args, **kwargs)
        # strict=False: the positional arguments given name a prefix of the parameters
        kwargs.update(zip(CHUNK_PARAMS, args, strict=False))
        recorder, layer = caller
        if kwargs.get("initial_state") is None:
            raise RuntimeError(f"per-token states: layer {layer} was recorded without a previous state (a prompt?)")
        out, states = delta_rule_per_token(getattr(home, STEP_NAME), **kwargs)
        recorder.record.setdefault(layer, {})["states"] = states
        return out, states[-1]

    chunk_or_per_token._dflash_per_token = True
    chunk_or_per_token._dflash_inner = chunk  # what `target.kernel_routing.external_kernels` looks through to
    return chunk_or_per_token


def _install(home) -> None:
    """Rebind `home`'s chunked delta rule to `_per_token_chunk` (once per modeling module)."""
    chunk = getattr(home, CHUNK_NAME)
    if not getattr(chunk, "_dflash_per_token", False):
        setattr(home, CHUNK_NAME, _per_token_chunk(chunk, home))


class PerTokenStates:
    """Records the per-token states of a target's Gated DeltaNet layers in forwards run under
    `recording()`, and keeps the first v tokens' states in a cache (`keep`)."""

    def __init__(self, mixers: dict[int, nn.Module]):
        assert mixers
        self.mixers = dict(mixers)
        self.active = False
        self.record: dict[int, dict] = {}  # layer -> {"states": [T x state], "window": [1, D, W + T]}
        for layer, module in self.mixers.items():
            _install(sys.modules[type(module).__module__])
            module.register_forward_pre_hook(functools.partial(self._enter, layer))

    @classmethod
    def for_target(cls, target: Target) -> tuple[PerTokenStates | None, str | None]:
        """(per-token states for this target, None); (None, the reason) where it has recurrent layers
        this cannot serve; (None, None) where it has none. One recorder per model: its hooks stay."""
        known = getattr(target.model, "_dflash_per_token_states", None)
        if known is not None:
            return known, None
        mixers, reason = recurrent_mixers(target)
        if not mixers:
            return None, reason
        target.model._dflash_per_token_states = cls(mixers)
        return target.model._dflash_per_token_states, None

    def _enter(self, layer: int, module, args) -> None:  # noqa: ARG002 (a forward pre-hook's, bound to a layer)
        if self.active:
            _calling[0] = (self, layer)

    def watch(self, cache) -> None:
        """Have `cache` (a transformers cache) hand each recorded layer's convolution input to the record."""
        if getattr(cache, "_dflash_watched", None) is self:
            return
        update = cache.update_conv_state

        def update_conv_state(conv_input, layer_idx, *args, **kwargs):
            window = update(conv_input, layer_idx, *args, **kwargs)
            if self.active and layer_idx in self.mixers:
                self.record.setdefault(layer_idx, {})["window"] = window
            return window

        cache.update_conv_state = update_conv_state
        cache._dflash_watched = self

    @contextlib.contextmanager
    def recording(self, cache) -> Iterator[None]:
        """Record the per-token states of the forward run inside the block (on `cache`); `take` them after."""
        self.watch(cache)
        self.record, self.active = {}, True
        try:
            yield
        finally:
            self.active, _calling[0] = False, None

    def take(self, tokens: int) -> dict[int, dict]:
        """The record of the forward just run over `tokens` tokens; RuntimeError (one line) where a layer
        left none (a transformers release that calls its Gated DeltaNet differently)."""
        record, self.record = self.record, {}
        for layer in self.mixers:
            got = record.get(layer, {})
            states, window = got.get("states"), got.get("window")
            if states is None or len(states) != tokens or window is None or window.shape[-1] < tokens:
                raise RuntimeError(
                    f"per-token states: Gated DeltaNet layer {layer} left no complete record of a {tokens}-token "
                    f"forward (states {None if states is None else len(states)}, convolution window "
                    f"{None if window is None else tuple(window.shape)})"
                )
        return record

    @staticmethod
    def keep(cache_layers, record: dict[int, dict], tokens: int, kept: int) -> None:
        """Set each recorded layer of `cache_layers` to its states after the first `kept` of the
        recorded forward's `tokens` tokens (the recurrent state, the convolution window, and the
        token count transformers 5.2x keeps per linear layer)."""
        assert 1 <= kept <= tokens, (kept, tokens)
        if kept == tokens:
            return  # the cache holds the last position's states already
        for layer, got in record.items():
            cached = cache_layers[layer]
            width = cached.conv_states[0].shape[-1]
            cached.conv_states[0].copy_(got["window"][..., kept : kept + width])
            cached.recurrent_states[0].copy_(got["states"][kept - 1])
            counter = getattr(cached, "cumulative_length_linear", None)
            if isinstance(counter, torch.Tensor):
                counter.sub_(tokens - kept)


def zero_recurrent_states(cache) -> None:
    """Zero every recurrent state and convolution window of `cache` (a static cache's next sequence
    starts from zeros, which is what transformers' first forward of a sequence starts from)."""
    for layer in getattr(cache, "layers", ()):
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            for state in (states or {}).values():
                if isinstance(state, torch.Tensor):
                    state.zero_()
