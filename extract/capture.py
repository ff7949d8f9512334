"""One target forward -> tap hidden states and the top-k of the true final logits.

- Taps: a forward hook on decoder layer `i` receives that layer's output, which is HF
  `output_hidden_states[i + 1]` (index 0 is the embeddings). Hooks keep only the requested layers
  (output_hidden_states would keep all 65 of Qwen3.6 alive).
- Final logits: the base (text) model is called with `use_cache=False`; its `last_hidden_state`
  is the output of the last layer after the model's own final norm, from the same forward. The
  causal LM's own output path (`Target.logits_fn`, `target.head.OwnHead`: its own forward from the
  decoder's output on, so its head, multipliers and soft-capping) turns it into logits in chunks
  of `logits_chunk` real positions, so full-vocabulary logits never exist for a batch.
- Whole prefills: every sample goes through the decoder in one forward, never split into chunks of
  its length (a hybrid target's recurrent layers give other values for a split prefill).
  Log-probs are `logit - logsumexp(logits)` in float32 (= log_softmax), top-k sorted descending,
  equal values by ascending id (so the stored top-1 is exactly `logits.argmax(-1)`).
- Padding: only real positions reach lm_head; per-sample NaN/Inf flags cover real positions only.

`capture` returns device tensors (tests, the bench's bare forward). `Capturer.launch` is the
pipeline's version: it arranges the taps on the device in the layout the shards store (taps
concatenated per token; for the `planes` encoding, split into high and low bytes, each in the
dataset's column pieces), copies that
block to pinned host memory on a side stream as soon as the last tap layer has run, so the copy
overlaps the rest of the forward, and returns without waiting. The host then hands each sample's
rows to the shard writer as views: no copy, no byte-plane split and no NaN/Inf scan on the host
(the per-sample finite flags come from the device, computed on the stored bf16 values).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Sequence

import torch

from extract.batching import HostBatch, attention_mask_for
from shards import HiddenPlanes
from shards.projection import load_projection
from shards.quant import (
    ErrorSums,
    QuantizedHidden,
    channel_error_sums,
    decode_piece,
    encode_piece,
    parse_encoding,
    scales_to_numpy,
)
from target.load import TapHooks
from target.packing import packed_arguments

STORE_DTYPE = torch.bfloat16
# Byte planes are cut from a byte view of the bf16 values: (low, high) per value in memory.
assert sys.byteorder == "little", "byte-plane layout assumes a little-endian host (as are CUDA devices)"


def forward_with_taps(
    target, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None, layer_ids, on_tap, packed=None
) -> torch.Tensor:
    """Run the base model once; return its final-normed last hidden state [B, T, H]. `packed`: the
    boundaries of a packed row (`target.packing.packed_arguments`), passed to the decoder."""
    with torch.inference_mode(), TapHooks(target.layers, layer_ids, on_tap):
        out = target.decoder(
            input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False, **(packed or {})
        )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


@torch.inference_mode()
def final_topk(target, hidden_NH: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids (int32 [N, k]) and log-probs (float32 [N, k]) of the final logits of normed
    hidden states, plus a finite flag per position ([N] bool: no NaN/+Inf among the logits)."""
    N = hidden_NH.shape[0]
    device = hidden_NH.device
    ids_NK = torch.empty(N, k, dtype=torch.int32, device=device)
    logprobs_NK = torch.empty(N, k, dtype=torch.float32, device=device)
    finite_N = torch.empty(N, dtype=torch.bool, device=device)
    for start in range(0, N, chunk):
        end = min(N, start + chunk)
        logits_CV = target.logits_fn(hidden_NH[start:end]).float()
        lse_C = torch.logsumexp(logits_CV, dim=-1)
        values_CK, ids_CK = ties_lowest_id_first(*torch.topk(logits_CV, k, dim=-1, sorted=True))
        ids_NK[start:end] = ids_CK.to(torch.int32)
        logprobs_CK = values_CK - lse_C[:, None]
        logprobs_NK[start:end] = logprobs_CK
        # NaN anywhere, or +Inf, makes the log-sum-exp non-finite. -Inf logits are legal (a masked
        # vocabulary) unless fewer than k are finite, so that one lands in the stored top-k.
        finite_N[start:end] = torch.isfinite(lse_C) & torch.isfinite(logprobs_CK).all(dim=-1)
        del logits_CV
    return ids_NK, logprobs_NK, finite_N


