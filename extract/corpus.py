"""Corpus -> tokenized samples: read records, render chat through the tokenizer's template, build
the loss mask, apply the length policy, and turn every bad record into a counted `Reject`.

Inputs: a `.jsonl` file (also `.jsonl.gz` / `.jsonl.zst`), a `.parquet` file, a directory or glob of
them, or a directory written by `datasets.Dataset.save_to_disk`. JSONL is read line by line here
(the `datasets` JSON loader fails a whole file on one bad line); Parquet and saved datasets are
read with `datasets`, streamed by default.

Record shapes (the first that applies wins):
    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}
    {"prompt": str, "response": str}          -> a user turn and an assistant turn
    {"text": str}                             -> plain text, loss on every token
    {"input_ids": [int], "loss_mask": [0|1]}  -> already tokenized (loss_mask optional: all 1)

Loss mask of a chat sample: 1 exactly on the tokens of each assistant message's `content` (and of
its `reasoning_content` when the template renders it) plus the end-of-turn token that closes the
assistant turn (`<|im_end|>` for Qwen); 0 on system/user/tool turns and on template text such as
role headers or an empty `<think></think>` block the template inserts. Spans are found in the
rendered text (see `assistant_char_spans`) and mapped to tokens through the tokenizer's offsets,
so templates without `{% generation %}` markers work.

A record's position is its 0-based index in the input (for JSONL: the line index over all files in
order, blank lines included), so a reject names `file:line` and resume can recognise it.
"""

from __future__ import annotations

import bz2
import dataclasses
import glob
import gzip
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from common.hashing import sample_id as hash_sample

CHAT_ROLES = ("system", "user", "assistant", "tool")

# Reject reasons (stable strings: they are counter names in the manifest and lines in rejects.jsonl).
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
EMPTY_CONVERSATION = "empty_conversation"
BAD_MESSAGE = "bad_message"
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
NO_ASSISTANT_TURN = "no_assistant_turn"
TEMPLATE_ERROR = "template_error"
SPAN_NOT_FOUND = "assistant_span_not_found"
EMPTY_SAMPLE = "empty_sample"
BAD_TOKENS = "bad_tokens"
TOO_LONG = "too_long"
TOO_FEW_LOSS_TOKENS = "too_few_loss_tokens"
DUPLICATE = "duplicate"
NONFINITE_HIDDEN = "nonfinite_hidden"
NONFINITE_LOGITS = "nonfinite_logits"
INVALID_TEXT = "invalid_text"

# Placeholders that stand in for message contents when rendering the template's skeleton; private
# use code points, which no template strips or rewrites.
_PLACEHOLDER = "\ue000{}\ue001"


@dataclasses.dataclass
class RawRecord:
    """One input record, or the reason it could not even be parsed."""

    position: int
    source: str
    record: Any = None
    error: tuple[str, str] | None = None  # (reason, detail) when the input itself is broken


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


class CorpusError(ValueError):
    """The corpus as a whole cannot be read as configured (not one bad record): stop the run."""


