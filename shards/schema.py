"""What one sample is, how it is laid out in Arrow, and the encodings of `hidden` (two lossless,
and the quantized storage tiers of `shards/quant.py`).

A shard file holds one record batch per sample, and each batch holds exactly one row, so reading
sample `row` of a shard is `open_file(...).get_batch(row)` and decodes nothing else (the reader
decodes the same record batch from the byte range the index gives, once its checksum matches; see
`shards/sample_checksums.py`). Columns of that row (T tokens, W = n_taps * H hidden width, k top-k entries):

    sample_id      string
    input_ids      list<int32>                       [T]
    loss_mask      list<uint8>                       [T]
    hidden         list<fixed_size_list<uint16, W>>  [T, W]   encoding "plain": bf16 bit patterns
    hidden_hi      list<fixed_size_list<uint8, W>>   [T, W]   encoding "planes": high byte of each bf16
    hidden_lo      list<fixed_size_list<uint8, W>>   [T, W]   encoding "planes": low byte of each bf16
    topk_ids       list<fixed_size_list<int32, k>>   [T, k]
    topk_logprobs  list<fixed_size_list<float32, k>> [T, k]

With `hidden_split` S > 1 (format version 3; extract uses one piece per tap) each hidden column is
stored as S columns of width W / S, left to right: `hidden_hi.0` .. `hidden_hi.{S-1}`, then
`hidden_lo.0` .. (or `hidden.0` ..).

Quantized encodings (format version 4; `shards/quant.py`) store per piece j the codes
`hidden_q.j` (list<fixed_size_list<uint8, code width>>) then the scales `hidden_scale.j`
(list<fixed_size_list<int8 | uint16, scale width>>): fp8 one int8 exponent per token and piece,
int4 / nf4 one bf16 scale (uint16 bits) per group. Readers dequantize them to bf16.

Arrow IPC compresses every buffer as its own zstd frame, so with "planes" zstd sees the
sign/exponent bytes (low entropy) apart from the mantissa bytes (nearly random), which is what
makes the planes smaller; per-tap pieces give zstd bytes of one layer's statistics at a time
(smaller again) and separate frames that pyarrow compresses and decompresses on several cores.
Both encodings are bit-exact. See shards/FORMAT.md.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pyarrow as pa

from shards.quant import LOSSLESS_ENCODINGS, QuantizedHidden, QuantSpec, parse_encoding

FORMAT_NAME = "dflash-shards"
# 2: index files carry each sample's byte range and xxh3-64 (FORMAT.md, "Versioning"); shard files
# are laid out as in 1, and version-1 datasets still read (without the per-sample check).
# 3: hidden columns may be split into `hidden_split` pieces of equal width (one per tap).
# 4: storage tiers: quantized encodings (`shards/quant.py`) and projected features
#    (`shards/projection.py`). Lossless, unprojected datasets are still written as version 3, byte
#    for byte as before; only a dataset with a tier is version 4 (older readers refuse it by version).
FORMAT_VERSION = 3
TIER_FORMAT_VERSION = 4
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4)
FIRST_SPLIT_VERSION = 3
ENCODINGS = LOSSLESS_ENCODINGS  # the lossless ones; quantized names are parsed (`shards.quant.parse_encoding`)
DEFAULT_ENCODING = "planes"  # chosen by measurement: FORMAT.md, "Why these defaults"
DEFAULT_ZSTD_LEVEL = 1  # chosen by measurement: FORMAT.md, "Why these defaults"
DEFAULT_SHARD_BYTES = 1 << 30
SHARD_SUFFIX = ".arrow"
INDEX_SUFFIX = ".index.arrow"
TAP_MEANING = "id i = output of decoder layer i = hidden_states[i+1]"

# bf16 is 1 sign, 8 exponent, 7 mantissa bits; an all-ones exponent is Inf or NaN.
BF16_EXPONENT_MASK = 0x7F80
_SCAN_BLOCK = 1 << 20  # values per block of the NaN/Inf scan (2 MB of uint16: stays in cache)
_JOIN_BLOCK_VALUES = 1 << 19  # values per block when joining split byte planes (1 MB of uint16)

_META_PREFIX = b"dflash."
_PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ShardFormatError(ValueError):
    """A dataset on disk does not match its manifest or this format (the message names the file)."""


@dataclasses.dataclass
class Sample:
    """One tokenized sample with its target features, as numpy arrays."""

    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on assistant-response tokens
    hidden: np.ndarray  # uint16 [T, W], bf16 bit patterns, W = n_taps * H (writing: or HiddenPlanes)
    topk_ids: np.ndarray  # int32 [T, k]
    topk_logprobs: np.ndarray  # float32 [T, k], log_softmax of the true final logits, descending

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


def sample_from_torch(sample_id, input_ids, loss_mask, hidden, topk_ids, topk_logprobs) -> Sample:
    """A `Sample` from CPU torch tensors (hidden in bf16), converting to the stored dtypes.

    The bf16 hidden states are reinterpreted as uint16 bit patterns without rounding.
    """
    import torch

    if hidden.dtype != torch.bfloat16:
        raise ValueError(f"sample {sample_id!r}: field 'hidden': expected a bfloat16 tensor, got {hidden.dtype}")
    return Sample(
        sample_id=sample_id,
        input_ids=input_ids.detach().cpu().to(torch.int32).numpy(),
        loss_mask=loss_mask.detach().cpu().to(torch.uint8).numpy(),
        hidden=hidden.detach().cpu().contiguous().view(torch.uint16).numpy(),
        topk_ids=topk_ids.detach().cpu().to(torch.int32).numpy(),
        topk_logprobs=topk_logprobs.detach().cpu().to(torch.float32).numpy(),
    )


def check_encoding(encoding: str) -> str:
    """`encoding` if it is a stored encoding name (lossless, or a canonical quantized name such as
    `fp8`, `nf4-g64`), else ValueError naming it. Use `shards.quant.canonical_encoding` first to
    accept the short names (`nf4`)."""
    spec = parse_encoding(encoding)
    if spec is not None and spec.name != encoding:
        raise ValueError(f"hidden_encoding: {encoding!r} is stored as {spec.name!r}; give the full name")
    return encoding


def format_version_for(encoding: str, projected: bool = False) -> int:
    """The format version a writer gives a dataset of this encoding: 3 (lossless, unprojected: the
    same files as before tiers existed), 4 with a storage tier."""
    return TIER_FORMAT_VERSION if projected or parse_encoding(encoding) is not None else FORMAT_VERSION


def check_hidden_split(hidden_split, hidden_width: int) -> int:
    """`hidden_split` if it is a positive integer dividing `hidden_width`, else ValueError naming it."""
    if (
        not isinstance(hidden_split, int)
        or isinstance(hidden_split, bool)
        or hidden_split < 1
        or not isinstance(hidden_width, int)
        or hidden_width % hidden_split
    ):
        raise ValueError(
            f"hidden_split: expected a positive integer that divides hidden_width {hidden_width}, got {hidden_split!r}"
        )
    return hidden_split


def hidden_field_names(encoding: str, hidden_split: int) -> list[str]:
    """The hidden columns of a shard, in schema order: per stored array (`hidden`, or `hidden_hi`
    then `hidden_lo`), its pieces left to right; unsplit (S = 1) columns keep the bare name."""
    if encoding == "plain":
        bases = ["hidden"]
    elif encoding == "planes":
        bases = ["hidden_hi", "hidden_lo"]
    else:
        bases = ["hidden_q", "hidden_scale"]
    if hidden_split == 1:
        return bases
    return [f"{base}.{piece}" for base in bases for piece in range(hidden_split)]


def check_prefix(name: str, what: str) -> str:
    if not isinstance(name, str) or not _PREFIX_PATTERN.match(name):
        raise ValueError(f"{what}: {name!r} must be a plain file name of letters, digits, '_', '-', '.'")
    return name


def shard_file_name(prefix: str, number: int) -> str:
    return f"{prefix}-{number:05d}{SHARD_SUFFIX}"


def index_file_name(shard_file: str) -> str:
    assert shard_file.endswith(SHARD_SUFFIX)
    return shard_file[: -len(SHARD_SUFFIX)] + INDEX_SUFFIX


def shard_number(prefix: str, file_name: str) -> int | None:
    """The number in `{prefix}-{NNNNN}.arrow`, or None if the name is not one of this prefix's shards."""
    match = re.fullmatch(re.escape(prefix) + r"-(\d+)" + re.escape(SHARD_SUFFIX), file_name)
    return int(match.group(1)) if match else None


