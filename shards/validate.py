"""Checks a `Sample` must pass before the writer stores it; each failure is a ValueError naming the
sample and the field, raised before anything of that sample is written.

The NaN/Inf scan of the hidden states is the one check that reads every stored byte. A caller that
has already checked exactly the values it hands over (extract checks the bf16 taps on the GPU and
never writes a sample that failed) may say so with `hidden_known_finite=True`; every other check
still runs.
"""

from __future__ import annotations

import numpy as np

from shards.quant import QuantizedHidden
from shards.schema import HiddenPlanes, Sample, count_nonfinite_bf16, count_nonfinite_planes, plane_pieces

# log_softmax in float32 can round the top log-prob of a near-certain token a hair above 0.
LOGPROB_MAX = 1e-3


def _fail(sample_id, field: str, message: str) -> None:
    raise ValueError(f"sample {sample_id!r}: field {field!r}: {message}")


def _check_array(sample_id, name: str, value, dtype, ndim: int) -> None:
    if not isinstance(value, np.ndarray):
        _fail(sample_id, name, f"expected a numpy array, got {type(value).__name__}")
    if value.dtype != dtype:
        _fail(sample_id, name, f"expected dtype {np.dtype(dtype).name}, got {value.dtype.name}")
    if value.ndim != ndim:
        _fail(sample_id, name, f"expected {ndim} dimensions, got shape {tuple(value.shape)}")


def _check_quantized(sample_id, hidden: QuantizedHidden) -> None:
    spec = hidden.spec
    if len(hidden.codes) != len(hidden.scales) or not hidden.codes:
        _fail(sample_id, "hidden", f"{len(hidden.codes)} code pieces but {len(hidden.scales)} scale pieces")
    piece = hidden.width // len(hidden.codes)
    for j, (codes, scales) in enumerate(zip(hidden.codes, hidden.scales, strict=True)):
        _check_array(sample_id, f"hidden.codes[{j}]", codes, np.uint8, 2)
        _check_array(sample_id, f"hidden.scales[{j}]", scales, spec.scale_dtype, 2)
        expected = [(hidden.shape[0], spec.code_width(piece)), (hidden.shape[0], spec.scale_width(piece))]
        if [codes.shape, scales.shape] != expected:
            _fail(
                sample_id,
                "hidden",
                f"piece {j}: codes {codes.shape} / scales {scales.shape}, expected {expected[0]} / {expected[1]} "
                f"for {spec.name}",
            )


def count_nonfinite_quantized(hidden: QuantizedHidden) -> int:
    """Codes or scales that decode to NaN/Inf: e4m3 NaN codes (0x7F, 0xFF), non-finite bf16 scales."""
    if hidden.spec.four_bit:
        return sum(count_nonfinite_bf16(scales) for scales in hidden.scales)
    return sum(int(np.count_nonzero((codes & 0x7F) == 0x7F)) for codes in hidden.codes)


def _check_hidden(sample_id, hidden) -> None:
    if isinstance(hidden, QuantizedHidden):
        _check_quantized(sample_id, hidden)
        return
    if not isinstance(hidden, HiddenPlanes):
        _check_array(sample_id, "hidden", hidden, np.uint16, 2)
        return
    for name in ("hi", "lo"):
        pieces = plane_pieces(getattr(hidden, name))
        if not pieces:
            _fail(sample_id, f"hidden.{name}", "no column pieces")
        for j, piece in enumerate(pieces):
            _check_array(sample_id, f"hidden.{name}" + (f"[{j}]" if len(pieces) > 1 else ""), piece, np.uint8, 2)
        if len({piece.shape[0] for piece in pieces}) > 1:
            _fail(sample_id, f"hidden.{name}", f"column pieces differ in length: {[tuple(p.shape) for p in pieces]}")
        if len({piece.shape[1] for piece in pieces}) > 1:
            _fail(sample_id, f"hidden.{name}", f"column pieces differ in width: {[tuple(p.shape) for p in pieces]}")
    hi_shapes = [p.shape for p in plane_pieces(hidden.hi)]
    lo_shapes = [p.shape for p in plane_pieces(hidden.lo)]
    if hi_shapes != lo_shapes:
        _fail(sample_id, "hidden", f"byte planes differ in shape: hi {hi_shapes}, lo {lo_shapes}")


