"""What a packed forward (several samples in one row, no padding) needs from the target's kernels.

A packed row carries its samples' boundaries the way transformers' decoders read them: position ids
that restart at 0 for each sample (the attention layers' mask builder turns that into a document
mask for sdpa, eager and flex attention; the flash-attention path reads them too) and `cu_seq_lens_q`
/ `cu_seq_lens_k` (the Gated DeltaNet layers pass them to fla as `cu_seqlens`). The torch fallbacks
of the Gated DeltaNet's convolution and delta rule accept those arguments and drop them, so a
sample would silently read its neighbour's state: `packing_refusal` says why a target cannot be
packed (None when it can), and the kernels `target.kernel_routing` routes (fla's delta rule and
convolution) raise instead of dropping boundaries.

Checking the structure is not enough: some transformers decoders never hand the position ids to
their mask builder (Qwen2-VL's text model expands them to three rows; gpt-oss leaves them out; ALiBi
models read none), and their attention then mixes packed samples with no error. So
`packing_probe` also runs the loaded target on two packed rows that share a last sample but differ
in the one before it: where the samples are kept apart that last sample's output is the same bits.

`use_packed_sdpa` runs transformers' SDPA once per sample of a packed row (causal and maskless:
SDPA's flash case) instead of over the row's dense N x N document mask.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from target.kernel_routing import external_kernels, fla_convolution_installed

ATTENTION_KINDS = {"full_attention", "sliding_attention", "linear_attention"}
PACKABLE_ATTENTION = (
    "sdpa",
    "sdpa_per_packed_sample",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
)


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
    for a, b in itertools.pairwise(segments):
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
