"""The built-in tiny default: a small chat corpus made from text shipped with Python, a byte-level
BPE chat tokenizer trained on it, and a small Qwen3-architecture target trained briefly on it.

Everything is built offline by `python -m extract.tiny [key=value ...]` (`make tiny`, knobs in
`TinyConfig`), on the GPU when torch sees one (`device`), else on the CPU, and cached; a second run
with the same recipe does nothing. A build is deterministic on a given machine (on a GPU with
torch's deterministic kernels); another CPU type, another precision or a GPU rounds differently,
and 1,000 steps of training turn that into a different, equally good target (see `recipe`):

    artifacts/tiny/corpus/train.jsonl, heldout.jsonl   chat records {"messages": [...]} (a few {"text": ...})
    artifacts/tiny/corpus/train_regen.jsonl,           the same user turns answered by the trained target
                          heldout_regen.jsonl          itself, greedily (dflash.md §3.1; the tiny default's data)
    artifacts/tiny/target/                             HF directory: config.json, model.safetensors (bf16),
                                                       generation_config.json, tokenizer files, chat template,
                                                       tiny_report.json (accuracies, tap ids, token ids, corpus sizes,
                                                       regeneration counts, lengths and time)
    artifacts/tiny/build.json                          recipe digest; written last

Library use: `build_tiny(TinyConfig(...)) -> Path`, `build_corpus(seed, heldout_fraction)`,
`build_chat_tokenizer(texts, vocab_size)`, `build_tiny_target(out_dir, train, heldout, cfg)`,
`regenerate_corpus(target_dir, train, heldout, cfg)`, `regenerate_records(model, tokenizer, records,
max_new_tokens)`, `tap_layer_ids(num_layers, n_taps)`.

Target-regenerated answers: each user turn is rendered as `train.specdecode` renders prompts
(`add_generation_prompt=True`, `enable_thinking=False`) and answered by the saved target (float32,
as extraction and speculative decoding run it) with greedy decoding until `<|im_end|>`/EOS,
`regen_max_new_tokens`, or the token where the answer starts looping (`regen_stop_repeat`,
`common.repeat.RepeatWatch`); multi-turn records are answered turn by turn. The tiny target loops
in about half of its answers, and how often depends on the build: 345 to 732 of 1,495 answers ran
to the 256-token cap in three builds that differ only in rounding. A drafter trained on the
uncut answers learns mostly loops, and its τ went with how often the target looped (online τ
1.35 to 3.35). Cut after the first repetition, the answers keep what the target says rather than
how long it keeps repeating it (`train.specdecode --stop-repeat` ends online responses by the
same rule). So the held-out first answers
are exactly what target-only greedy decoding produces from the speculative-decoding prompts, and
offline τ on them estimates online τ (dflash.md §4.3). (An earlier answer of a multi-turn record was
generated after the empty think block, which the template drops from past turns: only a
conversation's last answer is exactly the greedy continuation of its rendered prefix.)

Chat template (Qwen3 style, on purpose, so the tiny default exercises what the real target does):

    <|im_start|>{role}\\n{content}<|im_end|>\\n                  every message
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n{content}<|im_end|>\\n
                                                     assistant turns after the last user turn
    <|im_start|>assistant\\n                            generation prompt, enable_thinking=True
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n      generation prompt, enable_thinking=False

Like Qwen3, non-thinking mode inserts an empty think block, and the final assistant turn of a
rendered conversation carries one too (filled from `reasoning_content` when a message has it), so
a training sample rendered whole matches what the target sees at inference with
`enable_thinking=False`. Earlier assistant turns of a multi-turn conversation carry no think block
(Qwen3 drops past reasoning). `enable_thinking` defaults to True, as in Qwen3. `<think>` and
`</think>` are single added (non-special) tokens; `<|MASK|>` is the tokenizer's `mask_token`, an
id the target never sees in training (DFlash fills draft positions with it).
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal

from common.config import ConfigError, config_to_dict, fail, knob, parse_cli
from common.repeat import REPEAT_MAX_PERIOD
from extract.regenerate.local import answer_stop_ids  # noqa: F401 - the tiny build's stop ids are the regeneration's

if TYPE_CHECKING:  # heavy imports stay inside the functions: importing this module does no work
    import torch
    import transformers


EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|MASK|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END, MASK_TOKEN]
THINK_TOKENS = [THINK_OPEN, THINK_CLOSE]

# Qwen2/Qwen3 pre-tokenizer split: contractions, letter runs, single digits, punctuation runs,
# newlines and whitespace, then byte-level mapping.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' -}}"
    "{%- if message.get('reasoning_content') -%}{{- message['reasoning_content'].strip('\\n') -}}{%- endif -%}"
    "{{- '\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

MODEL_MAX_LENGTH = 4096
EVAL_BATCH_TOKENS = 8192
# Batch widths are rounded up to this: oneDNN keeps kernels per tensor shape, and with every width
# possible the bf16 training grew to several GB of memory.
PAD_MULTIPLE = 32


def build_chat_tokenizer(texts: list[str], vocab_size: int) -> "transformers.PreTrainedTokenizerFast":
    """A deterministic byte-level BPE chat tokenizer trained on `texts`.

    `vocab_size` counts everything: the BPE vocabulary (256 byte symbols + merges) plus the
    special and think tokens, which come last (as in Qwen: `<|endoftext|>`, `<|im_start|>`,
    `<|im_end|>`, `<|MASK|>`, `<think>`, `</think>`). On a small corpus the BPE may stop early, so
    `len(tokenizer)` can be below `vocab_size`; it is never above.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    n_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    n_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < n_bytes + n_added:
        raise ValueError(f"vocab_size must be at least {n_bytes + n_added} (256 bytes + {n_added} added tokens), got {vocab_size}")
    if not texts or not any(texts):
        raise ValueError("build_chat_tokenizer needs some non-empty training text")

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Added after training so they take the last ids, as in Qwen (the mask id is a real, unused id).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    assert len(wrapped) <= vocab_size, (len(wrapped), vocab_size)
    return wrapped


# ----------------------------------------------------------------------------------------------
# Corpus: chat records whose answers are real text shipped with Python

# Standard-library modules whose docstrings feed the corpus. Only modules present in every CPython
# build and whose documentation does not depend on the platform.
DOC_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "builtins", "calendar", "cmd", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "doctest", "email", "enum", "filecmp", "fnmatch",
    "fractions", "ftplib", "functools", "getopt", "glob", "graphlib", "gzip", "hashlib", "heapq",
    "html", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "logging", "math",
    "mimetypes", "netrc", "numbers", "operator", "optparse", "pathlib", "pdb", "pickle",
    "plistlib", "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil",
    "smtplib", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "wave", "weakref", "zipfile", "zlib",
)
BUILTIN_TYPES = ("str", "bytes", "list", "tuple", "dict", "set", "frozenset", "int", "float", "complex", "range")

