"""How a target's answers end, checked before any is generated, and how much of them survived.

`check_answer_end` runs before the first answer: a target that declares no end-of-answer token
(no `eos_token_id` in its generation config, and no `eos_token` in its tokenizer) would run every
answer to `max_new_tokens`, and the decode/re-encode round trip then cuts most of each away; it is
refused in one line that names the file and the token to set (the one the chat template ends an
assistant turn with, when it has one). A template whose end-of-turn token does not end generation
is warned about: answers run past it.

After the run, `round_trip_words` / `round_trip_warning` say how many answer tokens the round
trip (`conversation.fitted_length`) cut away, and warn when that is most of them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from target.checkpoint import text_config

log = logging.getLogger(__name__)

MOST = 0.5  # a round trip that cuts more than this share of the answer tokens is warned about
_MARK = "ANSWER-END-PROBE"
GENERATION_CONFIG = "generation_config.json"


def _ids(value) -> set[int]:
    return {int(i) for i in (value if isinstance(value, (list, tuple)) else [value]) if i is not None}


def declared_stop_ids(target_dir: str, tokenizer) -> tuple[set[int], str]:
    """(ids that end an answer, the file they come from): the generation config's eos_token_id
    (generation_config.json, or config.json without one, as transformers reads them) and the tokenizer's."""
    generation = Path(target_dir, GENERATION_CONFIG)
    if generation.is_file():
        try:
            source, eos = generation, json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        except ValueError as exc:
            raise ValueError(f"target: '{generation}' is not valid JSON: {exc}") from None
    else:
        source, eos = Path(target_dir, "config.json"), text_config(target_dir).get("eos_token_id")
    ids = _ids(eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids, str(source)


def template_end_token(tokenizer, template_kwargs: dict) -> tuple[str, int] | None:
    """(token, id) the chat template writes right after an assistant answer, if it is a special token."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    except Exception:  # noqa: BLE001 - a template may raise anything; then there is nothing to suggest
        return None
    if _MARK not in text:
        return None
    after = tokenizer(text.split(_MARK, 1)[1].lstrip(" "), add_special_tokens=False)["input_ids"]
    if not after:
        return None
    token = tokenizer.convert_ids_to_tokens(after[0])
    special = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    return (token, int(after[0])) if token in special else None


def check_answer_end(target_dir: str, tokenizer, template_kwargs: dict, max_new_tokens: int) -> set[int]:
    """The target's end-of-answer ids; ValueError (one line: the file, what to set) when it has none,
    a warning when the chat template's end-of-turn token is not one of them."""
    ids, source = declared_stop_ids(target_dir, tokenizer)
    end = template_end_token(tokenizer, template_kwargs)
    if not ids:
        hint = f": the chat template ends an answer with {end[0]!r}, id {end[1]}" if end else ""
        raise ValueError(
            f"target: '{target_dir}' declares no end-of-answer token (no eos_token_id in '{source}', no eos_token "
            f"in the tokenizer), so every answer would run to max_new_tokens ({max_new_tokens}); set eos_token_id "
            f"in '{Path(target_dir, GENERATION_CONFIG)}' to the id of the token that ends an answer{hint}"
        )
    if end is not None and end[1] not in ids:
        log.warning(
            "the chat template ends an answer with %r (id %d), which does not end generation (end-of-answer ids %s "
            "from %s and the tokenizer): answers run past it; add %d to eos_token_id in %s",
            end[0],
            end[1],
            sorted(ids),
            source,
            end[1],
            Path(target_dir, GENERATION_CONFIG),
        )
    return ids


def round_trip_share(counts: dict) -> float:
    """The share of the answer tokens the decode/re-encode round trip cut away (0 when none was checked)."""
    return counts.get("round_trip_cut_tokens", 0) / max(counts.get("round_trip_tokens", 0), 1)


def round_trip_words(counts: dict) -> str:
    cut, checked = counts.get("round_trip_cut_tokens", 0), counts.get("round_trip_tokens", 0)
    return f"the round trip cut {cut:,} of {checked:,} answer tokens, {100 * round_trip_share(counts):.1f}%"


def round_trip_warning(counts: dict) -> str:
    return (
        f"the decode/re-encode round trip cut away most of the answers ({round_trip_words(counts)}): they do not "
        "render and tokenize back through the chat template as generated. Check that the target ends its answers "
        "(eos_token_id in generation_config.json: answers that run to max_new_tokens rarely survive) and that "
        "chat_template is the target's own"
    )
