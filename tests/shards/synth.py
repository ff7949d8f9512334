"""Synthetic samples for the shard tests: every value is a function of (seed, index), so a sample
that is dropped, duplicated, reordered or altered is detected by comparing with a regenerated one."""

from __future__ import annotations

import numpy as np

from common.hashing import sample_id as hash_sample_id
from shards import Sample

VOCAB = 1000
N_TAPS, HIDDEN = 2, 8
WIDTH = N_TAPS * HIDDEN
TOPK = 4


def provenance(**overrides) -> dict:
    prov = {
        "target": {"name_or_path": "synthetic", "num_layers": 4, "hidden_size": HIDDEN, "vocab_size": VOCAB},
        "tokenizer": {"hash": "t0"},
        "taps": {"layer_ids": [1, 2][:N_TAPS], "meaning": "id i = output of decoder layer i = hidden_states[i+1]"},
        "dtype": "bfloat16",
        "topk": TOPK,
    }
    prov.update(overrides)
    return prov


def make_sample(index: int, n_tokens: int | None = None, width: int = WIDTH, topk: int = TOPK, seed: int = 0) -> Sample:
    """Sample number `index`: lengths 3..40 unless given; hidden are random bf16 bit patterns of
    finite values; log-probs are sorted descending and <= 0."""
    rng = np.random.default_rng([seed, index])
    T = n_tokens if n_tokens is not None else int(rng.integers(3, 41))
    input_ids = rng.integers(0, VOCAB, T, dtype=np.int32)
    loss_mask = (np.arange(T) >= T // 3).astype(np.uint8)
    values = rng.normal(0, 1, (T, width)).astype(np.float32)
    hidden = (values.view(np.uint32) >> 16).astype(np.uint16)
    topk_ids = rng.integers(0, VOCAB, (T, topk), dtype=np.int32)
    logprobs = -np.sort(rng.exponential(2.0, (T, topk)).astype(np.float32), axis=1)
    return Sample(hash_sample_id(input_ids, loss_mask), input_ids, loss_mask, hidden, topk_ids, logprobs)


def assert_same(a: Sample, b: Sample) -> None:
    """Bit-exact equality of every field, dtypes included."""
    assert a.sample_id == b.sample_id
    for name in ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name