class RecordError(Exception):
    """A record that cannot become a sample; carries the reject reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# ----------------------------------------------------------------------------------------------
# Finding and reading the input


@dataclasses.dataclass
class CorpusFiles:
    format: str  # jsonl | parquet | datasets
    files: list[str]  # the data files, in reading order (for `datasets`: the directory's files)
    root: str  # the path as given


def find_corpus(path: str, corpus_format: str = "auto") -> CorpusFiles:
    """Resolve a corpus path (file, directory, glob or saved `datasets` dir) into its files."""
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        if not files:
            raise ValueError(f"corpus: the pattern '{path}' matches no files")
    elif os.path.isdir(path):
        if corpus_format in ("auto", "datasets") and _is_saved_dataset(path):
            files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs)
            return CorpusFiles("datasets", files, path)
        if corpus_format == "datasets":
            raise ValueError(f"corpus: '{path}' is not a saved `datasets` directory (no dataset_info.json / state.json)")
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if _data_kind(f) is not None)
        if not files:
            raise ValueError(f"corpus: directory '{path}' holds no .jsonl / .jsonl.gz / .jsonl.zst / .parquet files")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"corpus: '{path}' does not exist")
    kinds = {_data_kind(f) for f in files}
    if corpus_format == "auto":
        if None in kinds or len(kinds) != 1:
            raise ValueError(
                f"corpus: cannot tell the format of {path!r} from its file names ({sorted(map(str, kinds))}); "
                "set corpus_format = jsonl or parquet"
            )
        corpus_format = kinds.pop()
    if corpus_format == "datasets":
        raise ValueError(f"corpus: corpus_format = datasets needs a saved dataset directory, got '{path}'")
    return CorpusFiles(corpus_format, files, path)


def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def _data_kind(name: str) -> str | None:
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return None


def iter_records(corpus: CorpusFiles, *, streaming: bool = True, max_records: int | None = None) -> Iterator[RawRecord]:
    """Every record of the corpus in a fixed order, with its position; bad lines come as errors."""
    if corpus.format == "jsonl":
        records = _iter_jsonl(corpus.files)
    elif corpus.format == "parquet":
        records = _iter_datasets(_load_parquet(corpus.files, streaming), corpus.root)
    else:
        records = _iter_datasets(_load_saved(corpus.root, streaming), corpus.root)
    for record in records:
        if max_records is not None and record.position >= max_records:
            return
        yield record


def _open_text_lines(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _iter_jsonl(files: list[str]) -> Iterator[RawRecord]:
    position = 0
    for path in files:
        name = os.path.basename(path)
        with _open_text_lines(path) as f:
            for line_no, raw in enumerate(f, start=1):
                source = f"{name}:{line_no}"
                if raw.strip():
                    yield _parse_json_line(raw, position, source)
                position += 1


def _parse_json_line(raw: bytes, position: int, source: str) -> RawRecord:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return RawRecord(position, source, error=(INVALID_JSON, f"not UTF-8: {err}"))
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return RawRecord(position, source, error=(INVALID_JSON, f"{err.msg} at column {err.colno}"))
    except RecursionError:
        return RawRecord(position, source, error=(INVALID_JSON, "nested too deeply"))
    surrogate = _LONE_SURROGATE_ESCAPE.search(text)
    if surrogate and _holds_lone_surrogate(record):
        # JSON's \udXXX escapes can spell half of a UTF-16 pair, which is no text: tokenizers fail on it.
        return RawRecord(position, source, error=(INVALID_TEXT, f"a string holds a lone UTF-16 surrogate ({surrogate.group(0)}), which is not valid Unicode text"))
    return RawRecord(position, source, record)


_LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _holds_lone_surrogate(record: Any) -> bool:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def count_jsonl_records(files: list[str]) -> int:
    """Lines in the JSONL files (what positions count), read fast in binary blocks."""
    total = 0
    for path in files:
        with _open_text_lines(path) as f:
            last = b"\n"
            while block := f.read(1 << 22):
                total += block.count(b"\n")
                last = block[-1:]
            if last != b"\n":
                total += 1
    return total


def _load_parquet(files: list[str], streaming: bool):
    import datasets  # lazy: the GPU machine may lack it, and only Parquet / saved corpora need it

    return datasets.load_dataset("parquet", data_files=files, split="train", streaming=streaming)


def _load_saved(path: str, streaming: bool):
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"corpus: '{path}' holds several splits ({', '.join(ds)}); point `corpus` at one split's directory")
    return ds.to_iterable_dataset() if streaming else ds


def _iter_datasets(ds: Iterable[dict], root: str) -> Iterator[RawRecord]:
    name = os.path.basename(root.rstrip("/")) or root
    for position, record in enumerate(ds):
        yield RawRecord(position, f"{name} row {position}", record)


def count_records(corpus: CorpusFiles) -> int | None:
    """How many records the corpus holds (for the progress bar), or None if unknown."""
    if corpus.format == "jsonl":
        return count_jsonl_records(corpus.files)
    if corpus.format == "parquet":
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in corpus.files)
    try:
        import datasets

        return len(datasets.load_from_disk(corpus.root))
    except Exception:  # noqa: BLE001 - a count is only for the progress bar
        return None


# ----------------------------------------------------------------------------------------------
# Records -> text and loss spans


def parse_record(record: Any) -> tuple[str, Any]:
    """("chat", messages) | ("text", text) | ("tokens", (input_ids, loss_mask)); RecordError otherwise."""
    if not isinstance(record, dict):
        raise RecordError(NOT_AN_OBJECT, f"expected a JSON object, got {type(record).__name__}")
    if record.get("messages") is not None:
        return "chat", check_messages(record["messages"])
    if record.get("prompt") is not None or record.get("response") is not None:
        for key in ("prompt", "response"):
            if record.get(key) is None:
                raise RecordError(MISSING_FIELD, f"has 'prompt' or 'response' but no '{key}'")
            if not isinstance(record[key], str):
                raise RecordError(NON_STRING_CONTENT, f"'{key}' is {type(record[key]).__name__}, not a string")
        return "chat", [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    if record.get("text") is not None:
        if not isinstance(record["text"], str):
            raise RecordError(NON_STRING_CONTENT, f"'text' is {type(record['text']).__name__}, not a string")
        return "text", record["text"]
    if record.get("input_ids") is not None:
        return "tokens", check_tokens(record["input_ids"], record.get("loss_mask"))
    present = ", ".join(sorted(map(str, record))) or "none"
    raise RecordError(MISSING_FIELD, f"needs 'messages', 'prompt' + 'response', 'text' or 'input_ids'; fields present: {present}")


def check_tokens(input_ids: Any, loss_mask: Any) -> tuple[np.ndarray, np.ndarray]:
    try:
        ids = np.asarray(input_ids)
        mask = np.ones(ids.shape, dtype=np.int64) if loss_mask is None else np.asarray(loss_mask)
    except (TypeError, ValueError) as err:
        raise RecordError(BAD_TOKENS, f"'input_ids' / 'loss_mask' are not lists of integers: {err}") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise RecordError(BAD_TOKENS, f"'input_ids' must be a flat list of integers, got {ids.dtype} of shape {ids.shape}")
    if mask.shape != ids.shape or (mask.size and (mask.dtype.kind not in "iub" or mask.min() < 0 or mask.max() > 1)):
        raise RecordError(BAD_TOKENS, f"'loss_mask' must be 0/1 with one entry per token ({ids.size}), got {mask.dtype} of shape {mask.shape}")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise RecordError(BAD_TOKENS, f"'input_ids' out of range: [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int32), mask.astype(np.uint8)


def check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list):
        raise RecordError(BAD_MESSAGE, f"'messages' is {type(messages).__name__}, not a list")
    if not messages:
        raise RecordError(EMPTY_CONVERSATION, "'messages' is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RecordError(BAD_MESSAGE, f"messages[{i}] is {type(message).__name__}, not an object")
        role = message.get("role")
        if role is None:
            raise RecordError(MISSING_FIELD, f"messages[{i}] has no 'role'")
        if role not in CHAT_ROLES:
            raise RecordError(UNKNOWN_ROLE, f"messages[{i}] has role {role!r}; allowed: {', '.join(CHAT_ROLES)}")
        if "content" not in message:
            raise RecordError(MISSING_FIELD, f"messages[{i}] has no 'content'")
        if not isinstance(message["content"], str):
            raise RecordError(NON_STRING_CONTENT, f"messages[{i}].content is {type(message['content']).__name__}, not a string")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise RecordError(NON_STRING_CONTENT, f"messages[{i}].reasoning_content is {type(reasoning).__name__}, not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError(NO_ASSISTANT_TURN, f"no assistant message among {len(messages)} messages")
    return [_clean_message(m) for m in messages]


def _clean_message(message: dict) -> dict:
    # Columnar inputs (Parquet) give every row every column; drop the empty ones so templates that
    # test `message.reasoning_content is defined` or `is string` see what a JSON record would give.
    return {k: v for k, v in message.items() if v is not None}


def render_chat(tokenizer, messages: list[dict], template_kwargs: dict) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    except Exception as err:  # noqa: BLE001 - a template may raise anything (jinja raise_exception)
        raise RecordError(TEMPLATE_ERROR, f"{type(err).__name__}: {err}") from None
    if not isinstance(text, str):
        raise RecordError(TEMPLATE_ERROR, f"the chat template returned {type(text).__name__}, not text")
    return text


def assistant_char_spans(tokenizer, messages: list[dict], text: str, template_kwargs: dict) -> list[tuple[int, int]]:
    """Character spans of the assistant contents (and rendered reasoning) inside `text`.

    First the template is rendered again with a unique placeholder for every content; if `text` is
    exactly that skeleton with the contents put back, every span is known without searching. If
    not (the template rewrote a content, e.g. stripped it), each content is searched for in
    order, starting after the template text that precedes it in the skeleton, so role headers are
    never mistaken for content; a content that cannot be found rejects the record.
    """
    fields = [(i, key) for i, m in enumerate(messages) for key in ("reasoning_content", "content") if isinstance(m.get(key), str)]
    values = {f: messages[f[0]][f[1]] for f in fields}
    if any("\ue000" in v or "\ue001" in v for v in values.values()):
        return _search_spans(messages, text, values, skeleton=None)
    holders = {f: _PLACEHOLDER.format(n) for n, f in enumerate(fields)}
    masked = [dict(m) for m in messages]
    for (i, key), holder in holders.items():
        masked[i][key] = holder
    try:
        skeleton = tokenizer.apply_chat_template(masked, tokenize=False, **template_kwargs)
    except Exception:  # noqa: BLE001 - fall back to searching
        return _search_spans(messages, text, values, skeleton=None)
    order = sorted((skeleton.find(h), f) for f, h in holders.items() if skeleton.count(h) == 1)
    rebuilt, spans, cursor = [], [], 0
    for at, f in order:
        rebuilt.append(skeleton[cursor:at])
        start = sum(map(len, rebuilt))
        rebuilt.append(values[f])
        if messages[f[0]]["role"] == "assistant":
            spans.append((start, start + len(values[f])))
        cursor = at + len(holders[f])
    rebuilt.append(skeleton[cursor:])
    if "".join(rebuilt) == text and all(skeleton.count(h) <= 1 for h in holders.values()):
        return spans
    return _search_spans(messages, text, values, skeleton=(skeleton, holders))


def _search_spans(messages, text: str, values: dict, skeleton) -> list[tuple[int, int]]:
    """Fallback: find each rendered content in order (exactly, else stripped)."""
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
    spans, cursor = [], 0
    for f in rendered:
        header = headers.get(f, "")
        # Skip the header this content sits behind (its tail, when the previous content was rewritten).
        for cut in range(len(header)):
            if text.startswith(header[cut:], cursor):
                cursor += len(header) - cut
                break
        value = values[f]
        for candidate in (value, value.strip(), value.strip("\n"), value.lstrip("\n"), value.rstrip()):
            if not candidate and value:
                continue
            at = text.find(candidate, cursor)
            if at >= 0:
                if messages[f[0]]["role"] == "assistant":
                    spans.append((at, at + len(candidate)))
                cursor = at + len(candidate)
                break
        else:
            # Without a skeleton we do not know whether the template renders reasoning at all.
            required = f[1] == "content" or skeleton is not None
            if messages[f[0]]["role"] == "assistant" and required:
                raise RecordError(SPAN_NOT_FOUND, f"messages[{f[0]}].{f[1]} does not appear in the rendered template text")
    return spans


def loss_mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], input_ids: list[int], end_of_turn_ids: set[int]) -> np.ndarray:
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


class SampleBuilder:
    """Turns raw records into `TokenizedSample`s or `Reject`s with one tokenizer and one policy."""

    def __init__(self, tokenizer, policy: SamplePolicy):
        if tokenizer is not None and not getattr(tokenizer, "is_fast", False):
            raise ValueError("tokenizer: a fast (Rust) tokenizer is needed for character offsets; this checkpoint has only a slow one")
        self.tokenizer = tokenizer
        self.policy = policy
        self.end_of_turn_ids = end_of_turn_token_ids(tokenizer) if tokenizer is not None else set()

    def build(self, records: list[RawRecord]) -> list[TokenizedSample | Reject]:
        """Tokenize a window of records (batched tokenizer calls); results in input order."""
        results: dict[int, TokenizedSample | Reject] = {}
        to_encode: dict[bool, list] = {True: [], False: []}  # add_special_tokens -> [(n, text, spans, chat)]
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
                to_encode[True].append((n, payload, None))
        for add_special, items in to_encode.items():
            if not items:
                continue
            enc = self.tokenizer(
                [text for _, text, _ in items], add_special_tokens=add_special, return_offsets_mapping=True, return_attention_mask=False, verbose=False
            )
            for (n, _, spans), ids, offsets in zip(items, enc["input_ids"], enc["offset_mapping"]):
                input_ids = np.asarray(ids, dtype=np.int32)
                if spans is None:
                    mask = np.ones(len(ids), dtype=np.uint8)
                else:
                    mask = loss_mask_from_spans(offsets, spans, ids, self.end_of_turn_ids)
                results[n] = self._finish(records[n], input_ids, mask)
        return [results[n] for n in range(len(records))]

    def _prepare(self, raw: RawRecord) -> tuple[str, Any]:
        if raw.error is not None:
            raise RecordError(*raw.error)
        kind, payload = parse_record(raw.record)
        if kind != "chat":
            return kind, payload
        if not getattr(self.tokenizer, "chat_template", None):
            raise CorpusError(
                f"{raw.source}: a chat record, but the tokenizer has no chat_template; "
                "give the checkpoint a chat template or convert the corpus to {\"text\": ...} records"
            )
        kwargs = self.policy.chat_template_kwargs
        rendered = render_chat(self.tokenizer, payload, kwargs)
        return "chat", (rendered, assistant_char_spans(self.tokenizer, payload, rendered, kwargs))

    def _finish(self, raw: RawRecord, input_ids: np.ndarray, mask: np.ndarray) -> TokenizedSample | Reject:
        if input_ids.size == 0:
            return Reject(raw.position, raw.source, EMPTY_SAMPLE, "the record tokenizes to 0 tokens")
        vocab = self.policy.vocab_size
        if vocab is not None and int(input_ids.max()) >= vocab:
            return Reject(raw.position, raw.source, BAD_TOKENS, f"token id {int(input_ids.max())} >= the target's vocab_size {vocab}")
        policy, truncated_from = self.policy, None
        if input_ids.size > policy.max_len:
            if policy.length_policy == "drop":
                sid = hash_sample(input_ids, mask)
                return Reject(raw.position, raw.source, TOO_LONG, f"{input_ids.size} tokens > max_len {policy.max_len}", sid)
            truncated_from = int(input_ids.size)
            input_ids, mask = input_ids[: policy.max_len], mask[: policy.max_len]
        sid = hash_sample(input_ids, mask)
        n_loss = int(mask.sum())
        if n_loss < policy.min_loss_tokens:
            where = f" (after truncation from {truncated_from} tokens)" if truncated_from else ""
            return Reject(raw.position, raw.source, TOO_FEW_LOSS_TOKENS, f"{n_loss} loss tokens < min_loss_tokens {policy.min_loss_tokens}{where}", sid)
        return TokenizedSample(raw.position, raw.source, sid, input_ids, mask, truncated_from)


def end_of_turn_token_ids(tokenizer) -> set[int]:
    """Token ids that may close an assistant turn: the special tokens (`<|im_end|>`, `<|eot_id|>`, eos)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
