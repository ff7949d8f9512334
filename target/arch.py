"""Can this checkpoint be a DFlash target, and where are the parts the drafter shares with it?

    arch = check_architecture(path)          # ValueError, one line, when the family cannot work

A DFlash drafter shares its target's token embedding (the block it drafts is embedded by the target)
and output head (its logits are the target's head applied to its hidden states), and reads the
target's decoder-layer outputs. `check_architecture` answers, before any weights are loaded (it builds the
model's skeleton with empty weights from the config), whether a checkpoint offers those:

- a decoder-only causal LM (an encoder-decoder, or a config transformers has no causal-LM class
  for, is refused);
- a token embedding and an output head reached through transformers' own accessors
  (`get_input_embeddings()`, `get_output_embeddings()`), whatever their tensors are called
  (`model.embed_tokens`, `transformer.wte`, `gpt_neox.embed_in` / `embed_out`, ...), as wide as the
  hidden states, the head without a bias (the drafter's logits are the head's weight times its
  hidden state, as SGLang's DFlash drafting computes them);
- an input embedding module that is a table lookup times a constant: Gemma's multiplies the row
  by sqrt(hidden_size) (`embed_scale`), and the drafter's block embedding is what that module returns,
  as z-lab's code, SGLang and vLLM's Gemma-4 support compute it (docs/serving.md, "Embedding and head");
- decoder layers and a final norm that `target.load.reach_text_parts` finds: the decoder is what
  transformers' `get_decoder()` returns, or, where that is the causal LM itself (Llama-4 text), its
  shallowest submodule holding the layer stack (`find_decoder`); the final norm goes by the names
  transformers' decoders give it (`FINAL_NORMS`: `norm`, `final_layernorm`, RecurrentGemma's
  `final_norm`, LFM2's `embedding_norm`, XGLM's `layer_norm`, ...);
- attention layers: a recurrent-only model (Mamba, Mamba-2: no `num_attention_heads`) is refused, as
  the drafter's attention takes its heads, head width and rope from the target's;
- one hidden state per token out of each decoder layer: Gemma-3n's layers carry stacked streams
  (AltUp, `altup_num_inputs`), which a tap cannot store; the self-check (`target.self_check`) checks
  the shape of every layer's output on a real forward for any other family.

The stages that load a target call it first: regeneration and extraction (so an unusable target is
refused at the first stage, before any forward pass), training and evaluation (`TargetHead` reads
the two tensors it names), and speculative decoding. A directory without weights (regeneration
through a server may have only the config and tokenizer) is checked for everything but the stored
tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from target.checkpoint import INDEX_FILE, stored_name, tensor_names, text_config

__all__ = [
    "TargetArch",
    "check_architecture",
    "find_decoder",
    "find_final_norm",
    "find_layers",
    "find_attr",
    "LAYER_CONTAINERS",
    "FINAL_NORMS",
]

# Where transformers' decoders keep their layer stack and their final norm (Llama `layers`, GPT-2 `h`,
# RecurrentGemma `final_norm`, LFM2 `embedding_norm` (applied after the last layer), XGLM `layer_norm`).
LAYER_CONTAINERS = ("layers", "h", "blocks", "block")
FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm", "embedding_norm")
FINAL_NORMS_LAST = ("layer_norm",)  # a common name of per-layer norms too: only on a decoder without the others


@dataclasses.dataclass(frozen=True)
class TargetArch:
    """What the drafter needs to know about its target's architecture."""

    path: str
    model_class: str  # the transformers class the target loads as
    embed_tensor: str | None  # stored name of the token embedding (None: the directory holds no weights)
    head_tensor: str | None  # stored name of the output head (the embedding's when tied)
    embed_scale: float  # what the input embedding module multiplies a table row by (Gemma: sqrt(hidden))

    @property
    def tied(self) -> bool:
        return self.embed_tensor is not None and self.embed_tensor == self.head_tensor


