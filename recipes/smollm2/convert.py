"""A GGUF checkpoint -> a Hugging Face checkpoint directory that every stage loads like any other
target: config.json, generation_config.json, model.safetensors (float32), the tokenizer files and
the chat template, and `conversion.json` (where it came from, and each file's checksum).

transformers reads the GGUF (with the `gguf` package) and dequantizes its tensors to float32; the
tensors are written as they come out (no rounding to bf16), so the converted target computes what
the GGUF's dequantized weights compute. The output is deterministic: the same GGUF gives the same
bytes (`checksum` over the files' checksums), which `conversion.json` records and a test holds.
Written into a temporary directory and renamed into place: a killed conversion leaves no target, and
the next build removes what it left (`remove_temporaries`). The directory and its files get the
permissions of an ordinary output (the umask's), not the temporary's 0700 / 0600.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common.hashing import file_checksum, json_digest
from recipes.smollm2.pins import ordinary_mode

CONVERSION_RECORD = "conversion.json"
# What the converted directory must hold (the tokenizer writes its own, version-dependent extra files).
REQUIRED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", CONVERSION_RECORD)


def file_checksums(directory: Path) -> dict[str, str]:
    """{file name: xxh3-128} of every file in `directory` except the conversion record."""
    import pyarrow.fs as pafs

    fs = pafs.LocalFileSystem()
    return {
        p.name: file_checksum(fs, str(p))
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != CONVERSION_RECORD
    }


def directory_checksum(checksums: dict[str, str]) -> str:
    return json_digest(sorted(checksums.items()))


def temporary_dir(out: Path) -> Path:
    """A new temporary directory beside `out`, named so that `remove_temporaries(out)` finds it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))


def remove_temporaries(out: Path) -> list[Path]:
    """Delete the temporary directories a killed run left beside `out` (the caller holds the build's
    lock, so no live run owns them); the ones removed."""
    stale = sorted(out.parent.glob(f".{out.name}.tmp-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def give_ordinary_permissions(directory: Path) -> None:
    """Directory and files readable as any output (0755 / 0644 under the usual umask): mkdtemp makes
    the directory 0700, and some writers make their files 0600."""
    os.chmod(directory, ordinary_mode(0o777))
    for path in directory.iterdir():
        os.chmod(path, ordinary_mode(0o777 if path.is_dir() else 0o666))


def convert_gguf(gguf: Path, out: Path, *, name: str, source: dict[str, Any]) -> dict[str, Any]:
    """Convert `gguf` into the directory `out` (replaced whole); returns the conversion record."""
    tmp = temporary_dir(out)
    try:
        write_target(gguf, tmp, name)
        checksums = file_checksums(tmp)
        record = {
            "name": name,
            "source": source,
            "files": checksums,
            "checksum": directory_checksum(checksums),
            "dtype": "float32",
        }
        (tmp / CONVERSION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        give_ordinary_permissions(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def write_target(gguf: Path, out: Path, name: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are written dequantized
    config["_name_or_path"] = name
    config["dtype"] = "float32"
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # the same tensor as the embedding; transformers ties it on load
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    drop_load_flags(out / "tokenizer_config.json")


# How the tokenizer was loaded (offline or not), not what it is: kept out so that the bytes do not
# depend on the environment the conversion ran in (HF_HUB_OFFLINE turns local_files_only on).
LOAD_FLAGS = ("is_local", "local_files_only")


def drop_load_flags(path: Path) -> None:
    config = json.loads(path.read_text())
    for key in LOAD_FLAGS:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