TOPIC_PROMPTS = (
    "Explain {title}.",
    "What does the Python reference say about {title}?",
    "Can you describe {title} in Python?",
    "I'm learning Python. How does {title} work?",
    "Give me a detailed explanation of {title}.",
    "Tell me about {title}.",
    "Summarize the documentation on {title}.",
    "How should I understand {title}?",
    "Walk me through {title}, please.",
    "I keep getting confused by {title}. What are the rules?",
)
SECTION_PROMPTS = (  # a later part of a topic asked for without context: names the topic
    "Continue the explanation of {title}.",
    "What else should I know about {title}?",
    "What comes next in the documentation on {title}?",
    "Tell me more about {title}.",
    "Explain part {part} of the reference on {title}.",
    "Go deeper into {title}.",
)
CONTINUE_PROMPTS = (  # a second turn in the same conversation
    "Go on.",
    "Tell me more.",
    "Please continue.",
    "What else should I know about {title}?",
    "And then?",
    "Continue the explanation of {title}.",
)
OBJECT_PROMPTS = (
    "What does `{name}` do?",
    "Show me the documentation of `{name}`.",
    "How is `{name}` used?",
    "Explain `{name}` briefly.",
    "What is `{name}`?",
    "Describe `{name}`.",
    "I need help with `{name}`. What does it do?",
    "Quick question: what is `{name}` for?",
)
MODULE_PROMPTS = (
    "Give me an overview of the `{name}` module.",
    "What is the `{name}` module for?",
    "Describe the Python `{name}` module.",
    "What can I do with `{name}`?",
)

MIN_DOC_CHARS = 40
MIN_CHUNK_CHARS = 150
MAX_CHUNK_CHARS = 6000  # about 1.5K tokens with the tiny tokenizer
MAX_CONVERSATION_CHARS = 7000
MULTI_TURN_SHARE = 0.25
TEXT_RECORDS = 8


@dataclass(frozen=True)
class SourceText:
    """One piece of documentation: a reference topic, a module overview or an object's docstring."""

    kind: Literal["topic", "module", "object"]
    name: str  # what a user would ask about
    text: str


def python_doc_sources() -> list[SourceText]:
    """Every source text, in a fixed order: reference topics, then module and object docstrings.

    Collected in a fresh isolated interpreter (`python -I`): in this process, libraries imported
    earlier (torch, pytest, ...) may have patched or added module attributes, which would change
    the corpus.
    """
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from extract.tiny import collect_doc_sources; "
        "json.dump(collect_doc_sources(), sys.stdout)"
    )
    repo = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-I", "-W", "ignore", "-c", code, repo], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"collecting the documentation failed:\n{done.stderr}"
    return [SourceText(kind, name, text) for kind, name, text in json.loads(done.stdout)]


def collect_doc_sources() -> list[tuple[str, str, str]]:
    """(kind, name, text) of every source, in this interpreter (see `python_doc_sources`)."""
    sources = reference_topics() + module_docstrings() + object_docstrings()
    return [(s.kind, s.name, s.text) for s in sources]


def reference_topics() -> list[SourceText]:
    """The language reference topics of `pydoc_data.topics` (hundreds of KB of real English)."""
    from pydoc_data.topics import topics

    sources = []
    for key in sorted(topics):
        title, body = split_topic_heading(topics[key])
        if len(body) >= MIN_DOC_CHARS:
            sources.append(SourceText("topic", title, body))
    return sources


def split_topic_heading(text: str) -> tuple[str, str]:
    """('the "for" statement', body) from a topic that starts with a title underlined by stars."""
    lines = text.strip("\n").split("\n")
    if len(lines) >= 2 and lines[1].startswith("***"):
        title, body = lines[0].strip(), "\n".join(lines[2:]).strip("\n")
    else:
        title, body = lines[0].strip(), text.strip("\n")
    # Titles are used mid-sentence in the prompts: 'Explain the "for" statement.'
    if title[:1].isupper() and not any(c.isupper() for c in title[1:]):  # keep Title Case titles
        title = title[0].lower() + title[1:]
    return title, body


def module_docstrings() -> list[SourceText]:
    sources = []
    for name in DOC_MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc and len(doc) >= MIN_DOC_CHARS:
            sources.append(SourceText("module", name, doc))
    return sources


def object_docstrings() -> list[SourceText]:
    """Docstrings of public functions and classes of `DOC_MODULES` and methods of builtin types,
    each text once (inherited and shared docstrings are dropped after their first use)."""
    seen: set[str] = set()
    sources = []
    for qualified, obj in documented_objects():
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= MIN_DOC_CHARS and doc not in seen:
            seen.add(doc)
            sources.append(SourceText("object", qualified, doc))
    return sources


def documented_objects() -> Iterator[tuple[str, Any]]:
    for type_name in BUILTIN_TYPES:
        cls = getattr(builtins, type_name)
        for attr in sorted(vars(cls)):
            if not attr.startswith("_"):
                yield f"{type_name}.{attr}", getattr(cls, attr)
    for module_name in DOC_MODULES:
        module = importlib.import_module(module_name)
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            is_api = inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)
            # Names a module re-exports from elsewhere are documented where they are defined.
            defined_here = module_name == "builtins" or getattr(obj, "__module__", None) == module.__name__
            if not attr.startswith("_") and is_api and defined_here:
                yield (attr if module_name == "builtins" else f"{module_name}.{attr}"), obj


