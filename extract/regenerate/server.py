"""The `server` backend: answers from any OpenAI-compatible endpoint (vLLM, SGLang, `transformers
serve`), through the `openai` client, many requests in flight over one or several URLs.

APIs (`api` in the config):
  completions  the prompt is rendered here with the target's own chat template (as extraction will
               render it) and sent as text; the answer text comes back raw, `<think>` blocks and
               tool-call markup included, and is checked token for token (`conversation`).
  chat         the messages (and `chat_template_kwargs`, `tools`) are sent; the server renders them
               with its template and may parse reasoning and tool calls out of the answer, which
               are stored as the message fields they come in.

Failures:
  - connection errors, timeouts, 408, 409, 429 and 5xx are retried with exponential backoff and
    jitter (`retry_backoff_s`, doubling up to 60 s, `max_retries` times), on the least busy URL;
    a record whose request fails every retry is counted as failed, not finished: a rerun tries it
    again;
  - 401, 403 and 404 stop the run at once with the server's message (a key, URL or model name that
    every request would fail on);
  - before any record is sent, each URL gets one request of the real shape (`preflight`): any error
    there stops the run with the server's message, so a request the server cannot take (a
    parameter it refuses: transformers serve answers 422 to `top_k`) is never sent a million times;
  - after that, a 400/422 (or other 4xx) on a record refuses that record (reject `refused`, with the
    message: for example a prompt longer than the server's context);
  - `max_consecutive_failures` records in a row that failed or were refused stop the run.

Hybrid targets (`chunked_prefill_advice`): a serving engine splits a long prompt's prefill into chunks
by default; for a target with recurrent layers (Gated DeltaNet, Mamba) a split prefill is another
computation than a whole one (z-lab measured the next-token argmax move at about 7% of positions on
Qwen3.5-9B), so the answers would not be the target's own greedy continuations. The run warns, naming
the engines' switches; extraction and speculative decoding prefill every prompt whole themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
from collections.abc import Callable, Iterable

from extract.regenerate.conversation import Conversation, Generated
from extract.regenerate.local import answer_seed
from target.checkpoint import read_config
from target.rules import recurrent_layer_kinds

log = logging.getLogger(__name__)

TRANSIENT_STATUS = {408, 409, 429}
FATAL_STATUS = {401, 403, 404}
MAX_BACKOFF_S = 60.0


def chunked_prefill_advice(target_dir: str) -> str | None:
    """The warning for answering through a serving engine with a hybrid target (None: attention only)."""
    kinds = recurrent_layer_kinds(read_config(target_dir))
    if not kinds:
        return None
    return (
        f"target '{target_dir}' has recurrent layers ({', '.join(kinds)}): a prefill the server splits into chunks "
        "gives other answers than the target's own; start the server with chunked prefill off: vLLM "
        "--no-enable-chunked-prefill (with --max-num-batched-tokens at least --max-model-len), SGLang "
        '--chunked-prefill-size -1 (docs/regenerate.md, "Hybrid targets")'
    )


class ServerStop(Exception):
    """A failure every further request would share: stop the run (done work stays)."""


@dataclasses.dataclass
class RequestStats:
    requests: int = 0
    retries: int = 0
    failed_records: int = 0
    by_url: dict = dataclasses.field(default_factory=dict)


class Endpoint:
    def __init__(self, url: str, client):
        self.url, self.client, self.in_flight = url, client, 0


class ServerBackend:
    """Sends the prompts of many conversations at once; see the module docstring."""

    def __init__(self, cfg, renderer):
        self.cfg, self.renderer = cfg, renderer
        self.stats = RequestStats()
        self.model = cfg.model
        self._consecutive_failures = 0
        self.last_failure = ""
        self.endpoints: list[Endpoint] = []

    # -- setup ----------------------------------------------------------------------------------

    def open(self) -> None:
        import openai

        key = os.environ.get(self.cfg.api_key_env) or "EMPTY"
        self.endpoints = [
            Endpoint(
                url,
                openai.AsyncOpenAI(
                    base_url=url.rstrip("/"), api_key=key, max_retries=0, timeout=self.cfg.request_timeout_s
                ),
            )
            for url in self.cfg.urls
        ]
        self.stats.by_url = {e.url: 0 for e in self.endpoints}

    async def close(self) -> None:
        for endpoint in self.endpoints:
            with contextlib.suppress(Exception):
                await endpoint.client.close()

    async def resolve_model(self) -> str:
        """The served model name (the config's, checked against every URL's list, or the first listed).

        Listing is optional when the config names the model: some servers fail it while they serve
        well (`transformers serve` 5.17 answered HTTP 500 on a fresh GPU host), so then a failed list
        is a warning; the first request still fails clearly if the name is wrong or nobody answers."""
        for endpoint in self.endpoints:
            try:
                listed = [m.id async for m in endpoint.client.models.list()]
            except Exception as err:  # noqa: BLE001 - reported with the URL
                if not self.model:
                    raise ServerStop(
                        f"{endpoint.url}: cannot list the served models: {describe_error(err)} "
                        "(if the server answers requests anyway, name its model with config key "
                        "'model')"
                    ) from None
                log.warning(
                    "%s: cannot list the served models (%s); going on with model %r (config key 'model')",
                    endpoint.url,
                    describe_error(err),
                    self.model,
                )
                continue
            if not self.model:
                if not listed:
                    raise ServerStop(f"{endpoint.url}: serves no model")
                self.model = listed[0]
            elif listed and self.model not in listed:
                raise ServerStop(
                    f"{endpoint.url}: does not serve model {self.model!r}; it serves "
                    f"{', '.join(map(repr, listed))} (config key 'model')"
                )
        return self.model

    async def preflight(self, conversation: Conversation) -> None:
        """One real-shaped request to every URL, max 1 token: any error stops the run with its message."""
        for endpoint in self.endpoints:
            try:
                await self._send(endpoint, conversation, max_tokens=1)
            except Exception as err:  # noqa: BLE001
                raise ServerStop(
                    f"{endpoint.url}: the first request failed, so every request would: {describe_error(err)}"
                ) from None

    # -- requests -------------------------------------------------------------------------------

    def request_body(self, conversation: Conversation, max_tokens: int) -> dict:
        cfg = self.cfg
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": cfg.temperature}
        extra: dict = {}
        if cfg.temperature > 0:
            body["seed"] = answer_seed(cfg.seed, conversation.record_id, conversation.stats["answers"]) % (1 << 31)
            if cfg.top_p < 1.0:
                body["top_p"] = cfg.top_p
            if cfg.top_k:
                extra["top_k"] = cfg.top_k
        if cfg.api == "completions":
            body["prompt"] = conversation.prompt()[0]
        else:
            body["messages"] = conversation.messages()
            extra["chat_template_kwargs"] = self.renderer.generation_kwargs
            if conversation.tools:
                body["tools"] = conversation.tools
        if extra:
            body["extra_body"] = extra
        return body

    async def _send(self, endpoint: Endpoint, conversation: Conversation, max_tokens: int) -> Generated:
        body = self.request_body(conversation, max_tokens)
        endpoint.in_flight += 1
        self.stats.requests += 1
        self.stats.by_url[endpoint.url] += 1
        try:
            if self.cfg.api == "completions":
                response = await endpoint.client.completions.create(**body)
                choice = response.choices[0]
                text, message = choice.text or "", None
            else:
                response = await endpoint.client.chat.completions.create(**body)
                choice = response.choices[0]
                message = choice.message.model_dump(exclude_none=True)
                text = None
        finally:
            endpoint.in_flight -= 1
        if choice.finish_reason == "content_filter":
            return Generated(refused="the server's content filter stopped the answer (finish_reason content_filter)")
        return Generated(text=text, message=message, at_cap=choice.finish_reason == "length")

    async def answer_turn(self, conversation: Conversation) -> Generated | None:
        """The next answer of `conversation`, retried as the module docstring says; None: failed every retry."""
        import openai

        for attempt in range(self.cfg.max_retries + 1):
            endpoint = min(self.endpoints, key=lambda e: (e.in_flight, random.random()))
            try:
                generated = await self._send(
                    endpoint, conversation, conversation.answer_budget(self.cfg.max_new_tokens)
                )
                self._consecutive_failures = 0
                return generated
            except openai.APIStatusError as err:
                if err.status_code in FATAL_STATUS:
                    raise ServerStop(f"{endpoint.url}: {describe_error(err)}") from None
                if err.status_code < 500 and err.status_code not in TRANSIENT_STATUS:
                    self._failed(f"{endpoint.url}: {describe_error(err)}")
                    return Generated(refused=describe_error(err))
                failure = err
            except (openai.APIConnectionError, openai.APITimeoutError) as err:
                failure = err
            if attempt < self.cfg.max_retries:
                self.stats.retries += 1
                delay = min(self.cfg.retry_backoff_s * 2**attempt, MAX_BACKOFF_S) * (0.5 + random.random() / 2)
                log.debug("%s: %s; retry %d in %.1fs", endpoint.url, describe_error(failure), attempt + 1, delay)
                await asyncio.sleep(delay)
        self.stats.failed_records += 1
        self._failed(f"{endpoint.url}: {describe_error(failure)} (after {self.cfg.max_retries} retries)")
        return None

    def _failed(self, what: str) -> None:
        self._consecutive_failures += 1
        self.last_failure = what

    def check_failures(self) -> None:
        """Stop once `max_consecutive_failures` records in a row failed or were refused (checked after
        each such record is written down)."""
        if self._consecutive_failures >= self.cfg.max_consecutive_failures:
            raise ServerStop(
                f"{self._consecutive_failures} records in a row failed or were refused; the last: {self.last_failure}"
            )

    # -- driving --------------------------------------------------------------------------------

    async def run(
        self,
        conversations: Iterable[Conversation],
        on_done: Callable[[Conversation], None],
        on_failed: Callable[[Conversation, str], None],
    ) -> None:
        """Answer every conversation, `max_in_flight` requests at once; `on_done` as each finishes."""
        limit = asyncio.Semaphore(self.cfg.max_in_flight)
        tasks: set[asyncio.Task] = set()
        stop: list[BaseException] = []

        async def answer(conversation: Conversation) -> None:
            try:
                while conversation.wants_turn():
                    generated = await self.answer_turn(conversation)
                    if generated is None:
                        on_failed(conversation, self.last_failure)
                        self.check_failures()
                        return
                    conversation.finish_turn(generated)
                on_done(conversation)
                self.check_failures()
            except ServerStop as err:
                stop.append(err)
            finally:
                limit.release()

        try:
            for conversation in conversations:
                await limit.acquire()
                if stop:
                    break
                task = asyncio.create_task(answer(conversation))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(set(tasks))
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        if stop:
            raise stop[0]


def describe_error(err: BaseException) -> str:
    """The status and the server's own message, in one line."""
    status = getattr(err, "status_code", None)
    body = getattr(err, "body", None)
    message = body.get("detail") or body.get("message") or body.get("error") if isinstance(body, dict) else None
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message if message is not None else err).strip().replace("\n", " ")
    return f"HTTP {status}: {text}" if status is not None else f"{type(err).__name__}: {text}"
