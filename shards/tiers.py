"""Encoding one sample's features into a storage tier on the host (transcode, benchmarks, tests):
optional projection z = P·h, then the dataset's encoding of z (lossless bf16, or quantized), with
the reconstruction error measured against h in the taps' space. Extraction does the same on the GPU,
tap by tap (`extract/capture.py`), with the same `shards.quant` and `shards.projection` functions.
torch is imported inside the function that uses it, as in `shards.quant`, so `python -m shards
transcode --help` loads without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shards.projection import Projection
from shards.quant import (
    ErrorSums,
    QuantizedHidden,
    decode_pieces,
    encode_pieces,
    error_sums_of,
    parse_encoding,
    scales_to_numpy,
)

if TYPE_CHECKING:
    import torch


def encode_features(
    hidden_TF: torch.Tensor,
    encoding: str,
    pieces: int,
    projection: Projection | None = None,
    *,
    what: str = "hidden",
    with_error: bool = True,
    device=None,
) -> tuple[np.ndarray | QuantizedHidden, ErrorSums | None]:
    """(what a `Sample.hidden` holds for a writer of this tier, the reconstruction error sums or None).

    `hidden_TF`: the tap features [T, F] (bf16, or uint16 bf16 bits as a numpy array), encoded on
    `device` (default: where they are; `projection` must be there too). Lossless
    encodings give uint16 bf16 bits of z (bit-exact h when unprojected: no error is recorded);
    quantized ones a `QuantizedHidden` (ValueError on NaN/Inf, naming `what`)."""
    import torch

    if isinstance(hidden_TF, np.ndarray):
        hidden_TF = torch.from_numpy(np.ascontiguousarray(hidden_TF)).view(torch.bfloat16)
    hidden_TF = hidden_TF.to(device) if device is not None else hidden_TF
    spec = parse_encoding(encoding)
    if projection is None and spec is None:
        return hidden_TF.to(torch.bfloat16).cpu().view(torch.uint16).numpy(), None
    z = projection.apply(hidden_TF) if projection is not None else hidden_TF.float()
    if spec is None:
        stored_bf16 = z.to(torch.bfloat16)
        if not bool(torch.isfinite(stored_bf16).all()):
            raise ValueError(f"{what}: NaN/Inf in the projected features")
        stored, z_hat = stored_bf16.cpu().view(torch.uint16).numpy(), stored_bf16.float()
    else:
        pairs = encode_pieces(z, spec, pieces, what=what)
        stored = QuantizedHidden(
            spec.name,
            tuple(c.cpu().numpy() for c, _ in pairs),
            tuple(scales_to_numpy(s) for _, s in pairs),
            int(z.shape[-1]),
        )
        z_hat = decode_pieces(pairs, spec, torch.float32)
    if not with_error:
        return stored, None
    x_hat = projection.back(z_hat) if projection is not None else z_hat
    return stored, error_sums_of(hidden_TF, x_hat)