# ----------------------------------------------------------------------------- Arrow schemas


def _rows_of(value_type: pa.DataType, width: int) -> pa.DataType:
    return pa.list_(pa.field("item", pa.list_(pa.field("item", value_type, nullable=False), width), nullable=False))


def hidden_column_types(encoding: str, hidden_width: int, hidden_split: int) -> list[tuple[pa.DataType, int]]:
    """(value type, values per token) of each hidden column, in schema order."""
    piece = hidden_width // hidden_split
    spec = parse_encoding(encoding)
    if spec is None:
        value_type = pa.uint16() if encoding == "plain" else pa.uint8()
        return [(value_type, piece)] * len(hidden_field_names(encoding, hidden_split))
    scale_type = pa.uint16() if spec.four_bit else pa.int8()
    return [(pa.uint8(), spec.code_width(piece))] * hidden_split + [
        (scale_type, spec.scale_width(piece))
    ] * hidden_split


def shard_schema(
    encoding: str, hidden_width: int, topk: int, format_version: int | None = None, hidden_split: int = 1
) -> pa.Schema:
    """The schema of a shard file; its metadata repeats the encoding, widths and split so a shard
    describes itself, and names the format version of the writer that wrote it (default: the
    version this code writes for the encoding, `format_version_for`)."""
    check_encoding(encoding)
    check_hidden_split(hidden_split, hidden_width)
    spec = parse_encoding(encoding)
    if spec is not None:
        spec.check_piece_width(hidden_width // hidden_split)
    if format_version is None:
        format_version = format_version_for(encoding)
    assert hidden_split == 1 or format_version >= FIRST_SPLIT_VERSION, (hidden_split, format_version)
    assert spec is None or format_version >= TIER_FORMAT_VERSION, (encoding, format_version)
    hidden_fields = [
        pa.field(name, _rows_of(value_type, width), nullable=False)
        for name, (value_type, width) in zip(
            hidden_field_names(encoding, hidden_split),
            hidden_column_types(encoding, hidden_width, hidden_split),
            strict=True,
        )
    ]
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False),
        pa.field("loss_mask", pa.list_(pa.field("item", pa.uint8(), nullable=False)), nullable=False),
        *hidden_fields,
        pa.field("topk_ids", _rows_of(pa.int32(), topk), nullable=False),
        pa.field("topk_logprobs", _rows_of(pa.float32(), topk), nullable=False),
    ]
    metadata = {
        _META_PREFIX + b"format": FORMAT_NAME.encode(),
        _META_PREFIX + b"format_version": str(format_version).encode(),
        _META_PREFIX + b"encoding": encoding.encode(),
        _META_PREFIX + b"hidden_width": str(hidden_width).encode(),
        _META_PREFIX + b"topk": str(topk).encode(),
    }
    if format_version >= FIRST_SPLIT_VERSION:
        metadata[_META_PREFIX + b"hidden_split"] = str(hidden_split).encode()
    return pa.schema(fields, metadata=metadata)


