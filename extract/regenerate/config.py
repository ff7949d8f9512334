"""`RegenerateConfig`: every knob of `python -m extract.regenerate` (section `[regenerate]`).

Loaded from a TOML file plus `key=value` overrides (`common.config`) and validated before any
model, tokenizer or server is touched. Keys split in two groups, as extraction's do: those that
decide what the regenerated corpus holds (`DATASET_KEYS`: target, corpus, sampling, thinking,
length cap...) must match exactly when a run resumes; the others (endpoints, requests in flight,
batch size, device, timeouts) may change between runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.config import fail, knob
from target.chat_template import check_chat_template

THINKING_MODES = ("disable", "keep", "strip")
ALLOWED_TEMPLATE_KWARG_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class RegenerateConfig:
    # -- what is answered, by whom -----------------------------------------------------------
    target: str = knob(
        "",
        help="local directory of the target checkpoint: its tokenizer and chat template render the prompts and "
        "check the "
        "answers (both backends); the local backend also loads its weights",
        path="local_in",
    )
    corpus: str = knob(
        "",
        help="corpus to answer again: a .jsonl/.parquet file, a directory or glob of them, or a saved `datasets` "
        "directory",
        path="local_in",
    )
    corpus_format: Literal["auto", "jsonl", "parquet", "datasets"] = knob(
        "auto", help="how to read the corpus (as extraction reads it)"
    )
    streaming: bool = knob(True, help="read Parquet / datasets corpora as a stream")
    max_records: int | None = knob(None, help="answer only the first N records of the corpus (smoke tests)", min=1)
    out: str = knob(
        "",
        help="output directory (or s3://bucket/prefix, docs/object-storage.md): data.jsonl (the regenerated corpus), "
        "rejects.jsonl, regenerate.json (provenance), summary.json",
        path="data_out",
    )
    backend: Literal["local", "server"] = knob(
        "local",
        help="server: any OpenAI-compatible endpoint (vLLM, SGLang, transformers serve); local: batched "
        "generation in this process",
    )

    # -- sampling and answers ------------------------------------------------------------------
    max_new_tokens: int = knob(2048, help="cap on each generated answer in tokens (see at_cap)", min=1, max=1 << 20)
    temperature: float = knob(0.0, help="0 = greedy; above 0 samples", min=0.0, max=10.0)
    top_p: float = knob(1.0, help="nucleus sampling (1 = off); only with temperature > 0", min=0.0, max=1.0)
    top_k: int = knob(
        0,
        help="top-k sampling (0 = off); only with temperature > 0. The server backend sends it only when set "
        "(vLLM and SGLang take it; transformers serve refuses it)",
        min=0,
    )
    seed: int = knob(
        0,
        help="sampling seed; each answer draws from (seed, record id, turn), so a rerun samples the same answer",
        min=0,
    )
    thinking: Literal["disable", "keep", "strip"] = knob(
        "disable",
        help="thinking models: disable (chat template enable_thinking=false), keep the <think> block (stored as "
        "reasoning_content), or think and strip it from the stored answer. Extraction renders the corpus with the "
        "same choice",
    )
    chat_template_kwargs: dict = knob(
        factory=dict, help="further chat template variables (enable_thinking is set by `thinking`)"
    )
    chat_template: str | None = knob(
        None,
        help="a Jinja chat template file that renders the prompts and checks the answers instead of the tokenizer's "
        "own (a target without one: a base model); extraction of the corpus must be given the same file",
        path="local_in",
    )
    max_context: int | None = knob(
        None,
        help="tokens a prompt and its answer may take together: none = the target's max_position_embeddings; a "
        "smaller value lowers it. A prompt that leaves no room for an answer is rejected (prompt_too_long) before "
        "anything is allocated for it; an answer is cut where it would pass the limit (counted as at the cap)",
        min=2,
    )
    at_cap: Literal["keep", "drop"] = knob(
        "keep",
        help="an answer that hits max_new_tokens: keep it (cut there; counted) or reject the record (reason "
        "length_cap)",
    )

    # -- server backend --------------------------------------------------------------------------
    urls: list[str] = knob(
        factory=list,
        help='server: base URLs of the OpenAI-compatible endpoints, e.g. ["http://127.0.0.1:8000/v1"]; requests '
        "go to the least busy",
    )
    model: str = knob("", help="server: the model name as served; empty = the first model the endpoint lists")
    api: Literal["completions", "chat"] = knob(
        "completions",
        help="server: completions sends the prompt rendered here with the target's template (answers checked token for "
        "token against what extraction reads); chat sends the messages and lets the server render and parse them",
    )
    api_key_env: str = knob(
        "OPENAI_API_KEY", help="server: the environment variable holding the API key (never saved); unset = no key"
    )
    max_in_flight: int = knob(64, help="server: requests in flight over all URLs", min=1, max=65536)
    request_timeout_s: float = knob(900.0, help="server: seconds one request may take", min=1.0)
    max_retries: int = knob(
        8,
        help="server: retries of a request after a connection error, 408, 429 or 5xx (exponential backoff)",
        min=0,
        max=100,
    )
    retry_backoff_s: float = knob(
        1.0, help="server: first retry delay; doubles each retry, at most 60 s, with jitter", min=0.0
    )
    max_consecutive_failures: int = knob(
        32,
        help="server: stop the run after this many records in a row failed all their retries or were refused (a server "
        "that is down or a request the server never takes); done work stays, a rerun resumes",
        min=1,
    )

    # -- local backend ----------------------------------------------------------------------------
    device: str = knob("auto", help="local: auto (cuda:LOCAL_RANK if a GPU exists, else cpu), cpu, cuda or cuda:N")
    dtype: Literal["bfloat16", "float16", "float32"] = knob("bfloat16", help="local: compute dtype of the target")
    tf32: bool = knob(
        False,
        help="local, CUDA, float32: matrix products on TF32 tensor cores (several times faster; an answer may then "
        "differ from full float32 where two tokens nearly tie; the labels still come from extraction's own forward)",
    )
    attn_implementation: str = knob(
        "sdpa",
        help="local: attention kernel (auto: transformers' choice for the target, sdpa where it has one, else eager)",
        choices=("sdpa", "eager", "flash_attention_2", "flash_attention_3", "auto"),
    )
    batch_size: int = knob(64, help="local: prompts per generation batch (left-padded, sorted by length)", min=1)
    cache: Literal["auto", "static", "dynamic"] = knob(
        "auto",
        help="local: the KV cache of batched decoding. static: one slot per position, each step replayed as a CUDA "
        "graph on CUDA (full-attention models only); dynamic: transformers' growing cache; auto: static on CUDA "
        "where the model allows it",
    )
    window_records: int = knob(
        1024,
        help="local: records answered together, turn by turn (a longer window pads less; results are written per "
        "window)",
        min=1,
    )
    trust_remote_code: bool = knob(False, help="allow code shipped with the checkpoint to run")

    # -- behaviour -------------------------------------------------------------------------------
    fsync_every_s: float = knob(
        5.0,
        help="fsync the journal of finished records at most this often (and at the end); on an object store, put "
        "the records finished since the last put as a new journal object at most this often",
        min=0.0,
    )
    progress: bool = knob(True, help="show a progress bar (rank 0)")

    def check(self) -> None:
        if not self.target:
            fail(
                "target",
                "must name the target checkpoint directory (its tokenizer and chat template are needed by both "
                "backends)",
            )
        if not self.corpus:
            fail("corpus", "name the corpus whose prompts are answered (corpus=PATH)")
        if not self.out:
            fail("out", "name the output directory (out=DIR)")
        if self.backend == "server" and not self.urls:
            fail("urls", 'the server backend needs at least one endpoint, e.g. urls=["http://127.0.0.1:8000/v1"]')
        for i, url in enumerate(self.urls):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                fail(f"urls[{i}]", f"expected an http(s) URL such as http://127.0.0.1:8000/v1, got {url!r}")
        if len(set(self.urls)) != len(self.urls):
            fail("urls", "lists an endpoint twice")
        if self.temperature == 0 and (self.top_p != 1.0 or self.top_k != 0):
            fail(
                "top_p" if self.top_p != 1.0 else "top_k",
                "only applies when sampling; set temperature > 0 or leave it at its default",
            )
        check_chat_template(self.chat_template)
        for key, value in self.chat_template_kwargs.items():
            if key == "enable_thinking":
                fail(
                    "chat_template_kwargs.enable_thinking",
                    "is set by `thinking` (disable | keep | strip); remove it here",
                )
            if key in ("add_generation_prompt", "tools", "tokenize", "continue_final_message"):
                fail(f"chat_template_kwargs.{key}", "is set by regeneration itself")
            if not isinstance(value, ALLOWED_TEMPLATE_KWARG_TYPES):
                fail(f"chat_template_kwargs.{key}", f"expected a boolean, number or string, got {value!r}")
        if not (
            self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            fail("device", f"{self.device!r} is not allowed; use auto, cpu, cuda or cuda:N")
        if self.window_records < self.batch_size:
            fail(
                "window_records",
                f"{self.window_records} is below batch_size {self.batch_size}; a window must fill a batch",
            )

    def generation_template_kwargs(self) -> dict:
        """Chat template variables of the prompts the target answers."""
        return {**self.chat_template_kwargs, "enable_thinking": self.thinking != "disable"}

    def extraction_template_kwargs(self) -> dict:
        """Chat template variables extraction must render the regenerated corpus with: the stored answers of
        `strip` carry no reasoning, so they are rendered as non-thinking turns."""
        return {**self.chat_template_kwargs, "enable_thinking": self.thinking == "keep"}


# Keys that decide what the regenerated corpus holds: a resume must match them exactly. The target
# and the corpus are compared by content digest, not by path.
DATASET_KEYS = (
    "backend",
    "max_records",
    "max_new_tokens",
    "max_context",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "thinking",
    "chat_template_kwargs",
    "at_cap",
    "model",
    "api",
)


def dataset_keys(cfg: RegenerateConfig) -> dict:
    return {key: getattr(cfg, key) for key in DATASET_KEYS}