def build_corpus(seed: int = 0, heldout_fraction: float = 0.06) -> tuple[list[dict], list[dict]]:
    """(train, heldout) chat records built from Python's own documentation, deterministically.

    Reference topics are cut at paragraph boundaries into answers of log-uniformly drawn length
    (150 to 6000 characters), some of them continued over two turns; docstrings give short answers
    (two of them per conversation now and then) and module overviews give medium ones. A few
    module overviews are plain `text` records. The split is a stable hash of each record.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be between 0 and 1, got {heldout_fraction}")
    rng = random.Random(seed)
    sources = python_doc_sources()
    modules = [s for s in sources if s.kind == "module"]
    as_text = set(rng.sample(range(len(modules)), min(TEXT_RECORDS, len(modules))))
    records = []
    for source in sources:
        if source.kind == "topic":
            records += topic_records(source, rng)
    for i, source in enumerate(modules):
        records.append(text_record(source) if i in as_text else module_record(source, rng))
    records += object_records([s for s in sources if s.kind == "object"], rng)
    rng.shuffle(records)
    return split_heldout(records, heldout_fraction, seed)


def topic_records(source: SourceText, rng: random.Random) -> list[dict]:
    """The topic cut into answer-sized chunks; consecutive chunks sometimes form one conversation."""
    chunks = chunk_paragraphs(source.text, rng)
    records = []
    i = 0
    while i < len(chunks):
        prompt = rng.choice(TOPIC_PROMPTS if i == 0 else SECTION_PROMPTS).format(title=source.name, part=i + 1)
        messages = [user(prompt), assistant(chunks[i])]
        fits_two = i + 1 < len(chunks) and len(chunks[i]) + len(chunks[i + 1]) <= MAX_CONVERSATION_CHARS
        if fits_two and rng.random() < MULTI_TURN_SHARE:
            messages += [user(rng.choice(CONTINUE_PROMPTS).format(title=source.name)), assistant(chunks[i + 1])]
            i += 1
        records.append({"messages": messages})
        i += 1
    return records


def chunk_paragraphs(text: str, rng: random.Random) -> list[str]:
    """Consecutive paragraphs grouped into chunks of a log-uniformly drawn target length."""
    chunks: list[str] = []
    current: list[str] = []
    target = draw_chunk_chars(rng)
    for paragraph in split_long(text.split("\n\n"), MAX_CHUNK_CHARS):
        size = sum(len(p) + 2 for p in current)
        if current and size + len(paragraph) > min(target, MAX_CHUNK_CHARS):
            chunks.append("\n\n".join(current))
            current, target = [], draw_chunk_chars(rng)
        current.append(paragraph)
    if current:
        chunks.append("\n\n".join(current))
    # A tail too short to stand alone joins its predecessor when that still fits.
    if len(chunks) >= 2 and len(chunks[-1]) < MIN_CHUNK_CHARS and len(chunks[-2]) + len(chunks[-1]) <= MAX_CHUNK_CHARS:
        chunks[-2:] = [chunks[-2] + "\n\n" + chunks[-1]]
    return [c.strip("\n") for c in chunks if c.strip()]


def draw_chunk_chars(rng: random.Random) -> int:
    return int(math.exp(rng.uniform(math.log(MIN_CHUNK_CHARS), math.log(MAX_CHUNK_CHARS))))


def split_long(paragraphs: list[str], max_chars: int) -> list[str]:
    """Paragraphs longer than `max_chars` (long code listings) cut at line boundaries."""
    out = []
    for paragraph in paragraphs:
        while len(paragraph) > max_chars:
            cut = paragraph.rfind("\n", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            out.append(paragraph[:cut])
            paragraph = paragraph[cut:].lstrip("\n")
        if paragraph.strip():
            out.append(paragraph)
    return out


def module_record(source: SourceText, rng: random.Random) -> dict:
    answer = split_long([source.text], MAX_CHUNK_CHARS)[0]
    return {"messages": [user(rng.choice(MODULE_PROMPTS).format(name=source.name)), assistant(answer)]}


def object_records(sources: list[SourceText], rng: random.Random) -> list[dict]:
    """One short question per documented object; now and then two in one conversation."""
    records = []
    i = 0
    while i < len(sources):
        messages = object_turn(sources[i], rng)
        if i + 1 < len(sources) and rng.random() < MULTI_TURN_SHARE:
            messages += object_turn(sources[i + 1], rng)
            i += 1
        records.append({"messages": messages})
        i += 1
    return records


def object_turn(source: SourceText, rng: random.Random) -> list[dict]:
    answer = split_long([source.text], MAX_CHUNK_CHARS)[0]
    return [user(rng.choice(OBJECT_PROMPTS).format(name=source.name)), assistant(answer)]


def text_record(source: SourceText) -> dict:
    return {"text": split_long([source.text], MAX_CHUNK_CHARS)[0]}


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def split_heldout(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """The `fraction` of records with the smallest hashes is held out: the split depends on the
    records themselves, not on their order, and its size is exact."""
    def key(record: dict) -> bytes:
        return hashlib.sha256(f"{seed}|{json.dumps(record, sort_keys=True)}".encode()).digest()

    ranked = sorted(range(len(records)), key=lambda i: key(records[i]))
    held = set(ranked[: max(1, round(fraction * len(records)))])
    train = [r for i, r in enumerate(records) if i not in held]
    heldout = [r for i, r in enumerate(records) if i in held]
    return train, heldout


def record_texts(records: list[dict]) -> list[str]:
    """The text a tokenizer should be trained on: each message as `role\\ncontent`, or the text."""
    texts = []
    for record in records:
        if "messages" in record:
            texts += [f"{m['role']}\n{m['content']}" for m in record["messages"]]
        else:
            texts.append(record["text"])
    return texts


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    """One record per line, keys sorted, UTF-8: the same records always give the same bytes."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------
# Build parameters


