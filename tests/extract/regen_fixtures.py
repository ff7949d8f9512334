"""Helpers of the regeneration tests: a tiny random Qwen3 target that answers in whole words (its
lm_head can only pick word tokens and `<|im_end|>`), so its answers survive the tokenizer round
trip without training; corpora; running the CLI in a child process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from tests.extract.conftest import build_model, qwen3_config, qwen35_text_config, sentence, write_lines
from tests.paths import REPO, child_pythonpath


def word_token_ids(tokenizer) -> list[int]:
    return sorted(i for t, i in tokenizer.get_vocab().items() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 2)


def word_model(tokenizer, *, hybrid: bool = False, seed: int = 0, stop_weight: float = 1.0):
    """A random model whose greedy (and sampled) answers are words and `<|im_end|>`."""
    from recipes.tiny import generation_config

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    make = qwen35_text_config if hybrid else qwen3_config
    model = build_model(
        make(len(tokenizer), layers=2, eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id), seed=seed
    )
    keep = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool)
    keep[word_token_ids(tokenizer) + [im_end]] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0  # logit 0: below the best word's (positive) logit
        model.lm_head.weight[im_end] *= stop_weight
    model.generation_config = generation_config(tokenizer)
    return model


def save_target(path, model, tokenizer) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def chat_corpus(path, n: int = 12, seed: int = 0, *, extra: list | None = None) -> str:
    """Single- and multi-turn chats, prompt-only records, and `extra` lines."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if i % 4 == 1:
            lines.append(
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": sentence(rng, 4)},
                        {"role": "assistant", "content": "old"},
                        {"role": "user", "content": sentence(rng, 3)},
                        {"role": "assistant", "content": "old"},
                    ]
                }
            )
        elif i % 4 == 2:
            lines.append({"prompt": sentence(rng, rng.randint(2, 9))})
        else:
            lines.append(
                {
                    "messages": [
                        {"role": "user", "content": sentence(rng, rng.randint(2, 12))},
                        {"role": "assistant", "content": sentence(rng, 5)},
                    ]
                }
            )
    return write_lines(path, lines + list(extra or []))


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def regenerate_cli(*words: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m extract.regenerate WORDS` in a child process."""
    child_env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "extract.regenerate", *words],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env,
        timeout=timeout,
    )


def run_crashing_before_provenance(monkeypatch, cfg, **run_kwargs) -> None:
    """Run regeneration with the write of regenerate.json raising KeyboardInterrupt (so data.jsonl and
    rejects.jsonl are in place and regenerate.json is not); that write works again afterwards."""
    from extract.regenerate import run as R
    from extract.regenerate import store

    real = store.atomic_write_json

    def crash(path, obj, *args):
        if path.endswith(store.PROVENANCE_FILE):
            raise KeyboardInterrupt
        return real(path, obj, *args)

    monkeypatch.setattr(store, "atomic_write_json", crash)
    with pytest.raises(KeyboardInterrupt):
        R.run(cfg, **run_kwargs)
    monkeypatch.setattr(store, "atomic_write_json", real)


def answered_baseline(root, tokenizer, chats: int, settings: list[str], name: str) -> dict:
    """A word model saved as a target, a corpus of `chats` chats and two broken lines, and the
    corpus regenerated under root/`name` with `settings`: {"root", "target", "corpus", "model", name}."""
    from common.config import load_config
    from extract.regenerate import run as R
    from extract.regenerate.config import RegenerateConfig

    model = word_model(tokenizer, stop_weight=2.0)
    target = save_target(root / "target", model, tokenizer)
    corpus = chat_corpus(root / "corpus.jsonl", chats, extra=[{"text": "no prompt"}, "{broken"])
    out = root / name
    cfg = load_config(RegenerateConfig, None, [f"target={target}", f"corpus={corpus}", f"out={out}", *settings])
    assert R.run(cfg, model=model, tokenizer=tokenizer)["complete"]
    return {"root": root, "target": target, "corpus": corpus, "model": model, name: out}


def start_regenerate_child(words: list[str]) -> subprocess.Popen:
    """The regeneration CLI with these key=value words in a child process (for kills), one thread."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "extract.regenerate", *words],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
