"""The prompts of speculative decoding: chat records from JSONL rendered as the target renders
them, or the prompt side of each shard sample; and the stop tokens of a target.
"""

from __future__ import annotations

import json
import os

import torch

from shards import ShardDataset
from target.chat_template import NO_TEMPLATE_HINT
from target.load import Target


def first_response(loss_mask_T: torch.Tensor) -> tuple[int, int]:
    """(start, end) of the first run of response (loss) positions."""
    positions = loss_mask_T.nonzero().view(-1)
    if positions.numel() == 0:
        return len(loss_mask_T), len(loss_mask_T)
    start = int(positions[0])
    end = start
    while end < len(loss_mask_T) and bool(loss_mask_T[end]):
        end += 1
    return start, end


def prompts_from_jsonl(
    path: str | os.PathLike, tokenizer, limit: int | None, *, thinking: bool = False
) -> list[list[int]]:
    """The first user turn (with any system turn before it) of each `{"messages": [...]}` record,
    rendered with the chat template and the generation prompt; a `{"text": ...}` record is a prompt
    as given (base models: tokenized with the tokenizer's special tokens). Other records are skipped."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"'{path}' line {line_no}: not JSON ({exc})") from None
            prompt = _record_prompt(record, tokenizer, thinking, f"'{path}' line {line_no}")
            if prompt is not None:
                prompts.append(prompt)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"'{path}' holds no record with a user message or a text")
    return prompts


def _record_prompt(record, tokenizer, thinking: bool, where: str) -> list[int] | None:
    """One record's prompt ids (see `prompts_from_jsonl`), None when it has none."""
    if isinstance(record, dict) and isinstance(record.get("text"), str) and record["text"]:
        return tokenizer(record["text"])["input_ids"]
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list):
        return None
    user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
    if user is None:
        return None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: a chat record, but the target's tokenizer has no chat template; {NO_TEMPLATE_HINT}")
    text = tokenizer.apply_chat_template(
        messages[: user + 1], tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompts_from_shards(root: str, limit: int | None) -> tuple[list[list[int]], list[dict]]:
    """Prompts (the tokens before each sample's first response) and the samples themselves."""
    dataset = ShardDataset(root)
    prompts, samples = [], []
    for i in range(len(dataset)):
        sample = dataset.torch(i)
        start, _ = first_response(sample["loss_mask"])
        if 0 < start < len(sample["input_ids"]) - 1:
            prompts.append(sample["input_ids"][:start].tolist())
            samples.append(sample)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"'{root}': no sample with a prompt and a response")
    return prompts, samples


def stop_token_ids(target: Target) -> list[int]:
    """EOS ids from the generation config and the tokenizer."""
    found: set[int] = set()
    generation = getattr(target.model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    for value in eos if isinstance(eos, (list, tuple)) else [eos]:
        if value is not None:
            found.add(int(value))
    if target.tokenizer is not None and target.tokenizer.eos_token_id is not None:
        found.add(int(target.tokenizer.eos_token_id))
    return sorted(found)
