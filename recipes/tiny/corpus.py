"""The tiny default's corpus: chat records whose answers are real text shipped with Python (the language
reference topics, module and object docstrings), built deterministically (`build_corpus`), and
JSONL reading and writing.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DOC_MODULES = (
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "builtins",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "mimetypes",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pdb",
    "pickle",
    "plistlib",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shlex",
    "shutil",
    "smtplib",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "zipfile",
    "zlib",
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
        "import json, sys; sys.path.insert(0, sys.argv[1]); from recipes.tiny.corpus import collect_doc_sources; "
        "json.dump(collect_doc_sources(), sys.stdout)"
    )
    repo = str(Path(__file__).resolve().parents[2])
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
