"""A transformers `StaticCache` written at positions we choose: what regeneration's batched decoding
(`extract/regenerate/static_batch.py`) and speculative decoding's target (`train/serve/static_target.py`)
share to replay their forwards as CUDA graphs.

transformers before 5.2x place new keys by a `cache_position` argument; later ones by a length
counter in each cache layer (`cumulative_length`, a device tensor moved in place by every forward,
also inside a captured graph). `CachePlacement` hides the difference: `place(start)` makes the next
forward write from position `start` on, and `kwargs(positions)` gives the forward what this version
reads.
"""

from __future__ import annotations

import inspect


def takes_cache_position(model) -> bool:
    return "cache_position" in inspect.signature(model.forward).parameters


def cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x): the name this version takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def full_attention_only(cache) -> bool:
    """Every layer of this `StaticCache` holds plain keys and values: no sliding window, no recurrent
    state (Gated DeltaNet), so positions past a count are never read and rows can be selected."""
    from transformers.cache_utils import StaticLayer

    return all(type(layer) is StaticLayer for layer in getattr(cache, "layers", ()))


class CachePlacement:
    """Where the next forward on `cache` writes its keys (see the module docstring)."""

    def __init__(self, model, cache):
        self.cache = cache
        self.by_argument = takes_cache_position(model)
        self.length = 0  # what the layers' counters hold (later transformers)

    def place(self, start: int) -> None:
        import torch

        if self.by_argument or start == self.length:
            return
        for layer in self.cache.layers:
            # A hybrid model's linear-attention layers count their tokens apart (transformers 5.2x).
            for name in ("cumulative_length", "cumulative_length_linear"):
                counter = getattr(layer, name, None)
                if isinstance(counter, torch.Tensor):
                    counter.fill_(start)
                elif counter is not None:
                    setattr(layer, name, start)
        self.length = start

    def wrote(self, end: int) -> None:
        """A forward (eager or replayed) has moved the counters to `end`."""
        self.length = end

    def kwargs(self, positions_T) -> dict:
        return {"cache_position": positions_T} if self.by_argument else {}
