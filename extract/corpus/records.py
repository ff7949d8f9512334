"""Corpus records -> what gets tokenized: a chat (messages and tools), plain text, or ready tokens.
Every record that cannot become one raises `RecordError` with a stable reject reason.

Record shapes (the first that applies wins; docs/corpus.md has an example of each and says what
the loss covers):
    {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}   OpenAI / Hugging Face chat
    {"conversations": [{"from": "human", "value": ...}, ...]}           ShareGPT
    {"prompt": str, "response": str}                                     a user turn and an assistant turn
    {"text": str}                                                        plain text, loss on every token
    {"input_ids": [int], "loss_mask": [0|1]}                             already tokenized (loss_mask optional: all 1)

Chat messages are normalized to what chat templates expect: `content` a string (a list of OpenAI
text parts is joined; `null` is accepted on an assistant turn that calls tools), `tool_calls` in
the OpenAI form `{"type": "function", "function": {"name": str, "arguments": {...}}}` with the
arguments an object (a JSON string of one is parsed: Qwen3.5/3.6 templates iterate over them),
the legacy `function_call` read as one tool call and the `function` role as `tool`. ShareGPT turns
map `human`/`user` -> user, `gpt`/`assistant`/`chatgpt`/`model` -> assistant, `system`,
`observation`/`tool`/`function_response` -> tool, and `function_call` (a JSON call, or a list of
them) -> an assistant turn that makes those calls; a record-level `system` becomes the first turn.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

CHAT_ROLES = ("system", "user", "assistant", "tool")

# Reject reasons (stable strings: they are counter names in the manifest and lines in rejects.jsonl).
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
EMPTY_CONVERSATION = "empty_conversation"
BAD_MESSAGE = "bad_message"
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
NON_TEXT_CONTENT = "non_text_content"
BAD_TOOL_CALL = "bad_tool_call"
NO_ASSISTANT_TURN = "no_assistant_turn"
TEMPLATE_ERROR = "template_error"
TOOL_CALLS_NOT_RENDERED = "tool_calls_not_rendered"
SPAN_NOT_FOUND = "assistant_span_not_found"
EMPTY_SAMPLE = "empty_sample"
BAD_TOKENS = "bad_tokens"
TOO_LONG = "too_long"
TOO_FEW_LOSS_TOKENS = "too_few_loss_tokens"
DUPLICATE = "duplicate"
NONFINITE_HIDDEN = "nonfinite_hidden"
NONFINITE_LOGITS = "nonfinite_logits"
INVALID_TEXT = "invalid_text"
BAD_TURN_WEIGHT = "bad_turn_weight"
# Per-turn training switches users bring (axolotl's and LLaMA-Factory's datasets): `"weight": 0` or
# `"train": false` on an assistant turn takes that turn out of the loss; `1` / `true` is the default.
TURN_SWITCHES = ("weight", "train")

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "observation": "tool",
    "tool": "tool",
    "function_response": "tool",
    "function_call": "assistant",
}
ROLE_ALIASES = {"function": "tool"}  # OpenAI's legacy role for function results


class RecordError(Exception):
    """A record that cannot become a sample; carries the reject reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclasses.dataclass
class Chat:
    """A conversation ready for the chat template: normalized messages and the tools offered."""

    messages: list[dict]
    tools: list | None = None
    untrained: frozenset = frozenset()  # indices of assistant turns that carry no loss (weight 0 / train false)

    def template_kwargs(self, extra: dict) -> dict:
        return {**extra, "tools": self.tools} if self.tools else dict(extra)


def parse_record(record: Any, *, answers_required: bool = True) -> tuple[str, Any]:
    """("chat", Chat) | ("text", text) | ("tokens", (input_ids, loss_mask)); RecordError otherwise.

    `answers_required=False` (regeneration, which answers the prompts itself) also accepts chats
    without an assistant turn and a `prompt` without a `response`."""
    if not isinstance(record, dict):
        raise RecordError(NOT_AN_OBJECT, f"expected a JSON object, got {type(record).__name__}")
    for key in ("messages", "conversations"):
        if record.get(key) is not None:
            messages = _system_turn(record) + _sharegpt_or_messages(record[key], key)
            checked = check_messages(messages, key, answers_required=answers_required)
            untrained = frozenset(i for i, m in enumerate(checked) if _trains(m) is False)
            return "chat", Chat([_without_switches(m) for m in checked], _tools(record.get("tools")), untrained)
    if record.get("prompt") is not None or record.get("response") is not None:
        needed = ("prompt", "response") if answers_required else ("prompt",)
        for key in needed:
            if record.get(key) is None:
                raise RecordError(MISSING_FIELD, f"has 'prompt' or 'response' but no '{key}'")
        for key in ("prompt", "response"):
            if record.get(key) is not None and not isinstance(record[key], str):
                raise RecordError(NON_STRING_CONTENT, f"'{key}' is {type(record[key]).__name__}, not a string")
        messages = [{"role": "user", "content": record["prompt"]}]
        if record.get("response") is not None:
            messages.append({"role": "assistant", "content": record["response"]})
        return "chat", Chat(messages)
    if record.get("text") is not None:
        if not isinstance(record["text"], str):
            raise RecordError(NON_STRING_CONTENT, f"'text' is {type(record['text']).__name__}, not a string")
        return "text", record["text"]
    if record.get("input_ids") is not None:
        return "tokens", check_tokens(record["input_ids"], record.get("loss_mask"))
    present = ", ".join(sorted(map(str, record))) or "none"
    raise RecordError(
        MISSING_FIELD,
        f"needs 'messages', 'conversations', 'prompt' + 'response', 'text' or 'input_ids'; fields present: {present}",
    )


