"""What a packed forward (several samples in one row, no padding) needs from the target's kernels.

A packed row carries its samples' boundaries the way transformers' decoders read them: position ids
that restart at 0 for each sample (the attention layers' mask builder turns that into a document
mask for sdpa, eager and flex attention; the flash-attention path reads them too) and `cu_seq_lens_q`
/ `cu_seq_lens_k` (the Gated DeltaNet layers pass them to fla as `cu_seqlens`). The torch fallbacks
of the Gated DeltaNet's convolution and delta rule accept those arguments and drop them, so a
sample would silently read its neighbour's state: `packing_refusal` says why a target cannot be
packed (None when it can), and the routed kernels raise instead of dropping boundaries.

The convolution: transformers' `causal_conv1d_fn` falls back to its reference PyTorch code when the
`causal-conv1d` package is missing (no wheel for these hosts), although fla, which the Gated DeltaNet
already uses, has a Triton one that takes `cu_seqlens`. `install_fla_convolution` rebinds that one
module function (nothing else of the model code) so CUDA tensors go to fla's kernel and every other
tensor to the reference, as `common.target.route_kernels_by_device` does for the delta rule.

Checking the structure is not enough: some transformers decoders never hand the position ids to
their mask builder (Qwen2-VL's text model expands them to three rows; gpt-oss leaves them out; ALiBi
models read none), and their attention then mixes packed samples with no error. So
`packing_probe` also runs the loaded target on two packed rows that share a last sample but differ
in the one before it: where the samples are kept apart that last sample's output is the same bits.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable

import torch
from torch import nn

from common.target import _external_kernel, _unwrap_func_module, external_kernels, transformers_modules

log = logging.getLogger(__name__)

CONV_NAME = "causal_conv1d_fn"
# transformers' reference convolution: hidden_states [B, D, T], weight [D, W] (qwen3_5, 5.17 to 5.25).
CONV_PARAMS = ("hidden_states", "weight", "bias", "activation")
ATTENTION_KINDS = {"full_attention", "sliding_attention", "linear_attention"}
PACKABLE_ATTENTION = (
    "sdpa",
    "sdpa_per_packed_sample",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
)


def fla_causal_conv1d() -> Callable | None:
    """fla's Triton `causal_conv1d` (x [B, T, D], weight [D, W], ... -> (y, final_state)), or None."""
    for name in ("fla.modules.causal_conv1d", "fla.modules.convolution"):  # fla-core 0.6 / earlier releases
        try:
            fn = getattr(importlib.import_module(name), "causal_conv1d", None)
        except Exception:  # noqa: BLE001 - fla missing, or its Triton import failing on this host
            continue
        if callable(fn):
            return fn
    return None