@dataclass
class TinyConfig:
    """How `python -m extract.tiny` builds the tiny default (section `[tiny]` of a config file)."""

    out_dir: str = knob("artifacts/tiny", help="where target/, corpus/ and build.json go")
    seed: int = knob(0, help="seed of the corpus draw, the held-out split, the model init and the batch order", min=0)
    heldout_fraction: float = knob(0.06, help="share of corpus records held out (offline evaluation, speculative-decoding prompts)", min=0.01, max=0.5)
    vocab_size: int = knob(4096, help="tokenizer size, special tokens included (an upper bound on a small corpus)", min=300, max=65536)
    hidden_size: int = knob(128, help="target hidden width", min=16, max=4096)
    intermediate_size: int = knob(384, help="target MLP width", min=16, max=16384)
    num_layers: int = knob(8, help="target decoder layers", min=2, max=64)
    num_heads: int = knob(2, help="attention query heads", min=1, max=64)
    num_kv_heads: int = knob(1, help="attention key/value heads (divides num_heads)", min=1, max=64)
    head_dim: int = knob(64, help="width of one attention head", min=8, max=256)
    n_taps: int = knob(4, help="how many tap layer ids to recommend (evenly spread, never the last layer)", min=1, max=16)
    steps: int = knob(1000, help="optimizer steps of target training", min=0)
    batch_tokens: int = knob(1024, help="padded tokens per training batch (sequences of similar length are batched together)", min=64)
    max_len: int = knob(
        512, help="training sequences are cut to their first max_len tokens. The regenerated answers (prompt + at most "
        "regen_max_new_tokens) stay below 512 tokens, so 512 trains the target where it is used: 4.4 passes over what is "
        "left instead of 3.5 over 2048-token samples, in the same time; held-out next-token accuracy 0.26 against 0.24 "
        "over the first 512 tokens, 0.17 against 0.15 on answer tokens", min=16,
    )
    lr: float = knob(3e-3, help="peak AdamW learning rate (linear warmup, cosine decay to 10%)", min=0.0, max=1.0)
    warmup_steps: int = knob(40, help="learning-rate warmup steps", min=0)
    weight_decay: float = knob(0.1, help="AdamW weight decay on matrices", min=0.0, max=1.0)
    regen_max_new_tokens: int = knob(256, help="cap on each target-regenerated answer (greedy answers that hit it are truncated)", min=1, max=4096)
    regen_batch: int = knob(128, help="prompts per batch of the greedy regeneration (left-padded; larger is faster on CPU up to ~128)", min=1)
    regen_stop_repeat: int = knob(
        16, help="cut a regenerated answer where it starts looping: once its last n >= max(this, p) tokens repeat the p tokens "
        f"before them (any period p <= {REPEAT_MAX_PERIOD}); 0 = answers end only at the stop token or the cap", min=0, max=4096,
    )
    device: Literal["auto", "cpu", "cuda"] = knob("auto", help="where the target trains and answers; auto = cuda when torch sees a GPU")
    precision: Literal["auto", "fp32", "bf16"] = knob(
        "auto", help="training compute: bf16 autocast (fast where the CPU has bf16 instructions), fp32, or auto "
        "(bf16 on a GPU or a CPU with bf16 instructions, else fp32)"
    )
    threads: int = knob(0, help="torch CPU threads; 0 = common.device.small_model_threads() (OMP_NUM_THREADS, else at most 4)", min=0)
    force: bool = knob(False, help="rebuild even when a matching build exists")

    def check(self) -> None:
        if self.num_heads % self.num_kv_heads:
            fail("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.n_taps > self.num_layers - 1:
            fail("n_taps", f"at most num_layers - 1 = {self.num_layers - 1} (the last layer is never a tap)")


def tap_layer_ids(num_layers: int, n_taps: int) -> list[int]:
    """Evenly spread tap ids, never the last layer: DFlash's rule, from layer 1 to layer L-3
    (36 layers, 5 taps -> [1, 9, 17, 25, 33], the published Qwen3-8B drafter's; 8 layers, 4 taps ->
    [1, 2, 4, 5]), widened towards layer 0 and L-2 only when the target is too shallow for that."""
    if not 1 <= n_taps <= num_layers - 1:
        raise ValueError(f"n_taps must be between 1 and {num_layers - 1} for {num_layers} layers, got {n_taps}")
    first, last = 1, num_layers - 3
    if last - first + 1 < n_taps:
        first, last = (1, num_layers - 2) if num_layers - 2 >= n_taps else (0, num_layers - 2)
    if n_taps == 1:
        return [first]
    ids = [first + math.floor(i * (last - first) / (n_taps - 1) + 0.5) for i in range(n_taps)]
    assert len(set(ids)) == n_taps and max(ids) < num_layers - 1, ids
    return ids


def resolve_precision(precision: str, device_type: str = "cpu") -> str:
    """'bf16' on a GPU and where the CPU has native bf16 math (autocast is then about twice as fast), else 'fp32'."""
    if precision != "auto":
        return precision
    if device_type == "cuda":
        return "bf16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "fp32"


def resolve_build_device(choice: str) -> str:
    """'cuda' or 'cpu' for the `device` knob (auto = cuda when torch sees a GPU)."""
    from common.device import resolve_device

    return resolve_device(choice).type


@dataclass
class Compute:
    """Where a build step runs, and what it noticed: ops that warned of nondeterminism on the GPU."""

    device: "torch.device"
    nondeterministic_ops: list[str]


@contextlib.contextmanager
def build_compute(cfg: TinyConfig) -> Iterator[Compute]:
    """The device of the build, set up for it: torch CPU threads (`threads`, else
    `common.device.small_model_threads()`), and on a GPU what makes a build repeat itself on the
    same machine: torch's deterministic kernels, cuBLAS with a fixed workspace, and attention by
    SDPA's math kernel (the fused kernels' backward accumulates atomically). An op without a
    deterministic kernel warns instead of stopping the build; the warnings are collected and reported."""
    import torch

    from common.device import small_model_threads

    compute = Compute(torch.device(resolve_build_device(cfg.device)), [])
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or small_model_threads())
    try:
        if compute.device.type != "cuda":
            yield compute
            return
        with deterministic_cuda(compute.nondeterministic_ops):
            yield compute
    finally:
        torch.set_num_threads(threads_before)


@contextlib.contextmanager
def deterministic_cuda(noticed: list[str]) -> Iterator[None]:
    import warnings

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Read when cuBLAS first runs in this process; ":4096:8" is the setting torch's docs give.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(SDPBackend.MATH):
            warnings.simplefilter("always")
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        for warning in caught:
            message = str(warning.message)
            if "deterministic" in message and message not in noticed:
                noticed.append(message)
                log(f"warning: a GPU op of the build has no deterministic kernel, so two builds may differ: {message}")
            elif "deterministic" not in message:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


# ----------------------------------------------------------------------------------------------
# Target: a small Qwen3 trained on the rendered training conversations


def render_record(tokenizer, record: dict) -> str:
    """The text the target is trained on: the chat template for conversations, text + EOS otherwise."""
    if "messages" in record:
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    return record["text"] + EOS_TOKEN


def encode_records(tokenizer, records: list[dict], max_len: int) -> list[list[int]]:
    texts = [render_record(tokenizer, r) for r in records]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [ids[:max_len] for ids in encoded]


def qwen3_config(cfg: TinyConfig, tokenizer) -> "transformers.Qwen3Config":
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},  # Qwen3's value
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # like the real target: a separate lm_head
        bos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )


def generation_config(tokenizer) -> "transformers.GenerationConfig":
    from transformers import GenerationConfig

    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(EOS_TOKEN)]
    return GenerationConfig(
        bos_token_id=eos[1], eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )


