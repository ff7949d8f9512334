"""Micro-batches for the target forward: length-sorted groups under a token budget, right-padded,
and the (pinned) host buffers their results are copied into.

Right padding with an attention mask is the one layout every decoder handles: causal attention
never lets a real token see a later pad, and Qwen3.5's linear-attention (Gated DeltaNet) layers
zero padded positions and run left to right, so pads after the last real token cannot reach it.
Padded positions are dropped when results are unpacked; they never reach the shards.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

from shards.schema import check_encoding


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices, longest first, so that batch size x longest length <= token_budget.

    Longest first puts the largest batch at the start of a window, so an out-of-memory setting
    fails in the first seconds. Ties keep input order, so the plan is a pure function of the
    lengths (a resumed run re-forms exactly the same batches).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if lengths[i] > token_budget:
            raise ValueError(f"sample of {lengths[i]} tokens exceeds tokens_per_batch {token_budget}")
        # Sorted descending, so the batch's first sample is its longest.
        if current and (len(current) + 1) * lengths[current[0]] > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padded_tokens(batch: Sequence[int], lengths: Sequence[int]) -> int:
    return len(batch) * max(lengths[i] for i in batch)


def collate_right_padded(sequences: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, list[int]]:
    """[B, T] int64 input ids (right padded with `pad_id`) and the true lengths."""
    lengths = [int(s.shape[0]) for s in sequences]
    input_ids_BT = torch.full((len(sequences), max(lengths)), pad_id, dtype=torch.long)
    for b, seq in enumerate(sequences):
        input_ids_BT[b, : lengths[b]] = seq
    return input_ids_BT, lengths


def attention_mask_for(lengths: Sequence[int], T: int) -> torch.Tensor | None:
    """[B, T] 1/0 mask of real tokens, or None when nothing is padded (pure causal is faster)."""
    if all(n == T for n in lengths):
        return None
    lengths_B = torch.tensor(lengths, dtype=torch.long)
    return (torch.arange(T)[None, :] < lengths_B[:, None]).long()


class HostBatch:
    """Host buffers sized for any micro-batch under the token budget (pinned when a GPU is used,
    so device-to-host copies run asynchronously on a side stream).

    The hidden states arrive in the layout the shards store (`Capturer` arranges them on the
    device), so each column piece of a sample's rows is one contiguous block that goes to the writer
    without a copy: encoding "planes": uint8 [2, S, B, T, W / S], the high bytes of every bf16, then
    the low bytes, each in the dataset's `hidden_split` S column pieces (one per tap by default);
    encoding "plain": bf16 [B, T, W] (the writer cuts the pieces). W = n_taps * hidden_size, taps
    concatenated per token."""

    def __init__(
        self, *, n_taps: int, hidden_size: int, token_budget: int, topk: int, pin: bool, encoding: str = "planes", hidden_split: int = 1
    ):
        check_encoding(encoding)
        self.n_taps, self.hidden_size, self.token_budget, self.encoding = n_taps, hidden_size, token_budget, encoding
        self.width = n_taps * hidden_size
        assert self.width % hidden_split == 0, (self.width, hidden_split)
        self.hidden_split = hidden_split
        self.hidden = torch.empty(2 * token_budget * self.width, dtype=torch.uint8, pin_memory=pin)  # 2 bytes per bf16
        self.topk_ids = torch.empty(token_budget, topk, dtype=torch.int32, pin_memory=pin)
        self.topk_logprobs = torch.empty(token_budget, topk, dtype=torch.float32, pin_memory=pin)
        self.hidden_ok = torch.empty(token_budget, dtype=torch.bool, pin_memory=pin)  # per sample
        self.logits_ok = torch.empty(token_budget, dtype=torch.bool, pin_memory=pin)  # per sample

    def hidden_view(self, B: int, T: int) -> torch.Tensor:
        """planes: uint8 [2, S, B, T, W / S]; plain: bf16 [B, T, W] (one contiguous block, so one copy fills it)."""
        assert B * T <= self.token_budget, (B, T, self.token_budget)
        used = self.hidden[: 2 * B * T * self.width]
        if self.encoding == "planes":
            return used.view(2, self.hidden_split, B, T, self.width // self.hidden_split)
        return used.view(torch.bfloat16).view(B, T, self.width)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.topk_ids, self.topk_logprobs, self.hidden_ok, self.logits_ok))


class BufferPool:
    """At most `count` `HostBatch`es; `acquire` blocks while all are in flight (bounded memory and
    back-pressure: the forward loop waits for the writer, never the other way round).

    Buffers are allocated on first need, not up front: pinning several GiB takes the host a while,
    and this way only the first buffer delays the first forward; the others are pinned while the
    GPU already computes."""

    def __init__(self, count: int, **host_batch_kwargs):
        self._free: queue.Queue[HostBatch] = queue.Queue()
        self._kwargs = host_batch_kwargs
        self._lock = threading.Lock()
        self.count, self.created = count, 0

    def acquire(self, timeout: float | None = None) -> HostBatch:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self.created < self.count:
                host = HostBatch(**self._kwargs)  # may fail (pinned memory): then nothing is counted
                self.created += 1
                return host
        return self._free.get(timeout=timeout)

    def release(self, host: HostBatch) -> None:
        self._free.put(host)

    def available(self) -> int:
        """Buffers free right now, or still to be allocated (tests, diagnostics)."""
        return self._free.qsize() + self.count - self.created
