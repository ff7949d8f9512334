"""Real greedy speculative decoding with a target and an exported DFlash drafter, against target-only
greedy decoding, and the agreement of offline chain τ with the online τ.

    python -m train.specdecode --target DIR --drafter EXPORT_DIR [--prompts FILE.jsonl | --data SHARDS]
        [--max-new-tokens N] [--num-prompts N] [--out result.json] [--agreement [--agreement-bf16]]
        [--tree-budgets 8,32] [--dtype float32] [--threads N] [--thinking] [--no-baseline] [--stop-repeat N]
    make specdecode ARGS="--target artifacts/tiny/target --drafter exports/NAME --agreement"

Prompts: the first user turn of each `{"messages": [...]}` record (default
artifacts/tiny/corpus/heldout.jsonl), rendered with the chat template, add_generation_prompt=True and
enable_thinking=False (non-thinking, as the published drafters); or, with --data, the tokens before
each shard sample's first response.

One round (docs/dflash.md "Inference round"), anchored at position a (the last verified token x_a, whose target
features do not exist yet):
  1. the drafter runs once over [target tap features of the positions not yet in its context cache |
     block [x_a, MASK x (B-1)] at positions a..a+B-1] and proposes d_1..d_{B-1} = argmax of the
     target's lm_head at block positions 1..B-1 (position k predicts the token at a+k); its context
     cache is then cut back to a, so it holds context entries only;
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
at the first differing token in both decodings (`compare_generations`: `margin`, `other_margin`), so a
near-tie (a margin of the order of the dtype's rounding) and a bug (a clear margin) are told apart,
and the default dtype is float32, whose rounding is 2^16 times finer than bfloat16's (so far fewer
near-ties are close enough to flip).

Target cache: a `transformers` DynamicCache cropped to the accepted length. Hybrid models (Qwen3.5 /
3.6 Gated DeltaNet layers) carry recurrent states that cannot be cropped; for them the cache is
copied before each verification, and after a partial acceptance the copy is restored and the
accepted tokens are run through the target once more (one extra target forward per such round;
`cache_mode` = "snapshot" in the results).

τ accounting (docs/dflash.md "Acceptance length (τ)", the conventions of `train.eval.acceptance`): τ of
a round = 1 + the number of leading drafts that equal the target's tokens, counted only over the
tokens the round produced (the last round of a response is cut at the stop token, the token budget,
or with --stop-repeat where the response starts looping (`Ending`), where a cut block's streak is at
most its valid length). The reported τ is the mean over prompts of the per-prompt mean
over rounds; the histogram counts rounds by τ = 1..B. The first token comes from the prefill and
is not a round. (z-lab's benchmark counts a last round's committed tokens instead: the two differ
only when a response's last round accepted every draft up to its end.) Speed: tokens/s over the
decode phase (after the prefill and its first token) and over the wall time; the speed-up is the
ratio of target-only to speculative decode time (= the TPOT ratio of docs/dflash.md "Acceptance length (τ)"); both loops
run interleaved per prompt with the same cache handling, after one warm-up.

DDTree (`--tree-budgets 8,32`, `ddtree_generate`; stretch goal, docs/dflash.md "DDTree"): the drafter's top-k
per depth gives a best-first tree of `budget` nodes (`train.eval.ddtree.build_ddtree`); the target
verifies [anchor | nodes] in one forward with an ancestor-only mask and positions anchor + depth,
walks its greedy tokens down the tree, and the cache keeps the accepted path only.

Agreement (`--agreement`, `train.serve.agreement`): offline chain τ is computed over teacher-forced data,
with an anchor at every position; online rounds start only where the previous round stopped, and
the data tokens are the target's own greedy continuation. So the comparison is built on that
continuation: the generated sequences are run through the target in one teacher-forced forward
(what extraction stores: tap features, greedy top-1), the drafter proposes at every anchor of the
response with the training mask (many blocks in one forward), and chain τ is computed with
`train.eval.acceptance`. Offline τ at the anchors where online rounds started equals the online τ round
by round (exactly, up to floating-point argmax flips between the incremental and the one-pass
forward); offline τ over all anchors is a different average (see `agreement`).

Shape legend: T tokens, S context, Q block tokens, F tap feature width, V vocabulary, B block size.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ConfigError
from common.repeat import RepeatWatch
from common.target import TapHooks, Target, check_layer_ids, load_target, reach_text_parts
from train.alignment import block_input_ids
from train.serve.cli import DEFAULT_PROMPTS, parse_specdecode_args, usage_error
from train.serve.peers import PEERS
from train.serve.prompts import prompts_from_jsonl, prompts_from_shards, stop_token_ids

__all__ = [
    "Round",
    "Generation",
    "Ending",
    "SpecTarget",
    "Proposer",
    "DFlashProposer",
    "speculative_generate",
    "greedy_generate",
    "ddtree_generate",
    "tree_attention_mask",
    "walk_verified_tree",
    "compact_cache",
    "round_tau",
    "summarize",
    "compare_generations",
    "run_benchmark",
    "crop_cache",
    "main",
]


# ----------------------------------------------------------------------------------------------
# Results


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
    rollback_s: float = 0.0  # cache crop / snapshot restore + re-run
    target_forwards: int = 0  # target forwards after the prefill
    # The target's logit margin (top-1 minus top-2) behind each generated token: where two decodings
    # differ, a margin near 0 says a numerical near-tie decided it, a large one says a bug did.
    margins: list[float] = dataclasses.field(default_factory=list)

    @property
    def taus(self) -> list[int]:
        return [r.tau for r in self.rounds]

    def end_round(self, round_: "Round", t0: float, t1: float, t2: float, t3: float) -> None:
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
# The target: forward with taps and a KV cache


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
    """'crop' when the cache can be cut back exactly, else 'snapshot' (copy before each verification)."""
    croppable = getattr(cache, "is_croppable", None)
    if croppable is not None:
        return "crop" if croppable else "snapshot"
    # transformers without `is_croppable`: hybrid models declare their recurrent layers in layer_types.
    layer_types = getattr(text_config, "layer_types", None) or []
    recurrent = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
    return "snapshot" if recurrent else "crop"


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


class SpecTarget:
    """A target causal LM as speculative decoding uses it: cached forwards that also return tap features."""

    def __init__(self, target: Target, layer_ids: Sequence[int], stop_ids: Sequence[int]):
        check_layer_ids(list(layer_ids), target.num_layers)
        self.target = target
        self.model = target.model
        self.layer_ids = [int(i) for i in layer_ids]
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.embed_VD = target.decoder.get_input_embeddings().weight
        self.cache_mode: str | None = None
        # transformers renamed `past_key_values` to `cache` (5.2x); pass whichever this version takes.
        self.cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @classmethod
    def from_model(
        cls, model: nn.Module, layer_ids: Sequence[int], stop_ids: Sequence[int], tokenizer=None
    ) -> "SpecTarget":
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
        out, features_1TF = self.call_model(kwargs, taps=taps)
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

    def draft_logits(self, hidden_NQD: torch.Tensor) -> torch.Tensor:
        """The target's final logits of drafter outputs (its lm_head and any post-scaling)."""
        head = self.target.lm_head
        return self.target.logits_fn(head(hidden_NQD.to(head.weight.dtype))).float()


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
    """An exported DFlash drafter (loaded through `AutoModel`) driven as in docs/dflash.md "Inference round"."""

    def __init__(self, drafter: nn.Module, target: SpecTarget, *, context_cache: bool = True):
        self.drafter = drafter
        self.target = target
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
        return self.draft_logits(new_features_1SF, anchor_token, anchor_pos).argmax(-1).tolist()

    @torch.inference_mode()
    def draft_logits(self, new_features_1SF: torch.Tensor, anchor_token: int, anchor_pos: int) -> torch.Tensor:
        """The target's logits [B-1, V] at block positions 1..B-1 (same inputs as `propose`)."""
        B = self.block_size
        self.pending.append(new_features_1SF)
        context_1SF = torch.cat(self.pending, dim=1)
        first = self.cached if self.context_cache else 0
        assert first + context_1SF.shape[1] == anchor_pos, (first, context_1SF.shape, anchor_pos)
        device = self.target.device
        block_ids_1Q = block_input_ids(torch.tensor([anchor_token], device=device), B, self.mask_token_id)
        noise_1QD = F.embedding(block_ids_1Q, self.target.embed_VD)
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
        return self.target.draft_logits(hidden_1QD[:, 1:])[0]


