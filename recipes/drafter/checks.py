"""The drafter command's checks of its first step: everything a later step would refuse, checked
before anything is written, so that a target or a setting that cannot work is refused in one line at
once rather than after regeneration and extraction have run.

    output folder   one folder, one target (`check_owner`): a folder that holds another target's
                    drafter is refused
    tokenizer       a chat template for chat prompts, a top-k within the vocabulary (`check_rendering`)
    mask token      the tokenizer's, a spare special token, or yours (`mask_token`): a tokenizer with
                    none to spare is refused naming `extract.mask_token_id`
    drafter         training's own derivation of the drafter's shape from the target's config
                    (`check_drafter_shape`, `train.prepare.build_drafter_config`)
    self-check      `target.self_check` on the target loaded as the steps load it (dtype, device,
                    attention kernel), reused while the target and those settings are unchanged
                    (`target_self_check`); a cache mismatch may be accepted (`allow_cache_mismatch`)
    serving engine  a hybrid target answered through a server: how to turn chunked prefill off

The architecture (`target.arch.check_architecture`) and the prompt sets' overlap
(`recipes.drafter.prompts`) are checked by the command itself before these.
"""

from __future__ import annotations

import gc
import json
import os

import torch
import transformers

from common.io import read_record
from extract.config import ExtractConfig
from extract.corpus.mask_token import mask_token_candidates
from recipes.drafter.config import DrafterRecipeConfig
from recipes.drafter.defaults import Derived
from shards.provenance import Provenance
from target.chat_template import with_chat_template
from target.checkpoint import text_config
from target.load import load_target
from target.self_check import ACCEPT_CACHE_KEY, SelfCheck, self_check
from train.config import TrainConfig
from train.prepare import build_drafter_config

RECORD = "drafter.json"


def recorded_owner(out: str) -> dict | None:
    """{path, digest} of the target whose drafter `out` holds (None: no drafter there). A record
    written before the digest was kept names the target as given, resolved here."""
    record = read_record(os.path.join(out, RECORD)) if os.path.isfile(os.path.join(out, RECORD)) else {}
    owner = record.get("target")
    if isinstance(owner, dict) and owner.get("path"):
        return owner
    given = (record.get("config") or {}).get("target")
    return {"path": os.path.realpath(given), "digest": None} if given else None


def check_owner(out: str, target: str, digest: str) -> None:
    """ValueError (one line) when `out` holds the drafter of another target: another directory whose
    content differs (the same target moved or copied elsewhere is the same target)."""
    owner = recorded_owner(out)
    if owner is None or owner["path"] == os.path.realpath(target):
        return
    if owner.get("digest") and owner["digest"] == digest:
        return
    raise ValueError(
        f"out '{out}' holds the drafter of another target, '{owner['path']}' (this one is "
        f"'{os.path.realpath(target)}'): give another out=DIR, or leave out empty for this target's own folder"
    )


def mask_token(cfg: DrafterRecipeConfig, tokenizer, extract_cfg: ExtractConfig, train_cfg: TrainConfig) -> Derived:
    """The mask token extraction will record, as a derived default; ValueError naming
    `extract.mask_token_id` when the tokenizer has none and no special token to spare."""
    vocab = len(tokenizer)
    given = extract_cfg.mask_token_id if extract_cfg.mask_token_id is not None else train_cfg.model.mask_token_id
    if given is not None:
        if not 0 <= int(given) < vocab:
            raise ValueError(
                f"config key 'extract.mask_token_id': {given} lies outside the vocabulary (0..{vocab - 1})"
            )
        return Derived("mask token", int(given), "your setting (extraction checks that the data never holds it)")
    if tokenizer.mask_token_id is not None:
        return Derived(
            "mask token", int(tokenizer.mask_token_id), f"the tokenizer's mask_token {tokenizer.mask_token!r}"
        )
    candidates = mask_token_candidates(with_chat_template(tokenizer, cfg.chat_template or None))
    if not candidates:
        raise ValueError(
            f"target '{cfg.target}': its tokenizer has no mask token and no special token to spare (each is its eos, "
            "bos, pad or unk token or written by the chat template): set extract.mask_token_id=ID to a token id of its "
            "vocabulary that your prompts and answers never hold"
        )
    token = tokenizer.convert_ids_to_tokens(candidates[0])
    return Derived(
        "mask token",
        candidates[0],
        f"{token!r}: the first special token neither the chat template nor the prompts use (extraction confirms "
        "it against the answers and records it)",
    )


def check_rendering(cfg: DrafterRecipeConfig, tokenizer, extract_cfg: ExtractConfig, lines: list[str]) -> None:
    """What regeneration and extraction would refuse about the target's tokenizer, now: chat prompts
    without a chat template (extraction would reject every record), a top-k wider than the vocabulary."""
    chats = any(isinstance(r, dict) and "messages" in r for r in map(_parsed, lines))
    if chats and not getattr(with_chat_template(tokenizer, cfg.chat_template or None), "chat_template", None):
        raise ValueError(
            f"target '{cfg.target}': its tokenizer has no chat template and your prompts are chats: set "
            'chat_template=FILE (a Jinja chat template; docs/corpus.md, "Targets without a chat template")'
        )
    if extract_cfg.topk > len(tokenizer):
        raise ValueError(
            f"config key 'extract.topk': {extract_cfg.topk} exceeds the target's vocabulary of {len(tokenizer)} tokens"
        )


def _parsed(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def check_drafter_shape(target: str, train_cfg: TrainConfig, taps: list[int], mask_token_id: int) -> None:
    """Training's derivation of the drafter from the target's config, now (ValueError naming the step)."""
    try:
        build_drafter_config(
            train_cfg, text_config(target), Provenance.from_dict({"taps": {"layer_ids": taps}}), mask_token_id
        )
    except (ValueError, KeyError, TypeError) as exc:
        detail = f"the target's config has no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"step 'drafter training': {detail}") from None


def check_key(target_digest: str, dtype: str, device: str, attention: str) -> dict:
    """What a self-check result depends on: reused while all of it is the same."""
    return {
        "target": target_digest,
        "dtype": dtype,
        "device": device,
        "attn_implementation": attention,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def target_self_check(cfg: DrafterRecipeConfig, out: str, key: dict) -> tuple[dict, bool]:
    """(the self-check's record, whether it was reused from OUT/drafter.json); ValueError (one line
    with the numbers) when it fails, unless only the cache differs and `allow_cache_mismatch` is set."""
    earlier = (
        read_record(os.path.join(out, RECORD)).get("self_check") if os.path.isfile(os.path.join(out, RECORD)) else None
    )
    if isinstance(earlier, dict) and earlier.get("key") == key:
        result, reused = SelfCheck.from_record(earlier), True
    else:
        device = key["device"]
        placement = {"device_map": "auto"} if device == "cuda" else {"device": device}
        target = load_target(
            cfg.target, dtype=key["dtype"], attn_implementation=key["attn_implementation"], **placement
        )
        try:
            result, reused = self_check(target), False
        finally:
            del target
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    refusal = result.refusal(accept_cache=cfg.allow_cache_mismatch)
    if refusal is not None:
        raise refusal
    return {**result.record(accept_cache=cfg.allow_cache_mismatch), "key": key}, reused


def accepted_line(record: dict) -> str | None:
    """The warning for a check that failed and was accepted (None: none was)."""
    if not record.get("accepted"):
        return None
    return f"accepted by {ACCEPT_CACHE_KEY}=true: {', '.join(record['accepted'])} outside its tolerance (see above)"
