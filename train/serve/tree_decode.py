"""DDTree verification (stretch goal, docs/dflash.md "DDTree"; `--tree-budgets 8,32`): the drafter's
top-k per depth gives a best-first tree of `budget` nodes (`train.eval.ddtree.build_ddtree`; a DFlash2
drafter's tree is the conditional one of its selector's q over the candidates, as offline evaluation
scores it: `train.eval.ddtree.build_selector_ddtree`); the target verifies [anchor | nodes] in one
forward with an ancestor-only mask and positions anchor + depth, walks its greedy tokens down the
tree, and the cache keeps the accepted path only (`ddtree_generate`, the tree counterpart of
`train.serve.decoding.speculative_generate`).

Shape legend: T tokens, M tree nodes, D draft depth, V vocabulary, K top-k.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from train.eval.ddtree import DDTree, build_ddtree, build_selector_ddtree, draft_topk
from train.eval.selector import lattice_of, selector_logq
from train.serve.decoding import DFlashProposer, Ending, Generation, Round, prompt_tensor
from train.serve.spec_target import SpecTarget, cache_mode_for


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
    child = {(p, t): i for i, (p, t) in enumerate(zip(parent_M.tolist(), token_M.tolist(), strict=True))}
    path, node = [], -1
    while (node, greedy[node + 1]) in child:
        node = child[(node, greedy[node + 1])]
        path.append(node)
    return path


@torch.inference_mode()
def round_tree(
    proposer: DFlashProposer, new_features_1SF: torch.Tensor, anchor_token: int, anchor: int, budget: int
) -> DDTree:
    """The round's tree of `budget` nodes: of the drafter's top-k per depth, or a DFlash2 drafter's conditional tree."""
    if not getattr(proposer, "selector", False):
        logits_DV = proposer.draft_logits(new_features_1SF, anchor_token, anchor).float().cpu()
        lp_1DK, ids_1DK = draft_topk(logits_DV[None], min(budget, logits_DV.shape[-1]))
        return build_ddtree(lp_1DK[0], ids_1DK[0], budget)
    hidden_1DH = proposer.draft_hidden(new_features_1SF, anchor_token, anchor)
    drafter, selector = proposer.drafter, proposer.drafter.candidate_selector
    unary_1Dk, candidates_1Dk = (
        drafter.compute_logits(hidden_1DH, proposer.target.target.lm_head).float().topk(selector.top_k, dim=-1)
    )
    anchor_1 = torch.tensor([anchor_token], device=hidden_1DH.device)
    logq_1DPk = selector_logq(selector, hidden_1DH, unary_1Dk, candidates_1Dk, anchor_1)
    return build_selector_ddtree(lattice_of(logq_1DPk.cpu(), candidates_1Dk.cpu()), budget)


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
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    started = time.perf_counter()
    ending = Ending(target.stop_ids, max_new_tokens, stop_repeat)
    proposer.reset()
    logits, features_1TF, cache = target.forward(
        prompt_tensor(prompt_ids, target.device), None, taps=True, last_only=True
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
        tree = round_tree(proposer, new_features_1SF, tokens[-1], anchor, budget)
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