def length_batches(lengths: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped so each batch holds sequences of similar length and at most `batch_tokens`
    padded tokens (widths rounded up to `PAD_MULTIPLE`; one over-long sequence is a batch of its
    own); batch order shuffled. Lengths
    are compared in steps of 16 tokens, so batches are composed differently from epoch to epoch."""
    noise = [rng.random() for _ in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i] // 16, noise[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        width = max(width, padded_width(lengths[i])) if current else padded_width(lengths[i])
        if current and (len(current) + 1) * width > batch_tokens:
            batches.append(current)
            current, width = [], padded_width(lengths[i])
        current.append(i)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def padded_width(length: int) -> int:
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE


def collate(seqs: list[list[int]], pad_id: int) -> dict[str, "torch.Tensor"]:
    """Right-padded input ids, attention mask, and labels with -100 on padding."""
    import torch

    width = padded_width(max(len(s) for s in seqs))
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def endless_batches(seqs: list[list[int]], batch_tokens: int, seed: int) -> Iterator[list[list[int]]]:
    """Epoch after epoch of length-grouped batches, reshuffled per epoch from (seed, epoch)."""
    lengths = [len(s) for s in seqs]
    epoch = 0
    while True:
        for batch in length_batches(lengths, batch_tokens, random.Random(f"{seed}/{epoch}")):
            yield [seqs[i] for i in batch]
        epoch += 1


def learning_rate(step: int, cfg: TinyConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to a tenth of it at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model, cfg: TinyConfig) -> "torch.optim.Optimizer":
    import torch

    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]  # norms: no decay
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train_target(model, seqs: list[list[int]], cfg: TinyConfig, pad_id: int, progress: bool = True) -> list[float]:
    """Next-token training on every position of the rendered samples, on the model's device (the
    same batches and steps on a CPU and a GPU); returns the loss per step."""
    import torch
    from tqdm.auto import tqdm

    model.train()
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, cfg)
    use_bf16 = resolve_precision(cfg.precision, device.type) == "bf16"
    batches = endless_batches(seqs, cfg.batch_tokens, cfg.seed)
    losses = []
    bar = tqdm(range(cfg.steps), desc=f"train tiny target ({device.type})", unit="step", disable=not progress, dynamic_ncols=True)
    tokens, start = 0, time.perf_counter()
    for step in bar:
        batch = {name: t.to(device) for name, t in collate(next(batches), pad_id).items()}
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            logits_BTV = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = next_token_loss(logits_BTV, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += int(batch["attention_mask"].sum())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    model.eval()
    return losses


def next_token_loss(logits_BTV: "torch.Tensor", labels_BT: "torch.Tensor") -> "torch.Tensor":
    """Mean cross-entropy of every position's prediction of the next token (labels -100 skipped),
    computed as log-softmax + gather: torch has no deterministic CUDA kernel for nll_loss."""
    logprobs_BTV = logits_BTV[:, :-1].float().log_softmax(-1)
    targets_BT = labels_BT[:, 1:]
    valid_BT = targets_BT != -100
    picked_BT = logprobs_BTV.gather(-1, targets_BT.clamp(min=0)[..., None])[..., 0]
    return -(picked_BT * valid_BT).sum() / valid_BT.sum().clamp(min=1)


def next_token_accuracy(
    model, seqs: list[list[int]], batch_tokens: int, pad_id: int, masks: list[list[bool]] | None = None
) -> tuple[int, int]:
    """(correct, total) of the model's argmax next-token prediction over every position with a
    successor, or only where the predicted token is marked in `masks`."""
    import torch

    correct = total = 0
    lengths = [len(s) for s in seqs]
    device = next(model.parameters()).device
    with torch.inference_mode():
        for batch_idx in length_batches(lengths, batch_tokens, random.Random(0)):
            batch = {name: t.to(device) for name, t in collate([seqs[i] for i in batch_idx], pad_id).items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            predicted, target = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
            valid = target != -100
            if masks is not None:
                marked = torch.zeros(batch["attention_mask"].shape, dtype=torch.bool)
                for row, i in enumerate(batch_idx):
                    marked[row, : len(masks[i])] = torch.tensor(masks[i], dtype=torch.bool)
                valid &= marked[:, 1:].to(device)
            correct += int((predicted == target)[valid].sum())
            total += int(valid.sum())
    return correct, total


def assistant_masks(tokenizer, records: list[dict], max_len: int) -> list[list[bool]]:
    """Per token of each rendered record (as `encode_records` makes them): True inside an assistant
    answer (its content and closing `<|im_end|>`), the tokens a drafter is trained to propose."""
    masks = []
    for record in records:
        text = render_record(tokenizer, record)
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        spans = assistant_spans(text, record)
        masks.append([any(a <= start < b for a, b in spans) for start, _ in offsets[:max_len]])
    return masks


def assistant_spans(text: str, record: dict) -> list[tuple[int, int]]:
    spans, cursor = [], 0
    for message in record.get("messages", []):
        if message["role"] == "assistant":
            start = text.index(message["content"] + IM_END, cursor)
            cursor = start + len(message["content"]) + len(IM_END)
            spans.append((start, cursor))
    return spans


def frequency_baseline(
    train_seqs: list[list[int]], eval_seqs: list[list[int]], masks: list[list[bool]] | None = None
) -> tuple[int, float]:
    """(token, accuracy): always predicting the token most frequent as a training target, scored
    like `next_token_accuracy` (every position with a successor, or only the marked ones)."""
    from collections import Counter

    counts = Counter(t for s in train_seqs for t in s[1:])
    token = min(counts, key=lambda t: (-counts[t], t))
    targets = [
        t for i, s in enumerate(eval_seqs) for j, t in enumerate(s) if j > 0 and (masks is None or masks[i][j])
    ]
    return token, sum(t == token for t in targets) / max(1, len(targets))


def length_summary(seqs: list[list[int]]) -> dict[str, Any]:
    lengths = sorted(len(s) for s in seqs)
    if not lengths:
        return {"records": 0, "tokens": 0}
    def pick(q: float) -> int:
        return lengths[round(q * (len(lengths) - 1))]
    edges = [128, 512, 1024, 2048]
    buckets = {}
    for lo, hi in zip([0] + edges, edges + [None]):
        name = f"{lo}-{hi - 1}" if hi else f"{lo}+"
        buckets[name] = sum(1 for n in lengths if n >= lo and (hi is None or n < hi))
    return {
        "records": len(lengths),
        "tokens": sum(lengths),
        "length_min": lengths[0], "length_p10": pick(0.1), "length_p50": pick(0.5),
        "length_p90": pick(0.9), "length_max": lengths[-1],
        "records_by_length": buckets,
    }


def build_tiny_target(
    out_dir: str | os.PathLike,
    train_records: list[dict],
    heldout_records: list[dict],
    cfg: TinyConfig | None = None,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Train the tokenizer and a small Qwen3 on `train_records`, save an HF directory to `out_dir`,
    measure held-out next-token accuracy of the saved (bf16) model, write `tiny_report.json`.

    Returns the report. `out_dir` gets `config.json`, `model.safetensors` (bf16),
    `generation_config.json`, the tokenizer files with the chat template, and `tiny_report.json`.
    """
    import torch

    cfg = cfg or TinyConfig()
    if not train_records or not heldout_records:
        raise ValueError("build_tiny_target needs training and held-out records")
    out = Path(out_dir)
    started = time.perf_counter()
    with build_compute(cfg) as compute:
        report = train_and_report(out, train_records, heldout_records, cfg, compute, progress, started)
    report["gpu_nondeterministic_ops"] = compute.nondeterministic_ops
    (out / "tiny_report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def train_and_report(
    out: Path, train_records: list[dict], heldout_records: list[dict], cfg: TinyConfig, compute: "Compute", progress: bool, started: float
) -> dict[str, Any]:
    tokenizer = build_chat_tokenizer(record_texts(train_records), cfg.vocab_size)
    train_seqs = encode_records(tokenizer, train_records, cfg.max_len)
    heldout_seqs = encode_records(tokenizer, heldout_records, cfg.max_len)
    losses = train_and_save(out, tokenizer, train_seqs, cfg, compute.device, progress)
    train_seconds = time.perf_counter() - started
    report = {
        **evaluate_saved(out, tokenizer, train_seqs, heldout_seqs, heldout_records, cfg, compute.device),
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else None,
        "tap_layer_ids": tap_layer_ids(cfg.num_layers, cfg.n_taps),
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": len(tokenizer),
        "mask_token": MASK_TOKEN,
        "mask_token_id": tokenizer.mask_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "im_end_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "chat_template": "qwen3-style; enable_thinking=False adds an empty <think> block (see extract/tiny.py)",
        "device": compute.device.type,
        "precision": resolve_precision(cfg.precision, compute.device.type),
        "threads": torch_threads(),
        "train_seconds": round(train_seconds, 1),
        "corpus": {"train": length_summary(train_seqs), "heldout": length_summary(heldout_seqs)},
    }
    return report


