"""Load a target model and capture its tap layers: shared by extraction (`extract/`) and real
speculative decoding (`train/serve/spec_target.py`), so both read the same features the same way.

Any Hugging Face causal LM from a local directory is reduced to what these need: the text
decoder's layers, its final norm, `lm_head` and the model's own output path from the decoder's last
hidden state to its final logits (`target.head.OwnHead`). Loading refuses, in one line, a truncated or
damaged safetensors file and a checkpoint that lacks a tensor the model expects (transformers' loading
info: it would initialise the tensor randomly, differently in every process); `Target.loading` keeps
that info for the self-check (`target.self_check`). Multimodal checkpoints such as Qwen3.6-27B
(`Qwen3_5ForConditionalGeneration`) are loaded through `AutoModelForCausalLM`, which gives the
text-only class (`Qwen3_5ForCausalLM`: no vision tower, layers at `model.model.layers`); if a
checkpoint has no causal-LM mapping, the image-text class is loaded and its text decoder reached
with `get_decoder()`.

Taps: a forward hook on decoder layer `i` receives that layer's output, which is HF
`output_hidden_states[i + 1]` (index 0 is the embeddings).

Kernels: `reach_text_parts` routes the external kernels transformers binds (fla's delta rule) and
fla's convolution to CUDA tensors only (`target.kernel_routing`), so a CPU model on a host with `fla`
installed runs transformers' torch implementation.

`read_text_config` + `check_layer_ids` run before any weights are loaded, so a bad tap list fails in
a second, not after minutes of loading.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from common.config import fail
from common.hashing import json_digest
from target.arch import find_decoder, find_final_norm, find_layers
from target.checkpoint import check_weight_files, read_config
from target.head import OwnHead
from target.identity import target_identity
from target.kernel_routing import install_fla_convolution, route_kernels_by_device
from target.rules import layer_ids_problem

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass
class Target:
    """A loaded target reduced to the parts extraction touches."""

    model: nn.Module  # the causal LM (text) or the multimodal wrapper
    decoder: (
        nn.Module
    )  # base text model: forward(input_ids, attention_mask, use_cache) -> last_hidden_state (final-normed)
    layers: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Module
    text_config: object
    tokenizer: object
    path: str
    logits_fn: Callable[[torch.Tensor], torch.Tensor]  # final-normed hidden [N, H] -> the model's logits [N, V]
    loading: dict = dataclasses.field(default_factory=dict)  # transformers' loading info (`load_target`)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def input_device(self) -> torch.device:
        return self.decoder.get_input_embeddings().weight.device

    @property
    def output_device(self) -> torch.device:
        return self.lm_head.weight.device


# ----------------------------------------------------------------------------------------------
# Before loading: config and layer ids


def read_text_config(path: str, trust_remote_code: bool = False):
    """The text decoder's `PretrainedConfig` (the nested text config of multimodal checkpoints)."""
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise ValueError(
            f"target: '{path}' is not a directory (a local Hugging Face checkpoint is needed; nothing is downloaded). "
            "The built-in tiny default is built by `make tiny`."
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"target: '{path}' has no config.json; it is not a Hugging Face checkpoint directory")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return config.get_text_config()


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """ConfigError naming `layer_ids` unless every id is a decoder layer; warn on the last layer."""
    problem = layer_ids_problem(layer_ids, num_layers)
    if problem:
        fail("layer_ids", problem)
    if num_layers - 1 in layer_ids:
        warnings.warn(
            f"extract: layer_ids taps the last decoder layer ({num_layers - 1}). Its raw output is stored; note "
            "that HF "
            f"output_hidden_states[{num_layers}] is the final-normed state instead, and DFlash taps normally stop "
            "at L-3.",
            stacklevel=2,
        )


# ----------------------------------------------------------------------------------------------
# Loading