def check_architecture(path: str | os.PathLike, trust_remote_code: bool = False) -> TargetArch:
    """The target's architecture as the drafter uses it; ValueError (one line, naming the directory,
    its class and why) for a family a DFlash drafter cannot serve."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(f"target '{path}' has no config.json: it is not a Hugging Face checkpoint directory")
    stamp = tuple((root / name).stat().st_mtime_ns if (root / name).exists() else 0 for name in _STAMPED)
    return _checked(str(root.resolve()), bool(trust_remote_code), stamp)


_STAMPED = ("config.json", INDEX_FILE, "model.safetensors")


@functools.lru_cache(maxsize=8)
def _checked(path: str, trust_remote_code: bool, stamp: tuple) -> TargetArch:  # noqa: ARG001 (a cache key)
    # stamp: the files' modification times, so a checkpoint rewritten in place is checked again
    model = _skeleton(path, trust_remote_code)
    name = type(model).__name__

    def refuse(why: str) -> ValueError:
        return ValueError(f"target '{path}' ({name}) cannot be a DFlash target: {why}")

    embed, head = _accessed(model.get_input_embeddings), _accessed(model.get_output_embeddings)
    hidden = int(model.config.get_text_config().hidden_size)
    problem = _kind_problem(model.config) or _parts_problem(model, embed, head, hidden)
    if problem:
        raise refuse(problem)
    embed_tensor = head_tensor = None
    if _has_weights(path):
        model.tie_weights()  # what loading does: a tied head is the embedding's tensor
        embed_tensor, head_tensor, problem = _stored_parts(path, model, embed, head)
        if problem:
            raise refuse(problem)
    scale = _embed_scale(embed, hidden)
    if scale is None:
        raise refuse(f"its input embedding module ({type(embed).__name__}) is not a table lookup times a constant")
    return TargetArch(path, name, embed_tensor, head_tensor, scale)


def _skeleton(path: str, trust_remote_code: bool) -> nn.Module:
    """The model built from its config with empty (meta) weights; buffers are real (a scale lives in one)."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise ValueError(f"target '{path}' needs its own model code: set trust_remote_code=true") from None
        raise ValueError(f"target '{path}': transformers cannot read its config.json ({_first_line(exc)})") from None
    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"target '{path}' ({kind}) cannot be a DFlash target: it is an encoder-decoder model; "
            "DFlash drafts for decoder-only causal LMs"
        )
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            with init_empty_weights(include_buffers=False):
                return auto.from_config(config, trust_remote_code=trust_remote_code)
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise ValueError(
                    f"target '{path}' ({kind}): transformers cannot build it ({_first_line(exc)})"
                ) from None
    raise ValueError(
        f"target '{path}' ({kind}) cannot be a DFlash target: transformers has no causal-LM class for model_type "
        f"{kind!r}"
    )


def _accessed(accessor) -> nn.Module | None:
    """What one of transformers' accessors returns (None where the class does not implement it)."""
    try:
        return accessor()
    except (NotImplementedError, AttributeError):
        return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _parts_problem(model: nn.Module, embed, head, hidden: int) -> str | None:
    """Why the drafter cannot share this model's embedding, head or layers (None: it can)."""
    table, out = getattr(embed, "weight", None), getattr(head, "weight", None)
    if not isinstance(table, torch.Tensor) or table.ndim != 2:
        return "get_input_embeddings() gives no token table"
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        return "get_output_embeddings() gives no output head (a causal LM's vocabulary projection)"
    if table.shape[1] != hidden:
        return (
            f"its token embedding is {table.shape[1]} wide but its hidden states {hidden}: the drafter embeds "
            "its block with the target's table at the hidden width"
        )
    if tuple(out.shape) != tuple(table.shape):
        return (
            f"its output head is {list(out.shape)}, its token embedding {list(table.shape)}: the drafter "
            "needs both [vocab, hidden]"
        )
    if getattr(head, "bias", None) is not None:
        return "its output head has a bias (the drafter's logits are the head's weight times its hidden state)"
    decoder = find_decoder(model)
    if decoder is None:
        return f"cannot find its decoder layers (no submodule of {type(model).__name__} holds a layer stack)"
    if find_final_norm(decoder) is None:
        return f"cannot find the final norm of {type(decoder).__name__} (looked for {', '.join(FINAL_NORMS)})"
    return None


def _kind_problem(config) -> str | None:
    """Why a family whose parts are all there still cannot work (None: it can)."""
    text = config.get_text_config()
    if getattr(text, "altup_num_inputs", None):
        return (
            f"its decoder layers carry {text.altup_num_inputs} stacked streams (AltUp) instead of one hidden state "
            "per token, which a tap cannot store"
        )
    if not getattr(text, "num_attention_heads", None):
        return (
            "it has no attention layers (a recurrent-only model: no num_attention_heads); the drafter's attention "
            "takes its heads, head width and rope from the target's"
        )
    return None


def _has_weights(path: str) -> bool:
    root = Path(path)
    return (root / INDEX_FILE).is_file() or any(root.glob("*.safetensors"))


