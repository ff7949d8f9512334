"""What a target directory must hold before a stage loads anything from it: `config.json`, the
weights and a tokenizer. A directory without them is refused by name in one line (`check_target_files`)
where the stage checks its inputs, before any corpus is read or model code runs; without this check
a tokenizer-less target met transformers' own errors mid-run, and a directory holding only
`config.json` passed the config checks and was refused once the weights were loaded.
"""

from __future__ import annotations

import os

from common.config import fail

CONFIG_FILE = "config.json"
# The files a tokenizer is read from: fast (tokenizer.json), SentencePiece, BPE / WordPiece vocabularies, tiktoken.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
TOKENIZER_SUFFIXES = (".tiktoken",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def target_files_problem(target_dir: str, *, weights: bool = True, tokenizer: bool = True) -> str | None:
    """What `target_dir` lacks to be loaded as a Hugging Face model directory (None: nothing)."""
    if not os.path.isdir(target_dir):
        return f"{target_dir} is not a directory (a local Hugging Face model: config.json, weights, tokenizer)"
    names = set(os.listdir(target_dir))
    missing = []
    if CONFIG_FILE not in names:
        missing.append("its config.json")
    if weights and not any(n.endswith(WEIGHT_SUFFIXES) and not n.startswith(".") for n in names):
        missing.append(f"weights (no {', '.join('*' + s for s in WEIGHT_SUFFIXES)} file)")
    if tokenizer and not (names & set(TOKENIZER_FILES) or any(n.endswith(TOKENIZER_SUFFIXES) for n in names)):
        missing.append(f"a tokenizer (none of {', '.join(TOKENIZER_FILES)}, *.tiktoken)")
    if not missing:
        return None
    return (
        f"{target_dir} holds no {' and no '.join(missing)}: a target is a whole Hugging Face model directory "
        "(copy the model's files into it, e.g. `huggingface-cli download MODEL --local-dir DIR`)"
    )


def check_target_files(target_dir: str, key: str = "target", *, weights: bool = True, tokenizer: bool = True) -> None:
    """ConfigError naming `key` when `target_dir` lacks what `target_files_problem` names."""
    problem = target_files_problem(target_dir, weights=weights, tokenizer=tokenizer)
    if problem:
        fail(key, problem)
