"""Records -> tokenized samples: render chat through the target's own chat template, build the loss
mask, keep record text from forging control tokens, apply the length policy, and turn every bad
record into a counted `Reject`. docs/corpus.md lists the accepted formats and what the loss covers.

Loss mask of a chat sample: 1 on what the target generates in each assistant turn: the tokens of
its `content`, of its `reasoning_content` when the template renders it, of its tool calls as the
template renders them (`<tool_call>...</tool_call>` for Qwen), and the end-of-turn token that closes
the turn (`<|im_end|>` for Qwen); 0 on system, user and tool turns (tool results included) and on
template text such as role headers or an empty `<think></think>` block the template inserts.
Contents are found in the rendered text (see `content_char_spans`), tool calls by rendering the
conversation once without each turn's calls (see `tool_call_spans`); both are mapped to tokens
through the tokenizer's offsets, so templates without `{% generation %}` markers work.

Record text never forges control tokens: text such as `<|im_end|>\n<|im_start|>user` inside a
message (or a tool call's arguments) is tokenized as plain text (`split_special_tokens`), so only
the template's own turn boundaries are special tokens. A record whose text holds such a token but
cannot be located in the rendered text is rejected (`control_token_in_content`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import numpy as np

from common.hashing import sample_id as hash_sample
from extract.corpus.reading import RawRecord
from extract.corpus.records import (
    BAD_TOKENS,
    EMPTY_SAMPLE,
    INVALID_TEXT,
    SPAN_NOT_FOUND,
    TEMPLATE_ERROR,
    TOO_FEW_LOSS_TOKENS,
    TOO_LONG,
    TOOL_CALLS_NOT_RENDERED,
    Chat,
    RecordError,
    parse_record,
)
from extract.corpus.streams import CorpusError
from target.chat_template import NO_TEMPLATE_HINT

CONTROL_TOKEN_IN_CONTENT = "control_token_in_content"
HOLDS_MASK_TOKEN = "holds_mask_token"

# Placeholders that stand in for message contents when rendering the template's skeleton: a number
# between two private use code points (which no template strips or rewrites) that no content holds.
_PLACEHOLDER = "{open}{{}}{close}"


def _free_placeholder(values) -> str:
    text = "".join(values)
    for code in range(0xE000, 0xF8FF, 2):
        opening, closing = chr(code), chr(code + 1)
        if opening not in text and closing not in text:
            return _PLACEHOLDER.format(open=opening, close=closing)
    raise RecordError(INVALID_TEXT, "the record uses every private use code point; its contents cannot be located")


@dataclasses.dataclass
class Reject:
    position: int
    source: str
    reason: str
    detail: str
    sample_id: str | None = None

    def to_json(self) -> dict:
        out = {"position": self.position, "source": self.source, "reason": self.reason, "detail": self.detail}
        if self.sample_id is not None:
            out["sample_id"] = self.sample_id
        return out


@dataclasses.dataclass
class TokenizedSample:
    position: int
    source: str
    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated_from: int | None = None  # original length when the truncate policy cut it

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclasses.dataclass
class Span:
    """Characters of the rendered text that come from the record."""

    start: int
    end: int
    loss: bool  # the target generates them (assistant content, rendered reasoning, tool calls)
    data: str | None = None  # None: all of it is record text; else the record data rendered into it (tool calls)
    message: int | None = None  # the message the span comes from


# ----------------------------------------------------------------------------------------------
# Rendering and locating what the record put into the text


def render_chat(tokenizer, messages: list[dict], template_kwargs: dict) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    except Exception as err:  # noqa: BLE001 - a template may raise anything (jinja raise_exception)
        raise RecordError(TEMPLATE_ERROR, f"{type(err).__name__}: {err}") from None
    if not isinstance(text, str):
        raise RecordError(TEMPLATE_ERROR, f"the chat template returned {type(text).__name__}, not text")
    return text


def chat_spans(
    tokenizer, chat: Chat, text: str, template_kwargs: dict, control_texts: tuple[str, ...] = ()
) -> list[Span]:
    """Every span of `text` the record wrote (see `Span`); RecordError when what the target generates
    cannot be located, or when record text spelling a control token cannot be."""
    spans, unlocated = content_char_spans(tokenizer, chat.messages, text, template_kwargs)
    if (
        unlocated is None
    ):  # located by searching alone: a control token spelled in a content could be matched to the template's
        unlocated = [
            (i, key)
            for i, m in enumerate(chat.messages)
            for key in ("reasoning_content", "content")
            if isinstance(m.get(key), str)
        ]
    for i, key in unlocated:
        value = chat.messages[i][key]
        if any(t in value for t in control_texts):
            raise RecordError(
                CONTROL_TOKEN_IN_CONTENT,
                f"messages[{i}].{key} spells a control token and was not found in the rendered text, "
                "so it cannot be kept from forging a turn boundary",
            )
    spans = spans + tool_call_spans(tokenizer, chat.messages, text, template_kwargs)
    for span in spans:
        if span.message in chat.untrained:  # an assistant turn marked weight 0 / train false
            span.loss = False
    return spans


def content_char_spans(
    tokenizer, messages: list[dict], text: str, template_kwargs: dict
) -> tuple[list[Span], list[tuple[int, str]] | None]:
    """Character spans of the message contents (and rendered reasoning) inside `text`, and the
    (message, field) pairs the template renders but that could not be located (None: not known,
    the template failed on the placeholders and every content was searched for).

    First the template is rendered again with a unique placeholder for every content; if `text` is
    exactly that skeleton with the contents put back, every span is known without searching. If
    not (the template rewrote a content, e.g. stripped it), each content is searched for in
    order, starting after the template text that precedes it in the skeleton, so role headers are
    never mistaken for content; an assistant content that cannot be found rejects the record.
    """
    fields = [
        (i, key)
        for i, m in enumerate(messages)
        for key in ("reasoning_content", "content")
        if isinstance(m.get(key), str)
    ]
    values = {f: messages[f[0]][f[1]] for f in fields}
    placeholder = _free_placeholder(values.values())
    holders = {f: placeholder.format(n) for n, f in enumerate(fields)}
    masked = [dict(m) for m in messages]
    for (i, key), holder in holders.items():
        masked[i][key] = holder
    try:
        skeleton = tokenizer.apply_chat_template(masked, tokenize=False, **template_kwargs)
    except Exception:  # noqa: BLE001 - fall back to searching
        return _search_spans(messages, text, values, skeleton=None)[0], None
    order = sorted((skeleton.find(h), f) for f, h in holders.items() if skeleton.count(h) == 1)
    rebuilt, spans, cursor = [], [], 0
    for at, f in order:
        rebuilt.append(skeleton[cursor:at])
        start = sum(map(len, rebuilt))
        rebuilt.append(values[f])
        spans.append(Span(start, start + len(values[f]), loss=messages[f[0]]["role"] == "assistant", message=f[0]))
        cursor = at + len(holders[f])
    rebuilt.append(skeleton[cursor:])
    if "".join(rebuilt) == text and all(skeleton.count(h) <= 1 for h in holders.values()):
        return spans, []
    return _search_spans(messages, text, values, skeleton=(skeleton, holders))


def _search_spans(messages, text: str, values: dict, skeleton) -> tuple[list[Span], list[tuple[int, str]]]:
    """Fallback: find each rendered content in order (exactly, else stripped). With the skeleton, a
    content must start right after the template text before it (a short content is never matched
    further on, inside another one); an assistant content that does not is searched for after it."""
    rendered = list(values)
    headers: dict = {}
    if skeleton is not None:
        skel, holders = skeleton
        rendered = [f for f in values if skel.count(holders[f]) == 1]
        rendered.sort(key=lambda f: skel.find(holders[f]))
        previous_end = 0
        for f in rendered:  # template text between the previous content and this one
            at = skel.find(holders[f])
            headers[f] = skel[previous_end:at]
            previous_end = at + len(holders[f])
    # The template text after each content (the next one's header; the skeleton's end for the last).
    trailers = {f: headers[g] for f, g in itertools.pairwise(rendered)}
    if rendered and skeleton is not None:
        trailers[rendered[-1]] = skeleton[0][previous_end:]
    spans, unlocated, cursor = [], [], 0
    for f in rendered:
        cursor = _skip_header(text, cursor, headers.get(f, ""))
        value = values[f]
        assistant = messages[f[0]]["role"] == "assistant"
        candidates = [
            c
            for c in dict.fromkeys((value, value.strip(), value.strip("\n"), value.lstrip("\n"), value.rstrip()))
            if c or not value
        ]
        at, found = -1, ""
        if skeleton is not None:
            here = [c for c in candidates if text.startswith(c, cursor)]
            # A content the template trimmed can match with the template's own next character
            # (a "\n" before "</think>"): prefer the reading after which the template text goes on.
            found = next((c for c in here if text.startswith(trailers[f], cursor + len(c))), here[0] if here else "")
            at = cursor if found or not value else -1
            if at < 0 and not value.strip():
                at = cursor  # only whitespace, which the template trimmed away: empty, right after its header
        if at < 0 and (assistant or skeleton is None):
            for candidate in candidates:
                at = text.find(candidate, cursor)
                if at >= 0:
                    found = candidate
                    break
        if at >= 0:
            spans.append(Span(at, at + len(found), loss=assistant, message=f[0]))
            cursor = at + len(found)
            continue
        unlocated.append(f)
        # Without a skeleton we do not know whether the template renders reasoning at all.
        required = f[1] == "content" or skeleton is not None
        if assistant and required:
            raise RecordError(SPAN_NOT_FOUND, f"messages[{f[0]}].{f[1]} does not appear in the rendered template text")
    return spans, unlocated


def _skip_header(text: str, cursor: int, header: str) -> int:
    """The position after the template text `header` that follows `cursor` (its tail, when the
    previous content was rewritten; searched for, when the previous content was not located)."""
    if not header:
        return cursor
    for cut in range(len(header)):
        if text.startswith(header[cut:], cursor):
            return cursor + len(header) - cut
    at = text.find(header, cursor)
    return at + len(header) if at >= 0 else cursor


def tool_call_spans(tokenizer, messages: list[dict], text: str, template_kwargs: dict) -> list[Span]:
    """The rendered tool calls of each assistant turn that makes them: the text the conversation
    gains when that turn's `tool_calls` are rendered (the template is run once without them).

    RecordError when the template ignores the calls (training on such a turn would teach the
    drafter to end it where the target calls a tool) or changes more than it adds."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        without = [dict(m) for m in messages]
        del without[i]["tool_calls"]
        try:
            other = render_chat(tokenizer, without, template_kwargs)
        except RecordError as err:
            raise RecordError(
                SPAN_NOT_FOUND,
                f"messages[{i}].tool_calls: the template fails on the turn without its calls ({err.detail})",
            ) from None
        if other == text:
            raise RecordError(
                TOOL_CALLS_NOT_RENDERED,
                f"messages[{i}] has {len(message['tool_calls'])} tool call(s) but the chat template does not "
                "render tool_calls; "
                "use the target's own template (Qwen3.6 renders them as <tool_call> blocks) or drop the calls",
            )
        span = inserted_span(text, other)
        if span is None:
            raise RecordError(
                SPAN_NOT_FOUND,
                f"messages[{i}].tool_calls: the template renders the turn differently without its calls, not just "
                "without them",
            )
        spans.append(Span(*span, loss=True, data=json.dumps(message["tool_calls"], ensure_ascii=False), message=i))
    return spans


