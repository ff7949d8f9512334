"""Micro-batches for the target forward: length-sorted groups under a token budget, right-padded,
and the (pinned) host buffers their results are copied into.

Right padding with an attention mask is the one layout every decoder handles: causal attention
never lets a real token see a later pad, and Qwen3.5's linear-attention (Gated DeltaNet) layers
zero padded positions and run left to right, so pads after the last real token cannot reach it.
Padded positions are dropped when results are unpacked; they never reach the shards.

Packed micro-batches (`packing = true`) are one row of several samples and no padding, planned by
tokens; `target.packing` says which targets can keep the samples of a row apart.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

from shards.quant import parse_encoding
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


def plan_packed_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into packed rows of at most `token_budget` tokens in all (no padding):
    first fit over the samples longest first, each row's members in that order. A pure function of
    the lengths, as `plan_micro_batches` is, so a resumed run re-forms the same rows."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > token_budget:
            raise ValueError(f"sample of {n} tokens exceeds tokens_per_batch {token_budget}")
        fit = next((r for r, free in enumerate(room) if free >= n), None)
        if fit is None:
            rows.append([])
            room.append(token_budget)
            fit = len(rows) - 1
        rows[fit].append(i)
        room[fit] -= n
    return rows


def collate_packed(sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """[1, N] int64 input ids of the samples one after another, and their lengths."""
    lengths = [int(s.shape[0]) for s in sequences]
    return torch.cat([s.to(torch.long) for s in sequences])[None], lengths


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
    concatenated per token.

    Storage tiers: `stored_width` is the width of the stored features (a projection's r; default W),
    and a quantized encoding lays out, per column piece, codes uint8 [S, B, T, code width] then
    scales [S, B, T, scale width] (int8 or bf16 bits); `error_rows` then gives per-sample
    reconstruction error sums float32 [B, W] (energy and squared error per channel)."""

    def __init__(
        self,
        *,
        n_taps: int,
        hidden_size: int,
        token_budget: int,
        topk: int,
        pin: bool,
        encoding: str = "planes",
        hidden_split: int = 1,
        stored_width: int | None = None,
    ):
        check_encoding(encoding)
        self.n_taps, self.hidden_size, self.token_budget, self.encoding = n_taps, hidden_size, token_budget, encoding
        self.width = n_taps * hidden_size
        self.stored_width = stored_width or self.width
        assert self.stored_width % hidden_split == 0, (self.stored_width, hidden_split)
        self.hidden_split = hidden_split
        self.quant = parse_encoding(encoding)
        self.pin = pin
        self.hidden = torch.empty(token_budget * self.bytes_per_token, dtype=torch.uint8, pin_memory=pin)
        self._errors: torch.Tensor | None = None  # [2, rows, W] float32, grown on demand
        self.topk_ids = torch.empty(token_budget, topk, dtype=torch.int32, pin_memory=pin)
        self.topk_logprobs = torch.empty(token_budget, topk, dtype=torch.float32, pin_memory=pin)
        self.hidden_ok = torch.empty(token_budget, dtype=torch.bool, pin_memory=pin)  # per sample
        self.logits_ok = torch.empty(token_budget, dtype=torch.bool, pin_memory=pin)  # per sample

    @property
    def bytes_per_token(self) -> int:
        """Stored hidden bytes per token: 2 per bf16, or a quantized encoding's codes and scales."""
        if self.quant is None:
            return 2 * self.stored_width
        piece = self.stored_width // self.hidden_split
        per_piece = self.quant.code_width(piece) + self.quant.scale_width(piece) * self.quant.scale_dtype.itemsize
        return self.hidden_split * per_piece

    def hidden_block(self, B: int, T: int) -> torch.Tensor:
        """The bytes a [B, T] micro-batch's hidden states use, as one contiguous uint8 block."""
        assert self.token_budget >= B * T, (B, T, self.token_budget)
        return self.hidden[: B * T * self.bytes_per_token]

    def layout(self, block: torch.Tensor, B: int, T: int):
        """Views of a hidden block (this buffer's, or a device copy of the same size) in the stored
        layout: planes uint8 [2, S, B, T, W / S]; plain bf16 [B, T, W]; quantized (codes uint8
        [S, B, T, code width], scales [S, B, T, scale width])."""
        S, piece = self.hidden_split, self.stored_width // self.hidden_split
        if self.quant is not None:
            code_bytes = S * B * T * self.quant.code_width(piece)
            codes = block[:code_bytes].view(S, B, T, self.quant.code_width(piece))
            scale_dtype = torch.int16 if self.quant.four_bit else torch.int8  # int16: bf16 bits (uint16 on disk)
            return codes, block[code_bytes:].view(scale_dtype).view(S, B, T, self.quant.scale_width(piece))
        if self.encoding == "planes":
            return block.view(2, S, B, T, piece)
        return block.view(torch.bfloat16).view(B, T, self.stored_width)

    def hidden_view(self, B: int, T: int):
        """planes: uint8 [2, S, B, T, W / S]; plain: bf16 [B, T, W] (one contiguous block, so one copy
        fills it); quantized: (codes, scales) as in `layout`."""
        return self.layout(self.hidden_block(B, T), B, T)

    def error_rows(self, B: int) -> torch.Tensor:
        """float32 [2, B, W] for per-sample (energy, squared error) sums per channel (grown as needed)."""
        if self._errors is None or self._errors.shape[1] < B:
            self._errors = torch.empty(2, max(B, 16), self.width, dtype=torch.float32, pin_memory=self.pin)
        return self._errors[:, :B]

    @property
    def nbytes(self) -> int:
        extra = [] if self._errors is None else [self._errors]
        return sum(
            t.numel() * t.element_size()
            for t in (self.hidden, self.topk_ids, self.topk_logprobs, self.hidden_ok, self.logits_ok, *extra)
        )


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
