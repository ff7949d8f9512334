"""The target's final logits of its final-normed hidden states, computed by the causal LM's own
forward (`OwnHead`), so that every family's head, scaling, multipliers and soft-capping are the
model's by construction: Falcon-H1's `lm_head_multiplier`, Granite's `logits_scaling`, Cohere's
`logit_scale`, Gemma-2/3's soft-capping, and whatever a family adds next.

How: a causal LM's forward calls its text decoder, then turns the decoder's last hidden state into
logits. `OwnHead(hidden_NH)` runs that forward with the decoder's `forward` replaced, for the one
call, by a function that returns `hidden_NH` as the last hidden state; the rest of the forward, the
model's own output path, runs as written. The dummy input ids it passes ([1, N] zeros) reach only the
replaced decoder (a multimodal wrapper embeds them, cheaply, before calling its language model). No
extra full-vocabulary tensor is made: the forward returns the logits the old `lm_head` call made.
Not thread-safe: one forward at a time per model, as extraction and decoding run it.

Where a model's forward cannot be driven this way (it raises, or returns logits of another shape),
`OwnHead` falls back to `lm_head` plus the scalings of `known_scalings`, says so once, and names the
path it took (`OwnHead.path`); the self-check (`target.self_check`) compares the path in use with the
model's full forward, so a fallback that misses a scaling is refused at step 1.

Shape legend: N positions, H hidden, V vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

log = logging.getLogger(__name__)

OWN = "the model's own forward"
FALLBACK = "lm_head and the known scalings"


class _DecoderOutput(BaseModelOutputWithPast):
    """What the replaced decoder returns: the hidden states given, as `last_hidden_state` and `[0]`;
    every other field a causal LM's forward may read (`router_logits`, `aux_loss`, ...) is None."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class OwnHead:
    """hidden [N, H] (final-normed) -> the model's final logits [N, V], in the model's dtype."""

    def __init__(self, model: nn.Module, decoder: nn.Module, lm_head: nn.Module, text_config):
        self.model, self.decoder, self.lm_head = model, decoder, lm_head
        self.fallback = known_scalings(text_config)
        self.path = OWN if decoder is not model else FALLBACK  # a decoder that is the model cannot be replaced
        self.problem: str | None = None  # why the own forward was given up (logged once)

    def __call__(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        if self.path == OWN:
            try:
                return self._own(hidden_NH)
            except (TypeError, ValueError, AttributeError, RuntimeError, IndexError, KeyError) as exc:
                self.path, self.problem = FALLBACK, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                log.warning(
                    "target head: %s cannot be driven on given hidden states (%s); using %s",
                    type(self.model).__name__,
                    self.problem,
                    FALLBACK,
                )
        return self.fallback(self.lm_head(hidden_NH.to(self.lm_head.weight.dtype)))

    def _own(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        N = hidden_NH.shape[0]
        stub = _DecoderOutput(last_hidden_state=hidden_NH[None])
        ids_1N = torch.zeros(1, N, dtype=torch.long, device=self.model.get_input_embeddings().weight.device)
        saved = self.decoder.__dict__.get("forward")  # an instance attribute when accelerate hooks the module
        self.decoder.forward = lambda *args, **kwargs: stub  # noqa: ARG005 (forward's signature)
        try:
            out = self.model(input_ids=ids_1N, use_cache=False)
        finally:
            if saved is None:
                del self.decoder.forward
            else:
                self.decoder.forward = saved
        logits = out.logits if hasattr(out, "logits") else out[0]
        if logits.shape[:2] != (1, N):
            raise ValueError(f"the forward returned logits of shape {list(logits.shape)} for {N} positions")
        return logits[0]


def known_scalings(text_config) -> Callable[[torch.Tensor], torch.Tensor]:
    """`lm_head` output -> final logits for the scalings transformers' causal LMs apply after the head
    (Gemma-2/3 soft-capping, Cohere's `logit_scale`, Granite's `logits_scaling`, Falcon-H1's
    `lm_head_multiplier`): the fallback of `OwnHead` only."""
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    divide = getattr(text_config, "logits_scaling", None)
    multiply = getattr(text_config, "lm_head_multiplier", None)

    def apply(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None and getattr(text_config, "model_type", "").startswith("cohere"):
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if multiply is not None:
            logits = logits * multiply
        if softcap is not None:
            logits = torch.tanh(logits.float() / softcap) * softcap
        return logits

    return apply