def train_and_save(
    out: Path, tokenizer, train_seqs: list[list[int]], cfg: TinyConfig, device: "torch.device", progress: bool
) -> list[float]:
    """Train a fresh Qwen3 from `cfg.seed` on `device`; save it in bf16 (as the real target ships) with the tokenizer."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(qwen3_config(cfg, tokenizer))  # initialized on the CPU: the same weights on every device
    model.generation_config = generation_config(tokenizer)
    losses = train_target(model.to(device), train_seqs, cfg, tokenizer.pad_token_id, progress)
    model.to("cpu", torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return losses


def evaluate_saved(
    out: Path, tokenizer, train_seqs: list[list[int]], heldout_seqs: list[list[int]], heldout_records: list[dict], cfg: TinyConfig,
    device: "torch.device | str" = "cpu",
) -> dict[str, Any]:
    """Next-token accuracy of the model as saved (reloaded in bf16, as extraction will run it), on
    every held-out position and on answer tokens only, against always predicting the most
    frequent token; plus the accuracy on as many training samples, to show the generalization gap."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, trust_remote_code=False).to(device).eval()
    pad = tokenizer.pad_token_id
    answers = assistant_masks(tokenizer, heldout_records, cfg.max_len)
    correct, total = next_token_accuracy(model, heldout_seqs, EVAL_BATCH_TOKENS, pad)
    answer_correct, answer_total = next_token_accuracy(model, heldout_seqs, EVAL_BATCH_TOKENS, pad, answers)
    train_correct, train_total = next_token_accuracy(model, train_seqs[: len(heldout_seqs)], EVAL_BATCH_TOKENS, pad)
    baseline_token, baseline = frequency_baseline(train_seqs, heldout_seqs)
    _, answer_baseline = frequency_baseline(train_seqs, heldout_seqs, answers)
    return {
        "heldout_next_token_accuracy": correct / max(1, total),
        "heldout_positions": total,
        "heldout_answer_next_token_accuracy": answer_correct / max(1, answer_total),
        "heldout_answer_positions": answer_total,
        "train_probe_next_token_accuracy": train_correct / max(1, train_total),
        "most_frequent_token_accuracy": baseline,
        "most_frequent_token_answer_accuracy": answer_baseline,
        "most_frequent_token": tokenizer.convert_ids_to_tokens(baseline_token),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------
# Target-regenerated corpus (dflash.md §3.1): the corpus prompts answered by the target itself
#
# DFlash trains on the target's own answers to user prompts. Offline τ equals online greedy τ only
# where the data tokens are the target's greedy continuation (dflash.md §4.3), and the tiny target's
# own answers (generic, repetitive) are what a drafter can learn, unlike documentation text the
# target predicts poorly. So every user turn is re-answered by the saved target, greedily, on the
# prompt rendered exactly as `train.specdecode.prompts_from_jsonl` renders it.

REGEN_FILES = {"train": "corpus/train_regen.jsonl", "heldout": "corpus/heldout_regen.jsonl"}


def answer_prompt(tokenizer, messages: list[dict]) -> str:
    """The conversation so far as the target sees it before it answers: the chat template with the
    generation prompt, non-thinking (train.specdecode's rendering of prompts)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def regenerate_records(
    model, tokenizer, records: list[dict], max_new_tokens: int, batch_size: int = 64, *, stop_repeat: int = 0, progress: bool = False
) -> tuple[list[dict], dict[str, Any]]:
    """(records, stats): every record's user turns answered by `model`'s greedy decoding, through
    the `local` backend of `python -m extract.regenerate` (`extract.regenerate.local`, one window
    holding all records, thinking disabled as `answer_prompt` renders).

    A record keeps its user (and system) turns; each assistant answer is replaced, turn by turn,
    by the target's greedy continuation of the conversation so far (earlier answers already
    regenerated), cut before the stop token, at `max_new_tokens`, or (`stop_repeat` > 0) where it
    starts looping (`RepeatWatch`). Records without a user turn
    are skipped; a record with an answer that would be empty is dropped; both are counted. An
    answer whose text would tokenize differently is cut to its longest prefix that tokenizes back
    to the same ids, so extraction reads exactly the tokens the target generated.
    """
    from tqdm.auto import tqdm

    from extract.reading import RawRecord
    from extract.regenerate.conversation import EMPTY_ANSWER, NO_USER_TURN, NOT_A_CHAT, Conversation, Renderer
    from extract.regenerate.local import LocalGenerator, answer_window

    no_thinking = {"enable_thinking": False}
    renderer = Renderer(tokenizer, "disable", no_thinking, no_thinking)
    conversations = [Conversation(RawRecord(i, f"record {i}", record), renderer, at_cap="keep") for i, record in enumerate(records)]
    generator = LocalGenerator(model, tokenizer, max_new_tokens, batch_size, stop_repeat=stop_repeat)
    with tqdm(desc="regenerate answers", unit="prompt", disable=not progress, dynamic_ncols=True) as bar:
        answer_window(conversations, generator, on_batch=bar.update)
    outcomes = [c.outcome for c in conversations]
    reasons = [o.reason for o in outcomes]
    stats: dict[str, Any] = {
        "records_in": len(records), "skipped_no_user_turn": sum(r in (NOT_A_CHAT, NO_USER_TURN) for r in reasons),
        "dropped_empty_answer": reasons.count(EMPTY_ANSWER), "dropped_no_round_trip": sum(r not in (None, NOT_A_CHAT, NO_USER_TURN, EMPTY_ANSWER) for r in reasons),
        "answers": sum(o.stats["answers"] for o in outcomes), "answers_at_cap": sum(o.stats["at_cap"] for o in outcomes),
        "answers_cut_at_repeat": sum(o.stats["at_repeat"] for o in outcomes),
        "answers_cut_to_round_trip": sum(o.stats["cut"] for o in outcomes),
    }
    lengths = [n for c in conversations for n in c.answer_lengths]
    out = [o.record for o in outcomes if o.record is not None]
    stats.update(records_out=len(out), answer_tokens=sum(lengths), answer_length=quantiles(lengths))
    return out, stats


def quantiles(values: list[int]) -> dict[str, int]:
    if not values:
        return {}
    ordered = sorted(values)
    return {name: ordered[round(q * (len(ordered) - 1))] for name, q in (("min", 0), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("max", 1))}


def greedy_answers(
    model, prompts: list[list[int]], max_new_tokens: int, batch_size: int, stop_ids: set[int], pad_id: int, stop_repeat: int = 0,
) -> list[tuple[list[int], str]]:
    """(tokens, how the answer ended: "stop", "repeat" or "cap") of greedy decoding per prompt
    (`extract.regenerate.local.generate_answers`, the regeneration's own batched decoding)."""
    from extract.regenerate.local import generate_answers

    return generate_answers(model, prompts, max_new_tokens, batch_size, stop_ids, pad_id, stop_repeat=stop_repeat)


def regenerate_corpus(
    target_dir: str | os.PathLike, train: list[dict], heldout: list[dict], cfg: TinyConfig | None = None, *, progress: bool = True
) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train, heldout, report) of the target-regenerated corpus, answered by the target saved in
    `target_dir`, loaded as extraction and speculative decoding load it (float32 from the bf16 file).

    The report has counts and lengths per split, the time taken, and the share of held-out answer
    tokens that equal the target's teacher-forced greedy prediction (about 1: the data is the
    target's greedy continuation; the misses are the `<|im_end|>` closing answers cut at the cap
    or where they start repeating).
    """
    from common.target import load_target

    cfg = cfg or TinyConfig()
    with build_compute(cfg) as compute:
        target = load_target(str(target_dir), dtype="float32", device=compute.device)
        model, tokenizer = target.model, target.tokenizer
        started = time.perf_counter()
        splits = {}
        for name, records in (("train", train), ("heldout", heldout)):
            splits[name] = regenerate_records(model, tokenizer, records, cfg.regen_max_new_tokens, cfg.regen_batch,
                                              stop_repeat=cfg.regen_stop_repeat, progress=progress)
        seconds = time.perf_counter() - started
        report = {"max_new_tokens": cfg.regen_max_new_tokens, "stop_repeat": cfg.regen_stop_repeat, "seconds": round(seconds, 1),
                  "device": compute.device.type, "threads": torch_threads(), "files": dict(REGEN_FILES)}
        for name, (records, stats) in splits.items():
            report[name] = {**stats, "tokens": length_summary(encode_records(tokenizer, records, cfg.max_len))}
        report["heldout_answer_greedy_agreement"] = greedy_agreement(model, tokenizer, splits["heldout"][0], cfg.max_len)
    report["gpu_nondeterministic_ops"] = compute.nondeterministic_ops
    return splits["train"][0], splits["heldout"][0], report


def greedy_agreement(model, tokenizer, records: list[dict], max_len: int) -> float:
    """Share of answer tokens that equal the model's greedy next token given the data before them."""
    seqs = encode_records(tokenizer, records, max_len)
    masks = assistant_masks(tokenizer, records, max_len)
    correct, total = next_token_accuracy(model, seqs, EVAL_BATCH_TOKENS, tokenizer.pad_token_id, masks)
    return correct / max(1, total)


