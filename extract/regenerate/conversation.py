"""One record being answered again: its prompt side, its turns, the answers so far, and how each
generated answer becomes a stored assistant message that extraction reads back exactly.

Prompt side. A record is read by `extract.corpus.records.parse_record` (every shape extraction reads;
a chat without an answer and a `prompt` without a `response` are accepted here). Its system and
user turns are kept; every assistant turn is answered again, in order, each prompt holding the
answers regenerated before it. A trailing user turn without an answer is answered too, so
prompt-only corpora work. Reasoning and tool calls of the original assistant turns are dropped
(they are what is regenerated).

Tool turns. A tool result answers the calls of the original assistant turn, which the regenerated
turn need not make. So a conversation ends before the first assistant turn that follows a tool
result (or another assistant turn with no user turn between): the turns before it are kept,
counted as `turns_cut`. A record whose first answer already follows a tool result has nothing left
and is rejected (`no_user_turn`). The record's `tools` are offered to the target as given.

Exactness. Extraction renders the stored conversation with the target's chat template and puts
the loss on the answer. An answer is stored only as far as that rendering gives back exactly the
generated text and token ids after exactly the prompt the target saw (`fitted_length`): a model
may emit a token split that BPE would merge, or a template may trim an answer's trailing
whitespace; such an answer is cut to its longest prefix that survives (counted `answers_cut`), an
answer of which nothing survives rejects the record (`answer_not_reproducible`). The tokens the
round trip checked and cut away are counted too (`round_trip_tokens`, `round_trip_cut_tokens`, over
every answer checked, in stored and rejected records alike), so the summary can say how much it cut.

Thinking (`thinking` in the config):
  disable  prompts rendered with enable_thinking=false; the answer is stored as generated.
  keep     enable_thinking=true; the text before `</think>` is stored as `reasoning_content`, the
           rest as `content` (templates render the reasoning of the last turn); extraction renders
           with enable_thinking=true.
  strip    enable_thinking=true; only the text after `</think>` is stored, checked against the
           non-thinking prompt extraction renders (enable_thinking=false) and tokenized there.
"""

from __future__ import annotations

import dataclasses
import json

import xxhash

from extract.corpus.reading import RawRecord
from extract.corpus.records import RecordError, parse_record

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Reject reasons of regeneration (stable strings, as extraction's).
NOT_A_CHAT = "not_a_chat"
NO_USER_TURN = "no_user_turn"
EMPTY_ANSWER = "empty_answer"
LENGTH_CAP = "length_cap"
NOT_REPRODUCIBLE = "answer_not_reproducible"
REFUSED = "refused"
TEMPLATE_ERROR = "template_error"
THINKING_NOT_CLOSED = "thinking_not_closed"
PROMPT_TOO_LONG = "prompt_too_long"


@dataclasses.dataclass
class Generated:
    """What a backend returns for one prompt."""

    text: str | None = None  # the answer text (server); None when ids are given
    ids: list[int] | None = None  # the answer's token ids before the stop token (local)
    at_cap: bool = False  # stopped by max_new_tokens, not by a stop token
    at_repeat: bool = False  # cut where it started looping (local backend with stop_repeat)
    message: dict | None = None  # chat API: the server's parsed assistant message (content, reasoning, tool_calls)
    refused: str | None = None  # the server refused the request (its message)


@dataclasses.dataclass
class Outcome:
    """The finished record: the stored record, or the reject."""

    position: int
    source: str
    record_id: str
    record: dict | None = None
    reason: str | None = None
    detail: str | None = None
    stats: dict = dataclasses.field(default_factory=dict)

    def journal_entry(self) -> dict:
        entry = {"id": self.record_id, "position": self.position, "source": self.source, "stats": self.stats}
        if self.record is not None:
            entry.update(status="ok", record=self.record)
        else:
            entry.update(status="rejected", reason=self.reason, detail=self.detail)
        return entry


class Renderer:
    """The target's tokenizer and chat template, with the template variables of generation and of
    extraction; everything that turns messages into prompt text and ids."""

    def __init__(self, tokenizer, thinking: str, generation_kwargs: dict, extraction_kwargs: dict):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "target: the tokenizer has no chat_template, and regeneration renders chats with one; set "
                "chat_template=FILE (a Jinja chat template)"
            )
        self.tokenizer, self.thinking = tokenizer, thinking
        self.generation_kwargs, self.extraction_kwargs = dict(generation_kwargs), dict(extraction_kwargs)

    def prompt_text(self, messages: list[dict], tools: list | None, *, for_extraction: bool = False) -> str:
        kwargs = self.extraction_kwargs if for_extraction else self.generation_kwargs
        return self.render(messages, tools, kwargs, add_generation_prompt=True)

    def render(
        self, messages: list[dict], tools: list | None, kwargs: dict, *, add_generation_prompt: bool = False
    ) -> str:
        extra = {**kwargs, "tools": tools} if tools else dict(kwargs)
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as err:  # noqa: BLE001 - a template may raise anything (jinja raise_exception)
            raise RecordError(TEMPLATE_ERROR, f"{type(err).__name__}: {err}") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------------------------