# ----------------------------------------------------------------------------------------------
# Decoding loops


def _leading_matches(drafts: Sequence[int], tokens: Sequence[int]) -> int:
    n = 0
    for d, t in zip(drafts, tokens):
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


def _prompt_tensor(prompt_ids: Sequence[int], device) -> torch.Tensor:
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
    logits, _, cache = target.forward(_prompt_tensor(prompt_ids, target.device), None, taps=False, last_only=True)
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
    target: SpecTarget, proposer: Proposer, prompt_ids: Sequence[int], max_new_tokens: int, *, stop_repeat: int = 0
) -> Generation:
    """Greedy speculative decoding; the tokens equal `greedy_generate`'s (ends: `Ending`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B = proposer.block_size
    started = time.perf_counter()
    ending = Ending(target.stop_ids, max_new_tokens, stop_repeat)
    proposer.reset()
    logits, features_1TF, cache = target.forward(
        _prompt_tensor(prompt_ids, target.device), None, taps=True, last_only=True
    )
    mode = target.cache_mode = cache_mode_for(cache, target.target.text_config)
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
        verify_len = min(B, budget)  # no need to verify drafts past the token budget
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
        elif verified < verify_len:
            cache = snapshot
            _, _, cache = target.forward(block_1Q[:, :verified], cache, taps=False)
            result.target_forwards += 1
        t3 = time.perf_counter()
        result.end_round(
            Round(start=anchor, accepted=accepted, committed=len(committed), tau=round_tau(drafts, committed)),
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


# ----------------------------------------------------------------------------------------------
# DDTree verification (stretch goal; docs/dflash.md "DDTree")


def compact_cache(cache, keep_T: torch.Tensor) -> None:
    """Keep only the cache positions `keep_T` (ascending), in order: the accepted path of a tree.

    Works on caches made of plain key/value layers (transformers 5 `DynamicCache`); ValueError for
    anything else (sliding windows, recurrent states), where dropping positions is not meaningful.
    """
    layers = getattr(cache, "layers", None)
    if layers is None or not all(type(layer).__name__ == "DynamicLayer" for layer in layers):
        raise ValueError(
            f"DDTree verification needs a cache of plain key/value layers, got {type(cache).__name__} "
            f"with {sorted({type(layer).__name__ for layer in layers or []})}"
        )
    for layer in layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            index = keep_T.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)


def tree_attention_mask(parent_M: torch.Tensor, cached: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, 1+M, cached+1+M] for [root, nodes]: every cached position, then the root,
    the node's ancestors and itself (node i's parent is node parent_M[i], -1 = the root)."""
    M = parent_M.numel()
    visible = torch.zeros(M + 1, M + 1, dtype=torch.bool)
    visible[0, 0] = True
    for i, parent in enumerate(parent_M.tolist(), start=1):
        visible[i] = visible[parent + 1]  # parents come before their children
        visible[i, i] = True
    full = torch.cat((torch.ones(M + 1, cached, dtype=torch.bool), visible), dim=1)
    mask = torch.zeros(full.shape, dtype=dtype).masked_fill(~full, torch.finfo(dtype).min)
    return mask[None, None]