def _stored_parts(path: str, model: nn.Module, embed, head) -> tuple[str | None, str | None, str | None]:
    """(stored embedding name, stored head name, problem or None)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    stored = tensor_names(path)
    shapes = _stored_shapes(path, stored)
    shape = tuple(embed.weight.shape)
    embed_name, head_name = names[id(embed.weight)], names[id(head.weight)]
    # Stored tensors some other parameter of the model has by name (a [3D, D] qkv can be [V, D] too).
    claimed = {stored_name(n, stored) for n in names.values() if n not in (embed_name, head_name)} - {None}
    embed_tensor = _find_stored(embed_name, stored, shapes, shape, claimed)
    if embed_tensor is None:
        return None, None, f"no stored tensor of shape {list(shape)} is its token embedding ({embed_name})"
    if head.weight is embed.weight:
        return embed_tensor, embed_tensor, None
    head_tensor = _find_stored(head_name, stored, shapes, shape, claimed | {embed_tensor})
    if head_tensor is None:
        if text_config(path).get("tie_word_embeddings") is False:
            return None, None, f"its config unties the output head but no stored tensor is it ({head_name})"
        head_tensor = embed_tensor  # a checkpoint without a head and without tie_word_embeddings=false
    return embed_tensor, head_tensor, None


def _stored_shapes(path: str, stored: dict[str, str]) -> dict[str, tuple]:
    """{stored tensor name: shape}, read from the safetensors headers only."""
    shapes: dict[str, tuple] = {}
    for file in sorted(set(stored.values())):
        with safe_open(str(Path(path) / file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _find_stored(param: str, stored: dict, shapes: dict, shape: tuple, taken: set[str]) -> str | None:
    """How the checkpoint stores the model's parameter `param`: by its own name (or a multimodal
    spelling of it), else by its last two name parts, else the one tensor of its shape that no other
    parameter has (a checkpoint whose names transformers converts on load, e.g. GPT-NeoX's `embed_out`)."""
    fits = [n for n in shapes if shapes[n] == shape and n not in taken]
    found = stored_name(param, stored)
    if found is not None and found in fits:
        return found
    tail = ".".join(param.split(".")[-2:])
    by_tail = [n for n in fits if n == tail or n.endswith("." + tail)]
    if len(by_tail) == 1:
        return by_tail[0]
    return fits[0] if len(fits) == 1 else None


def _embed_scale(embed: nn.Module, hidden: int) -> float | None:
    """The constant the input embedding module multiplies a table row by (None: it does something else).

    Runs the module on three random rows put in place of its (empty) table."""
    rows = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0))
    embed.weight = nn.Parameter(rows, requires_grad=False)  # the skeleton's own module, discarded after
    if getattr(embed, "padding_idx", None) is not None:
        embed.padding_idx = None  # a row index into the real table; it only stops gradients
    with torch.no_grad():
        out = embed(torch.arange(3))
    if not isinstance(out, torch.Tensor) or out.shape != rows.shape:
        return None
    ratio = out.float() / rows
    scale = float(ratio[0, 0])
    return scale if torch.allclose(ratio, torch.full_like(ratio, scale), rtol=1e-5, atol=0) else None


def find_attr(module: nn.Module, names, kind):
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, kind):
            return child
    return None


def find_decoder(model: nn.Module) -> nn.Module | None:
    """The text decoder: what transformers' `get_decoder()` returns when it holds the layer stack, else
    (`get_decoder()` giving the causal LM itself, as Llama-4 text's does) the shallowest submodule that
    holds one; None when no module does."""
    first = model.get_decoder() if hasattr(model, "get_decoder") else model
    if find_layers(first) is not None:
        return first
    by_depth = sorted(first.named_modules(), key=lambda item: item[0].count(".") if item[0] else -1)
    return next((m for _, m in by_depth if find_layers(m) is not None), None)


def find_final_norm(decoder: nn.Module) -> nn.Module | None:
    """The decoder's final norm, by the names transformers gives it (`FINAL_NORMS`)."""
    return find_attr(decoder, FINAL_NORMS, nn.Module) or find_attr(decoder, FINAL_NORMS_LAST, nn.Module)


def find_layers(decoder: nn.Module) -> nn.ModuleList | None:
    found = find_attr(decoder, LAYER_CONTAINERS, nn.ModuleList)
    if found is None and isinstance(getattr(decoder, "decoder", None), nn.Module):  # OPT-style nesting
        found = find_attr(decoder.decoder, LAYER_CONTAINERS, nn.ModuleList)
    return found