# ----------------------------------------------------------------------------------------------
# The cached build of artifacts/tiny

BUILD_RECORD = "build.json"
REQUIRED_FILES = (
    BUILD_RECORD,
    "corpus/train.jsonl",
    "corpus/heldout.jsonl",
    *REGEN_FILES.values(),
    "target/config.json",
    "target/generation_config.json",
    "target/model.safetensors",
    "target/tokenizer.json",
    "target/tokenizer_config.json",
    "target/tiny_report.json",
)
# Knobs that change where or how fast the build runs, not what it builds.
NOT_IN_RECIPE = ("out_dir", "threads", "force")


# The code that decides the artifacts: this file, the regeneration code it answers the corpus with, the repeat rule.
RECIPE_CODE = (*(Path(__file__).parent / name for name in ("tiny.py", "regenerate/local.py", "regenerate/conversation.py")),
               Path(__file__).parent.parent / "common" / "repeat.py")


def recipe(cfg: TinyConfig) -> dict[str, Any]:
    """Everything that decides the artifacts: build parameters with the device type and precision
    they resolve to here, this file's code (and the regeneration's and the repeat rule's), and the
    Python version (its bundled documentation is the corpus).

    A CPU build and a GPU build are different computations (other kernels, bf16 on the GPU where a
    CPU may train in fp32), so the device type is part of the recipe: on a GPU host a CPU-built
    cache is rebuilt, not passed off as a GPU build, and the other way round. Left out on purpose:
    library versions, the CPU model and the thread count. They change the rounding, which after
    1,000 training steps gives a different but equally valid target, not a different recipe (the
    demo's numbers differ with it: README and docs/benchmarks.md give the spread measured across
    machines), and build.json records the machine that built the cache (`built_on`)."""
    params = {k: v for k, v in config_to_dict(cfg).items() if k not in NOT_IN_RECIPE}
    params["device"] = resolve_build_device(cfg.device)
    params["precision"] = resolve_precision(cfg.precision, params["device"])
    return {
        "params": params,
        "code": hashlib.sha256(b"".join(path.read_bytes() for path in RECIPE_CODE)).hexdigest()[:16],
        "python": sys.version.split()[0],
    }


