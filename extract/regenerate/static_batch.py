"""Batched one-token decoding on a static KV cache, each step replayed as a CUDA graph: what makes the
`local` backend fast for a small target (a 135 M model at batch 1,024 spent its steps growing the
dynamic cache by concatenation and launching ~1,000 small kernels a step).

`StaticBatch` holds the left-padded rows of one batch in a transformers `StaticCache` of `width +
max_new_tokens` slots: slot j of every row is its j-th token (prompt, left padding, then answer), so
all rows write the same slot per step. Its own 4-D attention mask lets a query at slot s see the
row's real tokens up to s (additive: 0 or the dtype's minimum, so rows of padding stay finite and
every attention kernel reads it); position ids count each row's real tokens, as in the dynamic path.
`keep(rows)` drops finished rows: the cache tensors are cut to those rows and the step's graph is
captured again for the smaller batch.

Attention: transformers' SDPA path repeats the 3 key-value heads to the 9 query heads over every slot
and runs a memory-efficient kernel that tiles 64 queries for the one a step has: at large batches
attention and those copies take most of a step (the profile: docs/benchmarks-log-2026-11-30-to-2026-12-04.md,
"Real target").
`grouped_decode_attention` takes one-query forwards instead: each key-value head's query heads as the
rows of one small matrix product over the slots, no copies; every other forward goes to
transformers' SDPA as before.

Only for caches whose every layer is plain full attention (`target.static_cache.full_attention_only`):
a sliding window or a recurrent state (Gated DeltaNet) cannot live in these slots. Off CUDA the same
forwards run eagerly (the tests compare them with the dynamic path).
"""

from __future__ import annotations

import logging

import torch

from target.static_cache import CachePlacement, cache_kwarg, full_attention_only

log = logging.getLogger(__name__)