def walk_verified_tree(parent_M: torch.Tensor, token_M: torch.Tensor, greedy: Sequence[int]) -> list[int]:
    """Accepted node indices, root first excluded: from the root, follow the child whose token is the
    target's greedy token at the current node (`greedy[0]` at the root, `greedy[i + 1]` at node i)."""
    child = {(p, t): i for i, (p, t) in enumerate(zip(parent_M.tolist(), token_M.tolist()))}
    path, node = [], -1
    while (node, greedy[node + 1]) in child:
        node = child[(node, greedy[node + 1])]
        path.append(node)
    return path


@torch.inference_mode()
def ddtree_generate(
    target: SpecTarget,
    proposer: DFlashProposer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    budget: int,
    *,
    stop_repeat: int = 0,
) -> Generation:
    """Greedy speculative decoding that verifies a DDTree of `budget` nodes per round (one target forward
    with an ancestor-only mask over [root | nodes]); the accepted path's K/V are kept and compacted.

    τ of a round = 1 + the accepted depth within the tokens the round produced (as `walk_tree` with
    the valid length). Tokens equal `greedy_generate`'s. Needs a croppable (plain key/value) cache.
    """
    from train.eval.ddtree import build_ddtree, draft_topk

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    started = time.perf_counter()
    ending = Ending(target.stop_ids, max_new_tokens, stop_repeat)
    proposer.reset()
    logits, features_1TF, cache = target.forward(
        _prompt_tensor(prompt_ids, target.device), None, taps=True, last_only=True
    )
    target.cache_mode = cache_mode_for(cache, target.target.text_config)
    if target.cache_mode != "crop":
        raise ValueError(
            "DDTree verification is not supported for targets whose cache cannot be cut back (hybrid models)"
        )
    tokens = ending.take([int(logits[0, -1].argmax())])
    result = Generation(prompt_len=len(prompt_ids), tokens=tokens, stop="length")
    anchor, new_features_1SF = len(prompt_ids), features_1TF
    prefilled = time.perf_counter()
    while ending.reason is None:
        t0 = time.perf_counter()
        logits_DV = proposer.draft_logits(new_features_1SF, tokens[-1], anchor).float().cpu()
        lp_1DK, ids_1DK = draft_topk(logits_DV[None], min(budget, logits_DV.shape[-1]))
        tree = build_ddtree(lp_1DK[0], ids_1DK[0], budget)
        t1 = time.perf_counter()
        ids_1T = torch.tensor([[tokens[-1]] + tree.token_M.tolist()])
        positions_1T = anchor + torch.cat((torch.zeros(1, dtype=torch.long), tree.depth_M))[None]
        mask = tree_attention_mask(tree.parent_M, anchor, target.embed_VD.dtype)
        logits, features_1TF, cache = target.forward(
            ids_1T, cache, taps=True, position_ids_1T=positions_1T, mask_11TK=mask
        )
        greedy = logits[0].argmax(-1).tolist()
        path = walk_verified_tree(tree.parent_M, tree.token_M, greedy)
        bonus = greedy[path[-1] + 1] if path else greedy[0]
        committed = ending.take([int(tree.token_M[i]) for i in path] + [bonus])
        t2 = time.perf_counter()
        rows = torch.tensor([0] + [i + 1 for i in path])  # root and accepted nodes in the verify input
        compact_cache(cache, torch.cat((torch.arange(anchor), anchor + rows)))
        t3 = time.perf_counter()
        result.end_round(
            Round(start=anchor, accepted=len(path), committed=len(committed), tau=1 + min(len(path), len(committed))),
            t0,
            t1,
            t2,
            t3,
        )
        tokens.extend(committed)
        new_features_1SF = features_1TF[:, rows.to(features_1TF.device)]
        anchor += len(path) + 1
    result.stop = ending.reason
    result.prefill_s, result.decode_s = prefilled - started, time.perf_counter() - prefilled
    return result


