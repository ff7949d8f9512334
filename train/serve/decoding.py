"""Greedy speculative decoding with a target and an exported DFlash drafter: the round loop
(`speculative_generate`), target-only greedy decoding to compare it with (`greedy_generate`), the
drafter driven as a proposer (`DFlashProposer`) and what a decoding returns (`Generation`, `Round`).
This module knows nothing of how its results are checked or reported: the agreement of offline and
online τ (`train.serve.agreement`), DDTree verification (`train.serve.tree_decode`), the CUDA-graph
target and drafter (`train.serve.static_target`, `train.serve.static_drafter`), the summaries
(`train.serve.results`) and the command (`train.serve.specdecode`, its work in
`train.serve.specdecode_run`) build on it.

One round (docs/dflash.md "Inference round"), anchored at position a (the last verified token x_a, whose target
features do not exist yet):
  1. the drafter runs once over [target tap features of the positions not yet in its context cache |
     block [x_a, MASK x (B-1)] at positions a..a+B-1] and proposes d_1..d_{B-1} = argmax of the
     target's lm_head at block positions 1..B-1 (position k predicts the token at a+k; a DFlash2
     drafter: its candidate selector's greedy walk over the top-k of those logits, from x_a on); its
     context cache is then cut back to a, so it holds context entries only;
  2. the target runs once over [x_a, d_1..d_{B-1}] with its KV cache and gives its greedy token
     y_{k+1} at every block position k;
  3. the longest prefix with d_k == y_k is accepted and y_{acc+1} is the bonus; the x_a..d_acc
     positions were verified, so their tap features (from this same forward) become new drafter
     context, and the target cache is cut back to a + acc + 1.
The output is the target's own greedy continuation, token for token (lossless).

What "lossless" can promise in floating point: the verify pass computes 16 positions in one forward,
target-only decoding one position per forward, and a GPU runs the two with different kernels (other
reduction orders), so their logits differ in the last bits. Where the target's top-1 and top-2 are
that close, the two decodings may pick different tokens, neither of them wrong. On the CPU in float32
every test decodes identically. Each divergence is reported with the target's top-1 minus top-2 logit
at the first differing token in both decodings (`Generation.margins`, reported by
`train.serve.results.compare_generations` as `margin`, `other_margin`), so a near-tie (a margin of
the order of the dtype's rounding) and a bug (a clear margin) are told apart, and the default dtype
is float32, whose rounding is 2^16 times finer than bfloat16's (so far fewer near-ties are close
enough to flip).

Target cache: a `transformers` DynamicCache cropped to the accepted length (`cache_mode` "crop").
Hybrid models (Qwen3.5 / 3.6, Qwen3-Next Gated DeltaNet layers) carry recurrent states that cannot
be cropped: the verify keeps each such layer's state after every position and the round keeps those
of the accepted length ("rollback", `SpecTarget.keep`). For recurrent layers of a kind
`target.recurrent_states` does not know, the eager fallback: the cache is copied before each
verification, and after a partial acceptance the copy is restored and the accepted tokens are run
through the target once more (one extra target forward per such round; "snapshot").

τ accounting (docs/dflash.md "Acceptance length (τ)", the conventions of `train.eval.acceptance`): τ of
a round = 1 + the number of leading drafts that equal the target's tokens, counted only over the
tokens the round produced (the last round of a response is cut at the stop token, the token budget,
or with --stop-repeat where the response starts looping (`Ending`), where a cut block's streak is at
most its valid length). The first token comes from the prefill and is not a round. How τ and speed
are summed up over prompts: `train.serve.results`.

Shape legend: T tokens, S context, Q block tokens, F tap feature width, V vocabulary, B block size.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from common.repeat import RepeatWatch
from train.alignment import block_input_ids
from train.serve.spec_target import SpecTarget, crop_cache

__all__ = [
    "Round",
    "Generation",
    "Ending",
    "Proposer",
    "DFlashProposer",
    "speculative_generate",
    "greedy_generate",
    "round_tau",
]


# ----------------------------------------------------------------------------------------------
# What a decoding returns


@dataclasses.dataclass
class Round:
    """One draft-and-verify round."""

    start: int  # absolute position of the anchor (the last verified token)
    accepted: int  # leading drafts equal to the target's greedy tokens, among those verified (a stop
    # token among them still ends the response there)
    committed: int  # tokens this round appended (accepted drafts + bonus, cut at a stop or the budget)
    tau: int  # 1 + leading drafts equal to the committed tokens (the train.eval.acceptance convention)


@dataclasses.dataclass
class Generation:
    """A generated continuation and where its time went."""

    prompt_len: int
    tokens: list[int]  # generated tokens; the first comes from the prefill
    stop: str  # "eos", "length", or "repeat" (stop_repeat: where it started looping)
    rounds: list[Round] = dataclasses.field(default_factory=list)  # empty for target-only decoding
    prefill_s: float = 0.0
    decode_s: float = 0.0  # everything after the prefill
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0  # cache crop / per-token state rollback / snapshot restore + re-run
    target_forwards: int = 0  # target forwards after the prefill
    # The target's logit margin (top-1 minus top-2) behind each generated token: where two decodings
    # differ, a margin near 0 says a numerical near-tie decided it, a large one says a bug did.
    margins: list[float] = dataclasses.field(default_factory=list)

    @property
    def taus(self) -> list[int]:
        return [r.tau for r in self.rounds]

    def end_round(self, round_: Round, t0: float, t1: float, t2: float, t3: float) -> None:
        """Book one draft-verify round: its record, its verifying target forward, and where its time
        went (t0 draft t1 verify t2 rollback t3)."""
        self.rounds.append(round_)
        self.target_forwards += 1
        self.draft_s += t1 - t0
        self.verify_s += t2 - t1
        self.rollback_s += t3 - t2

    @property
    def mean_tau(self) -> float | None:
        return sum(self.taus) / len(self.taus) if self.rounds else None


# ----------------------------------------------------------------------------------------------
# Proposers


class Proposer(Protocol):
    """Proposes the B-1 draft tokens of a round."""

    block_size: int

    def reset(self) -> None: ...

    def propose(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> list[int]:
        """Drafts for positions anchor_pos+1 .. anchor_pos+B-1. `new_features_1SF` are the target
        features of the positions verified since the last call (all prompt positions at first)."""
        ...


class DFlashProposer:
    """An exported DFlash or DFlash2 drafter (loaded through `AutoModel`) driven as in docs/dflash.md
    "Inference round"; a DFlash2 drafter's proposal is its selector's walk (`decide`)."""

    def __init__(self, drafter: nn.Module, target: SpecTarget, *, context_cache: bool = True):
        self.drafter = drafter
        self.target = target
        self.selector = hasattr(drafter, "candidate_selector")  # DFlash2DraftModel
        self.block_size = int(drafter.block_size)
        self.mask_token_id = int(drafter.mask_token_id)
        self.context_cache = context_cache
        if list(drafter.target_layer_ids) != target.layer_ids:
            raise ValueError(
                f"drafter target_layer_ids {list(drafter.target_layer_ids)} != the target taps {target.layer_ids}"
            )
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache() if self.context_cache else None
        self.cached = 0  # context positions whose K/V are in the cache
        self.pending: list[torch.Tensor] = []  # features not yet in the cache (all of them without a cache)

    @torch.inference_mode()
    def propose(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> list[int]:
        hidden_1LD = self.draft_hidden(new_features_1SF, anchor_token, anchor_pos)
        return self.decide(hidden_1LD, torch.tensor([anchor_token], device=hidden_1LD.device)).tolist()

    def decide(self, hidden_1LD: torch.Tensor, anchor_1: torch.Tensor) -> torch.Tensor:
        """The drafts [L] from the drafter's hidden states at block positions 1..L: the argmax of the target's
        logits, or a DFlash2 drafter's selector walk after the anchor token (device ops only: capturable)."""
        if self.selector:
            return self.drafter.propose(hidden_1LD, anchor_1, self.target.target.lm_head)[0][0]
        return self.target.draft_logits(hidden_1LD)[0].argmax(-1)

    @torch.inference_mode()
    def draft_logits(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> torch.Tensor:
        """The target's logits [B-1, V] at block positions 1..B-1 (same inputs as `propose`)."""
        return self.target.draft_logits(self.draft_hidden(new_features_1SF, anchor_token, anchor_pos))[0]

    @torch.inference_mode()
    def draft_hidden(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> torch.Tensor:
        """The drafter's hidden states [1, B-1, D] at block positions 1..B-1 (same inputs as `propose`)."""
        B = self.block_size
        self.pending.append(new_features_1SF)
        context_1SF = torch.cat(self.pending, dim=1)
        first = self.cached if self.context_cache else 0
        assert first + context_1SF.shape[1] == anchor_pos, (first, context_1SF.shape, anchor_pos)
        device = self.target.device
        block_ids_1Q = block_input_ids(torch.tensor([anchor_token], device=device), B, self.mask_token_id)
        noise_1QD = self.target.embed(block_ids_1Q)
        position_ids = torch.arange(first, anchor_pos + B, device=device)[None]
        hidden_1QD = self.drafter(
            position_ids=position_ids,
            noise_embedding=noise_1QD,
            target_hidden=context_1SF,
            past_key_values=self.cache,
            use_cache=self.context_cache,
        )
        if self.context_cache:
            crop_cache(self.cache, anchor_pos)  # keep context entries only (the block's are rebuilt next round)
            self.cached = anchor_pos
            self.pending = []
        return hidden_1QD[:, 1:]


# ----------------------------------------------------------------------------------------------
# Decoding loops


def _leading_matches(drafts: Sequence[int], tokens: Sequence[int]) -> int:
    n = 0
    # strict=False: the common prefix (the target's tokens run one past the drafts it verified)
    for d, t in zip(drafts, tokens, strict=False):
        if d != t:
            break
        n += 1
    return n


def round_tau(drafts: Sequence[int], committed: Sequence[int]) -> int:
    """1 + leading drafts equal to the tokens the round produced (at most B-1 drafts count)."""
    return 1 + _leading_matches(drafts, committed)


class Ending:
    """Where a response ends: with its first stop token ("eos", the token kept), after
    `max_new_tokens` tokens ("length"), or, with `stop_repeat` > 0, after the token where it starts
    looping ("repeat"; `common.repeat.RepeatWatch`, the rule by which the tiny default's
    regenerated answers are cut, so a response decoded here ends where its training answer does)."""

    def __init__(self, stop_ids: frozenset, max_new_tokens: int, stop_repeat: int = 0):
        self.stop_ids, self.max_new_tokens = stop_ids, max_new_tokens
        self.watch = RepeatWatch(1, max_new_tokens, stop_repeat) if stop_repeat else None
        self.count = 0
        self.reason: str | None = None

    def take(self, tokens: Sequence[int]) -> list[int]:
        """The leading `tokens` the response keeps: all of them, unless it ends among them."""
        kept: list[int] = []
        for token in tokens:
            if self.reason is not None:
                break
            kept.append(token)
            self.count += 1
            if token in self.stop_ids:
                self.reason = "eos"
            elif self.watch is not None and self.watch.push([token])[0]:
                self.reason = "repeat"
            elif self.count >= self.max_new_tokens:
                self.reason = "length"
        return kept


def prompt_tensor(prompt_ids: Sequence[int], device) -> torch.Tensor:
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt")
    return torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)


def greedy_with_margin(logits_TV: torch.Tensor) -> tuple[list[int], list[float]]:
    """(argmax token per row, top-1 minus top-2 logit per row), in one device-to-host copy."""
    top_T2 = logits_TV.topk(2, dim=-1)
    rows = torch.stack((top_T2.indices[:, 0].to(top_T2.values.dtype), top_T2.values[:, 0] - top_T2.values[:, 1]), 1)
    host = rows.tolist()
    return [int(t) for t, _ in host], [float(m) for _, m in host]


@torch.inference_mode()
def greedy_generate(
    target: SpecTarget, prompt_ids: Sequence[int], max_new_tokens: int, *, stop_repeat: int = 0
) -> Generation:
    """Target-only greedy decoding with the same KV cache, one token per forward (ends: `Ending`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    started = time.perf_counter()
    ending = Ending(target.stop_ids, max_new_tokens, stop_repeat)
    logits, _, cache = target.forward(prompt_tensor(prompt_ids, target.device), None, taps=False, last_only=True)
    token, margin = greedy_with_margin(logits[0, -1:])
    tokens = ending.take(token)
    result = Generation(prompt_len=len(prompt_ids), tokens=tokens, stop="length", margins=margin)
    prefilled = time.perf_counter()
    while ending.reason is None:
        logits, _, cache = target.forward(torch.tensor([[tokens[-1]]]), cache, taps=False)
        token, margin = greedy_with_margin(logits[0, -1:])
        tokens.extend(ending.take(token))
        result.margins.extend(margin)
        result.target_forwards += 1
    result.stop = ending.reason
    result.prefill_s, result.decode_s = prefilled - started, time.perf_counter() - prefilled
    return result


@torch.inference_mode()
def speculative_generate(
    target: SpecTarget,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    stop_repeat: int = 0,
    verify_tokens: int = 0,
) -> Generation:
    """Greedy speculative decoding; the tokens equal `greedy_generate`'s (ends: `Ending`).

    `verify_tokens` (0 = the block size): each round verifies the anchor and only the first
    `verify_tokens - 1` drafts, so a round commits at most that many tokens, in a verify forward of
    that many rows (where float32 products of 16 rows cost twice a one-token step, a drafter that
    rarely gets past its first drafts pays more with a shorter verify)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B = proposer.block_size
    if not 0 <= verify_tokens <= B:
        raise ValueError(
            f"verify_tokens must be between 1 and the block size {B} (0 = the block size), got {verify_tokens}"
        )
    V = verify_tokens or B  # a round's τ counts the verified drafts only (all B-1 when V = B)
    started = time.perf_counter()
    ending = Ending(target.stop_ids, max_new_tokens, stop_repeat)
    proposer.reset()
    logits, features_1TF, cache = target.forward(
        prompt_tensor(prompt_ids, target.device), None, taps=True, last_only=True
    )
    mode = target.cache_mode = target.mode_for(cache)
    token, margin = greedy_with_margin(logits[0, -1:])
    tokens = ending.take(token)
    result = Generation(prompt_len=len(prompt_ids), tokens=tokens, stop="length", margins=margin)
    anchor = len(prompt_ids)  # position of tokens[-1]
    new_features_1SF = features_1TF
    prefilled = time.perf_counter()
    while ending.reason is None:
        t0 = time.perf_counter()
        drafts = [int(d) for d in proposer.propose(new_features_1SF, tokens[-1], anchor)]
        assert len(drafts) == B - 1, (len(drafts), B)
        t1 = time.perf_counter()
        budget = max_new_tokens - len(tokens)
        verify_len = min(V, budget)  # no need to verify drafts past the token budget
        snapshot = copy.deepcopy(cache) if mode == "snapshot" else None
        block_1Q = torch.tensor([[tokens[-1]] + drafts[: verify_len - 1]])
        logits, features_1TF, cache = target.forward(block_1Q, cache, taps=True)
        greedy, margins = greedy_with_margin(logits[0])  # greedy[k] = the target's token for position anchor+k+1
        accepted = _leading_matches(drafts[: verify_len - 1], greedy)
        committed = ending.take(drafts[:accepted] + [greedy[accepted]])
        result.margins.extend(margins[: len(committed)])
        t2 = time.perf_counter()
        verified = (
            accepted + 1
        )  # positions anchor..anchor+accepted hold correct tokens; their K/V and features are right
        if mode == "crop":
            crop_cache(cache, anchor + verified)
        elif mode == "rollback" and verified < verify_len:
            target.keep(cache, verified)
        elif verified < verify_len:
            cache = snapshot
            _, _, cache = target.forward(block_1Q[:, :verified], cache, taps=False)
            result.target_forwards += 1
        t3 = time.perf_counter()
        result.end_round(
            Round(start=anchor, accepted=accepted, committed=len(committed), tau=round_tau(drafts[: V - 1], committed)),
            t0,
            t1,
            t2,
            t3,
        )
        tokens.extend(committed)
        new_features_1SF = features_1TF[:, :verified]
        anchor += verified
    result.stop = ending.reason
    result.prefill_s, result.decode_s = prefilled - started, time.perf_counter() - prefilled
    return result
