"""The DFlash drafter's proposal as one fixed-shape forward on a slot cache, replayed as a CUDA graph:
the drafter-side half of making a small target's speculative decoding fast where kernel launches,
not arithmetic, set the pace (a 5-layer drafter of a 135 M target costs ~8 ms eagerly, mostly launches).

`StaticDFlashProposer` proposes exactly what `train.serve.decoding.DFlashProposer` proposes (the same exported
model's `forward`, unchanged), with two differences in how it is driven:

- Its cache (`SlotCache`) holds every layer's K/V in fixed buffers indexed by absolute position: a
  call writes its entries at their positions, and the attention mask, built from the anchor, lets the
  block see the context before the anchor and its own B positions only. Entries past the block are
  stale and never visible, so a round never has to cut the cache back.
- After the first round of a sequence (the prompt's context, of any length, runs eagerly), every
  round re-projects a fixed window of the last `B` context positions (the verified tokens of the last
  round are at most B, and re-projecting an already cached position writes the same K/V) and the
  B-token block: one shape, captured once as a CUDA graph through the target's lm_head to the drafts
  (`DFlashProposer.decide`: the argmax, or a DFlash2 drafter's selector walk, whose loop over the
  block positions is device work only and is captured with the rest).

Without CUDA (or where capture fails, said by `graph_note`) the same fixed-window forwards run
eagerly, so the CPU tests exercise every path except the replay itself.
"""

from __future__ import annotations

import torch
from torch import nn

from train.alignment import block_input_ids
from train.export_format.dflash_hf import position_mask
from train.serve.decoding import DFlashProposer
from train.serve.spec_target import SpecTarget