# ----------------------------------------------------------------------------------------------
# Summaries


def compare_generations(spec: Generation, base: Generation) -> dict:
    """Whether two continuations are identical, and where they first differ."""
    first = next((i for i, (a, b) in enumerate(zip(spec.tokens, base.tokens)) if a != b), None)
    if first is None and len(spec.tokens) != len(base.tokens):
        first = min(len(spec.tokens), len(base.tokens))
    out = {"identical": first is None, "first_mismatch": first}
    if first is not None:
        for name, gen in (("margin", base), ("other_margin", spec)):
            if first < len(gen.margins):
                out[name] = gen.margins[first]
    return out


def tau_histogram(taus: Sequence[int], block_size: int) -> list[int]:
    """Counts of τ = 1..B (entry i counts τ = i + 1)."""
    counts = [0] * block_size
    for tau in taus:
        counts[tau - 1] += 1
    return counts


def _mean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(specs: Sequence[Generation], bases: Sequence[Generation] | None, block_size: int) -> dict:
    """Aggregate τ and speed over prompts (τ: mean over prompts of the per-prompt means, docs/dflash.md "Acceptance
    length (τ)")."""
    all_taus = [t for g in specs for t in g.taus]
    new_tokens = sum(len(g.tokens) for g in specs)
    summary = {
        "prompts": len(specs),
        "rounds": len(all_taus),
        "new_tokens": new_tokens,
        "tau": _mean([g.mean_tau for g in specs]),
        "tau_pooled": _mean(all_taus),
        "tau_histogram": tau_histogram(all_taus, block_size),
        "tokens_per_round": (sum(len(g.tokens) - 1 for g in specs) / len(all_taus)) if all_taus else None,
        "spec": _speed(specs),
    }
    if bases is not None:
        summary.update(against_baseline(specs, bases, summary["spec"]))
        spec_decode, base_decode = summary["spec"]["decode_s"], summary["baseline"]["decode_s"]
        summary["speedup"] = base_decode / spec_decode if spec_decode > 0 else None
    return summary


