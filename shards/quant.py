"""Quantized encodings of the hidden states (storage tiers, format version 4): torch code that runs
on the GPU during extraction and in the trainer, and on the CPU in `transcode`, readers and tests.
torch is imported inside the functions that use it, so the format's modules (and `python -m shards
--help`) load without it.

Encodings (names as stored in the manifest and the shard schema):

- `fp8`: e4m3 codes (uint8), **one scale per token per column piece** (extract and transcode
  write one piece per tap, so: per token per tap). The scale is a power of two, `s = 2^e` with
  `e = ceil(log2(amax / 448))` (448 is e4m3's largest finite value; amax = the largest |x| of the
  token's piece), so `x / s` lies in [-448, 448] and is exact (a power-of-two division), and the
  only error is e4m3's own rounding (round to nearest even): **|x - x̂| <= half an e4m3 step at
  |x / s|, times s** (steps: 2^(k-3) for |x/s| in [2^k, 2^(k+1)), k >= -6; 2^-9 below 2^-6).
  `e` is stored as an int8, clamped to [-64, 120] (bf16 inputs never need more than 120; below
  -64 a token is all below 3e-17 and keeps an absolute error under 2^-74 per value). An all-zero
  token stores e = 0 and zero codes. Rounding the scale to a power of two costs nothing in
  relative precision (e4m3 is a floating-point format) and makes the scale one byte.
- `int4-gG` and `nf4-gG`: 4-bit codes, two per byte (even column in the low nibble), **one bf16
  scale per group of G consecutive columns** of a token (G divides the piece width). The scale is
  the group's amax rounded to bf16; a value is coded as the nearest of 16 levels `s * L[c]` of a
  codebook L in [-1, 1]: int4 = {k/7, k = -7..7} (code k + 8; code 0 is never written), nf4 = the
  NF4 levels (quantiles of a normal, QLoRA). **Bound: |x - x̂| <= s * gap / 2**, gap = the largest
  distance between neighbouring levels (int4 1/7, nf4 0.2771); a scale rounded below amax only
  clips the top by < s * 2^-8, inside that bound.

NaN or Inf in the input is refused at encode (ValueError naming the token), unless the caller has
flagged non-finite tokens itself (extract: the samples are rejected, never written).

Codes and scales are handed around as one (codes, scales) pair per column piece; the decoders
take any leading shape ([T, ...] on the host, [B, S, ...] on the device).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0
FP8_EXP_MIN, FP8_EXP_MAX = -64, 120
DEFAULT_GROUP_SIZE = 64  # chosen by measurement (FORMAT.md, "Storage tiers")
GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)
LOSSLESS_ENCODINGS = ("plain", "planes")

INT4_LEVELS = [-8 / 7] + [k / 7 for k in range(-7, 8)]  # code 0 (-8/7) is never written
NF4_LEVELS = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]
CODEBOOKS = {"int4": INT4_LEVELS, "nf4": NF4_LEVELS}
_NAME = re.compile(r"^(fp8|int4|nf4)(?:-g(\d+))?$")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """A quantized encoding: `kind` fp8 / int4 / nf4 and, for the 4-bit kinds, the group size."""

    kind: str
    group_size: int | None = None

    @property
    def name(self) -> str:
        return self.kind if self.group_size is None else f"{self.kind}-g{self.group_size}"

    @property
    def four_bit(self) -> bool:
        return self.kind in CODEBOOKS

    @property
    def group(self) -> int:
        """The group size of a 4-bit kind (which always has one)."""
        assert self.group_size is not None, self.kind
        return self.group_size

    def code_width(self, piece_width: int) -> int:
        """Code bytes per token of one column piece."""
        return piece_width // 2 if self.four_bit else piece_width

    def scale_width(self, piece_width: int) -> int:
        """Scales per token of one column piece."""
        return piece_width // self.group if self.four_bit else 1

    @property
    def scale_dtype(self) -> np.dtype:
        """numpy dtype of a stored scale: int8 exponent (fp8) or bf16 bit pattern (4-bit)."""
        return np.dtype(np.uint16) if self.four_bit else np.dtype(np.int8)

    def bytes_per_value(self, piece_width: int) -> float:
        """Stored bytes per hidden value before zstd, scales included."""
        return (self.code_width(piece_width) + self.scale_width(piece_width) * self.scale_dtype.itemsize) / piece_width

    def max_error_over_scale(self) -> float:
        """The bound on |x - x̂| / s of the 4-bit kinds (half the largest gap between levels)."""
        assert self.four_bit
        levels = CODEBOOKS[self.kind][1:] if self.kind == "int4" else CODEBOOKS[self.kind]
        return float(np.max(np.diff(levels))) / 2

    def check_piece_width(self, piece_width: int) -> None:
        """ValueError unless pieces of this width can be stored in this encoding."""
        if self.four_bit and (piece_width % self.group or piece_width % 2):
            raise ValueError(
                f"hidden_encoding: {self.name} needs column pieces whose width is a multiple of the group size "
                f"{self.group_size}, got pieces of {piece_width} values"
            )


def parse_encoding(name: str) -> QuantSpec | None:
    """The QuantSpec of a quantized encoding name, None for a lossless one; ValueError otherwise.
    `int4` / `nf4` without a group size mean DEFAULT_GROUP_SIZE (see `canonical_encoding`)."""
    if name in LOSSLESS_ENCODINGS:
        return None
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None or (match.group(1) == "fp8" and match.group(2) is not None):
        raise ValueError(
            f"hidden_encoding: unknown encoding {name!r}; allowed: plain, planes (lossless), fp8, int4-gG, nf4-gG "
            f"(4-bit, G in {list(GROUP_SIZES)}; int4 / nf4 alone = group {DEFAULT_GROUP_SIZE})"
        )
    kind, group = match.group(1), match.group(2)
    if kind == "fp8":
        return QuantSpec("fp8")
    group_size = int(group) if group is not None else DEFAULT_GROUP_SIZE
    if group_size not in GROUP_SIZES:
        raise ValueError(f"hidden_encoding: group size {group_size} of {name!r} is not one of {list(GROUP_SIZES)}")
    return QuantSpec(kind, group_size)


def canonical_encoding(name: str) -> str:
    """The name an encoding is stored under (`nf4` -> `nf4-g64`); ValueError for unknown names."""
    spec = parse_encoding(name)
    return name if spec is None else spec.name


def is_quantized(name: str) -> bool:
    return parse_encoding(name) is not None


# ----------------------------------------------------------------------------------------------
# Encode / decode (torch, any device; leading dimensions are free, the last is one column piece)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """float32 2^e for integer e in the normal range, built from its bits: exact on every device."""
    import torch

    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _refuse_nonfinite(amax: torch.Tensor, what: str) -> None:
    import torch

    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        first = [int(i) for i in torch.nonzero(bad)[0].tolist()]
        raise ValueError(
            f"{what}: {int(bad.sum())} NaN/Inf values found at encode (first at index {first}); "
            "quantized encodings refuse non-finite hidden states"
        )


def fp8_encode(
    x: torch.Tensor, *, check_finite: bool = True, what: str = "hidden"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes uint8 [..., n], exponents int8 [..., 1]) of values x [..., n] (one piece)."""
    import torch

    x = x.float()
    amax = x.abs().amax(dim=-1)
    if check_finite:
        _refuse_nonfinite(amax, what)
    mantissa, exponent = torch.frexp(amax / FP8_MAX)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two needs one less
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent)).clamp(FP8_EXP_MIN, FP8_EXP_MAX)
    # amax / 448 was rounded: step up wherever the scaled amax would still exceed 448.
    exponent = exponent + (amax * _power_of_two(-exponent) > FP8_MAX).to(exponent.dtype)
    exponent = exponent.clamp(FP8_EXP_MIN, FP8_EXP_MAX)
    scaled = x * _power_of_two(-exponent).unsqueeze(-1)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, exponent.to(torch.int8).unsqueeze(-1)


