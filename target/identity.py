"""A target's identity: digests of its checkpoint directory, each computed without building the
model (`target_identity`), which extraction records in the shards' manifest and every later stage
compares (`target.identity_check`):

  config_hash             xxh3-128 of config.json as parsed: another architecture, size or setting
  weights_digest          the weight files' names and sizes and 1 MiB of each from its start, middle
                          and end (a quick fingerprint, kept so that records made before the next
                          field existed still compare)
  weights_content_digest  every byte of every weight file (`target.file_digests`: hashed once per
                          file and cached by the file's identity): a weight changed anywhere in any
                          file is another target
  head_digest             every byte of the stored embedding and output head, with their dtype and
                          shape, labelled the same whatever the stored names: the two tensors a
                          drafter shares with its target; None without safetensors weights

`directory_digest` is what the drafter command's ledger keys its steps by: the weights' content
digest and every other file of the directory (config, tokenizer, chat template, generation config).

`read_stored_head` reads those two tensors as stored; a stage that also keeps them (training's and
evaluation's `train.model.TargetHead`) reads them once and hands them to `target_identity`.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import xxhash

from common.hashing import json_digest
from target.arch import TargetArch, check_architecture
from target.checkpoint import EMBED, LM_HEAD, load_tensors, read_config, weight_files
from target.file_digests import file_digest

__all__ = [
    "StoredHead",
    "read_stored_head",
    "target_identity",
    "weights_digest",
    "weights_content_digest",
    "directory_digest",
    "head_digest",
    "stored_head_digest",
    "stored_head_or_none",
]

_DIGEST_SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def weights_digest(path: str | os.PathLike) -> str:
    """A fast fingerprint of the weight files: names, sizes, and 1 MiB from the start, middle and
    end of each (hashing 55 GB would take minutes; any other checkpoint differs in these bytes)."""
    h = xxhash.xxh3_128()
    names = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".pt", ".index.json")))
    for name in names:
        full = os.path.join(path, name)
        size = os.path.getsize(full)
        h.update(f"{name}:{size}|".encode())
        with open(full, "rb") as f:
            for at in sorted({0, max(0, size // 2 - _DIGEST_SAMPLE_BYTES // 2), max(0, size - _DIGEST_SAMPLE_BYTES)}):
                f.seek(at)
                h.update(f.read(_DIGEST_SAMPLE_BYTES))
    return h.hexdigest()


def loaded_weight_files(path: str | os.PathLike) -> list[str]:
    """The weight files transformers loads from the directory: its safetensors (the index's, else every
    one), else its PyTorch `.bin` files; names, sorted."""
    names = weight_files(path)
    if names:
        return names
    return sorted(f for f in os.listdir(path) if f.endswith(".bin") and os.path.isfile(os.path.join(path, f)))


def weights_content_digest(path: str | os.PathLike) -> str | None:
    """xxh3-128 over every weight file's name, size and content digest (`target.file_digests`: every
    byte, hashed once per file); None for a directory without weights."""
    names = loaded_weight_files(path)
    if not names:
        return None
    h = xxhash.xxh3_128()
    for name in names:
        full = os.path.join(path, name)
        h.update(f"{name}:{os.path.getsize(full)}:{file_digest(full)}|".encode())
    return h.hexdigest()


def directory_digest(path: str | os.PathLike) -> str:
    """Everything a stage reads from a target directory: the weights' content digest and every other
    top-level file (config, tokenizer, chat template, generation config, remote code), by content;
    weight files of other formats that transformers does not load here are left out."""
    h = xxhash.xxh3_128()
    h.update(f"weights:{weights_content_digest(path)}|".encode())
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full) and not name.endswith(WEIGHT_SUFFIXES):
            h.update(f"{name}:{file_digest(full)}|".encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class StoredHead:
    """The target's embedding and output head in their stored dtype, and where the model keeps them."""

    arch: TargetArch
    embed_VD: torch.Tensor
    lm_head_VD: torch.Tensor  # the embedding's own tensor when tied


def read_stored_head(target_dir: str | os.PathLike, trust_remote_code: bool = False) -> StoredHead | None:
    """The stored embedding and output head, found through the model's accessors whatever their stored
    names (`target.arch`); None when the directory holds no safetensors weights, ValueError
    (one line) for a target the drafter cannot serve."""
    arch = check_architecture(target_dir, trust_remote_code)
    if arch.embed_tensor is None:
        return None
    stored = load_tensors(target_dir, [arch.embed_tensor, arch.head_tensor])
    return StoredHead(arch, stored[arch.embed_tensor], stored[arch.head_tensor])


def stored_head_or_none(target_dir: str | os.PathLike) -> StoredHead | None:
    """`read_stored_head`, or None where the tensors cannot be read (no safetensors weights, or no
    usable target: the stage that needs them says why when it asks `read_stored_head`)."""
    try:
        return read_stored_head(target_dir)
    except ValueError:
        return None


def head_digest(target_dir: str | os.PathLike) -> str | None:
    """`stored_head_digest` of the directory's embedding and head; None when it holds no safetensors
    weights to read them from (or no usable target)."""
    stored = stored_head_or_none(target_dir)
    return None if stored is None else stored_head_digest(stored)


def stored_head_digest(stored: StoredHead) -> str:
    """xxh3-128 of the stored embedding and output head (dtype, shape, bytes; a tied head once),
    labelled with the causal-LM spellings, so a checkpoint's digest does not depend on how the
    tensors are found."""
    h = xxhash.xxh3_128()
    for label, tensor in ((EMBED, stored.embed_VD), (LM_HEAD, stored.lm_head_VD)):
        if label == LM_HEAD and stored.arch.tied:
            h.update(b"lm_head tied to the embedding|")
            continue
        flat = tensor.detach().contiguous().reshape(-1)
        h.update(f"{label}:{str(tensor.dtype).replace('torch.', '')}:{list(tensor.shape)}|".encode())
        h.update(flat.view(torch.uint8).numpy())
    return h.hexdigest()


def target_identity(target_dir: str | os.PathLike, stored: StoredHead | None = None) -> dict:
    """{name_or_path, config_hash, weights_digest, weights_content_digest, head_digest} of a checkpoint
    directory; `stored`: its embedding and head already read (`read_stored_head`), hashed instead of
    read again."""
    path = os.path.abspath(target_dir)
    return {
        "name_or_path": path,
        "config_hash": json_digest(read_config(path)),
        "weights_digest": weights_digest(path),
        "weights_content_digest": weights_content_digest(path),
        "head_digest": stored_head_digest(stored) if stored is not None else head_digest(path),
    }