def recipe_digest(cfg: TinyConfig) -> str:
    return hashlib.sha256(json.dumps(recipe(cfg), sort_keys=True).encode()).hexdigest()[:16]


def is_built(out_dir: str | os.PathLike, digest: str) -> bool:
    """True when `out_dir` holds a finished build of exactly this recipe."""
    out = Path(out_dir)
    if not all((out / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return json.loads((out / BUILD_RECORD).read_text()).get("recipe_digest") == digest
    except (OSError, ValueError):
        return False


def build_tiny(cfg: TinyConfig | None = None, *, progress: bool = True) -> Path:
    """Build the tiny corpus and target into `cfg.out_dir` unless a matching build is there.

    The build happens in a temporary sibling directory that is renamed into place at the end, so a
    build killed midway never looks finished; its leftovers are removed by the next run. A lock
    file makes concurrent callers wait for one build instead of racing.
    """
    cfg = cfg or TinyConfig()
    out = Path(cfg.out_dir).resolve()
    digest = recipe_digest(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        if not cfg.force and is_built(out, digest):
            log(f"tiny default is up to date in {out} (recipe {digest}); nothing to do")
            return out
        remove_leftovers(out)
        tmp = out.with_name(f"{out.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            build_into(tmp, cfg, digest, progress)
            from common.io import replace_local_dir  # here: pyarrow need not load for a cached build

            replace_local_dir(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_into(tmp: Path, cfg: TinyConfig, digest: str, progress: bool) -> None:
    from common.device import describe_machine

    started = time.perf_counter()
    log(f"building the tiny default (recipe {digest}) in {tmp}")
    train, heldout = build_corpus(cfg.seed, cfg.heldout_fraction)
    write_jsonl(tmp / "corpus/train.jsonl", train)
    write_jsonl(tmp / "corpus/heldout.jsonl", heldout)
    log(f"corpus: {len(train)} train and {len(heldout)} held-out records")
    report = build_tiny_target(tmp / "target", train, heldout, cfg, progress=progress)
    log(f"target trained on {report['device']} in {report['train_seconds']:.0f} s; regenerating the answers with it")
    train_regen, heldout_regen, regen = regenerate_corpus(tmp / "target", train, heldout, cfg, progress=progress)
    write_jsonl(tmp / REGEN_FILES["train"], train_regen)
    write_jsonl(tmp / REGEN_FILES["heldout"], heldout_regen)
    report["regenerated_corpus"] = regen
    (tmp / "target/tiny_report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    record = {
        "recipe_digest": digest,
        "recipe": recipe(cfg),
        "built_on": describe_machine(),
        "build_seconds": round(time.perf_counter() - started, 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")  # written last
    log(summary_lines(report, record["build_seconds"]))


def remove_leftovers(out: Path) -> None:
    """Delete temporary directories of earlier builds that were killed (the lock is held)."""
    for leftover in sorted(out.parent.glob(f"{out.name}.*.tmp")):
        log(f"removing the leftover of an unfinished build: {leftover}")
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    with open(out.with_name(f"{out.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def summary_lines(report: dict[str, Any], seconds: float) -> str:
    train, heldout = report["corpus"]["train"], report["corpus"]["heldout"]
    return "\n".join(
        [
            f"tiny target: Qwen3, {report['num_layers']} layers, hidden {report['hidden_size']}, "
            f"{report['parameters'] / 1e6:.2f}M parameters, vocab {report['vocab_size']}, "
            f"mask token {report['mask_token']} = {report['mask_token_id']}",
            f"held-out next-token accuracy {report['heldout_next_token_accuracy']:.3f} "
            f"(always the most frequent token: {report['most_frequent_token_accuracy']:.3f}; "
            f"on training samples: {report['train_probe_next_token_accuracy']:.3f}); "
            f"on answer tokens {report['heldout_answer_next_token_accuracy']:.3f} "
            f"(most frequent token: {report['most_frequent_token_answer_accuracy']:.3f})",
            f"corpus tokens: train {train['tokens']} in {train['records']} records, "
            f"held-out {heldout['tokens']} in {heldout['records']}",
            *regen_summary_lines(report.get("regenerated_corpus")),
            f"tap layer ids {report['tap_layer_ids']}; built in {seconds:.0f} s",
        ]
    )


def regen_summary_lines(regen: dict[str, Any] | None) -> list[str]:
    if not regen:
        return []
    train, heldout = regen["train"], regen["heldout"]
    dropped = train["dropped_empty_answer"] + heldout["dropped_empty_answer"]
    no_round_trip = train["dropped_no_round_trip"] + heldout["dropped_no_round_trip"]
    skipped = train["skipped_no_user_turn"] + heldout["skipped_no_user_turn"]
    answers = train["answers"] + heldout["answers"]
    at_cap = train["answers_at_cap"] + heldout["answers_at_cap"]
    at_repeat = train.get("answers_cut_at_repeat", 0) + heldout.get("answers_cut_at_repeat", 0)
    return [
        f"target-regenerated corpus: {train['records_out']} train and {heldout['records_out']} held-out records "
        f"(dropped: {dropped} with an empty answer, {no_round_trip} whose answer does not survive tokenization; "
        f"{skipped} without a user turn skipped), {answers} greedy answers, "
        f"median {train['answer_length'].get('p50')} tokens, {at_repeat} cut where they start repeating, "
        f"{at_cap} cut at {regen['max_new_tokens']}; {regen['seconds']:.0f} s on {regen.get('device', 'cpu')}",
        f"held-out regenerated answer tokens equal to the target's greedy token: {regen['heldout_answer_greedy_agreement']:.4f}",
    ]


def log(message: str) -> None:
    print(f"[tiny] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Spinning OpenMP threads waste most of the CPU when cores are shared: 100 training steps took
    # 78 s with the default wait policy against 20 s passive on 2 busy cores. Read when torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        cfg = parse_cli(TinyConfig, argv, section="tiny")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = build_tiny(cfg)
    log(f"target:  {out / 'target'}  (report: {out / 'target' / 'tiny_report.json'})")
    log(f"corpus:  {out / 'corpus' / 'train.jsonl'}  {out / 'corpus' / 'heldout.jsonl'}  (real text)")
    log(f"         {out / REGEN_FILES['train']}  {out / REGEN_FILES['heldout']}  (target-regenerated answers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
