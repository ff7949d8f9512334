"""The target-regenerated corpus (docs/dflash.md, "Training data"): the corpus prompts answered by the
tiny target itself, through the `local` backend of `python -m extract.regenerate`.

DFlash trains on the target's own answers to user prompts. Offline τ equals online greedy τ only
where the data tokens are the target's greedy continuation, and the tiny target's own answers
(generic, repetitive) are what a drafter can learn, unlike documentation text the target predicts
poorly. So every user turn is re-answered by the saved target, greedily, on the prompt rendered
exactly as `train.serve.prompts.prompts_from_jsonl` renders it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from extract.regenerate.local import answer_stop_ids  # noqa: F401 - the tiny build's stop ids are the regeneration's
from recipes.tiny.compute import build_compute
from recipes.tiny.config import TinyConfig
from recipes.tiny.target import (
    EVAL_BATCH_TOKENS,
    assistant_masks,
    encode_records,
    length_summary,
    next_token_accuracy,
    torch_threads,
)

REGEN_FILES = {"train": "corpus/train_regen.jsonl", "heldout": "corpus/heldout_regen.jsonl"}


def answer_prompt(tokenizer, messages: list[dict]) -> str:
    """The conversation so far as the target sees it before it answers: the chat template with the
    generation prompt, non-thinking (train.serve.specdecode's rendering of prompts)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def regenerate_records(
    model,
    tokenizer,
    records: list[dict],
    max_new_tokens: int,
    batch_size: int = 64,
    *,
    stop_repeat: int = 0,
    progress: bool = False,
) -> tuple[list[dict], dict[str, Any]]:
    """(records, stats): every record's user turns answered by `model`'s greedy decoding, through
    the `local` backend of `python -m extract.regenerate` (`extract.regenerate.local`, one window
    holding all records, thinking disabled as `answer_prompt` renders).

    A record keeps its user (and system) turns; each assistant answer is replaced, turn by turn,
    by the target's greedy continuation of the conversation so far (earlier answers already
    regenerated), cut before the stop token, at `max_new_tokens`, or (`stop_repeat` > 0) where it
    starts looping (`RepeatWatch`). Records without a user turn
    are skipped; a record with an answer that would be empty is dropped; both are counted. An
    answer whose text would tokenize differently is cut to its longest prefix that tokenizes back
    to the same ids, so extraction reads exactly the tokens the target generated.
    """
    from tqdm.auto import tqdm

    from extract.corpus.reading import RawRecord
    from extract.regenerate.conversation import EMPTY_ANSWER, NO_USER_TURN, NOT_A_CHAT, Conversation, Renderer
    from extract.regenerate.local import LocalGenerator, answer_window

    no_thinking = {"enable_thinking": False}
    renderer = Renderer(tokenizer, "disable", no_thinking, no_thinking)
    conversations = [
        Conversation(RawRecord(i, f"record {i}", record), renderer, at_cap="keep") for i, record in enumerate(records)
    ]
    generator = LocalGenerator(model, tokenizer, max_new_tokens, batch_size, stop_repeat=stop_repeat)
    with tqdm(desc="regenerate answers", unit="prompt", disable=not progress, dynamic_ncols=True) as bar:
        answer_window(conversations, generator, on_batch=bar.update)
    outcomes = [c.outcome for c in conversations]
    reasons = [o.reason for o in outcomes]
    stats: dict[str, Any] = {
        "records_in": len(records),
        "skipped_no_user_turn": sum(r in (NOT_A_CHAT, NO_USER_TURN) for r in reasons),
        "dropped_empty_answer": reasons.count(EMPTY_ANSWER),
        "dropped_no_round_trip": sum(r not in (None, NOT_A_CHAT, NO_USER_TURN, EMPTY_ANSWER) for r in reasons),
        "answers": sum(o.stats["answers"] for o in outcomes),
        "answers_at_cap": sum(o.stats["at_cap"] for o in outcomes),
        "answers_cut_at_repeat": sum(o.stats["at_repeat"] for o in outcomes),
        "answers_cut_to_round_trip": sum(o.stats["cut"] for o in outcomes),
    }
    lengths = [n for c in conversations for n in c.answer_lengths]
    out = [o.record for o in outcomes if o.record is not None]
    stats.update(records_out=len(out), answer_tokens=sum(lengths), answer_length=quantiles(lengths))
    return out, stats


def quantiles(values: list[int]) -> dict[str, int]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        name: ordered[round(q * (len(ordered) - 1))]
        for name, q in (("min", 0), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("max", 1))
    }


def greedy_answers(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int,
    stop_ids: set[int],
    pad_id: int,
    stop_repeat: int = 0,
) -> list[tuple[list[int], str]]:
    """(tokens, how the answer ended: "stop", "repeat" or "cap") of greedy decoding per prompt
    (`extract.regenerate.local.generate_answers`, the regeneration's own batched decoding)."""
    from extract.regenerate.local import generate_answers

    return generate_answers(model, prompts, max_new_tokens, batch_size, stop_ids, pad_id, stop_repeat=stop_repeat)


def regenerate_corpus(
    target_dir: str | os.PathLike,
    train: list[dict],
    heldout: list[dict],
    cfg: TinyConfig | None = None,
    *,
    progress: bool = True,
) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train, heldout, report) of the target-regenerated corpus, answered by the target saved in
    `target_dir`, loaded as extraction and speculative decoding load it (float32 from the bf16 file).

    The report has counts and lengths per split, the time taken, and the share of held-out answer
    tokens that equal the target's teacher-forced greedy prediction (about 1: the data is the
    target's greedy continuation; the misses are the `<|im_end|>` closing answers cut at the cap
    or where they start repeating).
    """
    from target.load import load_target

    cfg = cfg or TinyConfig()
    with build_compute(cfg) as compute:
        target = load_target(str(target_dir), dtype="float32", device=compute.device)
        model, tokenizer = target.model, target.tokenizer
        started = time.perf_counter()
        splits = {}
        for name, records in (("train", train), ("heldout", heldout)):
            splits[name] = regenerate_records(
                model,
                tokenizer,
                records,
                cfg.regen_max_new_tokens,
                cfg.regen_batch,
                stop_repeat=cfg.regen_stop_repeat,
                progress=progress,
            )
        seconds = time.perf_counter() - started
        report = {
            "max_new_tokens": cfg.regen_max_new_tokens,
            "stop_repeat": cfg.regen_stop_repeat,
            "seconds": round(seconds, 1),
            "device": compute.device.type,
            "threads": torch_threads(),
            "files": dict(REGEN_FILES),
        }
        for name, (records, stats) in splits.items():
            report[name] = {**stats, "tokens": length_summary(encode_records(tokenizer, records, cfg.max_len))}
        report["heldout_answer_greedy_agreement"] = greedy_agreement(
            model, tokenizer, splits["heldout"][0], cfg.max_len
        )
    report["gpu_nondeterministic_ops"] = compute.nondeterministic_ops
    return splits["train"][0], splits["heldout"][0], report


def greedy_agreement(model, tokenizer, records: list[dict], max_len: int) -> float:
    """Share of answer tokens that equal the model's greedy next token given the data before them."""
    seqs = encode_records(tokenizer, records, max_len)
    masks = assistant_masks(tokenizer, records, max_len)
    correct, total = next_token_accuracy(model, seqs, EVAL_BATCH_TOKENS, tokenizer.pad_token_id, masks)
    return correct / max(1, total)
