"""Agreement of offline chain τ with online τ (`python -m train.serve.specdecode --agreement`): the
target's own greedy continuations run once teacher-forced, the drafter's blocks drafted at every
response anchor as offline evaluation drafts them, and τ compared at the online round starts, over
the online schedule replayed offline, and over all anchors.

Why: offline chain τ is computed over teacher-forced data, with an anchor at every position; online
rounds start only where the previous round stopped, and the data tokens are the target's own greedy
continuation. So the comparison is built on that continuation: the generated sequences are run
through the target in one teacher-forced forward (what extraction stores: tap features, greedy
top-1), the drafter proposes at every anchor of the response with the training mask (many blocks in
one forward), and chain τ is computed with `train.eval.acceptance`. Offline τ at the anchors where
online rounds started equals the online τ round by round (exactly, up to floating-point argmax flips
between the incremental and the one-pass forward); offline τ over all anchors is a different average
(see `agreement`).

It checks the generations `train.serve.decoding` decoded (or decodes them itself); the decoding
loop knows nothing of this check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from train.alignment import block_input_ids, block_positions, draft_label_rows
from train.attention import MaskRule, build_layer_masks
from train.eval.acceptance import chain_blocks
from train.serve.decoding import DFlashProposer, Generation, speculative_generate
from train.serve.prompts import first_response
from train.serve.results import mean_or_none
from train.serve.spec_target import SpecTarget


@torch.inference_mode()
def offline_block_drafts(
    drafter: nn.Module,
    target: SpecTarget,
    ids_T: torch.Tensor,
    features_TF: torch.Tensor,
    anchors: Sequence[int],
    *,
    chunk: int = 32,
) -> torch.Tensor:
    """Drafts [N, B-1] at each anchor, computed as offline evaluation does: teacher-forced features,
    many blocks in one forward under the training mask (context strictly before each anchor, own
    block, no other block; each layer type with its own window and in-block causality); a DFlash2
    drafter's are its selector's walk, as online."""
    B = int(drafter.block_size)
    mask_id = int(drafter.mask_token_id)
    rules = {t: MaskRule(window=w, causal=c) for t, (w, c) in drafter.attention_rules.items()}
    out = []
    for start in range(0, len(anchors), chunk):
        part = torch.tensor(list(anchors[start : start + chunk]), dtype=torch.long)
        N = part.numel()
        S = int(part.max())  # context needed: positions < the last anchor
        block_ids_NQ = block_input_ids(ids_T[part], B, mask_id)
        positions = torch.cat((torch.arange(S), block_positions(part, B).reshape(-1)))[None]
        masks = build_layer_masks("sdpa", part[None], torch.ones(1, N, dtype=torch.bool), S, B, rules)
        noise_1QD = target.embed(block_ids_NQ.reshape(1, -1).to(target.device))
        hidden_1QD = drafter(
            position_ids=positions.to(target.device),
            noise_embedding=noise_1QD,
            target_hidden=features_TF[None, :S],
            attention_mask={t: m.to(target.device) for t, m in masks.items()},
        )
        hidden_NLD = hidden_1QD.view(N, B, -1)[:, 1:]
        if hasattr(drafter, "candidate_selector"):  # DFlash2: the selector's walk after each block's anchor
            anchors_N = block_ids_NQ[:, 0].to(target.device)
            out.append(drafter.propose(hidden_NLD, anchors_N, target.target.lm_head)[0].cpu())
        else:
            out.append(target.draft_logits(hidden_NLD).argmax(-1).cpu())
    return torch.cat(out) if out else torch.zeros(0, B - 1, dtype=torch.long)


def _chain(drafts_ND: torch.Tensor, greedy_T: torch.Tensor, anchors: Sequence[int], end: int):
    """train.eval.acceptance chain blocks: y_k = the greedy token for a+k (= greedy_T[a+k-1], the
    label rows of `train.alignment`), valid length = the tokens left."""
    D = drafts_ND.shape[1]
    anchors_N = torch.tensor(list(anchors), dtype=torch.long)
    rows_ND = draft_label_rows(anchors_N, D + 1).clamp(max=len(greedy_T) - 1)
    target_ND = greedy_T[rows_ND]
    valid_N = (end - 1 - anchors_N).clamp(max=D)
    return chain_blocks(drafts_ND, target_ND, valid_N)


def chained_anchors(tau_N: torch.Tensor, first: int, end: int) -> list[int]:
    """The anchors online decoding would start rounds at, replayed offline: the first response
    position, then each next one `τ` tokens later (`tau_N[i]` is the τ of anchor `first + i`), while
    a token is left to produce. With offline τ equal to online τ per anchor, these are the online
    round starts exactly."""
    anchors, a = [], first
    while a < end - 1:
        anchors.append(a)
        a += int(tau_N[a - first])
    return anchors


def agreement(
    target: SpecTarget,
    drafter: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    feature_dtype: torch.dtype | None = None,
    progress: bool = False,
    generations: Sequence[Generation] | None = None,
    stop_repeat: int = 0,
) -> dict:
    """Online τ against offline chain τ on the target's own greedy continuations of `prompts`.

    Per prompt: speculative decoding gives the continuation and the online rounds; the whole
    sequence is run once through the target, teacher-forced (tap features, greedy top-1, as
    extraction stores them; `feature_dtype=torch.bfloat16` rounds the features as the shards do);
    the drafter proposes at every response anchor with the training mask; `train.eval.acceptance`
    gives chain τ per anchor with y = the greedy top-1 and valid length = the tokens left.

    Reported, each as the mean over prompts of the per-prompt means (docs/dflash.md "Acceptance length (τ)"):
      online_tau               the speculative-decoding τ
      offline_tau_at_rounds    offline τ at the anchors where online rounds started. Equal to
                               online_tau round by round, unless floating point flips an argmax
                               between the incremental (cached) and the one-pass forward
                               (`round_mismatches` counts the rounds where it differs)
      offline_tau_chained      offline τ over the anchors of the online schedule replayed offline
                               (`chained_anchors`: start at the response, jump by τ). Needs no online
                               decoding, only teacher-forced greedy data; equal to online_tau when
                               offline_tau_at_rounds is
      offline_tau_all          offline τ over every anchor (what offline evaluation reports). A
                               different average: online rounds skip the anchors inside accepted
                               spans, so a stretch the drafter gets right counts once per round
                               online but once per token here (usually higher than online τ)
      offline_tau_harmonic     1 / mean(1/τ) over every anchor: the tokens per round if each position
                               started a round with probability 1/τ there (a rough predictor; it
                               overweights the low-τ anchors at the end of accepted stretches)
    plus `greedy_mismatches`: continuation tokens where the teacher-forced greedy top-1 differs from
    the decoded token (0 unless floating point differs between the cached and one-pass forward).
    """
    from tqdm.auto import tqdm

    B = int(drafter.block_size)
    if generations is not None and len(generations) != len(prompts):
        raise ValueError(f"agreement: {len(generations)} generations for {len(prompts)} prompts")
    proposer = DFlashProposer(drafter, target) if generations is None else None
    per_prompt = []
    for index, prompt in enumerate(tqdm(prompts, desc="agreement", unit="prompt", disable=not progress)):
        gen = (
            speculative_generate(target, proposer, prompt, max_new_tokens, stop_repeat=stop_repeat)
            if generations is None
            else generations[index]
        )
        if not gen.rounds:
            continue
        ids_T = torch.tensor(list(prompt) + gen.tokens, dtype=torch.long)
        end = len(ids_T)
        greedy_T, features_TF = target.teacher_forced(ids_T[None])
        greedy_T = greedy_T.cpu()
        if feature_dtype is not None:
            features_TF = features_TF.to(feature_dtype)
        P = len(prompt)
        anchors = list(range(P, end - 1))  # every response position with a token after it
        offline_N = _chain(
            offline_block_drafts(drafter, target, ids_T, features_TF, anchors), greedy_T, anchors, end
        ).tau_N
        starts = [r.start for r in gen.rounds]
        at_rounds = offline_N[torch.tensor(starts) - P]
        chained = offline_N[torch.tensor(chained_anchors(offline_N, P, end)) - P]
        online = torch.tensor(gen.taus)
        per_prompt.append(
            {
                "index": index,
                "rounds": len(starts),
                "anchors": len(anchors),
                "online_tau": float(online.double().mean()),
                "offline_tau_at_rounds": float(at_rounds.double().mean()),
                "offline_tau_chained": float(chained.double().mean()),
                "offline_tau_all": float(offline_N.double().mean()),
                "offline_tau_harmonic": float(1.0 / (1.0 / offline_N.double()).mean()),
                "round_mismatches": int((at_rounds != online).sum()),
                "greedy_mismatches": int((greedy_T[P - 1 : end - 1] != ids_T[P:end]).sum()),
            }
        )
    keys = ("online_tau", "offline_tau_at_rounds", "offline_tau_chained", "offline_tau_all", "offline_tau_harmonic")
    result = {k: mean_or_none([p[k] for p in per_prompt]) for k in keys}
    result.update(
        prompts=len(per_prompt),
        rounds=sum(p["rounds"] for p in per_prompt),
        anchors=sum(p["anchors"] for p in per_prompt),
        round_mismatches=sum(p["round_mismatches"] for p in per_prompt),
        greedy_mismatches=sum(p["greedy_mismatches"] for p in per_prompt),
        feature_dtype=str(feature_dtype or "model").replace("torch.", ""),
        block_size=B,
        per_prompt=per_prompt,
    )
    if result["online_tau"] is not None:
        for key in ("offline_tau_at_rounds", "offline_tau_chained", "offline_tau_all", "offline_tau_harmonic"):
            result[f"ratio_{key.removeprefix('offline_tau_')}"] = result[key] / result["online_tau"]
    return result


def corpus_offline_tau(drafter: nn.Module, target: SpecTarget, samples: Sequence[dict]) -> dict:
    """Offline chain τ on the corpus responses of shard samples (stored bf16 features and target
    top-1): over every position of the first response with a token after it (what offline
    evaluation reports on held-out shards) and over the chained online schedule."""
    D = int(drafter.block_size) - 1
    all_means, chained_means = [], []
    for sample in samples:
        ids_T, mask_T = sample["input_ids"].long(), sample["loss_mask"].bool()
        start, end = first_response(mask_T)
        anchors = list(range(start, end - 1))
        if not anchors:
            continue
        features_TF = sample["hidden"].to(target.embed_VD.dtype).to(target.device)
        drafts_ND = offline_block_drafts(drafter, target, ids_T, features_TF, anchors)
        tau_N = _chain(drafts_ND[:, :D], sample["topk_ids"][:, 0].long(), anchors, end).tau_N
        all_means.append(float(tau_N.double().mean()))
        chained_means.append(float(tau_N[torch.tensor(chained_anchors(tau_N, start, end)) - start].double().mean()))
    return {
        "offline_tau_corpus": mean_or_none(all_means),
        "offline_tau_corpus_chained": mean_or_none(chained_means),
        "samples": len(all_means),
    }