def against_baseline(gens: Sequence[Generation], bases: Sequence[Generation], speed: dict) -> dict:
    """Target-only greedy decoding of the same prompts (`baseline`: its speed), whether `gens` equal it
    prompt by prompt (`lossless`, where they differ and the margins there) and the wall-clock speed-up
    of `gens` (whose speed is `speed`)."""
    baseline = _speed(bases)
    comparisons = [compare_generations(g, b) for g, b in zip(gens, bases)]
    return {
        "baseline": baseline,
        "lossless": all(c["identical"] for c in comparisons),
        "mismatched_prompts": [i for i, c in enumerate(comparisons) if not c["identical"]],
        "mismatches": [dict(prompt=i, **c) for i, c in enumerate(comparisons) if not c["identical"]],
        "speedup_wall": baseline["wall_s"] / speed["wall_s"] if speed["wall_s"] > 0 else None,
    }


def _speed(gens: Sequence[Generation]) -> dict:
    prefill = sum(g.prefill_s for g in gens)
    decode = sum(g.decode_s for g in gens)
    tokens = sum(len(g.tokens) for g in gens)
    after_first = tokens - len(gens)  # the first token of each prompt comes from the prefill
    out = {
        "prefill_s": prefill,
        "decode_s": decode,
        "wall_s": prefill + decode,
        "tokens_per_s": tokens / (prefill + decode) if prefill + decode > 0 else None,
        "decode_tokens_per_s": after_first / decode if decode > 0 else None,
        "target_forwards": sum(g.target_forwards for g in gens),
    }
    if any(g.rounds for g in gens):
        out.update(
            draft_s=sum(g.draft_s for g in gens),
            verify_s=sum(g.verify_s for g in gens),
            rollback_s=sum(g.rollback_s for g in gens),
        )
    return out


def generation_record(index: int, spec: Generation, base: Generation | None) -> dict:
    record = {
        "index": index,
        "prompt_tokens": spec.prompt_len,
        "new_tokens": len(spec.tokens),
        "stop": spec.stop,
        "rounds": len(spec.rounds),
        "tau": spec.mean_tau,
        "taus": spec.taus,
        "spec": {
            k: getattr(spec, k)
            for k in ("prefill_s", "decode_s", "draft_s", "verify_s", "rollback_s", "target_forwards")
        },
    }
    if base is not None:
        record["baseline"] = {k: getattr(base, k) for k in ("prefill_s", "decode_s", "target_forwards")}
        record.update(compare_generations(spec, base))
    return record


