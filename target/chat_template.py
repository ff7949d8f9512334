"""`chat_template = FILE`: a chat template from a Jinja file, for a target whose tokenizer has none
(a base model) or whose own is to be replaced. Regeneration, extraction and speculative decoding
take the key; the file's template replaces the loaded tokenizer's (`with_chat_template`), so it is
what renders every chat and what their provenance hashes (`chat_template_hash`). The file is read
and its Jinja syntax checked when the config is validated (`check_chat_template`), before anything
loads.

A base model needs no template at all when its corpus is plain text (`{"text": ...}` records,
docs/corpus.md "Targets without a chat template").
"""

from __future__ import annotations

import copy
from pathlib import Path

import jinja2

from common.config import fail

__all__ = [
    "KEY",
    "read_chat_template",
    "check_chat_template",
    "with_chat_template",
    "NO_TEMPLATE_HINT",
]

KEY = "chat_template"
NO_TEMPLATE_HINT = 'set chat_template=FILE (a Jinja chat template), or give plain {"text": ...} records'


def read_chat_template(path: str | Path) -> str:
    """The template text of `path`; ConfigError naming the key unless it is a readable, non-empty
    Jinja template."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(KEY, f"cannot read '{path}': {exc}")
    if not text.strip():
        fail(KEY, f"'{path}' is empty")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        fail(KEY, f"'{path}' line {exc.lineno}: not a Jinja template: {exc.message}")
    return text


def check_chat_template(path: str | None) -> None:
    """A config's `check`: the file named by `chat_template`, if any, is a usable template."""
    if path is not None:
        read_chat_template(path)


def with_chat_template(tokenizer, path: str | None):
    """`tokenizer` itself when `path` is None, else a shallow copy of it that carries the file's
    template (the caller's tokenizer keeps its own)."""
    if path is None:
        return tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = read_chat_template(path)
    return tokenizer