class SlotCache:
    """Every drafter layer's K/V [1, G, L, E] by absolute position; `update` writes a call's entries at
    `slots_P` (set by the caller before the forward) and hands back the whole buffer."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, length: int, dtype, device):
        shape = (1, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots_P: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def update(self, k_1GPE: torch.Tensor, v_1GPE: torch.Tensor, layer_idx: int):
        assert self.slots_P is not None and self.slots_P.numel() == k_1GPE.shape[2], (self.slots_P, k_1GPE.shape)
        self.keys[layer_idx].index_copy_(2, self.slots_P, k_1GPE)
        self.values[layer_idx].index_copy_(2, self.slots_P, v_1GPE)
        return self.keys[layer_idx], self.values[layer_idx]


class _Window:
    """Static inputs and outputs of the captured fixed-window round."""

    def __init__(self, B: int, F_: int, dtype, device):
        self.features_1WF = torch.zeros((1, B, F_), dtype=dtype, device=device)
        self.block_ids_1Q = torch.zeros((1, B), dtype=torch.long, device=device)
        self.anchor = torch.zeros((), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_LV: torch.Tensor | None = None  # a DFlash drafter's draft logits (None for DFlash2)
        self.drafts_L: torch.Tensor | None = None


class StaticDFlashProposer(DFlashProposer):
    """A `Proposer` (specdecode) driving an exported DFlash or DFlash2 drafter on a `SlotCache` of
    `max_len` positions, its steady-state rounds replayed as one CUDA graph where `graphs` and CUDA
    allow (the drafter's checks and `decide` are `DFlashProposer`'s; its cache and rounds are its own)."""

    def __init__(self, drafter: nn.Module, target: SpecTarget, *, max_len: int, graphs: bool = True):
        super().__init__(drafter, target)
        B = self.block_size
        self.device = target.device
        config = drafter.config
        dtype = drafter.fc.weight.dtype
        self.cache = SlotCache(
            int(config.num_hidden_layers),
            int(config.num_key_value_heads),
            int(config.head_dim),
            int(max_len),
            dtype,
            self.device,
        )
        self.key_pos_K = torch.arange(int(max_len), device=self.device)
        self.offsets_P = torch.arange(-B, B, device=self.device)  # window then block, relative to the anchor
        self.window = _Window(B, int(drafter.fc.in_features), target.embed_VD.dtype, self.device)
        self.graph_note = "off"
        if graphs:
            self.graph_note = self._capture()

    def reset(self) -> None:
        self.recent_1WF: torch.Tensor | None = None  # features of the last <= B context positions
        self.started = False
        self._first: tuple | None = None  # a sequence's first round: (features, block ids, positions, anchor)
        self._staged_anchor: torch.Tensor | None = None  # [1], the staged round's anchor token
        self.replays = getattr(self, "replays", 0)  # rounds replayed as the graph (over the proposer's life)

    # -- one forward ----------------------------------------------------------------------------

    def _masks(self, anchor) -> dict:
        """{layer type: bool [1, 1, B, L]}: the block at anchor..anchor+B-1 sees the context before it
        and itself, under each layer's window and causality; slots at or past anchor+B never."""
        q_pos_1Q = (anchor + torch.arange(self.block_size, device=self.device))[None]
        filled_11QK = (self.key_pos_K < anchor + self.block_size)[None, None, None, :]
        masks = {}
        for layer_type, rule in self.drafter.attention_rules.items():
            by_position = position_mask(q_pos_1Q, self.key_pos_K[None], *rule)
            masks[layer_type] = filled_11QK if by_position is None else by_position & filled_11QK
        return masks

    def _forward(self, features_1SF: torch.Tensor, block_ids_1Q: torch.Tensor, positions_P: torch.Tensor, anchor):
        """The drafter's hidden states [1, B-1, D] at block positions 1..B-1, writing the K/V of `positions_P`."""
        self.cache.slots_P = positions_P
        hidden_1QD = self.drafter(
            position_ids=positions_P[None],
            attention_mask=self._masks(anchor),
            noise_embedding=self.target.embed(block_ids_1Q),
            target_hidden=features_1SF,
            past_key_values=self.cache,
        )
        return hidden_1QD[:, 1:]

    def _window_forward(self) -> torch.Tensor:
        w = self.window
        return self._forward(w.features_1WF, w.block_ids_1Q, w.anchor + self.offsets_P, w.anchor)

    def _window_outputs(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the target's logits [B-1, V] or None, the drafts [B-1]) of the window round: a DFlash drafter's
        argmax of its logits; a DFlash2 drafter's selector walk, which computes the head's logits itself."""
        hidden_1LD = self._window_forward()
        if self.selector:
            return None, self.decide(hidden_1LD, self.window.block_ids_1Q[:, 0])
        logits_LV = self.target.draft_logits(hidden_1LD)[0]
        return logits_LV, logits_LV.argmax(-1)

    # -- capture --------------------------------------------------------------------------------

    def _capture(self) -> str:
        if self.device.type != "cuda":
            return "off: CUDA graphs need a CUDA device"
        if self.cache.length < 2 * self.block_size:
            return f"off: a cache of {self.cache.length} positions holds no window and block"
        w = self.window
        w.anchor.fill_(self.block_size)  # any anchor with a full window: the capture's writes are stale later
        try:
            with torch.inference_mode():
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._window_outputs()
                torch.cuda.current_stream(self.device).wait_stream(side)
                w.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(w.graph):
                    w.logits_LV, w.drafts_L = self._window_outputs()
        except Exception as exc:  # noqa: BLE001 - a drafter whose forward cannot be captured runs eagerly
            w.graph = w.logits_LV = w.drafts_L = None
            torch.cuda.synchronize(self.device)
            return f"off: capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        return f"on for a {self.block_size}-position window and block"

    # -- the round ----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> list[int]:
        """The drafts of positions anchor_pos+1 .. anchor_pos+B-1 (as `DFlashProposer.propose`): a steady-state
        round replays the captured graph, where there is one."""
        if self._stage(new_features_1SF, anchor_token, anchor_pos) and self.window.graph is not None:
            self._replay()
            return self.window.drafts_L.tolist()
        return self.decide(self._staged_hidden(), self._staged_anchor).tolist()

    @torch.inference_mode()
    def draft_logits(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> torch.Tensor:
        """The target's logits [B-1, V] at block positions 1..B-1 (as `DFlashProposer.draft_logits`), replayed
        where the graph holds them (a DFlash drafter's)."""
        window = self._stage(new_features_1SF, anchor_token, anchor_pos)
        if window and self.window.graph is not None and self.window.logits_LV is not None:
            self._replay()
            return self.window.logits_LV.clone()  # the next replay overwrites it
        return self.target.draft_logits(self._staged_hidden())[0]

    def _replay(self) -> None:
        self.window.graph.replay()
        self.replays += 1

    @torch.inference_mode()
    def draft_hidden(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> torch.Tensor:
        """The drafter's hidden states [1, B-1, D] at block positions 1..B-1, run eagerly (as DFlashProposer's)."""
        self._stage(new_features_1SF, anchor_token, anchor_pos)
        return self._staged_hidden()

    def _staged_hidden(self) -> torch.Tensor:
        if self._first is None:
            return self._window_forward()
        return self._forward(*self._first)

    def _stage(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> bool:
        """Set up one round: True for a fixed-window round (its inputs copied into the window), False for a
        sequence's first round (its inputs kept in `_first`)."""
        B = self.block_size
        if anchor_pos + B > self.cache.length:
            raise ValueError(f"a block at {anchor_pos} runs past the drafter's cache of {self.cache.length}")
        seen_1SF = new_features_1SF if self.recent_1WF is None else torch.cat((self.recent_1WF, new_features_1SF), 1)
        self.recent_1WF = seen_1SF[:, -B:]
        block_ids_1Q = block_input_ids(torch.tensor([anchor_token], device=self.device), B, self.mask_token_id)
        self._staged_anchor = block_ids_1Q[:, 0]
        if not self.started or anchor_pos < B:
            # The sequence's first round: all its context so far, whatever its length.
            assert seen_1SF.shape[1] == anchor_pos, (seen_1SF.shape, anchor_pos)
            self.started = True
            self._first = (seen_1SF, block_ids_1Q, torch.arange(anchor_pos + B, device=self.device), anchor_pos)
            return False
        self._first = None
        w = self.window
        w.features_1WF.copy_(self.recent_1WF)
        w.block_ids_1Q.copy_(block_ids_1Q)
        w.anchor.fill_(anchor_pos)
        return True