def shard_schema_matches(schema: pa.Schema, encoding: str, hidden_width: int, topk: int, hidden_split: int = 1) -> bool:
    """True if `schema` is the shard schema of this layout, written by any supported format version."""
    first = (
        TIER_FORMAT_VERSION if parse_encoding(encoding) is not None else FIRST_SPLIT_VERSION if hidden_split > 1 else 1
    )
    return any(
        schema.equals(shard_schema(encoding, hidden_width, topk, v, hidden_split), check_metadata=True)
        for v in SUPPORTED_FORMAT_VERSIONS
        if v >= first
    )


def index_schema(sample_checksums: bool = True) -> pa.Schema:
    """The per-shard index sidecar: one row per sample, in shard row order. Version 1 indexes end
    at `nbytes`; version 2 adds each sample's byte range and checksum (`shards/sample_checksums.py`)."""
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("n_tokens", pa.int32(), nullable=False),
        pa.field("n_loss_tokens", pa.int32(), nullable=False),
        pa.field("row", pa.int32(), nullable=False),
        # bytes the shard grew by when this sample was written (row 0 also holds the file header)
        pa.field("nbytes", pa.int64(), nullable=False),
    ]
    if sample_checksums:
        fields += [
            pa.field(
                "offset", pa.int64(), nullable=False
            ),  # where the sample's record batch message starts in the shard file
            pa.field(
                "length", pa.int64(), nullable=False
            ),  # its bytes: metadata + body, up to where the next one starts
            pa.field("xxh3_64", pa.uint64(), nullable=False),  # xxh3-64 of those bytes
        ]
    return pa.schema(
        fields,
        metadata={
            _META_PREFIX + b"format": FORMAT_NAME.encode(),
            _META_PREFIX + b"format_version": str(FORMAT_VERSION).encode(),
        },
    )