def fp8_decode(codes: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values [..., n] of e4m3 codes [..., n] with int8 exponents [..., 1] (exact in bf16)."""
    import torch

    values = codes.view(torch.float8_e4m3fn).to(torch.float32) * _power_of_two(exponents.to(torch.int32))
    return values.to(torch.bfloat16 if dtype is None else dtype)


_LEVELS: dict = {}  # (kind, device) -> (levels, midpoints): made once, since a host-to-device copy waits for the GPU


def _levels(kind: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the codebook's 16 levels, the 15 midpoints between neighbours) on `device`."""
    import torch

    key = (kind, str(device))
    if key not in _LEVELS:
        levels = torch.tensor(CODEBOOKS[kind], dtype=torch.float32, device=device)
        _LEVELS[key] = (levels, (levels[1:] + levels[:-1]) / 2)
    return _LEVELS[key]


def lut4_encode(
    x: torch.Tensor, spec: QuantSpec, *, check_finite: bool = True, what: str = "hidden"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed 4-bit codes uint8 [..., n/2], bf16 scales as their bits in int16 [..., n/G]) of x [..., n].
    (Torch keeps the bits in int16, which every device copies; numpy and Arrow see them as uint16.)"""
    import torch

    x = x.float()
    n, G = x.shape[-1], spec.group_size
    groups = x.unflatten(-1, (n // G, G))
    amax = groups.abs().amax(dim=-1)
    if check_finite:
        _refuse_nonfinite(amax, what)
    scale = amax.to(torch.bfloat16)
    s = scale.float().unsqueeze(-1)
    unit = torch.where(s > 0, groups / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(groups)).clamp(
        -1.0, 1.0
    )
    codes = torch.bucketize(unit, _levels(spec.kind, x.device)[1]).to(torch.uint8).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale.view(torch.int16)


def lut4_decode(
    packed: torch.Tensor, scales: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Values [..., n] of packed 4-bit codes [..., n/2] with bf16 scales (their bits, int16 or uint16) [..., n/G]."""
    import torch

    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    values = _levels(spec.kind, packed.device)[0][codes]
    s = scales.view(torch.bfloat16).float()
    values = (values.unflatten(-1, (s.shape[-1], spec.group_size)) * s.unsqueeze(-1)).flatten(-2)
    return values.to(torch.bfloat16 if dtype is None else dtype)


def encode_piece(
    x: torch.Tensor, spec: QuantSpec, *, check_finite: bool = True, what: str = "hidden"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of one column piece x [..., n] in encoding `spec`."""
    if spec.four_bit:
        return lut4_encode(x, spec, check_finite=check_finite, what=what)
    return fp8_encode(x, check_finite=check_finite, what=what)


def decode_piece(
    codes: torch.Tensor, scales: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None
) -> torch.Tensor:
    if spec.four_bit:
        return lut4_decode(codes, scales, spec, dtype)
    return fp8_decode(codes, scales, dtype)


def encode_pieces(
    x: torch.Tensor, spec: QuantSpec, pieces: int, *, check_finite: bool = True, what: str = "hidden"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(codes, scales) of each of `pieces` equal column pieces of x [..., W]."""
    width = x.shape[-1] // pieces
    spec.check_piece_width(width)
    return [
        encode_piece(x[..., j * width : (j + 1) * width], spec, check_finite=check_finite, what=what)
        for j in range(pieces)
    ]


def decode_pieces(pairs, spec: QuantSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values [..., W] of the (codes, scales) of every column piece, left to right."""
    import torch

    return torch.cat([decode_piece(codes, scales, spec, dtype) for codes, scales in pairs], dim=-1)


# ----------------------------------------------------------------------------------------------
# Host containers


@dataclasses.dataclass(frozen=True)
class QuantizedHidden:
    """Hidden states already quantized (a `Sample.hidden` on its way into a `ShardWriter`, or the
    compact form a reader hands the trainer): per column piece, codes uint8 [T, code width] and
    scales [T, scale width] (int8 exponents for fp8, bf16 bits as uint16 for 4-bit), numpy arrays."""

    encoding: str
    codes: tuple[np.ndarray, ...]
    scales: tuple[np.ndarray, ...]
    width: int  # W, values per token
    error: ErrorSums | None = None  # reconstruction error sums, when the encoder measured them

    @property
    def spec(self) -> QuantSpec:
        spec = parse_encoding(self.encoding)
        assert spec is not None, self.encoding
        return spec

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes[0].shape[0]), self.width)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.codes, *self.scales))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values [T, W] as a CPU tensor."""
        import torch

        pairs = [(torch.from_numpy(c), scales_to_torch(s)) for c, s in zip(self.codes, self.scales, strict=True)]
        return decode_pieces(pairs, self.spec, dtype)

    def bf16_bits(self) -> np.ndarray:
        """The dequantized values as bf16 bit patterns uint16 [T, W] (what lossless readers return)."""
        import torch

        return self.dequantize(torch.bfloat16).view(torch.uint16).numpy()


def quantize_bf16_bits(hidden_TW: np.ndarray, encoding: str, pieces: int, *, what: str = "hidden") -> QuantizedHidden:
    """Quantize uint16 bf16 bit patterns [T, W] on the CPU (ValueError on NaN/Inf)."""
    import torch

    spec = parse_encoding(encoding)
    assert spec is not None, encoding
    values = torch.from_numpy(np.ascontiguousarray(hidden_TW)).view(torch.bfloat16)
    pairs = encode_pieces(values, spec, pieces, what=what)
    return QuantizedHidden(
        spec.name,
        tuple(c.numpy() for c, _ in pairs),
        tuple(scales_to_numpy(s) for _, s in pairs),
        int(hidden_TW.shape[1]),
    )


def scales_to_numpy(scales: torch.Tensor) -> np.ndarray:
    """Scales as the format stores them: int8 exponents, or bf16 bits as uint16 (from torch's int16)."""
    array = scales.cpu().numpy()
    return array.view(np.uint16) if array.dtype == np.int16 else array


def scales_to_torch(array: np.ndarray) -> torch.Tensor:
    """The inverse of `scales_to_numpy` (bf16 bits back in int16, the dtype torch copies everywhere)."""
    import torch

    return torch.from_numpy(array.view(np.int16) if array.dtype == np.uint16 else array)


def e4m3_half_step(scaled: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |v| (the fp8 rounding bound of `fp8_encode`, in scaled units)."""
    import torch

    magnitude = scaled.abs().float().clamp_min(2.0**-6)
    _, exponent = torch.frexp(magnitude)  # magnitude in [2^(e-1), 2^e)
    return _power_of_two(exponent - 1 - 3) / 2


# ----------------------------------------------------------------------------------------------
# Reconstruction error, measured where the original values are at hand (at encode time)


@dataclasses.dataclass
class ErrorSums:
    """Per-channel sums over tokens, in the original feature space [F] (taps concatenated): the
    values' energy sum(x^2) and the error's sum((x - x̂)^2), x̂ the values a reader gets back
    (dequantized, and mapped back through the projection when there is one)."""

    sq: np.ndarray  # float64 [F]
    err2: np.ndarray  # float64 [F]
    tokens: int

    @classmethod
    def zeros(cls, width: int) -> ErrorSums:
        return cls(np.zeros(width), np.zeros(width), 0)

    def add(self, other: ErrorSums) -> None:
        self.sq += other.sq
        self.err2 += other.err2
        self.tokens += other.tokens

    def summary(self, n_taps: int) -> list[dict]:
        """Per tap: relative RMS error sqrt(sum err^2 / sum x^2), and the channel with the largest
        relative RMS error of its own (sqrt(err2_c / sq_c); channels that are all zero are skipped)."""
        out = []
        for sq, err2 in zip(np.split(self.sq, n_taps), np.split(self.err2, n_taps), strict=True):
            rel_c = np.where(sq > 0, np.sqrt(err2 / np.where(sq > 0, sq, 1.0)), 0.0)
            worst = int(np.argmax(rel_c))
            out.append(
                {
                    "sq": float(sq.sum()),
                    "err2": float(err2.sum()),
                    "rel_rms": float(np.sqrt(err2.sum() / sq.sum())) if sq.sum() > 0 else 0.0,
                    "worst_channel": worst,
                    "worst_channel_rel_rms": float(rel_c[worst]),
                }
            )
        return out


def channel_error_sums(
    x: torch.Tensor, x_hat: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum x^2, sum (x - x̂)^2) over the token dimension -2 of [..., T, F], in float32 on x's device;
    `valid` [..., T] (bool) leaves padded positions out."""
    x, x_hat = x.float(), x_hat.float()
    sq, err2 = x * x, (x - x_hat) ** 2
    if valid is not None:
        keep = valid.unsqueeze(-1).to(sq.dtype)
        sq, err2 = sq * keep, err2 * keep
    return sq.sum(dim=-2), err2.sum(dim=-2)


def error_sums_of(x: torch.Tensor, x_hat: torch.Tensor) -> ErrorSums:
    """ErrorSums of one sample's values [T, F] and their reconstruction."""
    sq, err2 = channel_error_sums(x, x_hat)
    return ErrorSums(sq.double().cpu().numpy(), err2.double().cpu().numpy(), int(x.shape[0]))