# Records -> conversations


def record_id(position: int, messages: list[dict], tools: list | None) -> str:
    """Stable key of a record: its position and its prompt side (xxh3-128)."""
    prompt_side = [{"role": m["role"], "content": m.get("content")} for m in messages if m["role"] != "assistant"]
    data = json.dumps({"position": position, "prompt": prompt_side, "tools": tools}, sort_keys=True, ensure_ascii=False)
    return xxhash.xxh3_128_hexdigest(data.encode("utf-8"))


def prompt_turns(messages: list[dict]) -> tuple[list[list[dict]], bool]:
    """(the non-assistant messages before each answer to generate, whether the conversation was cut
    at a tool result); see the module docstring."""
    turns: list[list[dict]] = []
    pending: list[dict] = []
    for message in messages:
        if message["role"] == "assistant":
            if not pending or any(m["role"] == "tool" for m in pending):
                return turns, True
            turns.append(pending)
            pending = []
        else:
            pending.append({"role": message["role"], "content": message["content"]})
    if pending and not any(m["role"] == "tool" for m in pending) and any(m["role"] == "user" for m in pending):
        turns.append(pending)  # a last user turn without an answer: answered too
    return turns, any(m["role"] == "tool" for m in pending)


class Conversation:
    """A record being answered turn by turn. Drive it with `wants_turn` / `prompt_*` / `finish_turn`
    until `outcome` is set."""

    def __init__(self, raw: RawRecord, renderer: Renderer, at_cap: str, context_limit: int | None = None):
        self.position, self.source = raw.position, raw.source
        self.renderer, self.at_cap = renderer, at_cap
        # Tokens the target can attend over (prompt + answer); None: not checked. A prompt that
        # leaves no room rejects the record before anything is allocated for it.
        self.context_limit = context_limit
        self.history: list[dict] = []
        self.turns: list[list[dict]] = []
        self.tools: list | None = None
        self.record_id = f"position-{raw.position}"
        self.outcome: Outcome | None = None
        self.stats = {
            "answers": 0,
            "answer_tokens": 0,
            "prompt_tokens": 0,
            "at_cap": 0,
            "at_repeat": 0,
            "cut": 0,
            "turns_cut": 0,
            "round_trip_tokens": 0,  # answer tokens checked by the decode/re-encode round trip
            "round_trip_cut_tokens": 0,  # of those, the tokens it cut away (a whole answer that fails: all)
        }
        self.answer_lengths: list[int] = []  # tokens of each stored answer
        self._prompt: tuple[str, list[int]] | None = None
        try:
            self._read(raw)
        except RecordError as err:
            self.reject(err.reason, err.detail)

    def _read(self, raw: RawRecord) -> None:
        if raw.error is not None:
            raise RecordError(*raw.error)
        kind, chat = parse_record(raw.record, answers_required=False)
        if kind != "chat":
            raise RecordError(
                NOT_A_CHAT,
                f"a {kind!r} record has no prompt to answer; regeneration reads chats "
                "(messages, conversations, prompt [+ response])",
            )
        self.tools = chat.tools
        self.record_id = record_id(raw.position, chat.messages, chat.tools)
        self.turns, cut = prompt_turns(chat.messages)
        self.stats["turns_cut"] = int(cut)
        if not self.turns or not any(m["role"] == "user" for m in self.turns[0]):
            raise RecordError(
                NO_USER_TURN, "no user turn before the first answer" + (" (it follows a tool result)" if cut else "")
            )

    # -- driving --------------------------------------------------------------------------------

    def wants_turn(self) -> bool:
        if self.outcome is not None or self.stats["answers"] >= len(self.turns):
            return False
        if self.context_limit is not None:
            n = len(self.prompt()[1])
            if n >= self.context_limit:
                self.reject(
                    PROMPT_TOO_LONG,
                    f"the prompt of answer {self.stats['answers'] + 1} is {n:,} tokens; the target's context holds "
                    f"{self.context_limit:,} (max_context), which leaves no room for an answer",
                )
                return False
        return True

    def answer_budget(self, max_new_tokens: int) -> int:
        """Tokens the next answer may take: `max_new_tokens`, less what would run past the context."""
        if self.context_limit is None:
            return max_new_tokens
        return max(1, min(max_new_tokens, self.context_limit - len(self.prompt()[1])))

    def messages(self) -> list[dict]:
        """The conversation the next answer continues: earlier turns with their regenerated answers, then this turn."""
        return self.history + self.turns[self.stats["answers"]]

    def prompt(self) -> tuple[str, list[int]]:
        """(text, ids) of the next prompt, rendered for generation."""
        if self._prompt is None:
            text = self.renderer.prompt_text(self.messages(), self.tools)
            self._prompt = (text, self.renderer.encode(text))
        return self._prompt

    def finish_turn(self, generated: Generated) -> None:
        """Store one generated answer (or reject the record)."""
        assert self.wants_turn()
        try:
            self._finish_turn(generated)
        except RecordError as err:
            self.reject(err.reason, err.detail)
            return
        finally:
            self._prompt = None
        if not self.wants_turn() and self.outcome is None:
            record = {"messages": self.history}
            if self.tools:
                record["tools"] = self.tools
            self.outcome = Outcome(self.position, self.source, self.record_id, record=record, stats=dict(self.stats))

    def reject(self, reason: str, detail: str) -> None:
        self.outcome = Outcome(
            self.position, self.source, self.record_id, reason=reason, detail=detail, stats=dict(self.stats)
        )

    # -- one answer -----------------------------------------------------------------------------

    def _finish_turn(self, generated: Generated) -> None:
        if generated.refused is not None:
            raise RecordError(REFUSED, generated.refused)
        if generated.at_cap and self.at_cap == "drop":
            raise RecordError(LENGTH_CAP, f"answer {self.stats['answers'] + 1} reached max_new_tokens (at_cap = drop)")
        messages = self.messages()
        prompt_text, prompt_ids = self.prompt_for_storage(messages)
        if generated.message is not None:
            message, n_tokens = self._chat_message(generated.message, messages, prompt_text, prompt_ids)
        else:
            message, n_tokens = self._fitted_message(generated, messages, prompt_text, prompt_ids)
        self.history = messages + [message]
        self.stats["answers"] += 1
        self.stats["answer_tokens"] += n_tokens
        self.answer_lengths.append(n_tokens)
        self.stats["prompt_tokens"] += len(prompt_ids)
        self.stats["at_cap"] += int(generated.at_cap)
        self.stats["at_repeat"] += int(generated.at_repeat)

    def prompt_for_storage(self, messages: list[dict]) -> tuple[str, list[int]]:
        """The prompt extraction will see before this answer: the generation prompt, except for
        `strip`, whose stored answers follow the non-thinking prompt."""
        if self.renderer.thinking != "strip":
            return self.prompt()
        text = self.renderer.prompt_text(messages, self.tools, for_extraction=True)
        return text, self.renderer.encode(text)

    def _fitted_message(
        self, generated: Generated, messages, prompt_text: str, prompt_ids: list[int]
    ) -> tuple[dict, int]:
        ids = self._stored_ids(generated, prompt_text, prompt_ids)
        if not ids:
            raise RecordError(
                EMPTY_ANSWER, f"answer {self.stats['answers'] + 1} is empty (the target ended its turn at once)"
            )
        thinking_open = self.renderer.thinking == "keep" and _opens_thinking(prompt_text)
        kept = fitted_length(self.renderer, messages, self.tools, prompt_text, prompt_ids, ids, thinking_open)
        self.stats["round_trip_tokens"] += len(ids)
        self.stats["round_trip_cut_tokens"] += len(ids) - kept
        if kept == 0:
            raise RecordError(
                NOT_REPRODUCIBLE,
                f"answer {self.stats['answers'] + 1}: no prefix of its {len(ids)} tokens renders and "
                "tokenizes back to itself through the chat template",
            )
        self.stats["cut"] += int(kept < len(ids))
        return answer_message(self.renderer.decode(ids[:kept]), self.renderer.thinking, thinking_open), kept

    def _stored_ids(self, generated: Generated, prompt_text: str, prompt_ids: list[int]) -> list[int]:
        """The token ids of the part of the answer that is stored, as they follow `prompt_text`."""
        if generated.ids is not None and self.renderer.thinking != "strip":
            return list(generated.ids)
        text = generated.text if generated.text is not None else self.renderer.decode(generated.ids)
        if self.renderer.thinking == "strip":
            if THINK_CLOSE not in text:
                if _opens_thinking(self.prompt()[0]) or text.lstrip().startswith(THINK_OPEN):
                    raise RecordError(
                        THINKING_NOT_CLOSED,
                        f"answer {self.stats['answers'] + 1} never closed its thinking "
                        f"({THINK_CLOSE}); nothing is left after stripping it",
                    )
            else:
                text = text.split(THINK_CLOSE, 1)[1].lstrip("\n")
        # Text from a server, or the stripped part: its ids are how the text tokenizes after the prompt.
        ids = self.renderer.encode(prompt_text + text)
        if ids[: len(prompt_ids)] != prompt_ids:
            raise RecordError(
                NOT_REPRODUCIBLE,
                f"answer {self.stats['answers'] + 1} merges into the prompt's last token when tokenized",
            )
        return ids[len(prompt_ids) :]

    def _chat_message(self, reply: dict, messages, prompt_text: str, prompt_ids: list[int]) -> tuple[dict, int]:
        """Chat API: the server's parsed message, kept as it is (content, reasoning per `thinking`,
        tool calls); checked to render after exactly this prompt; its tokens counted from that rendering."""
        content = reply.get("content") or ""
        reasoning = reply.get("reasoning_content") or reply.get("reasoning")
        if reasoning is None and THINK_CLOSE in content:  # no reasoning parser on the server
            reasoning, content = content.split(THINK_CLOSE, 1)
            reasoning = reasoning.split(THINK_OPEN, 1)[-1]
        message = {"role": "assistant", "content": content.lstrip("\n") if reasoning is not None else content}
        if reasoning is not None and self.renderer.thinking == "keep":
            message["reasoning_content"] = reasoning.strip("\n")
        if reply.get("tool_calls"):
            message["tool_calls"] = reply["tool_calls"]
        if not message["content"] and not message.get("tool_calls") and not message.get("reasoning_content"):
            raise RecordError(EMPTY_ANSWER, f"answer {self.stats['answers'] + 1} is empty")
        rendered = self.renderer.render(messages + [message], self.tools, self.renderer.extraction_kwargs)
        if not rendered.startswith(prompt_text):
            raise RecordError(
                NOT_REPRODUCIBLE,
                f"answer {self.stats['answers'] + 1}: the conversation with it does not render after its prompt",
            )
        ids = self.renderer.encode(rendered)
        return message, max(0, len(ids) - len(prompt_ids))