def ties_lowest_id_first(values_CK: torch.Tensor, ids_CK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order equal values by ascending token id, as `argmax` does (topk leaves ties in any order;
    bf16 logits tie often enough to matter for the stored top-1)."""
    by_id = torch.argsort(ids_CK, dim=-1)
    values_CK, ids_CK = values_CK.gather(-1, by_id), ids_CK.gather(-1, by_id)
    order = torch.sort(values_CK, dim=-1, descending=True, stable=True).indices
    return values_CK.gather(-1, order), ids_CK.gather(-1, order)


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without making the CPU wait for the GPU (a copy from pageable memory would)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def packed_positions(lengths: Sequence[int], T: int) -> torch.Tensor:
    """Flat indices b*T + t of the real positions of a right-padded [B, T] batch, in sample order."""
    return torch.cat([torch.arange(n, dtype=torch.long) + b * T for b, n in enumerate(lengths)])


@dataclasses.dataclass
class Captured:
    taps: list[torch.Tensor]  # per tap [B, T, H], model dtype, padding included
    topk_ids: torch.Tensor  # int32 [N, k], real positions packed in sample order
    topk_logprobs: torch.Tensor  # float32 [N, k]
    logits_finite: torch.Tensor  # bool [N]
    last_hidden: torch.Tensor  # [B, T, H], final-normed


def capture(
    target,
    input_ids_BT: torch.Tensor,
    lengths: Sequence[int],
    layer_ids,
    topk: int,
    logits_chunk: int = 1024,
    packed: bool = False,
) -> Captured:
    """The whole capture on device, synchronously (tests and the benchmark's bare forward). `packed`:
    `input_ids_BT` is one row [1, N] of the samples of `lengths` one after another."""
    B, T = input_ids_BT.shape
    assert not packed or (B == 1 and sum(lengths) == T), (B, T, list(lengths))
    mask = None if packed else attention_mask_for(lengths, T)
    device = target.input_device
    taps: list = [None] * len(layer_ids)

    def keep(slot: int, hidden: torch.Tensor) -> None:
        taps[slot] = hidden

    ids = to_device_async(input_ids_BT, device)
    mask = None if mask is None else to_device_async(mask, device)
    positions = to_device_async(packed_positions([T] if packed else lengths, T), target.output_device)
    boundaries = packed_arguments(lengths, device) if packed else None
    last = forward_with_taps(target, ids, mask, layer_ids, keep, boundaries)
    flat = last.reshape(B * T, -1).to(positions.device).index_select(0, positions)
    ids, logprobs, finite = final_topk(target, flat, topk, logits_chunk)
    return Captured(taps, ids, logprobs, finite, last)


# ----------------------------------------------------------------------------------------------
# The pipeline's overlapped capture


class LaunchThrottle:
    """Keeps the host at most `ahead` decoder layers in front of the GPU (0: off).

    Without a limit the forward loop runs ahead until the driver's launch queue is full, and from
    then on each launch waits inside the driver. This waits instead on an event recorded `ahead`
    layers earlier, with the GIL released and the thread asleep, so the host threads that write
    shards get the interpreter whenever they need it. The events carry over from one forward to the
    next, so the limit also holds across micro-batches."""

    def __init__(self, layers, ahead: int):
        self.layers, self.ahead = layers, ahead
        self._events: collections.deque = collections.deque()
        self._handles: list = []
        self._devices: dict = {}

    def __enter__(self) -> LaunchThrottle:
        if self.ahead > 0:
            self._handles = [layer.register_forward_pre_hook(self._before_layer) for layer in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_layer(self, module, args) -> None:  # noqa: ARG002 (a forward pre-hook's signature)
        device = self._devices.get(id(module))
        if device is None:
            device = self._devices[id(module)] = next(module.parameters()).device
        if device.type != "cuda":
            return
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(device))
        self._events.append(event)
        while len(self._events) > self.ahead:
            self._events.popleft().synchronize()


@dataclasses.dataclass
class InFlight:
    """A launched micro-batch: results land in `host` once `wait()` returns."""

    host: HostBatch
    lengths: list[int]
    T: int
    events: list
    keepalive: list  # device tensors the side-stream copies read; freed after wait()
    packed: bool = False  # one row [1, T] holding the samples one after another

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events, self.keepalive = [], []

    @property
    def offsets(self) -> list[int]:
        out, total = [], 0
        for n in self.lengths:
            out.append(total)
            total += n
        return out


class TierEncoder:
    """Storage tiers on the device (shards/FORMAT.md, "Storage tiers"): each tap's bf16 values are
    projected (z_i = P_i h_i, float32) and/or quantized (`shards.quant`) right where the forward left
    them, written into the stored layout, and decoded back to measure the reconstruction error
    per channel of each sample against h (masked to real positions). The host receives only the
    compact bytes and the per-sample error sums; NaN/Inf is flagged per token, never raised (a
    flagged sample is rejected by the host, never written)."""

    def __init__(self, encoding: str, projection=None, device=None):
        self.spec = parse_encoding(encoding)
        self.encoding = encoding
        self.projection = projection.to(device) if projection is not None else None

    def put(
        self,
        layout,
        slot: int,
        stored_BTH: torch.Tensor,
        valid_BT: torch.Tensor,
        ok_BT: torch.Tensor,
        errors_2BW: torch.Tensor,
    ) -> None:
        H = stored_BTH.shape[-1]
        x = stored_BTH.float()
        z = self.projection.apply_tap(slot, x) if self.projection is not None else x
        if self.projection is not None:
            ok_BT.logical_and_(torch.isfinite(z).all(dim=-1))
        if self.spec is not None:
            codes_SBTC, scales_SBTG = layout
            codes, scales = encode_piece(z, self.spec, check_finite=False)
            codes_SBTC[slot].copy_(codes)
            scales_SBTG[slot].copy_(scales)
            z_hat = decode_piece(codes, scales, self.spec, torch.float32)
        else:  # projected, stored lossless as bf16
            z_bf16 = z.to(STORE_DTYPE)
            put_tap(layout, slot, z_bf16, self.encoding)
            z_hat = z_bf16.float()
        x_hat = self.projection.back_tap(slot, z_hat) if self.projection is not None else z_hat
        sq_BH, err2_BH = channel_error_sums(x, x_hat, valid_BT)
        errors_2BW[0, :, slot * H : (slot + 1) * H] = sq_BH
        errors_2BW[1, :, slot * H : (slot + 1) * H] = err2_BH


def tier_for(writer, device) -> TierEncoder | None:
    """The device-side encoder of the writer's storage tier (None for lossless, unprojected shards)."""
    if writer.quant is None and writer.projection is None:
        return None
    projection = load_projection(writer.root, writer.projection) if writer.projection is not None else None
    return TierEncoder(writer.encoding, projection, device)


class Capturer:
    """Launches captures whose device-to-host copies overlap compute (CUDA), or copies directly (CPU).
    With a `TierEncoder` the taps are stored in a storage tier (projected and/or quantized on the device)."""

    def __init__(
        self,
        target,
        layer_ids: Sequence[int],
        topk: int,
        logits_chunk: int,
        launch_ahead_layers: int = 0,
        tier: TierEncoder | None = None,
    ):
        self.target, self.layer_ids, self.topk, self.logits_chunk = target, list(layer_ids), topk, logits_chunk
        self.out_device = target.output_device
        self.cuda = self.out_device.type == "cuda"
        self._side_streams: dict = {}
        self.throttle = LaunchThrottle(target.layers, launch_ahead_layers if self.cuda else 0)
        self.tier = tier

    @torch.inference_mode()
    def launch(self, input_ids_BT: torch.Tensor, lengths: list[int], host: HostBatch, packed: bool = False) -> InFlight:
        """Start one micro-batch: right-padded [B, T], or with `packed` one row [1, N] of the samples
        of `lengths` one after another (`extract.batching.collate_packed`)."""
        B, T = input_ids_BT.shape
        assert not packed or (B == 1 and sum(lengths) == T), (B, T, lengths)
        if packed and self.tier is not None:
            raise ValueError("packing: not with a storage tier yet (its error sums are kept per row, not per sample)")
        target, out_dev = self.target, self.out_device
        in_dev = target.input_device
        keepalive: list = []
        rows = [T] if packed else lengths  # the real length of each row of the forward
        # Every host-to-device copy is queued before the forward, from pinned memory, so none of
        # them makes the CPU wait for the GPU.
        mask = None if packed else attention_mask_for(lengths, T)
        ids_dev = to_device_async(input_ids_BT, in_dev)
        mask_dev = None if mask is None else to_device_async(mask, in_dev)
        boundaries = packed_arguments(lengths, in_dev) if packed else None
        positions_N = to_device_async(packed_positions(rows, T), out_dev)
        lengths_B = to_device_async(torch.tensor(rows, dtype=torch.long), out_dev)
        samples_S = to_device_async(torch.tensor(lengths, dtype=torch.long), out_dev)
        N = int(positions_N.shape[0])
        hidden_host = host.hidden_block(B, T)
        # On a GPU the taps are assembled in a device buffer of the host layout, then copied in one
        # piece; on a CPU they go straight into the host buffer.
        staging_block = (
            torch.empty(hidden_host.shape, dtype=hidden_host.dtype, device=out_dev) if self.cuda else hidden_host
        )
        staging = host.layout(staging_block, B, T)
        ok_BT = torch.ones(B, T, dtype=torch.bool, device=out_dev)
        arrived: list[int] = []
        tier = self.tier
        if tier is not None:
            # Scales are per token per column piece, and the device writes one tap into one piece.
            assert host.hidden_split == len(self.layer_ids), (host.hidden_split, self.layer_ids)
            valid_BT = torch.arange(T, device=out_dev)[None, :] < lengths_B[:, None]
            errors_2BW = torch.empty(2, B, host.width, dtype=torch.float32, device=out_dev)

        def on_tap(slot: int, hidden_BTH: torch.Tensor) -> None:
            stored = hidden_BTH.to(STORE_DTYPE)
            # The finite flags are computed on exactly the bf16 values stored, so the writer need
            # not scan them again.
            ok_BT.logical_and_(torch.isfinite(stored).all(dim=-1).to(out_dev))
            # Copied into the staging buffer at once (in stream order), so the model may modify
            # its activations in place afterwards.
            if tier is None:
                put_tap(staging, slot, stored, host.encoding)
            else:
                tier.put(staging, slot, stored.to(out_dev), valid_BT, ok_BT, errors_2BW)
            arrived.append(slot)
            if len(arrived) == len(self.layer_ids) and self.cuda:
                self._to_host(staging_block, hidden_host, keepalive)

        with self.throttle:
            last_BTH = forward_with_taps(target, ids_dev, mask_dev, self.layer_ids, on_tap, boundaries)
        assert sorted(arrived) == list(range(len(self.layer_ids))), f"tap hooks fired for slots {arrived}"
        flat_NH = last_BTH.reshape(B * T, -1).to(out_dev).index_select(0, positions_N)  # .to: no-op unless device_map
        ids_NK, logprobs_NK, finite_N = final_topk(target, flat_NH, self.topk, self.logits_chunk)
        # Per sample: a sample is a row of a padded batch, a stretch of the packed row.
        S = len(lengths)
        owner_N = torch.repeat_interleave(torch.arange(S, device=out_dev), samples_S, output_size=N)
        if packed:
            bad_hidden_S = torch.zeros(S, dtype=torch.int32, device=out_dev)
            hidden_ok_S = bad_hidden_S.index_add_(0, owner_N, (~ok_BT[0]).to(torch.int32)) == 0
        else:
            valid_BT = torch.arange(T, device=out_dev)[None, :] < lengths_B[:, None]
            hidden_ok_S = (ok_BT | ~valid_BT).all(dim=-1)
        bad_S = torch.zeros(S, dtype=torch.int32, device=out_dev).index_add_(0, owner_N, (~finite_N).to(torch.int32))
        self._to_host(ids_NK, host.topk_ids[:N], keepalive)
        self._to_host(logprobs_NK, host.topk_logprobs[:N], keepalive)
        self._to_host(hidden_ok_S, host.hidden_ok[:S], keepalive)
        self._to_host(bad_S == 0, host.logits_ok[:S], keepalive)
        if tier is not None:
            self._to_host(errors_2BW, host.error_rows(B), keepalive)
        events = []
        for stream in self._side_streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return InFlight(host, list(lengths), T, events, keepalive, packed)

    def _to_host(self, src: torch.Tensor, dst: torch.Tensor, keepalive: list) -> None:
        if src.device.type != "cuda":
            dst.copy_(src)
            return
        stream = self._side_streams.get(src.device)
        if stream is None:
            stream = self._side_streams[src.device] = torch.cuda.Stream(src.device)
        # The side stream starts the copy once everything queued so far (which produced `src`) is done.
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        # Until the copy finishes, `src` must not be freed and its memory handed to later kernels.
        keepalive.append(src)


def put_tap(staging: torch.Tensor, slot: int, stored_BTH: torch.Tensor, encoding: str) -> None:
    """Write one tap's bf16 values [B, T, H] into its columns of a buffer in the host layout
    (`HostBatch.hidden_view`): planes uint8 [2, S, B, T, W / S], plain bf16 [B, T, W]."""
    H = stored_BTH.shape[-1]
    start, end = slot * H, (slot + 1) * H  # the tap's columns of the full width W
    if encoding == "plain":
        staging[:, :, start:end].copy_(stored_BTH)
        return
    pairs_BTH2 = stored_BTH.contiguous().view(torch.uint8).unflatten(-1, (H, 2))  # (low, high) byte of each value
    width = staging.shape[-1]
    for piece in range(start // width, (end - 1) // width + 1):  # the column pieces the tap overlaps
        first, last = max(start, piece * width), min(end, (piece + 1) * width)
        source = pairs_BTH2[:, :, first - start : last - start]
        columns = slice(first - piece * width, last - piece * width)
        staging[0, piece, :, :, columns].copy_(source[..., 1])
        staging[1, piece, :, :, columns].copy_(source[..., 0])


def sample_views(inflight: InFlight, b: int, offset: int) -> tuple:
    """(hidden, topk_ids int32 [L, k], topk_logprobs float32 [L, k], hidden_ok, logits_ok) of sample
    `b` as views of the host buffers, no copy: valid until the buffer goes back to the pool.
    `hidden` is `shards.HiddenPlanes` (each plane a tuple of S column pieces uint8 [L, W / S]) for
    the planes layout, `shards.quant.QuantizedHidden` for a quantized one, else uint16 [L, W]; a
    storage tier's reconstruction error sums ride along as their `error`."""
    host, L = inflight.host, inflight.lengths[b]
    B = 1 if inflight.packed else len(inflight.lengths)
    rows = host.hidden_view(B, inflight.T)
    # Sample b: row b of a padded batch, or tokens offset .. offset + L of the packed row.
    row, span = (0, slice(offset, offset + L)) if inflight.packed else (b, slice(0, L))
    pieces = range(host.hidden_split)
    error = None
    if (
        host.stored_width != host.width or host.quant is not None
    ):  # a storage tier: its reconstruction error travels along
        assert not inflight.packed, "storage tiers are not packed (Capturer.launch refuses)"
        sums = host.error_rows(len(inflight.lengths))
        error = ErrorSums(sums[0, b].numpy(), sums[1, b].numpy(), L)
    if host.quant is not None:
        codes, scales = rows
        hidden = QuantizedHidden(
            host.encoding,
            tuple(codes[j, row, span].numpy() for j in pieces),
            tuple(scales_to_numpy(scales[j, row, span]) for j in pieces),
            host.stored_width,
            error,
        )
    elif host.encoding == "planes":
        hidden = HiddenPlanes(
            tuple(rows[0, j, row, span].numpy() for j in pieces),
            tuple(rows[1, j, row, span].numpy() for j in pieces),
            error,
        )
    else:
        hidden = rows[row, span].view(torch.uint16).numpy()
    topk_ids = host.topk_ids[offset : offset + L].numpy()
    topk_logprobs = host.topk_logprobs[offset : offset + L].numpy()
    return hidden, topk_ids, topk_logprobs, bool(host.hidden_ok[b]), bool(host.logits_ok[b])