def load_target(
    path: str,
    *,
    dtype: str = "bfloat16",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
) -> Target:
    """Load weights and tokenizer from `path` onto `device` (or across GPUs with `device_map`);
    `attn_implementation="auto"`: transformers' own choice for the model (sdpa where supported, else eager)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    attention = None if attn_implementation == "auto" else attn_implementation
    kwargs = dict(dtype=DTYPES[dtype], attn_implementation=attention, trust_remote_code=trust_remote_code)
    if device_map is not None:
        kwargs.update(device_map=device_map, max_memory=max_memory)
    else:
        kwargs.update(device_map={"": str(device)})
    check_weight_files(path)  # a truncated or damaged file: one line naming it, not a traceback from the loader
    kwargs.update(output_loading_info=True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
        from transformers import AutoModelForImageTextToText

        model, info = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    loading = check_loading_info(path, info)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return dataclasses.replace(reach_text_parts(model, tokenizer, path), loading=loading)


def check_loading_info(path: str, info: dict) -> dict:
    """transformers' loading info as lists; ValueError (one line) when a tensor the model expects was
    not in the weight files (transformers initialises it randomly, differently in every process that
    loads the target) or had another shape. Unexpected tensors (stored, not used: e.g. a multi-token
    prediction head) are recorded, not refused."""
    loading = {key: sorted(str(k) for k in (info.get(key) or ())) for key in ("missing_keys", "mismatched_keys")}
    loading["unexpected_keys"] = sorted(str(k) for k in (info.get("unexpected_keys") or ()))
    loading["error_msgs"] = [str(m) for m in (info.get("error_msgs") or ())]
    problems = {
        "missing_keys": "tensor(s) the model expects are not in its weight files",
        "mismatched_keys": "stored tensor(s) have another shape than the model's",
        "error_msgs": "error(s) from transformers loading its weights",
    }
    for key, what in problems.items():
        if loading[key]:
            raise ValueError(
                f"target '{path}': {len(loading[key])} {what} (first: {loading[key][0]}); transformers would "
                "initialise them randomly, differently in every process that loads it: give the complete checkpoint"
            )
    return loading


def reach_text_parts(model: nn.Module, tokenizer=None, path: str = "") -> Target:
    """Find the text decoder, its layers, final norm and lm_head in a loaded model (any wrapper)."""
    decoder = find_decoder(model) or model
    layers = find_layers(decoder)
    final_norm = find_final_norm(decoder)
    lm_head = model.get_output_embeddings()
    if layers is None or final_norm is None or lm_head is None:
        missing = [
            n for n, m in (("decoder layers", layers), ("final norm", final_norm), ("lm_head", lm_head)) if m is None
        ]
        raise ValueError(
            f"target: cannot find the {', '.join(missing)} of {type(model).__name__} (decoder {type(decoder).__name__})"
        )
    text_config = model.config.get_text_config()
    expected = getattr(text_config, "num_hidden_layers", len(layers))
    assert len(layers) == expected, f"{type(decoder).__name__} has {len(layers)} layers but its config says {expected}"
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    route_kernels_by_device(model)
    install_fla_convolution(model)
    head = OwnHead(model, decoder, lm_head, text_config)
    return Target(model, decoder, layers, final_norm, lm_head, text_config, tokenizer, path, head)


# ----------------------------------------------------------------------------------------------
# Provenance


def target_provenance(target: Target) -> dict:
    """The shards' `provenance.target`: the checkpoint's identity (`target.identity`, which later
    stages compare) and how it was loaded; a model without a directory has only its config's hash."""
    top = read_config(target.path) if target.path else target.model.config.to_dict()
    identity = (
        target_identity(target.path)
        if target.path
        else {
            "config_hash": json_digest(top),
            "weights_digest": None,
            "weights_content_digest": None,
            "head_digest": None,
        }
    )
    architectures = (
        top.get("architectures") or getattr(target.model.config, "architectures", None) or [type(target.model).__name__]
    )
    return {
        "name_or_path": target.path,  # as given (the identity's is absolute)
        "revision": getattr(target.model.config, "_commit_hash", None),
        "config_hash": identity["config_hash"],
        "weights_digest": identity["weights_digest"],
        "weights_content_digest": identity["weights_content_digest"],
        "head_digest": identity["head_digest"],
        "architecture": architectures[0],
        "loaded_as": type(target.model).__name__,
        "attn_implementation": getattr(target.model.config, "_attn_implementation", None),
        "model_type": getattr(target.text_config, "model_type", None),
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
    }


# ----------------------------------------------------------------------------------------------
# Tap hooks


def layer_output(output) -> torch.Tensor:
    """A decoder layer's hidden-state output (tensor in transformers 5, tuple in older code)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class TapHooks:
    """Context manager: calls `on_tap(slot, hidden_BTH)` when decoder layer `layer_ids[slot]` returns."""

    def __init__(
        self, layers: torch.nn.ModuleList, layer_ids: Sequence[int], on_tap: Callable[[int, torch.Tensor], None]
    ):
        self.layers, self.layer_ids, self.on_tap = layers, list(layer_ids), on_tap
        self.handles: list = []

    def __enter__(self) -> TapHooks:
        for slot, layer_id in enumerate(self.layer_ids):
            self.handles.append(self.layers[layer_id].register_forward_hook(self._hook(slot)))
        return self

    def _hook(self, slot: int):
        def hook(module, args, output):  # noqa: ARG001 (a forward hook's signature)
            self.on_tap(slot, layer_output(output))

        return hook

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