# ----------------------------------------------------------------------------- bf16 byte planes


@dataclasses.dataclass(frozen=True)
class HiddenPlanes:
    """Hidden states already split into the byte planes that the `planes` encoding stores:
    `hi = u16 >> 8`, `lo = u16 & 0xFF`. A `Sample.hidden` may be one of these on the way into a
    `ShardWriter` (extract splits on the GPU, so the writer stores the planes as they are, without
    a host pass); readers always return uint16.

    Each plane is uint8 [T, W], or a tuple of its column pieces uint8 [T, W / S] left to right (extract
    hands over one piece per tap, as the device laid them out, so a split dataset needs no copy)."""

    hi: np.ndarray | tuple[np.ndarray, ...]
    lo: np.ndarray | tuple[np.ndarray, ...]
    error: object = None  # shards.quant.ErrorSums of projected features (their reconstruction error), if measured

    @property
    def shape(self) -> tuple[int, int]:
        return plane_shape(self.hi)

    def join(self) -> np.ndarray:
        """The uint16 bit patterns [T, W] (a new array)."""
        return join_planes(whole_plane(self.hi), whole_plane(self.lo))


def plane_pieces(plane) -> tuple[np.ndarray, ...]:
    """The column pieces of a plane given whole (one piece) or as pieces."""
    return plane if isinstance(plane, tuple) else (plane,)


def plane_shape(plane) -> tuple[int, int]:
    """(T, W) of a plane given whole or as column pieces."""
    pieces = plane_pieces(plane)
    return (pieces[0].shape[0], sum(piece.shape[1] for piece in pieces))


def whole_plane(plane) -> np.ndarray:
    """A plane given whole or as column pieces, as one [T, W] array (a copy only for pieces)."""
    if not isinstance(plane, tuple):
        return plane
    return np.ascontiguousarray(plane[0]) if len(plane) == 1 else np.concatenate(plane, axis=1)


def column_pieces(array, hidden_split: int) -> list[np.ndarray]:
    """`hidden_split` C-contiguous column pieces of equal width of an array given whole or as pieces:
    views when the given pieces already match, copies otherwise."""
    if isinstance(array, tuple) and len(array) == hidden_split:
        return [np.ascontiguousarray(piece) for piece in array]
    whole = whole_plane(array)
    if hidden_split == 1:
        return [np.ascontiguousarray(whole)]
    width = whole.shape[1] // hidden_split
    return [np.ascontiguousarray(whole[:, j * width : (j + 1) * width]) for j in range(hidden_split)]


