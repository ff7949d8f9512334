"""The target as speculative decoding drives it: `SpecTarget`, cached forwards on a transformers
`DynamicCache` that also return the tap features (layer id i = output of decoder layer i, as
extraction stores them), and the cache helpers every decoding loop shares (`crop_cache`,
`cache_mode_for`).

How the decoding loops cut the cache back after a partial acceptance (`SpecTarget.cache_mode`):
"crop" cuts every layer back to the accepted length (`crop_cache`); "rollback", for a hybrid target
whose recurrent layers are Gated DeltaNet ones (`target.recurrent_states`), records the recurrent
states after every verified position and keeps those of the accepted length (`SpecTarget.keep`);
"snapshot", the eager fallback for recurrent layers of another kind, copies the cache before each
verify and re-runs the accepted tokens (`train.serve.decoding`). `train.serve.static_target` is the
same target on a static cache with its forwards captured as CUDA graphs; `decoding_path` names the
path a run took.

Shape legend: T tokens, S context, Q block tokens, F tap feature width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from target.load import TapHooks, Target, check_layer_ids, reach_text_parts
from target.recurrent_states import PerTokenStates
from target.static_cache import cache_kwarg

FALLBACK = "eager fallback (cache copy + re-run of the accepted tokens)"


def crop_cache(cache, length: int) -> None:
    """Cut a transformers cache back to its first `length` positions.

    A negative argument (tokens to remove) means the same in every transformers 5 release; a
    positive one is refused by newer releases, and `crop(0)` would empty the cache in older ones.
    """
    remove = cache.get_seq_length() - length
    assert remove >= 0, (cache.get_seq_length(), length)
    if remove:
        cache.crop(-remove)


def cache_mode_for(cache, text_config) -> str:
    """'crop' when the cache can be cut back exactly, else 'snapshot' (copy before each verification).

    A model with recurrent layers (hybrid models declare them in `layer_types`) always snapshots, and
    so does a cache with a layer that does not record its past: transformers 5.25 calls such caches
    croppable, but its linear-attention layers, and its sliding-window layers once past the window,
    refuse `crop` unless they were recording their past states all along."""
    layer_types = getattr(text_config, "layer_types", None) or []
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return "snapshot"
    if any(getattr(layer, "record_past", True) is False for layer in getattr(cache, "layers", None) or []):
        return "snapshot"
    croppable = getattr(cache, "is_croppable", None)
    return "snapshot" if croppable is False else "crop"


def decoding_path(target: SpecTarget) -> str:
    """The path a decoding took, as `make drafter` and specdecode name it: "full-attention graphed" /
    "full-attention eager" (the cache cut back), "graphed, with rollback" / "eager, with rollback" (a
    hybrid target's per-token states), or the eager fallback with its reason."""
    graphed = bool(getattr(target, "graphs", None))
    if target.cache_mode == "rollback":
        return f"{'graphed' if graphed else 'eager'}, with rollback"
    if target.cache_mode == "snapshot":
        return f"{FALLBACK}: {target.rollback_note or 'its cache cannot be cut back'}"
    return f"full-attention {'graphed' if graphed else 'eager'}"


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _attention_layers_croppable(cache, per_token: PerTokenStates) -> bool:
    """Whether every cache layer but the Gated DeltaNet ones can be cut back by `crop`."""
    layers = getattr(cache, "layers", None) or []
    return all(
        callable(getattr(layer, "crop", None))
        and getattr(layer, "record_past", True) is not False
        and getattr(layer, "is_croppable", True) is not False
        for i, layer in enumerate(layers)
        if i not in per_token.mixers
    )


class SpecTarget:
    """A target causal LM as speculative decoding uses it: cached forwards that also return tap features."""

    def __init__(self, target: Target, layer_ids: Sequence[int], stop_ids: Sequence[int]):
        check_layer_ids(list(layer_ids), target.num_layers)
        self.target = target
        self.model = target.model
        self.layer_ids = [int(i) for i in layer_ids]
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.embed_module = target.decoder.get_input_embeddings()
        self.embed_VD = self.embed_module.weight
        self.cache_mode: str | None = None
        # transformers renamed `past_key_values` to `cache` (5.2x); pass whichever this version takes.
        self.cache_kwarg = cache_kwarg(self.model)
        # Per-token states of the Gated DeltaNet layers (None: no recurrent layer, or `rollback_note` says why not).
        self.per_token, self.rollback_note = PerTokenStates.for_target(target)
        self.recorded: tuple | None = None  # (cache, tokens, record) of the last recorded forward
        if self.per_token is not None:
            self._probe()

    def _probe(self) -> None:
        """A recorded 2-token forward after a 2-token prompt, as a verify records: where this
        transformers release leaves a layer's record incomplete, fall back (the note says why)."""
        try:
            ids_12 = torch.zeros((1, 2), dtype=torch.long)
            _, _, cache = SpecTarget.forward(self, ids_12, None, taps=False)
            SpecTarget.forward(self, ids_12, cache, taps=False)
        except Exception as exc:  # noqa: BLE001 - any failure of the recorded forward means: fall back, saying why
            self.per_token = None
            self.rollback_note = (
                f"per-token states failed a probe ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})"
            )
        self.recorded = None

    def mode_for(self, cache) -> str:
        """How a decoding loop cuts `cache` back after a partial acceptance (module docstring)."""
        mode = cache_mode_for(cache, self.target.text_config)
        if mode == "snapshot" and self.per_token is not None and _attention_layers_croppable(cache, self.per_token):
            return "rollback"
        return mode

    @torch.inference_mode()
    def keep(self, cache, kept: int) -> None:
        """Cut `cache` back to the first `kept` tokens of the forward just recorded on it: the attention
        layers cropped, the Gated DeltaNet layers set to their states after token `kept`."""
        held, tokens, record = self.recorded
        assert held is cache, "keep() follows the recorded forward on the same cache"
        if tokens > kept:
            for i, layer in enumerate(cache.layers):
                if i not in record:
                    layer.crop(-(tokens - kept))
        PerTokenStates.keep(cache.layers, record, tokens, kept)
        self.recorded = None

    @classmethod
    def from_model(
        cls, model: nn.Module, layer_ids: Sequence[int], stop_ids: Sequence[int], tokenizer=None
    ) -> SpecTarget:
        return cls(reach_text_parts(model.eval(), tokenizer), layer_ids, stop_ids)

    @property
    def device(self) -> torch.device:
        return self.embed_VD.device

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @torch.inference_mode()
    def forward(
        self,
        ids_1T: torch.Tensor,
        cache=None,
        *,
        taps: bool = True,
        last_only: bool = False,
        position_ids_1T: torch.Tensor | None = None,
        mask_11TK: torch.Tensor | None = None,
    ):
        """(logits [1, T or 1, V] float32, tap features [1, T, F] or None, cache) of one cached forward.

        `position_ids_1T` and an additive float mask `mask_11TK` over [cached | new] keys are for tree
        verification; by default the new tokens continue the cache causally.
        """
        kwargs = {"input_ids": ids_1T.to(self.device), self.cache_kwarg: cache, "use_cache": True}
        if last_only:
            kwargs["logits_to_keep"] = 1
        if position_ids_1T is not None:
            kwargs["position_ids"] = position_ids_1T.to(self.device)
        if mask_11TK is not None:
            kwargs["attention_mask"] = mask_11TK.to(self.device)
        self.recorded = None
        if self.per_token is None or cache is None or ids_1T.shape[1] == 1:
            out, features_1TF = self.call_model(kwargs, taps=taps)
            return out.logits.float(), features_1TF, _cache_of(out)
        with self.per_token.recording(cache):
            out, features_1TF = self.call_model(kwargs, taps=taps)
        self.recorded = (cache, ids_1T.shape[1], self.per_token.take(ids_1T.shape[1]))
        return out.logits.float(), features_1TF, _cache_of(out)

    def call_model(self, kwargs: dict, *, taps: bool):
        """(the model's output, tap features [1, T, F] or None) of one forward with these arguments."""
        if not taps:
            return self.model(**kwargs), None
        captured: list = [None] * len(self.layer_ids)

        def keep(slot: int, hidden_1TH: torch.Tensor) -> None:
            captured[slot] = hidden_1TH

        with TapHooks(self.target.layers, self.layer_ids, keep):
            out = self.model(**kwargs)
        return out, torch.cat(captured, dim=-1)

    @torch.inference_mode()
    def teacher_forced(self, ids_1T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy next token [T] int64, tap features [T, F]) of one uncached forward, as extraction computes them."""
        out, features_1TF = self.call_model({"input_ids": ids_1T.to(self.device), "use_cache": False}, taps=True)
        return out.logits[0].float().argmax(-1), features_1TF[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The drafter's block embedding: what the target's input embedding module returns (Gemma's
        multiplies the table row by sqrt(hidden_size)), as z-lab's and SGLang's DFlash drafting take it."""
        return self.embed_module(ids)

    def draft_logits(self, hidden_NQD: torch.Tensor) -> torch.Tensor:
        """The target's final logits of drafter outputs (its own output path: head and any post-scaling)."""
        hidden_MD = hidden_NQD.reshape(-1, hidden_NQD.shape[-1]).to(self.target.lm_head.weight.dtype)
        return self.target.logits_fn(hidden_MD).float().reshape(*hidden_NQD.shape[:-1], -1)