def check_tokens(input_ids: Any, loss_mask: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(input_ids, (list, tuple)) and any(isinstance(i, (bool, np.bool_)) for i in input_ids):
        # numpy reads [true, 1, 4] as [1, 1, 4]: a boolean is never a token id
        raise RecordError(BAD_TOKENS, "'input_ids' holds true/false values; token ids are integers")
    try:
        ids = np.asarray(input_ids)
        mask = np.ones(ids.shape, dtype=np.int64) if loss_mask is None else np.asarray(loss_mask)
    except (TypeError, ValueError) as err:
        raise RecordError(BAD_TOKENS, f"'input_ids' / 'loss_mask' are not lists of integers: {err}") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise RecordError(
            BAD_TOKENS, f"'input_ids' must be a flat list of integers, got {ids.dtype} of shape {ids.shape}"
        )
    if mask.shape != ids.shape or (mask.size and (mask.dtype.kind not in "iub" or mask.min() < 0 or mask.max() > 1)):
        raise RecordError(
            BAD_TOKENS,
            f"'loss_mask' must be 0/1 with one entry per token ({ids.size}), got {mask.dtype} of shape {mask.shape}",
        )
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise RecordError(BAD_TOKENS, f"'input_ids' out of range: [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int32), mask.astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# Chat records


def _system_turn(record: dict) -> list[dict]:
    """A record-level `system` prompt (ShareGPT as LLaMA-Factory writes it) as the first turn."""
    system = record.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise RecordError(NON_STRING_CONTENT, f"'system' is {type(system).__name__}, not a string")
    return [{"role": "system", "content": system}]


def _sharegpt_or_messages(turns: Any, key: str) -> list:
    """The turns as role/content messages: ShareGPT `from`/`value` turns are converted."""
    if not isinstance(turns, list):
        raise RecordError(BAD_MESSAGE, f"'{key}' is {type(turns).__name__}, not a list")
    return [
        _from_sharegpt(turn, f"{key}[{i}]") if isinstance(turn, dict) and turn.get("from") is not None else turn
        for i, turn in enumerate(turns)
    ]


def _from_sharegpt(turn: dict, where: str) -> dict:
    speaker = turn["from"]
    if speaker not in SHAREGPT_ROLES:
        raise RecordError(UNKNOWN_ROLE, f"{where} is from {speaker!r}; allowed: {', '.join(SHAREGPT_ROLES)}")
    if "value" not in turn:
        raise RecordError(MISSING_FIELD, f"{where} has no 'value'")
    value = turn["value"]
    switches = {k: turn[k] for k in TURN_SWITCHES if k in turn}
    if speaker == "function_call":
        calls = _json_value(value, f"{where}.value", "a function call")
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": calls if isinstance(calls, list) else [calls],
            **switches,
        }
    return {"role": SHAREGPT_ROLES[speaker], "content": value, **switches}


def check_messages(messages: list, key: str = "messages", *, answers_required: bool = True) -> list[dict]:
    """Normalized copies of the messages (see the module docstring); RecordError on the first problem."""
    if not messages:
        raise RecordError(EMPTY_CONVERSATION, f"'{key}' is empty")
    out = [_check_message(message, f"{key}[{i}]") for i, message in enumerate(messages)]
    if answers_required and not any(m["role"] == "assistant" for m in out):
        raise RecordError(NO_ASSISTANT_TURN, f"no assistant message among {len(out)} messages")
    return out


def _check_message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise RecordError(BAD_MESSAGE, f"{where} is {type(message).__name__}, not an object")
    # Columnar inputs (Parquet) give every row every column: drop the empty ones so templates that
    # test `message.reasoning_content is defined` or `is string` see what a JSON record would give.
    message = {k: v for k, v in message.items() if v is not None or k == "content"}
    role = message.get("role")
    if role is None:
        raise RecordError(MISSING_FIELD, f"{where} has no 'role'")
    role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in CHAT_ROLES:
        raise RecordError(
            UNKNOWN_ROLE, f"{where} has role {role!r}; allowed: {', '.join(CHAT_ROLES)} (and 'function', read as tool)"
        )
    message["role"] = role
    if "function_call" in message and role == "assistant":
        message.setdefault("tool_calls", [message.pop("function_call")])
    if "tool_calls" in message:
        if role != "assistant":
            raise RecordError(
                BAD_TOOL_CALL, f"{where} is a {role} message with 'tool_calls'; only assistant turns call tools"
            )
        message["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if not message["tool_calls"]:
            del message["tool_calls"]
    if "content" not in message:
        raise RecordError(MISSING_FIELD, f"{where} has no 'content'")
    message["content"] = _content_text(message["content"], where, calls_tools=bool(message.get("tool_calls")))
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError(NON_STRING_CONTENT, f"{where}.reasoning_content is {type(reasoning).__name__}, not a string")
    _check_switches(message, where)
    return message


def _check_switches(message: dict, where: str) -> None:
    """`weight` 0 or 1 and `train` true or false, agreeing; only an assistant turn may train."""
    weight, train = message.get("weight"), message.get("train")
    if "weight" in message and (isinstance(weight, bool) or weight not in (0, 1)):
        raise RecordError(
            BAD_TURN_WEIGHT,
            f"{where}.weight is {weight!r}; a turn's weight is 0 (no loss on it) or 1 (the loss mask has no "
            "fractional weights)",
        )
    if "train" in message and not isinstance(train, bool):
        raise RecordError(BAD_TURN_WEIGHT, f"{where}.train is {train!r}, not true or false")
    if "weight" in message and "train" in message and bool(weight) != train:
        raise RecordError(BAD_TURN_WEIGHT, f"{where} has weight {weight!r} but train {train!r}")
    if _trains(message) and message["role"] != "assistant":
        raise RecordError(
            BAD_TURN_WEIGHT,
            f"{where} is a {message['role']} turn marked for training; only assistant turns carry loss "
            "(what the target generates)",
        )


def _trains(message: dict) -> bool | None:
    """The turn's own training switch (True / False), or None when it has none."""
    if "train" in message:
        return bool(message["train"])
    if "weight" in message:
        return bool(message["weight"])
    return None


def _without_switches(message: dict) -> dict:
    return {k: v for k, v in message.items() if k not in TURN_SWITCHES}


def _content_text(content: Any, where: str, *, calls_tools: bool) -> str:
    """A message's content as one string: text parts joined; null only beside tool calls."""
    if isinstance(content, str):
        return content
    if content is None and calls_tools:
        return ""
    if isinstance(content, list) and content and all(isinstance(part, dict) for part in content):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type", "text" if "text" in part else None)
            if kind != "text":
                raise RecordError(
                    NON_TEXT_CONTENT,
                    f"{where}.content[{j}] is a {kind!r} part; only text parts can be extracted (the drafter sees "
                    "text only)",
                )
            if not isinstance(part.get("text"), str):
                raise RecordError(
                    NON_STRING_CONTENT, f"{where}.content[{j}].text is {type(part.get('text')).__name__}, not a string"
                )
            texts.append(part["text"])
        return "".join(texts)
    what = "null without tool_calls" if content is None else type(content).__name__
    raise RecordError(NON_STRING_CONTENT, f"{where}.content is {what}, not a string or a list of text parts")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise RecordError(BAD_TOOL_CALL, f"{where} is {type(calls).__name__}, not a list of calls")
    return [_tool_call(call, f"{where}[{i}]") for i, call in enumerate(calls)]


def _tool_call(call: Any, where: str) -> dict:
    """OpenAI's {"type": "function", "function": {"name", "arguments"}} (or a bare {"name", "arguments"})
    -> the OpenAI form with the arguments an object."""
    if not isinstance(call, dict):
        raise RecordError(BAD_TOOL_CALL, f"{where} is {type(call).__name__}, not an object")
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise RecordError(BAD_TOOL_CALL, f"{where}.function is {type(function).__name__}, not an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise RecordError(BAD_TOOL_CALL, f"{where} has no function name (got {name!r})")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        arguments = _json_value(arguments, f"{where} arguments", "an object")
    if not isinstance(arguments, dict):
        raise RecordError(
            BAD_TOOL_CALL, f"{where} arguments are {type(arguments).__name__}, not an object of named arguments"
        )
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _json_value(value: Any, where: str, what: str) -> Any:
    """A JSON-encoded string (ShareGPT function calls, OpenAI arguments) decoded; other values as they are."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as err:
        raise RecordError(BAD_TOOL_CALL, f"{where} should be JSON text of {what}: {err}") from None


def _tools(tools: Any) -> list | None:
    """The record's `tools` (function schemas for the template's system prompt), or None."""
    tools = (
        _json_value(tools, "'tools'", "a list of tool schemas") if isinstance(tools, str) and tools.strip() else tools
    )
    if tools in (None, "", []):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError(
            BAD_TOOL_CALL, f"'tools' must be a list of tool schemas (objects), got {type(tools).__name__}"
        )
    return tools