def _count_nonfinite_hidden(hidden) -> int:
    if isinstance(hidden, QuantizedHidden):
        return count_nonfinite_quantized(hidden)
    if isinstance(hidden, HiddenPlanes):
        return sum(
            count_nonfinite_planes(hi, lo)
            for hi, lo in zip(plane_pieces(hidden.hi), plane_pieces(hidden.lo), strict=True)
        )
    return count_nonfinite_bf16(hidden)


def _check_shapes(sample: Sample, hidden_width: int, topk: int) -> None:
    sid = sample.sample_id
    _check_array(sid, "input_ids", sample.input_ids, np.int32, 1)
    _check_array(sid, "loss_mask", sample.loss_mask, np.uint8, 1)
    _check_hidden(sid, sample.hidden)
    _check_array(sid, "topk_ids", sample.topk_ids, np.int32, 2)
    _check_array(sid, "topk_logprobs", sample.topk_logprobs, np.float32, 2)
    T = sample.input_ids.shape[0]
    if T == 0:
        _fail(sid, "input_ids", "empty sequence (0 tokens)")
    for name in ("loss_mask", "hidden", "topk_ids", "topk_logprobs"):
        length = getattr(sample, name).shape[0]
        if length != T:
            _fail(sid, name, f"has {length} positions but input_ids has {T}")
    if sample.hidden.shape[1] != hidden_width:
        _fail(
            sid,
            "hidden",
            f"width {sample.hidden.shape[1]} != dataset hidden_width {hidden_width} (n_taps * hidden_size)",
        )
    for name in ("topk_ids", "topk_logprobs"):
        if getattr(sample, name).shape[1] != topk:
            _fail(
                sid, name, f"has {getattr(sample, name).shape[1]} entries per position but the dataset's topk is {topk}"
            )


def _check_values(sample: Sample, vocab_size: int | None, reject_nonfinite: bool, hidden_known_finite: bool) -> None:
    sid = sample.sample_id
    if np.any(sample.loss_mask > 1):
        _fail(sid, "loss_mask", "values must be 0 or 1")
    for name in ("input_ids", "topk_ids"):
        ids = getattr(sample, name)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            _fail(sid, name, f"token ids must lie in [0, {vocab_size}), found range [{low}, {high}]")
    if reject_nonfinite:
        bad = 0 if hidden_known_finite else _count_nonfinite_hidden(sample.hidden)
        if bad:
            _fail(sid, "hidden", f"{bad} NaN/Inf values (reject_nonfinite is on)")
        bad = int(np.count_nonzero(~np.isfinite(sample.topk_logprobs)))
        if bad:
            _fail(sid, "topk_logprobs", f"{bad} NaN/Inf values (reject_nonfinite is on)")
    logprobs = sample.topk_logprobs
    # Comparisons with NaN are False, so NaNs (allowed when reject_nonfinite is off) pass these two.
    if np.any(logprobs > LOGPROB_MAX):
        _fail(
            sid,
            "topk_logprobs",
            f"log-probabilities must be <= 0, found {float(np.nanmax(logprobs)):.4g} (logits instead of log_softmax?)",
        )
    if logprobs.shape[1] > 1 and np.any(logprobs[:, 1:] > logprobs[:, :-1]):
        _fail(sid, "topk_logprobs", "each position's top-k must be sorted by descending log-probability")


def validate_sample(
    sample,
    *,
    hidden_width: int,
    topk: int,
    vocab_size: int | None = None,
    reject_nonfinite: bool = True,
    hidden_known_finite: bool = False,
) -> None:
    """Raise ValueError naming the sample and field if `sample` cannot be stored as is.

    `hidden_known_finite=True` skips the NaN/Inf scan of `sample.hidden` (the caller checked it)."""
    if not isinstance(sample, Sample):
        raise ValueError(f"expected a shards.Sample, got {type(sample).__name__}")
    if not isinstance(sample.sample_id, str) or not sample.sample_id:
        raise ValueError(f"sample {sample.sample_id!r}: field 'sample_id': must be a non-empty string")
    _check_shapes(sample, hidden_width, topk)
    _check_values(sample, vocab_size, reject_nonfinite, hidden_known_finite)