def split_planes(hidden_TW: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high bytes, low bytes) of uint16 values, each uint8 of the same shape; lossless."""
    hi_TW = np.right_shift(hidden_TW, 8).astype(np.uint8)
    lo_TW = hidden_TW.astype(np.uint8)  # keeps the low 8 bits
    return hi_TW, lo_TW


def join_planes(hi_TW: np.ndarray, lo_TW: np.ndarray, out_TW: np.ndarray | None = None) -> np.ndarray:
    """The uint16 values whose high and low bytes are `hi` and `lo` (inverse of `split_planes`),
    written into `out` if given (two passes, no temporary)."""
    out_TW = np.left_shift(hi_TW, 8, dtype=np.uint16, out=out_TW)
    np.bitwise_or(out_TW, lo_TW, out=out_TW)
    return out_TW


def count_nonfinite_bf16(hidden: np.ndarray) -> int:
    """How many bf16 bit patterns are Inf or NaN."""
    flat = hidden.reshape(-1)
    # In blocks through two reused scratch arrays: whole-array temporaries of a long sample are
    # hundreds of MB of fresh pages (page faults cost more than the arithmetic).
    masked = np.empty(min(flat.size, _SCAN_BLOCK), dtype=flat.dtype)
    flags = np.empty(masked.size, dtype=bool)
    bad = 0
    for start in range(0, flat.size, _SCAN_BLOCK):
        block = flat[start : start + _SCAN_BLOCK]
        n = block.size
        np.bitwise_and(block, BF16_EXPONENT_MASK, out=masked[:n])
        np.equal(masked[:n], BF16_EXPONENT_MASK, out=flags[:n])
        bad += int(np.count_nonzero(flags[:n]))
    return bad


def count_nonfinite_planes(hi: np.ndarray, lo: np.ndarray) -> int:
    """How many bf16 values given as byte planes are Inf or NaN (exponent all ones: the low 7 bits
    of the high byte and the top bit of the low byte)."""
    return int(np.count_nonzero(((hi & 0x7F) == 0x7F) & (lo >= 0x80)))


def bf16_bits_to_float32(hidden: np.ndarray) -> np.ndarray:
    """Exact float32 values of bf16 bit patterns (bf16 is the top half of a float32)."""
    return (hidden.astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------- encode / decode


def _one_row_list(values: np.ndarray, width: int | None) -> pa.Array:
    """A one-row list array over `values` ([T] or [T, width]) without copying the numpy data."""
    flat = pa.array(values.reshape(-1))
    if width is not None:
        flat = pa.FixedSizeListArray.from_arrays(flat, width)
    offsets = pa.array(np.array([0, values.shape[0]], dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, flat)


def encode_sample(sample: Sample, schema: pa.Schema, encoding: str, hidden_split: int = 1) -> pa.RecordBatch:
    """One record batch of one row holding `sample` (already validated). Its hidden states may be
    uint16 or `HiddenPlanes` (lossless encodings) or `QuantizedHidden` (quantized: the writer
    quantizes uint16 input before it gets here); the Arrow arrays are views of the numpy data wherever the layout
    allows (planes given as planes in the dataset's pieces, uint16 stored plain and unsplit), so
    the only pass is zstd's."""
    hidden = sample.hidden
    k = sample.topk_ids.shape[1]
    if isinstance(hidden, QuantizedHidden):
        assert hidden.encoding == encoding and len(hidden.codes) == hidden_split, (
            hidden.encoding,
            encoding,
            len(hidden.codes),
        )
        stored = [np.ascontiguousarray(a) for a in (*hidden.codes, *hidden.scales)]
    elif encoding == "plain":
        bits = hidden.join() if isinstance(hidden, HiddenPlanes) else hidden
        stored = column_pieces(bits, hidden_split)
    else:
        hi, lo = (hidden.hi, hidden.lo) if isinstance(hidden, HiddenPlanes) else split_planes(hidden)
        stored = column_pieces(hi, hidden_split) + column_pieces(lo, hidden_split)
    columns = [
        pa.array([sample.sample_id], pa.string()),
        _one_row_list(np.ascontiguousarray(sample.input_ids), None),
        _one_row_list(np.ascontiguousarray(sample.loss_mask), None),
        *[_one_row_list(piece, piece.shape[1]) for piece in stored],
        _one_row_list(np.ascontiguousarray(sample.topk_ids), k),
        _one_row_list(np.ascontiguousarray(sample.topk_logprobs), k),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _rows(column: pa.Array, T: int, width: int, name: str) -> np.ndarray:
    """[T, width] view of a list<fixed_size_list> column, checking it has T positions."""
    values = _values(column, 2)
    if values.size != T * width:
        raise ShardFormatError(
            f"field {name!r} has {values.size // max(width, 1)} positions of width {width}, input_ids has {T}"
        )
    return values.reshape(T, width)


def _values(column: pa.Array, depth: int) -> np.ndarray:
    """The flat values of row 0 of a list (depth 1) or list-of-fixed-size-list (depth 2) column,
    as a numpy view of Arrow's buffer (no copy). The view is writable when Arrow's memory is
    (decompressed buffers are); it is read-only when it points into a memory-mapped file."""
    values = column.flatten()
    if depth == 2:
        values = values.flatten()
    if values.null_count:
        raise ShardFormatError(f"{values.null_count} null values in a non-nullable column")
    dtype = np.dtype(values.type.to_pandas_dtype())
    return np.frombuffer(values.buffers()[1], dtype=dtype, count=len(values), offset=values.offset * dtype.itemsize)


def _quantized_hidden(
    batch: pa.RecordBatch, spec: QuantSpec, T: int, hidden_width: int, hidden_split: int
) -> QuantizedHidden:
    """The codes and scales of a quantized sample, as views of the Arrow buffers."""
    names = hidden_field_names(spec.name, hidden_split)
    widths = [width for _, width in hidden_column_types(spec.name, hidden_width, hidden_split)]
    arrays = [_rows(batch.column(name), T, width, name) for name, width in zip(names, widths, strict=True)]
    return QuantizedHidden(spec.name, tuple(arrays[:hidden_split]), tuple(arrays[hidden_split:]), hidden_width)


def _dequantize_into(quantized: QuantizedHidden, destination) -> np.ndarray:
    """uint16 bf16 bits [T, W] of quantized hidden states, written into `destination` if given."""
    import torch

    values = quantized.dequantize(torch.bfloat16).view(torch.uint16).numpy()
    if destination is None:
        return values
    np.copyto(destination, values)
    return destination


def _decode_hidden(
    batch: pa.RecordBatch, encoding: str, T: int, hidden_width: int, hidden_split: int, destination
) -> np.ndarray:
    """uint16 [T, W] from the hidden columns: a view of the Arrow buffer for unsplit `plain` without a
    destination, else written into `destination` (or a new array) piece by piece; quantized
    encodings are dequantized to bf16."""
    spec = parse_encoding(encoding)
    if spec is not None:
        return _dequantize_into(_quantized_hidden(batch, spec, T, hidden_width, hidden_split), destination)
    names = hidden_field_names(encoding, hidden_split)
    width = hidden_width // hidden_split
    columns = [_rows(batch.column(name), T, width, name) for name in names]
    if encoding == "plain" and hidden_split == 1 and destination is None:
        return columns[0]
    out_TW = destination if destination is not None else np.empty((T, hidden_width), dtype=np.uint16)
    if encoding == "plain":
        for j, column in enumerate(columns):
            np.copyto(out_TW[:, j * width : (j + 1) * width], column)
        return out_TW
    if hidden_split == 1:
        return join_planes(columns[0], columns[1], out_TW)
    # Joined a block of rows at a time in a small contiguous buffer, then copied into the piece's
    # columns: joining straight into the strided columns costs numpy ~40% more (measured).
    rows = max(1, _JOIN_BLOCK_VALUES // width)
    block_RW = np.empty((min(T, rows), width), dtype=np.uint16)
    for start in range(0, T, rows):
        stop = min(T, start + rows)
        joined = block_RW[: stop - start]
        for j in range(hidden_split):
            join_planes(columns[j][start:stop], columns[hidden_split + j][start:stop], joined)
            out_TW[start:stop, j * width : (j + 1) * width] = joined
    return out_TW


def decode_sample(
    batch: pa.RecordBatch,
    encoding: str,
    hidden_width: int,
    topk: int,
    hidden_out: np.ndarray | None = None,
    hidden_split: int = 1,
    compact: bool = False,
) -> Sample:
    """The `Sample` held by a one-row record batch. Every array is a zero-copy view of the decoded
    Arrow buffers, except `planes` (or split) hidden states, which are joined into one fresh array,
    and quantized ones, which are dequantized to bf16 bits (uint16) unless `compact`: then
    `sample.hidden` is the `QuantizedHidden` as stored (views; the trainer dequantizes on its device).

    With `hidden_out` (uint16 [>= T, W], C-contiguous, e.g. a row of a trainer's batch buffer) the
    hidden states are decoded straight into `hidden_out[:T]`, saving the copy a collate would make.
    """
    if batch.num_rows != 1:
        raise ShardFormatError(f"expected one row per record batch, found {batch.num_rows}")
    input_ids = _values(batch.column("input_ids"), 1)
    T = input_ids.shape[0]
    destination = None
    if hidden_out is not None:
        if (
            hidden_out.dtype != np.uint16
            or hidden_out.ndim != 2
            or hidden_out.shape[1] != hidden_width
            or hidden_out.shape[0] < T
        ):
            raise ValueError(
                f"hidden_out: need uint16 [>= {T}, {hidden_width}], got {hidden_out.dtype} {tuple(hidden_out.shape)}"
            )
        destination = hidden_out[:T]
    spec = parse_encoding(encoding)
    if compact and spec is not None:
        hidden_TW: np.ndarray | QuantizedHidden = _quantized_hidden(batch, spec, T, hidden_width, hidden_split)
    else:
        hidden_TW = _decode_hidden(batch, encoding, T, hidden_width, hidden_split, destination)
    loss_mask = _values(batch.column("loss_mask"), 1)
    if loss_mask.size != T:
        raise ShardFormatError(f"field 'loss_mask' has {loss_mask.size} positions, input_ids has {T}")
    return Sample(
        sample_id=batch.column("sample_id")[0].as_py(),
        input_ids=input_ids,
        loss_mask=loss_mask,
        hidden=hidden_TW,  # type: ignore[arg-type]  # a compact read keeps the codes
        topk_ids=_rows(batch.column("topk_ids"), T, topk, "topk_ids"),
        topk_logprobs=_rows(batch.column("topk_logprobs"), T, topk, "topk_logprobs"),
    )