GROUPED = "regen_grouped_decode"


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: query [B, H, Q, D], key and value [B, Hkv, S, D],
    an additive mask [B, 1, Q, S]; returns ([B, Q, H, D], None). One query per row and a 4-D mask
    (the static batch's decoding step): softmax(q k^T * scale + mask) v per key-value head, with that
    head's H / Hkv query heads as the rows; anything else: transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, Q, D = query.shape
    Hkv = key.shape[1]
    if Q != 1 or attention_mask is None or attention_mask.dim() != 4 or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = D**-0.5 if scaling is None else scaling
    q_BKGD = query.reshape(B, Hkv, H // Hkv, D)  # query head h reads key-value head h // (H / Hkv), as repeat_kv
    scores_BKGS = torch.matmul(q_BKGD, key.transpose(-1, -2)) * scale + attention_mask
    probs_BKGS = torch.softmax(scores_BKGS.float(), dim=-1).to(value.dtype)
    out_BKGD = torch.matmul(probs_BKGS, value)
    return out_BKGD.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def register_grouped_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED, grouped_decode_attention)


def new_static_cache(model, slots: int):
    """A `StaticCache` of `slots` positions, or None where this model's layers cannot use one."""
    from transformers import StaticCache

    try:
        cache = StaticCache(config=model.config, max_cache_len=slots)
    except (TypeError, ValueError):  # a config transformers cannot build a static cache for
        return None
    return cache if full_attention_only(cache) else None


class StaticBatch:
    """One batch's decoding state (see the module docstring)."""

    def __init__(self, model, cache, ids_BW: torch.Tensor, real_BW: torch.Tensor, *, graphs: bool):
        self.model, self.cache = model, cache
        self.device = ids_BW.device
        self.slots = cache.layers[0].max_cache_len
        self.width = ids_BW.shape[1]
        self.placement = CachePlacement(model, cache)
        self.cache_kwarg = cache_kwarg(model)
        self.dtype = model.get_input_embeddings().weight.dtype
        self.use_graphs = graphs and self.device.type == "cuda"
        self.graph = None
        # Slot j of a row holds a real token from its first real one on (the answer's slots are real).
        real_BS = torch.ones((ids_BW.shape[0], self.slots), dtype=torch.bool, device=self.device)
        real_BS[:, : self.width] = real_BW.bool()
        self.real_BS = real_BS
        self.slot_ids_S = torch.arange(self.slots, device=self.device)
        self.ids_B1 = ids_BW[:, -1:].clone()
        self.positions_B1 = (real_BW.sum(1, keepdim=True) - 1).clamp(min=0)
        self.slot_1 = torch.full((1,), self.width - 1, dtype=torch.long, device=self.device)
        self._prefill_ids_BW = ids_BW
        # Made here, not in `_mask`: a tensor from a Python number copies from the host, which a graph cannot hold.
        self.blocked = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        self.zero = torch.zeros((), dtype=self.dtype, device=self.device)

    def _mask(self, query_slots_Q: torch.Tensor) -> torch.Tensor:
        """[B, 1, Q, slots] additive: 0 where a query may read a slot (real, at or before itself)."""
        allowed_BQS = self.real_BS[:, None, :] & (self.slot_ids_S[None, None, :] <= query_slots_Q[None, :, None])
        return torch.where(allowed_BQS, self.zero, self.blocked)[:, None]

    def _forward(self, ids_BQ, positions_BQ, query_slots_Q, last_only: bool):
        config = self.model.config
        if config._attn_implementation != "sdpa":
            return self._run(ids_BQ, positions_BQ, query_slots_Q, last_only)
        register_grouped_attention()
        config._attn_implementation = GROUPED  # read by every attention layer when it runs
        try:
            return self._run(ids_BQ, positions_BQ, query_slots_Q, last_only)
        finally:
            config._attn_implementation = "sdpa"

    def _run(self, ids_BQ, positions_BQ, query_slots_Q, last_only: bool):
        kwargs = {
            "input_ids": ids_BQ,
            "position_ids": positions_BQ,
            "attention_mask": self._mask(query_slots_Q),
            self.cache_kwarg: self.cache,
            "use_cache": True,
            **self.placement.kwargs(query_slots_Q),
        }
        if last_only:
            kwargs["logits_to_keep"] = 1
        return self.model(**kwargs).logits[:, -1]

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """The prompts' forward (eager: run once); logits at each row's last prompt token, [B, V]."""
        ids_BW, self._prefill_ids_BW = self._prefill_ids_BW, None
        real_BW = self.real_BS[:, : self.width].long()
        positions_BW = (real_BW.cumsum(1) - 1).clamp(min=0)
        self.placement.place(0)
        logits_BV = self._forward(ids_BW, positions_BW, self.slot_ids_S[: self.width], last_only=True)
        self.placement.wrote(self.width)
        return logits_BV

    @torch.inference_mode()
    def step(self, next_ids_B: torch.Tensor) -> torch.Tensor:
        """Feed one token per row at the next slot; logits for the token after it, [B, V]."""
        self.ids_B1.copy_(next_ids_B[:, None])
        self.positions_B1.add_(1)
        self.slot_1.add_(1)
        slot = self.width + self._steps_done()
        if slot >= self.slots:
            raise ValueError(f"decoding past the static cache's {self.slots} slots")
        self.placement.place(slot)
        if self.use_graphs and self.graph is None:
            self._try_capture(slot)
        if self.graph is None:
            logits_BV = self._forward(self.ids_B1, self.positions_B1, self.slot_1, last_only=False)
        else:
            self.graph.replay()
            logits_BV = self.logits_BV
        self.placement.wrote(slot + 1)
        return logits_BV

    def _steps_done(self) -> int:
        return self.placement.length - self.width

    def _try_capture(self, slot: int) -> None:
        """Capture, or go on eagerly (said once) where this model's forward cannot be captured."""
        try:
            self._capture(slot)
        except Exception as exc:  # noqa: BLE001 - e.g. a forward that synchronizes with the host
            torch.cuda.synchronize(self.device)
            self.use_graphs, self.graph = False, None
            self.placement.place(slot)
            log.warning(
                "regeneration: no CUDA graph for the decoding step (%s: %s); it runs eagerly",
                type(exc).__name__,
                str(exc).splitlines()[0][:200],
            )

    def _capture(self, slot: int) -> None:
        """Capture the one-token step at `slot`. Warm-up and capture runs write this slot too, which
        the real replay that follows writes again."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.placement.place(slot)
                self._forward(self.ids_B1, self.positions_B1, self.slot_1, last_only=False)
                self.placement.wrote(slot + 1)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.placement.place(slot)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits_BV = self._forward(self.ids_B1, self.positions_B1, self.slot_1, last_only=False)
        self.graph = graph
        self.placement.wrote(slot + 1)
        self.placement.place(slot)

    @torch.inference_mode()
    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` go on decoding: every row-indexed tensor is cut to them, the graph is dropped
        (the next step captures one for the smaller batch)."""
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
            if hasattr(layer, "batch_size"):
                layer.batch_size = len(rows)
        self.real_BS = self.real_BS.index_select(0, rows)
        self.ids_B1 = self.ids_B1.index_select(0, rows)
        self.positions_B1 = self.positions_B1.index_select(0, rows)
        self.graph = self.logits_BV = None