def inserted_span(longer: str, shorter: str) -> tuple[int, int] | None:
    """Where `longer` is `shorter` with one run of text inserted: (start, end) in `longer`, widened
    over characters that could belong to either side (e.g. a '<' the insertion starts with and the
    text after it too); None if `longer` is not `shorter` plus one insertion."""
    grown = len(longer) - len(shorter)
    if grown <= 0:
        return None
    prefix = _common_prefix(longer, shorter)
    suffix = _common_prefix(longer[::-1], shorter[::-1])
    first = len(shorter) - suffix  # the earliest start the insertion may have
    if first > prefix:
        return None
    return max(first, 0), prefix + grown


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of `a` and `b` (binary search on slice compares: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def loss_mask_from_spans(
    offsets: list[tuple[int, int]], spans: list[tuple[int, int]], input_ids: list[int], end_of_turn_ids: set[int]
) -> np.ndarray:
    """1 on tokens overlapping a span, and on the end-of-turn token that follows each span."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans:
        return mask
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    ends = np.fromiter((e for _, e in offsets), dtype=np.int64, count=len(offsets))
    for a, b in spans:
        inside = (starts < b) & (ends > a)
        mask[inside] = 1
        # The token that closes the turn: the first token starting at or after the span's end.
        after = np.flatnonzero(starts >= b) if b > a else np.flatnonzero(starts >= a)
        if after.size and input_ids[after[0]] in end_of_turn_ids:
            mask[after[0]] = 1
    return mask


# ----------------------------------------------------------------------------------------------
# Tokenizing a window of records


@dataclasses.dataclass
class SamplePolicy:
    max_len: int
    length_policy: str  # truncate | drop
    min_loss_tokens: int
    chat_template_kwargs: dict
    vocab_size: int | None = None  # the target's; ids at or above it would crash the embedding
    mask_token_id: int | None = None  # the dataset's mask token (`mask_token`): never in a sample


class SampleBuilder:
    """Turns raw records into `TokenizedSample`s or `Reject`s with one tokenizer and one policy."""

    def __init__(self, tokenizer, policy: SamplePolicy):
        if tokenizer is not None and not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "tokenizer: a fast (Rust) tokenizer is needed for character offsets; this checkpoint has only a "
                "slow one"
            )
        self.tokenizer = tokenizer
        self.policy = policy
        self.end_of_turn_ids = end_of_turn_token_ids(tokenizer) if tokenizer is not None else set()
        self.control_ids = control_token_ids(tokenizer) if tokenizer is not None else set()
        self.control_texts = (
            tuple(tokenizer.convert_ids_to_tokens(sorted(self.control_ids))) if tokenizer is not None else ()
        )

    def build(self, records: list[RawRecord]) -> list[TokenizedSample | Reject]:
        """Tokenize a window of records (batched tokenizer calls); results in input order."""
        results: dict[int, TokenizedSample | Reject] = {}
        to_encode: dict[bool, list] = {True: [], False: []}  # add_special_tokens -> [(n, text, spans or None)]
        for n, raw in enumerate(records):
            try:
                kind, payload = self._prepare(raw)
            except RecordError as err:
                results[n] = Reject(raw.position, raw.source, err.reason, err.detail)
                continue
            if kind == "tokens":
                results[n] = self._finish(raw, *payload)
            elif kind == "chat":
                text, spans = payload
                to_encode[False].append((n, text, spans))  # the template already holds any BOS
            else:
                to_encode[True].append((n, payload, None))  # plain text is tokenized as given, control tokens included
        for add_special, items in to_encode.items():
            if not items:
                continue
            enc = self._encode([text for _, text, _ in items], add_special_tokens=add_special)
            for (n, text, spans), ids, offsets in zip(items, enc["input_ids"], enc["offset_mapping"], strict=True):
                if spans is None:
                    mask = np.ones(len(ids), dtype=np.uint8)
                else:
                    ids, offsets = self.keep_record_text_plain(text, spans, ids, offsets)
                    mask = loss_mask_from_spans(
                        offsets, [(s.start, s.end) for s in spans if s.loss], ids, self.end_of_turn_ids
                    )
                results[n] = self._finish(records[n], np.asarray(ids, dtype=np.int32), mask)
        return [results[n] for n in range(len(records))]

    def _encode(self, texts: list[str], *, add_special_tokens: bool = False, split_special_tokens: bool = False):
        return self.tokenizer(
            texts,
            add_special_tokens=add_special_tokens,
            split_special_tokens=split_special_tokens,
            return_offsets_mapping=True,
            return_attention_mask=False,
            verbose=False,
        )

    def keep_record_text_plain(
        self, text: str, spans: list[Span], ids: list[int], offsets: list
    ) -> tuple[list[int], list]:
        """The tokens of a rendered chat (`ids`, `offsets`: its plain tokenization) with any control
        token that record text spelled re-tokenized as text."""
        forged = self.forged_spans(ids, offsets, text, spans)
        return self.encode_as_text(text, forged) if forged else (ids, offsets)

    def forged_spans(
        self, ids: list[int], offsets: list[tuple[int, int]], text: str, spans: list[Span]
    ) -> list[tuple[int, int]]:
        """The record spans in which the tokenizer read a control token out of record text, each cut
        to the tokens that lie wholly inside it (a tool-call span may reach into the `<` of the
        template's own `<|im_end|>`, see `inserted_span`, which must stay whole)."""
        found = set()
        for token_id, (a, b) in zip(ids, offsets, strict=True):
            if token_id not in self.control_ids:
                continue
            for span in spans:
                inside = a < span.end and b > span.start
                if inside and (span.data is None or text[a:b] in span.data):
                    found.add((span.start, span.end))
        cut = []
        for start, end in sorted(found):
            whole = [(a, b) for a, b in offsets if a >= start and b <= end and b > a]
            if whole:
                cut.append((whole[0][0], max(b for _, b in whole)))
        return cut

    def encode_as_text(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """Tokenize `text` with the record spans `spans` read as plain text (control tokens spelled
        in them split into ordinary tokens) and the template text between them as usual."""
        pieces, cursor = [], 0
        for a, b in spans:
            a = max(a, cursor)
            if a > cursor:
                pieces.append((cursor, a, False))
            if b > a:
                pieces.append((a, b, True))
            cursor = max(cursor, b)
        if cursor < len(text):
            pieces.append((cursor, len(text), False))
        encoded = {}
        for split in (False, True):
            chosen = [p for p in pieces if p[2] == split]
            if chosen:
                enc = self._encode([text[a:b] for a, b, _ in chosen], split_special_tokens=split)
                encoded.update(
                    {p: (i, o) for p, i, o in zip(chosen, enc["input_ids"], enc["offset_mapping"], strict=True)}
                )
        ids, offsets = [], []
        for piece in pieces:
            piece_ids, piece_offsets = encoded[piece]
            ids += piece_ids
            offsets += [(s + piece[0], e + piece[0]) for s, e in piece_offsets]
        return ids, offsets

    def _prepare(self, raw: RawRecord) -> tuple[str, Any]:
        if raw.error is not None:
            raise RecordError(*raw.error)
        kind, payload = parse_record(raw.record)
        if kind != "chat":
            return kind, payload
        if not getattr(self.tokenizer, "chat_template", None):
            raise CorpusError(
                f"{raw.source}: a chat record, but the tokenizer has no chat_template; {NO_TEMPLATE_HINT}"
            )
        kwargs = payload.template_kwargs(self.policy.chat_template_kwargs)
        rendered = render_chat(self.tokenizer, payload.messages, kwargs)
        return "chat", (rendered, chat_spans(self.tokenizer, payload, rendered, kwargs, self.control_texts))

    def _finish(self, raw: RawRecord, input_ids: np.ndarray, mask: np.ndarray) -> TokenizedSample | Reject:
        if input_ids.size == 0:
            return Reject(raw.position, raw.source, EMPTY_SAMPLE, "the record tokenizes to 0 tokens")
        vocab = self.policy.vocab_size
        if vocab is not None and int(input_ids.max()) >= vocab:
            return Reject(
                raw.position,
                raw.source,
                BAD_TOKENS,
                f"token id {int(input_ids.max())} >= the target's vocab_size {vocab}",
            )
        mask_id = self.policy.mask_token_id
        if mask_id is not None and bool(np.any(input_ids == mask_id)):
            # Only a configured mask token that text can produce gets here (`mask_token`).
            return Reject(raw.position, raw.source, HOLDS_MASK_TOKEN, f"holds the mask token id {mask_id}")
        policy, truncated_from = self.policy, None
        if input_ids.size > policy.max_len:
            if policy.length_policy == "drop":
                sid = hash_sample(input_ids, mask)
                return Reject(
                    raw.position, raw.source, TOO_LONG, f"{input_ids.size} tokens > max_len {policy.max_len}", sid
                )
            truncated_from = int(input_ids.size)
            input_ids, mask = input_ids[: policy.max_len], mask[: policy.max_len]
        sid = hash_sample(input_ids, mask)
        n_loss = int(mask.sum())
        if n_loss < policy.min_loss_tokens:
            where = f" (after truncation from {truncated_from} tokens)" if truncated_from else ""
            return Reject(
                raw.position,
                raw.source,
                TOO_FEW_LOSS_TOKENS,
                f"{n_loss} loss tokens < min_loss_tokens {policy.min_loss_tokens}{where}",
                sid,
            )
        return TokenizedSample(raw.position, raw.source, sid, input_ids, mask, truncated_from)


def control_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (`<|im_start|>`, `<|im_end|>`, ...): record text must never
    produce them. Added tokens that are not special (Qwen's `<think>`, `<tool_call>`) are words the
    target also writes as text, so they are not counted."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def end_of_turn_token_ids(tokenizer) -> set[int]:
    """Token ids that may close an assistant turn: the special tokens (`<|im_end|>`, `<|eot_id|>`, eos)."""
    ids = control_token_ids(tokenizer)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