def run_benchmark(
    target: SpecTarget,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    baseline: bool = True,
    warmup: bool = True,
    progress: bool = False,
    tree_budgets: Sequence[int] = (),
    stop_repeat: int = 0,
    peers: Sequence[str] = (),
    prompt_lookup_tokens: int = 10,
    peer_prompts: int = 0,
) -> dict:
    """Speculative and (interleaved, per prompt) target-only greedy decoding of every prompt; with
    `tree_budgets`, DDTree verification at each budget too (`ddtree`: one summary per budget); with
    `peers`, transformers' own decoding too (`train.serve.peers`; `peers`: one summary each, its
    lossless check and its wall-clock speed-up against target-only greedy decoding).
    `stop_repeat` > 0 ends every response where it starts looping (`Ending`)."""
    from tqdm.auto import tqdm

    from train.serve.peers import peer_generate

    if peers and stop_repeat:
        raise ValueError("the peer baselines cannot end responses where they start looping (stop_repeat)")

    if warmup and prompts:  # first calls allocate and pick kernels; keep that out of the timings
        speculative_generate(target, proposer, prompts[0], min(max_new_tokens, 2 * proposer.block_size))
        if baseline:
            greedy_generate(target, prompts[0], min(max_new_tokens, 8))
        for name in peers:
            peer_generate(name, target, prompts[0], min(max_new_tokens, 2 * proposer.block_size), prompt_lookup_tokens)
    specs, bases, records = [], [], []
    trees: dict[int, list[Generation]] = {int(b): [] for b in tree_budgets}
    peer_runs: dict[str, list[Generation]] = {name: [] for name in peers}
    for i, prompt in enumerate(tqdm(prompts, desc="specdecode", unit="prompt", disable=not progress)):
        base = greedy_generate(target, prompt, max_new_tokens, stop_repeat=stop_repeat) if baseline else None
        spec = speculative_generate(target, proposer, prompt, max_new_tokens, stop_repeat=stop_repeat)
        for budget, gens in trees.items():
            gens.append(ddtree_generate(target, proposer, prompt, max_new_tokens, budget, stop_repeat=stop_repeat))
        for name, gens in peer_runs.items():
            if not peer_prompts or i < peer_prompts:
                gens.append(peer_generate(name, target, prompt, max_new_tokens, prompt_lookup_tokens))
        specs.append(spec)
        bases.append(base)
        records.append(generation_record(i, spec, base))
    result = {
        "summary": summarize(specs, bases if baseline else None, proposer.block_size),
        "prompts": records,
        "cache_mode": target.cache_mode,
        "generations": specs,
    }
    if trees:
        result["ddtree"] = {
            str(b): summarize(g, bases if baseline else None, proposer.block_size) for b, g in trees.items()
        }
    if peer_runs:
        result["peers"] = {
            name: summarize_peer(g, bases[: len(g)] if baseline else None) for name, g in peer_runs.items()
        }
    return result


def summarize_peer(gens: Sequence[Generation], bases: Sequence[Generation] | None) -> dict:
    """A peer baseline's speed (whole calls, wall clock) and, against target-only greedy decoding, its
    lossless check and wall-clock speed-up."""
    out = {"prompts": len(gens), "new_tokens": sum(len(g.tokens) for g in gens), "spec": _speed(gens)}
    if bases is not None:
        out.update(against_baseline(gens, bases, out["spec"]))
    return out


# ----------------------------------------------------------------------------------------------
# CLI