def _kernel_takes(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" and tensor.dtype != torch.float64


def packed_boundaries(kwargs: dict) -> torch.Tensor | None:
    """The cumulative sample lengths a packed forward passes down (None: not packed)."""
    for key in ("cu_seq_lens_q", "cu_seqlens"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


FLA_ACTIVATIONS = (None, "silu", "swish")  # fla's kernel applies no other activation


def conv_via_fla(reference: Callable, kernel: Callable) -> Callable:
    """`reference` (transformers' causal_conv1d_fn) with CUDA tensors sent to fla's `kernel`, packed
    boundaries included; other tensors go to `reference`, which refuses packed input."""

    @functools.wraps(reference)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = packed_boundaries(kwargs)
        if _kernel_takes(hidden_states) and activation in FLA_ACTIVATIONS:
            x_BTD = hidden_states.transpose(1, 2).contiguous()
            y_BTD, _ = kernel(x_BTD, weight, bias, activation=activation, cu_seqlens=cu_seqlens)
            return y_BTD.transpose(1, 2)
        if cu_seqlens is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(
                f"{CONV_NAME}: packed sequences need fla's CUDA kernel; the torch implementation cannot keep them apart"
            )
        return reference(hidden_states, weight, bias, activation=activation)

    conv._dflash_fla_conv = True
    conv._dflash_reference = reference
    return conv


def _reference_conv(fn) -> Callable | None:
    """The reference convolution behind transformers' `causal_conv1d_fn` when no external package is
    bound to it (with `causal-conv1d` installed, transformers' own choice stays)."""
    if not callable(fn) or getattr(fn, "_dflash_fla_conv", False):
        return None
    unwrapped = _unwrap_func_module(fn)
    if _external_kernel(unwrapped) is not None:
        return None
    inner = getattr(unwrapped, "__wrapped__", unwrapped)
    try:
        params = tuple(inspect.signature(inner).parameters)
    except (TypeError, ValueError):
        return None
    return fn if params[: len(CONV_PARAMS)] == CONV_PARAMS else None


def install_fla_convolution(model: nn.Module, kernel: Callable | None = None) -> list[str]:
    """Rebind the model's transformers `causal_conv1d_fn` to `conv_via_fla` where fla is importable
    (or `kernel` is given) and no external convolution is bound; the module functions rebound now."""
    kernel = kernel or fla_causal_conv1d()
    if kernel is None:
        return []
    done = []
    for module in transformers_modules(model):
        reference = _reference_conv(getattr(module, CONV_NAME, None))
        if reference is not None:
            setattr(module, CONV_NAME, conv_via_fla(reference, kernel))
            done.append(f"{module.__name__}.{CONV_NAME}")
    if done:
        log.info("fla's Triton causal_conv1d for CUDA tensors (reference convolution otherwise): %s", ", ".join(done))
    return done


def restore_reference_convolution(model: nn.Module) -> list[str]:
    """Undo `install_fla_convolution` (a benchmark's baseline): the module functions restored."""
    done = []
    for module in transformers_modules(model):
        fn = getattr(module, CONV_NAME, None)
        if getattr(fn, "_dflash_fla_conv", False):
            setattr(module, CONV_NAME, fn._dflash_reference)
            done.append(f"{module.__name__}.{CONV_NAME}")
    return done


def fla_convolution_installed(model: nn.Module) -> bool:
    return any(getattr(getattr(m, CONV_NAME, None), "_dflash_fla_conv", False) for m in transformers_modules(model))


def packed_arguments(lengths, device) -> dict:
    """What a transformers decoder reads a packed row's boundaries from: position ids restarting at 0
    per sample (the attention mask) and cumulative lengths (flash attention, fla's kernels), on
    `device` (from pinned memory on a GPU, so the copies do not make the host wait for it)."""
    lengths_S = torch.tensor(list(lengths), dtype=torch.long)
    cu_seqlens = torch.zeros(len(lengths_S) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths_S, 0)
    starts_N = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths_S)
    position_ids = (torch.arange(int(lengths_S.sum())) - starts_N)[None]
    if torch.device(device).type == "cuda":
        cu = cu_seqlens.pin_memory().to(device, non_blocking=True)
        position_ids = position_ids.pin_memory().to(device, non_blocking=True)
    else:
        cu, position_ids = cu_seqlens.to(device), position_ids.to(device)
    longest = int(lengths_S.max())
    return {
        "dflash_segments": tuple(int(x) for x in cu_seqlens),  # on the host, for `packed_sdpa_attention`
        "position_ids": position_ids,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


# No "flash" in the name: transformers treats any implementation whose name holds it as flash attention.
PACKED_SDPA = "sdpa_per_packed_sample"


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function signature (query [B, H, Q, D], key and value [B, Hkv, S, D];
    returns ([B, Q, H, D], None)). A packed row (one row, `dflash_segments` given): transformers' SDPA
    once per sample, causal and without a mask (so SDPA's flash kernel runs) on layers without a
    sliding window shorter than the sample, on the sample's block of the mask otherwise (the row's mask
    is built, but no attention runs over all of it). Anything else (not packed, not causal, a position
    bias): transformers' SDPA as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop("dflash_segments", None)
    is_causal = kwargs.pop("is_causal", None)
    causal = getattr(module, "is_causal", True) and is_causal is not False
    packed = segments is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2] == segments[-1]
    packed = packed and causal and kwargs.get("position_bias") is None
    if not packed:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # Mistral-style models pass the window to the attention function; Qwen2/3-style ones set it on the module.
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    outputs = []
    for a, b in zip(segments, segments[1:]):
        windowed = window is not None and attention_mask is not None and b - a > window
        mask = attention_mask[..., a:b, a:b] if windowed else None
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            **kwargs,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def use_packed_sdpa(target) -> Callable[[], None] | None:
    """Switch the text decoder of a target that runs transformers' SDPA to `packed_sdpa_attention`
    (registered once, with SDPA's own mask builder); returns what switches it back, or None where
    nothing was switched (another attention implementation). Only the text decoder's configs change:
    a composite config's setter would pass the name on to a vision tower, which packing never feeds."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    configs = {id(target.text_config): target.text_config}
    for module in target.layers.modules():
        if getattr(module, "config", None) is not None:
            configs[id(module.config)] = module.config
    if any(getattr(c, "_attn_implementation", None) != "sdpa" for c in configs.values()):
        return None
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)
    for config in configs.values():
        config._attn_implementation = PACKED_SDPA  # read by every attention layer when it runs

    def restore() -> None:
        for config in configs.values():
            config._attn_implementation = "sdpa"

    return restore


PROBE_LENGTHS = (70, 90)  # past fla's 64-token chunks and the convolution's width


@torch.inference_mode()
def packing_probe(target, seed: int = 0) -> str | None:
    """Run the target on two packed rows [a, b] and [a', b] (random tokens, a != a'): None when b's
    final hidden states are equal in both (nothing of the sample before it reached b), else why not."""
    first, last = PROBE_LENGTHS
    gen = torch.Generator().manual_seed(seed)
    vocab = int(target.vocab_size)
    b = torch.randint(0, vocab, (last,), generator=gen)
    boundaries = packed_arguments(PROBE_LENGTHS, target.input_device)
    outputs = []
    for _ in range(2):
        a = torch.randint(0, vocab, (first,), generator=gen)
        ids = torch.cat([a, b])[None].to(target.input_device)
        out = target.decoder(input_ids=ids, use_cache=False, **boundaries)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        outputs.append(hidden[0, first:].float().cpu())
    scale = float(outputs[0].abs().max()) or 1.0
    error = float((outputs[0] - outputs[1]).abs().max()) / scale
    if error > 1e-4:  # kept apart, the same kernels on the same shapes give the same bits
        return (
            f"a packed sample's output changed with the sample before it (max difference {error:.2g} of its "
            "largest value): this model's layers do not keep packed samples apart"
        )
    return None


def packing_refusal(target) -> str | None:
    """Why packing this target's samples into one row could let one sample see another; None when
    every layer keeps packed samples apart (attention through the position-id document mask, Gated
    DeltaNet layers through fla's CUDA kernels for the delta rule and the convolution)."""
    model, config = target.model, target.text_config
    name = type(model).__name__
    if not type(target.decoder).__module__.startswith("transformers."):
        return f"{name} runs model code from outside transformers, whose handling of packed rows is unknown"
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return "this transformers version builds no document mask from restarting position ids"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - ATTENTION_KINDS:
        return f"{name} has layers of kind {sorted(kinds - ATTENTION_KINDS)}, which packing does not cover"
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in PACKABLE_ATTENTION:
        return f"attention implementation {attention!r} builds no document mask (use one of {PACKABLE_ATTENTION})"
    if "linear_attention" not in kinds:
        return None
    device = target.input_device
    if device.type != "cuda":
        return (
            f"its Gated DeltaNet layers keep packed samples apart only in fla's CUDA kernels; on {device} the torch "
            "implementation would carry one sample's state into the next"
        )
    bound = " ".join(external_kernels(model).values())
    if "chunk_gated_delta_rule" not in bound:
        return "fla's chunk_gated_delta_rule is not bound to its Gated DeltaNet layers (is fla installed?)"
    if not fla_convolution_installed(model):
        return "fla's causal_conv1d is not bound to its Gated DeltaNet convolution (is fla installed?)"
    if next(target.layers.parameters()).dtype == torch.float64:
        return "in float64 the Gated DeltaNet runs in torch, which cannot keep packed samples apart"
    return None
