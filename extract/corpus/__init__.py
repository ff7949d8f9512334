"""The corpus side of extraction, which regeneration reads through too: a corpus path -> records ->
tokenized samples with their loss masks, or counted rejects. No target forward happens here.

    files.py        a path (file, directory, glob, saved `datasets`) -> `CorpusFiles`, each file's format
    streams.py      a file's bytes: its extent, decompressed, hashed, decoded to lines; damage named
    reading.py      `CorpusFiles` -> `RawRecord`s with their positions; counting; the fingerprint
    regenerated.py  a regeneration's output directory read back (its data file, its provenance)
    records.py      record shapes (messages, ShareGPT, prompt/response, text, tokens) -> chats,
                    text or tokens; the reject reasons
    rendering.py    records -> tokens + loss mask through the target's chat template (`SampleBuilder`)
    windows.py      windows of this rank's samples, deduplicated, read ahead in a thread
    mask_token.py   the token DFlash fills draft positions with, chosen so the data never holds it

Each module's docstring is its reference; docs/corpus.md is the user's guide. The names below are the
corpus API in one place (`from extract import corpus as C`).
"""

from extract.corpus.files import CorpusFiles, data_kind, find_corpus
from extract.corpus.reading import RawRecord, corpus_fingerprint, count_records, iter_records, parse_json_line
from extract.corpus.records import (
    BAD_MESSAGE,
    BAD_TOKENS,
    BAD_TOOL_CALL,
    BAD_TURN_WEIGHT,
    CHAT_ROLES,
    DUPLICATE,
    EMPTY_CONVERSATION,
    EMPTY_SAMPLE,
    INVALID_JSON,
    INVALID_TEXT,
    MISSING_FIELD,
    NO_ASSISTANT_TURN,
    NON_STRING_CONTENT,
    NON_TEXT_CONTENT,
    NONFINITE_HIDDEN,
    NONFINITE_LOGITS,
    NOT_AN_OBJECT,
    SPAN_NOT_FOUND,
    TEMPLATE_ERROR,
    TOO_FEW_LOSS_TOKENS,
    TOO_LONG,
    TOOL_CALLS_NOT_RENDERED,
    UNKNOWN_ROLE,
    Chat,
    RecordError,
    parse_record,
)
from extract.corpus.rendering import (
    CONTROL_TOKEN_IN_CONTENT,
    HOLDS_MASK_TOKEN,
    Reject,
    SampleBuilder,
    SamplePolicy,
    Span,
    TokenizedSample,
    chat_spans,
    content_char_spans,
    control_token_ids,
    end_of_turn_token_ids,
    inserted_span,
    loss_mask_from_spans,
    render_chat,
    tool_call_spans,
)
from extract.corpus.streams import CorpusError

__all__ = [
    "BAD_MESSAGE",
    "BAD_TOKENS",
    "BAD_TOOL_CALL",
    "BAD_TURN_WEIGHT",
    "CHAT_ROLES",
    "CONTROL_TOKEN_IN_CONTENT",
    "DUPLICATE",
    "EMPTY_CONVERSATION",
    "EMPTY_SAMPLE",
    "HOLDS_MASK_TOKEN",
    "INVALID_JSON",
    "INVALID_TEXT",
    "MISSING_FIELD",
    "NONFINITE_HIDDEN",
    "NONFINITE_LOGITS",
    "NON_STRING_CONTENT",
    "NON_TEXT_CONTENT",
    "NOT_AN_OBJECT",
    "NO_ASSISTANT_TURN",
    "SPAN_NOT_FOUND",
    "TEMPLATE_ERROR",
    "TOOL_CALLS_NOT_RENDERED",
    "TOO_FEW_LOSS_TOKENS",
    "TOO_LONG",
    "UNKNOWN_ROLE",
    "Chat",
    "CorpusError",
    "CorpusFiles",
    "RawRecord",
    "RecordError",
    "Reject",
    "SampleBuilder",
    "SamplePolicy",
    "Span",
    "TokenizedSample",
    "chat_spans",
    "content_char_spans",
    "control_token_ids",
    "corpus_fingerprint",
    "count_records",
    "data_kind",
    "end_of_turn_token_ids",
    "find_corpus",
    "inserted_span",
    "iter_records",
    "loss_mask_from_spans",
    "parse_json_line",
    "parse_record",
    "render_chat",
    "tool_call_spans",
]