def _print_summary(result: dict) -> None:
    s = result["summary"]
    B = len(s["tau_histogram"])
    print(
        f"prompts {s['prompts']}, rounds {s['rounds']}, new tokens {s['new_tokens']}, target cache: "
        f"{result['cache_mode']}"
    )
    print(
        f"τ (mean over prompts of per-prompt means, bonus included) = {s['tau']:.3f}   pooled over rounds "
        f"{s['tau_pooled']:.3f}"
    )
    width = max(s["tau_histogram"]) or 1
    for tau in range(1, B + 1):
        count = s["tau_histogram"][tau - 1]
        print(f"  τ={tau:>2} {count:>6} {'#' * math.ceil(40 * count / width) if count else ''}")
    spec = s["spec"]
    print(
        f"speculative: {spec['wall_s']:.2f} s wall ({spec['prefill_s']:.2f} prefill), "
        f"{spec['decode_tokens_per_s']:.1f} tok/s decode "
        f"(draft {spec['draft_s']:.2f} s, verify {spec['verify_s']:.2f} s, rollback {spec['rollback_s']:.2f} s)"
    )
    if "baseline" in s:
        base = s["baseline"]
        print(
            f"target only: {base['wall_s']:.2f} s wall ({base['prefill_s']:.2f} prefill), "
            f"{base['decode_tokens_per_s']:.1f} tok/s decode"
        )
        print(
            f"speed-up {s['speedup']:.2f}x decode, {s['speedup_wall']:.2f}x wall;  lossless: {s['lossless']}"
            + ("" if s["lossless"] else f" (prompts {s['mismatched_prompts']} differ)")
        )
        for m in s.get("mismatches", []):
            print(
                f"  prompt {m['prompt']}: first differs at generated token {m['first_mismatch']}; the target's "
                f"top-1 minus top-2 logit there: {m.get('margin', float('nan')):.4g} (target-only decoding), "
                f"{m.get('other_margin', float('nan')):.4g} (speculative verify)"
            )
    for budget, tree in result.get("ddtree", {}).items():
        line = f"DDTree budget {budget}: τ {tree['tau']:.3f}, {tree['spec']['decode_tokens_per_s']:.1f} tok/s decode"
        if "speedup" in tree:
            line += f", speed-up {tree['speedup']:.2f}x, lossless: {tree['lossless']}"
        print(line)
    for name, peer in result.get("peers", {}).items():
        line = f"{name} (transformers): {peer['spec']['wall_s']:.2f} s wall"
        if "speedup_wall" in peer:
            line += f", speed-up {peer['speedup_wall']:.2f}x wall against target-only greedy"
            line += f", lossless: {peer['lossless']}"
        print(line)
    a = result.get("agreement")
    if a and a.get("online_tau") is not None:
        print(
            f"agreement over {a['prompts']} greedy continuations ({a['rounds']} rounds, {a['anchors']} anchors, "
            f"features {a['feature_dtype']}):"
        )
        print(
            f"  online τ {a['online_tau']:.3f} | offline τ at the online round starts {a['offline_tau_at_rounds']:.3f} "
            f"({a['round_mismatches']} of {a['rounds']} rounds differ)"
        )
        print(f"  offline τ over the online schedule replayed offline {a['offline_tau_chained']:.3f}")
        print(
            f"  offline τ over all anchors {a['offline_tau_all']:.3f} (x{a['ratio_all']:.3f}), "
            f"harmonic {a['offline_tau_harmonic']:.3f} (x{a['ratio_harmonic']:.3f})"
        )
        if "offline_tau_corpus" in a:
            print(
                f"  offline τ on the corpus responses of the same prompts: all anchors {a['offline_tau_corpus']:.3f}, "
                f"online schedule {a['offline_tau_corpus_chained']:.3f}"
            )


def maybe_static(args, target: SpecTarget, prompts, block_size: int) -> tuple[SpecTarget, str | None]:
    """The target on a static cache with CUDA graphs (train.serve.static_target) where `static_cache`
    asks for it and it can work; else the target as given (note None)."""
    from train.serve.static_target import StaticSpecTarget, static_cache_length

    wanted = args.static_cache == "on" or (args.static_cache == "auto" and target.device.type == "cuda")
    if not wanted:
        return target, None
    layer_types = getattr(target.target.text_config, "layer_types", None) or []
    if args.budgets or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        if args.static_cache == "on":
            raise ValueError("static_cache=on: not with DDTree budgets or a target with recurrent layers")
        return target, None
    limit = int(getattr(target.target.text_config, "max_position_embeddings", 1 << 20))
    length = static_cache_length(prompts, args.max_new_tokens, block_size, limit)
    static = StaticSpecTarget(
        target.target, target.layer_ids, sorted(target.stop_ids), max_len=length, graph_sizes=(1, block_size)
    )
    return static, f"{static.graph_note} ({length} positions)"


