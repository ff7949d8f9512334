"""The DFlash2 drafter (docs/dflash.md "DFlash2"): DFlash plus a block convolution around every
sublayer and a candidate selector, in the published layout (z-lab's `DFlash2DraftModel`, vLLM's
`qwen3_dflash2`, SGLang's DFlash2 model).

Convolution. Each decoder layer wraps its attention and its MLP in a `GroupedDynamicConv`
(`attention_conv`, `mlp_conv`): on the normed sublayer input (input side) and on the sublayer's
output before the residual add (output side),

    y[i] = sum_t (base[side, t] + dyn[i, side, t, group]) * x[i - t]       (x[i - t] = 0 before the block)

over the rows of one block only (the anchor row has no predecessor; context rows are never
convolved). `dyn` is one bias-free linear map of the normed input, shared by both sides; the base
kernel is per channel, the dynamic part per group of `conv_group_size` channels. A fresh
convolution is the identity (tap 0 = 1, every other tap and the projection 0), so a fresh DFlash2
computes what its DFlash backbone computes.

Selector. For block position j with final hidden h_j, the target head's top-K logits U_j(b) over
candidates b, and a predecessor token a (the anchor at j = 1, else the token chosen at j - 1):

    S_j(a, b) = U_j(b) + < A[a] * P(h_j), B[b] >        A, B: [V, r] codebooks; P: Linear(D -> r)

The proposal walks the block left to right, taking argmax_b S_j(a, b) and feeding the choice in as
the next predecessor (greedy, not Viterbi: what every engine serves). In training the predecessor
is the label of the previous position (teacher forcing). A fresh selector has B = 0, so it
proposes the unary argmax.

Shape legend: B rows, N blocks per row, K block size, Q = N*K block tokens, D hidden, T taps,
G groups (D / group size), g channels per group, V vocabulary, r selector rank, k candidates,
L block positions ranked, M rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.drafter_config import DrafterConfig
from train.model import DecoderLayer, DFlashDrafter

__all__ = ["GroupedDynamicConv", "CandidateSelector", "DFlash2DecoderLayer", "DFlash2Drafter", "build_drafter"]


def block_convolve(x_BQD: torch.Tensor, dyn_BQTG: torch.Tensor, base_TD: torch.Tensor, block: int) -> torch.Tensor:
    """sum_t (base[t] + dyn[:, :, t] per group) * (x shifted by t rows inside each block of `block` rows)."""
    B, Q, D = x_BQD.shape
    T, G = base_TD.shape[0], dyn_BQTG.shape[-1]
    x_BNKGg = x_BQD.view(B, Q // block, block, G, D // G)
    dyn_BNKTGx = dyn_BQTG.view(B, Q // block, block, T, G, 1)
    out = None
    for t in range(T):
        shifted = x_BNKGg if t == 0 else F.pad(x_BNKGg[:, :, :-t], (0, 0, 0, 0, t, 0))
        term = (base_TD[t].view(G, D // G).to(x_BQD.dtype) + dyn_BNKTGx[:, :, :, t]) * shifted
        out = term if out is None else out + term
    return out.view(B, Q, D)


class GroupedDynamicConv(nn.Module):
    """The two convolutions around one sublayer: `prepare` (input side) and `finish` (output side)."""

    def __init__(self, width: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.groups = kernel_size, width // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, width))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(width, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of both sides 1, the rest and the projection 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x_BQD: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input side's output, the output side's coefficients [B, Q, T, G]) for the normed input."""
        B, Q, _ = x_BQD.shape
        dyn_BQSTG = self.kernel_projection(x_BQD).view(B, Q, 2, self.kernel_size, self.groups)
        return block_convolve(x_BQD, dyn_BQSTG[:, :, 0], self.base_kernel[0], block), dyn_BQSTG[:, :, 1]

    def finish(self, x_BQD: torch.Tensor, dyn_BQTG: torch.Tensor, block: int) -> torch.Tensor:
        return block_convolve(x_BQD, dyn_BQTG, self.base_kernel[1], block)


