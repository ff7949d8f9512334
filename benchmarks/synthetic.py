"""Synthetic samples with the value distribution of real LLM features, for benchmarks and demos.

Real residual-stream activations are not i.i.d. Gaussians. What matters for compression is the
spread of bf16 exponents, so the generator reproduces the known structure:
- depth: the residual norm grows with layer depth (tap scales 0.05, 0.4, 1.5, 4 for taps at
  layers 1/16/31/46 of 64);
- channels: per-channel scales are log-normal (sigma 0.6) with per-channel offsets (0.3 scale);
- heavy tails: Gaussian noise times a log-normal (sigma 0.5) scale per token and group of 64
  channels, a scale mixture of normals;
- tokens: a per-token log-normal gain (sigma 0.2);
- outliers: 4 "massive activation" channels per tap at 30-200x the tap scale, and 10x that again
  on the first token (the attention-sink token).
The top-k log-probs are log-softmax values of a peaked distribution (top-1 mass ~ Beta(2, 1)),
sorted descending; top-k ids are random vocabulary ids; input ids follow a Zipf law; the loss mask
covers the last 70% of each sample (the response).
"""

from __future__ import annotations

import numpy as np
import torch

from common.hashing import sample_id
from shards.schema import Sample

TAP_SCALES = (0.05, 0.4, 1.5, 4.0)


def _tap_structure(rng: np.random.Generator, n_taps: int, hidden: int) -> list[dict]:
    taps = []
    for tap in range(n_taps):
        scale = (
            TAP_SCALES[min(tap, len(TAP_SCALES) - 1)]
            if n_taps == len(TAP_SCALES)
            else float(np.geomspace(0.05, 4.0, n_taps)[tap])
        )
        channel_std = scale * rng.lognormal(0.0, 0.6, hidden)
        outliers = rng.choice(hidden, 4, replace=False)
        channel_mean = rng.normal(0.0, 0.3, hidden) * channel_std
        channel_mean[outliers] = scale * rng.uniform(30, 200, 4) * rng.choice([-1, 1], 4)
        taps.append(
            {"std": channel_std.astype(np.float32), "mean": channel_mean.astype(np.float32), "outliers": outliers}
        )
    return taps


def realistic_hidden(rng: np.random.Generator, n_tokens: int, taps: list[dict]) -> np.ndarray:
    """uint16 [T, n_taps * H]: bf16 bit patterns (round to nearest even) of structured activations."""
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
    gain_T1 = torch.from_numpy(rng.lognormal(0.0, 0.2, (n_tokens, 1)).astype(np.float32))
    blocks = []
    for tap in taps:
        hidden = tap["std"].size
        noise_TH = torch.randn(n_tokens, hidden, generator=generator)
        # Heavy tails: a log-normal scale per token and group of 64 channels (a scale mixture of normals).
        groups = -(-hidden // 64)
        mix_TG = torch.from_numpy(rng.lognormal(0.0, 0.5, (n_tokens, groups)).astype(np.float32))
        noise_TH *= mix_TG.repeat_interleave(64, dim=1)[:, :hidden]
        block = (torch.from_numpy(tap["mean"]) + noise_TH * torch.from_numpy(tap["std"])) * gain_T1
        block[0, torch.from_numpy(tap["outliers"])] *= 10.0
        blocks.append(block)
    return torch.cat(blocks, dim=1).to(torch.bfloat16).view(torch.uint16).numpy()


def realistic_topk(rng: np.random.Generator, n_tokens: int, topk: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    top1 = rng.beta(2.0, 1.0, (n_tokens, 1))
    rest = rng.dirichlet(np.full(topk, 0.3), n_tokens) * (1.0 - top1) * 0.9  # 10% of the rest lies past the top-k
    probs = np.concatenate([top1, rest[:, : topk - 1]], axis=1)
    logprobs = -np.sort(-np.log(np.maximum(probs, 1e-30)), axis=1).astype(np.float32)  # descending
    ids = rng.integers(0, vocab, (n_tokens, topk), dtype=np.int32)
    return ids, np.ascontiguousarray(logprobs)


def realistic_samples(
    n_samples: int, mean_tokens: int, n_taps: int, hidden: int, topk: int, vocab: int = 248_320, seed: int = 0
) -> list[Sample]:
    """`n_samples` samples with lengths spread around `mean_tokens` (0.5x to 1.5x)."""
    rng = np.random.default_rng(seed)
    taps = _tap_structure(rng, n_taps, hidden)
    samples = []
    for _ in range(n_samples):
        T = int(rng.integers(max(2, mean_tokens // 2), mean_tokens * 3 // 2 + 1))
        input_ids = np.minimum(rng.zipf(1.2, T), vocab - 1).astype(np.int32)
        loss_mask = (np.arange(T) >= int(0.3 * T)).astype(np.uint8)
        topk_ids, topk_logprobs = realistic_topk(rng, T, topk, vocab)
        hidden_TW = realistic_hidden(rng, T, taps)
        samples.append(
            Sample(sample_id(input_ids, loss_mask), input_ids, loss_mask, hidden_TW, topk_ids, topk_logprobs)
        )
    return samples
