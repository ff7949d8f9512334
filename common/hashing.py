"""Stable hashes used for provenance: sample ids, file checksums, tokenizer, chat template and text digests.

All are xxh3-128 (fast, stable across platforms and versions) rendered as hex strings.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.fs as pafs
import xxhash

CHECKSUM_ALGO = "xxh3_128"


def sample_id(input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
    """Stable id of a tokenized sample: a hash of its int32 token ids and its loss mask."""
    h = xxhash.xxh3_128()
    h.update(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
    h.update(b"|")
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    return h.hexdigest()


def bytes_digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def text_digest(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def json_digest(obj) -> str:
    return text_digest(json.dumps(obj, sort_keys=True, default=str))


def file_checksum(fs: pafs.FileSystem, path: str, chunk_bytes: int = 16 << 20) -> str:
    """xxh3-128 of a file's bytes, streamed in chunks."""
    h = xxhash.xxh3_128()
    with fs.open_input_stream(path) as f:
        while True:
            chunk = f.read(chunk_bytes)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """Hash of everything that decides how text becomes token ids (vocab, merges, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        return text_digest(backend.to_str())
    return json_digest(sorted(tokenizer.get_vocab().items()))


def template_digest(tokenizer) -> str | None:
    """The provenance's `chat_template_hash`: the tokenizer's chat template's text digest, None without one."""
    template = getattr(tokenizer, "chat_template", None)
    return text_digest(template) if isinstance(template, str) else None