class DFlash2DecoderLayer(DecoderLayer):
    """A DFlash decoder layer with a `GroupedDynamicConv` inside each residual branch."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.block = cfg.block_size

    def forward(self, h_BQD, context_BSD, cos_BPR, sin_BPR, attn_mask) -> torch.Tensor:
        # Training rows hold whole blocks; a proposal holds one block, possibly cut short by the token budget.
        Q = h_BQD.shape[1]
        block = self.block if Q % self.block == 0 else Q
        assert Q % self.block == 0 or self.block > Q, (Q, self.block)
        x_BQD, dyn = self.attention_conv.prepare(self.input_layernorm(h_BQD), block)
        attended = self.self_attn(x_BQD, context_BSD, cos_BPR, sin_BPR, attn_mask)
        h_BQD = h_BQD + self.attention_conv.finish(attended, dyn, block)
        x_BQD, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(h_BQD), block)
        return h_BQD + self.mlp_conv.finish(self.mlp(x_BQD), dyn, block)


class CandidateSelector(nn.Module):
    """Scores of the unary top-k candidates given the previous token (module docstring)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        self.initializer_range = cfg.initializer_range
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Predecessor codes and the projection ~ N(0, initializer_range), successor codes 0: a fresh
        selector adds nothing to the unary logits (SpecForge's and NeMo's initialization)."""
        nn.init.normal_(self.predecessor_codebook, std=self.initializer_range)
        nn.init.normal_(self.hidden_projection.weight, std=self.initializer_range)
        nn.init.zeros_(self.successor_codebook)

    def scores(
        self, hidden_MD: torch.Tensor, unary_Mk: torch.Tensor, candidates_Mk: torch.Tensor, predecessor_M: torch.Tensor
    ) -> torch.Tensor:
        """S(a, b) [M, k] for each row's predecessor a and its candidates b, in float32."""
        gate_Mr = self.predecessor_codebook[predecessor_M] * self.hidden_projection(hidden_MD.to(self.dtype))
        pair_Mk = torch.einsum("mr,mkr->mk", gate_Mr, self.successor_codebook[candidates_Mk])
        return unary_Mk.float() + pair_Mk.float()

    @property
    def dtype(self) -> torch.dtype:
        return self.successor_codebook.dtype

    @torch.no_grad()
    def walk(
        self, hidden_BLD: torch.Tensor, unary_BLk: torch.Tensor, candidates_BLk: torch.Tensor, anchor_B: torch.Tensor
    ) -> torch.Tensor:
        """The greedy proposal [B, L]: position by position, the best candidate after the previous choice."""
        chosen, previous_B = [], anchor_B
        for j in range(hidden_BLD.shape[1]):
            best_B = self.scores(hidden_BLD[:, j], unary_BLk[:, j], candidates_BLk[:, j], previous_B).argmax(-1)
            previous_B = candidates_BLk[:, j].gather(1, best_B[:, None])[:, 0]
            chosen.append(previous_B)
        return torch.stack(chosen, dim=1)


class DFlash2Drafter(DFlashDrafter):
    """DFlash's drafter with DFlash2's layers and a `candidate_selector`; its forward is DFlash's
    contract (`train.model.DFlashDrafter`); the selector ranks the target head's candidates of its
    output (`propose`, and the selector loss in training)."""

    layer_class = DFlash2DecoderLayer

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)

    def reset_parameters(self) -> None:
        super().reset_parameters()  # every Linear ~ N(0, std), the convolutions' projections included
        for module in self.modules():
            if isinstance(module, (GroupedDynamicConv, CandidateSelector)):
                module.reset_parameters()

    @torch.no_grad()
    def propose(self, hidden_BLD: torch.Tensor, head_VD: torch.Tensor, anchor_B: torch.Tensor) -> torch.Tensor:
        """Tokens [B, L] for block positions 1..L from their final hidden states: the selector's walk over
        the top-k of the target head's logits, starting after the anchor token."""
        logits_BLV = F.linear(hidden_BLD.to(head_VD.dtype), head_VD).float()
        unary_BLk, candidates_BLk = logits_BLV.topk(self.candidate_selector.top_k, dim=-1)
        return self.candidate_selector.walk(hidden_BLD, unary_BLk, candidates_BLk, anchor_B)


DRAFTERS = {"dflash": DFlashDrafter, "dflash2": DFlash2Drafter}


def build_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """The drafter of the config's class (`DrafterConfig.arch`), freshly initialized."""
    return DRAFTERS[cfg.arch](cfg)