def _opens_thinking(prompt_text: str) -> bool:
    """The generation prompt already opened a think block (Qwen3.5/3.6 with thinking on)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def answer_message(text: str, thinking: str, thinking_open: bool) -> dict:
    """The assistant message that stores generated `text` (see the module docstring)."""
    if thinking != "keep":
        return {"role": "assistant", "content": text}
    if THINK_CLOSE in text:
        reasoning, content = text.split(THINK_CLOSE, 1)
        return {
            "role": "assistant",
            "content": content.lstrip("\n"),
            "reasoning_content": reasoning.split(THINK_OPEN, 1)[-1].strip("\n"),
        }
    if thinking_open or text.lstrip().startswith(THINK_OPEN):  # cut inside the thinking
        return {"role": "assistant", "content": "", "reasoning_content": text.split(THINK_OPEN, 1)[-1].strip("\n")}
    return {"role": "assistant", "content": text}


def fitted_length(
    renderer: Renderer,
    messages: list[dict],
    tools,
    prompt_text: str,
    prompt_ids: list[int],
    ids: list[int],
    thinking_open: bool = False,
) -> int:
    """The longest n such that the first n answer tokens, stored as a message and rendered with the
    conversation (as extraction renders it), give back exactly `prompt_text` + their text, and that
    text tokenizes back to exactly `prompt_ids + ids[:n]`. Tried from the longest down: survival is
    not monotone in n (a cut past the first difference can survive again), and only the few
    answers that do not survive whole pay."""

    def survives(n: int) -> bool:
        text = renderer.decode(ids[:n])
        if renderer.encode(prompt_text + text) != prompt_ids + ids[:n]:
            return False
        message = answer_message(text, renderer.thinking, thinking_open)
        try:
            rendered = renderer.render(messages + [message], tools, renderer.extraction_kwargs)
        except RecordError:
            return False
        return rendered.startswith(prompt_text + text)

    return next((n for n in range(len(ids), 0, -1) if survives(n)), 0)