def proposer_for(drafter: nn.Module, target: SpecTarget, context_cache: bool) -> tuple[Proposer, str | None]:
    """The drafter on a slot cache with its rounds as a CUDA graph (train.serve.static_drafter) beside a
    static-cache target; else on a dynamic cache. (proposer, note: how the static one runs, or None)."""
    from train.serve.static_drafter import StaticDFlashProposer
    from train.serve.static_target import StaticSpecTarget

    if isinstance(target, StaticSpecTarget) and context_cache:
        static = StaticDFlashProposer(drafter, target, max_len=target.max_len)
        return static, static.graph_note
    return DFlashProposer(drafter, target, context_cache=context_cache), None


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_specdecode_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        return usage_error("train.specdecode", exc)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from train.serve.export import load_exported

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    try:
        drafter = load_exported(args.drafter, dtype=dtype, device=args.device, trust_remote_code=args.trust_remote_code)
        target_obj = load_target(args.target, dtype=args.dtype, device=args.device)
        target = SpecTarget(target_obj, drafter.target_layer_ids, stop_token_ids(target_obj))
        static_note = None
        if target_obj.hidden_size != int(drafter.config.hidden_size):
            raise ValueError(
                f"drafter hidden_size {drafter.config.hidden_size} != target hidden_size {target_obj.hidden_size}"
            )
        samples = None
        if args.data:
            prompts, samples = prompts_from_shards(args.data, args.num_prompts or None)
        else:
            path = args.prompts or DEFAULT_PROMPTS
            if not Path(path).is_file():
                raise ValueError(f"prompts file '{path}' does not exist (give --prompts or --data)")
            prompts = prompts_from_jsonl(path, target_obj.tokenizer, args.num_prompts or None, thinking=args.thinking)
        target, static_note = maybe_static(args, target, prompts, int(drafter.block_size))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if static_note:
        print(f"target: static KV cache, CUDA graphs {static_note}")
    proposer, drafter_note = proposer_for(drafter, target, not args.no_context_cache)
    if drafter_note:
        print(f"drafter: slot cache, CUDA graph {drafter_note}")
    try:
        result = run_benchmark(
            target,
            proposer,
            prompts,
            args.max_new_tokens,
            baseline=not args.no_baseline,
            progress=True,
            tree_budgets=args.budgets,
            stop_repeat=args.stop_repeat,
            peers=PEERS if args.peer_baselines else (),
            prompt_lookup_tokens=args.prompt_lookup_tokens,
            peer_prompts=args.peer_prompts,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    generations = result.pop("generations")
    if args.agreement:  # on the very rounds the benchmark decoded, not a second decoding
        from train.serve.agreement import agreement, corpus_offline_tau  # it builds on this module

        result["agreement"] = agreement(
            target,
            drafter,
            prompts,
            args.max_new_tokens,
            feature_dtype=torch.bfloat16 if args.agreement_bf16 else None,
            progress=True,
            generations=generations,
            stop_repeat=args.stop_repeat,
        )
        if samples is not None:
            result["agreement"].update(corpus_offline_tau(drafter, target, samples))
    import transformers

    result["config"] = {
        "target": str(args.target),
        "drafter": str(args.drafter),
        "prompts": args.prompts or (None if args.data else DEFAULT_PROMPTS),
        "data": args.data,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "thinking": args.thinking,
        "block_size": proposer.block_size,
        "context_cache": not args.no_context_cache,
        "tree_budgets": args.budgets,
        "stop_repeat": args.stop_repeat,
        "peer_baselines": list(PEERS) if args.peer_baselines else [],
        "static_cache": static_note,
        "static_drafter": drafter_note,
        "prompt_lookup_tokens": args.prompt_lookup_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    _print_summary(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"results: {args.out}")
    summaries = [result["summary"], *result.get("ddtree", {}).values()]  # the peers' own checks are reported only
    if any(not s.get("lossless", True) for s in summaries):
        print("error: speculative output differs from target-only greedy decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
