"""Projected features (storage tier, format version 4): a dataset may store z = P·h instead of the
tap features h, for a fixed matrix P (r x F, F = n_taps * H), and the drafter trains fc' on z; the
export folds P into fc (fc = fc'·P), so the exported drafter reads full features anywhere.

P is block-diagonal, one block per tap: P_i (r_t x H) holds the top r_t eigenvectors of the tap's
**uncentered** second moment E[h hᵀ] over a calibration sample (PCA without centering: centering
would turn fc'·P(h - mu) into an affine map, and DFlash's fc has no bias). Per tap, because the
taps' scales differ by two orders of magnitude: one PCA over the concatenation would spend the
rank on the deepest tap. Every tap keeps the same rank r_t, so the stored features are n_taps
column pieces of equal width (one per tap, as in unprojected datasets), and r = n_taps * r_t.
Choose r_t directly (`pca:rank=R`) or from a target share of the second moment that every tap
keeps (`pca:variance=0.99`: the largest rank any tap needs); the share each tap keeps on the
calibration sample is stored ("explained": sum of the kept eigenvalues / trace).

Stored as `projection.safetensors` in the dataset directory: tensor `blocks` float32
[n_taps, r_t, H] (rows orthonormal), metadata `info` (JSON: method, ranks, explained shares,
calibration). The manifest's `projection` entry names the file, its size and xxh3-128 `checksum`
(which is also the projection's identity: the drafter config records it), `in_width`, `out_width`.

The second moments are accumulated in float64 on whatever device holds the features (the GPU during
extraction); the eigendecomposition runs there too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import TYPE_CHECKING

from common import io
from common.hashing import bytes_digest

if TYPE_CHECKING:
    import torch

PROJECTION_FILE = "projection.safetensors"
METHOD = "pca-uncentered-per-tap"
METHOD_KEPT = "pca-uncentered-per-tap-kept-channels"
_SPEC = re.compile(r"^pca:(rank|variance)=([0-9.eE+-]+)(?:,keep=([0-9]+))?$")


@dataclasses.dataclass(frozen=True)
class ProjectionSpec:
    """How to choose the rank: `rank` per tap, or the `variance` share every tap keeps; `keep`: that
    many channels per tap (those of largest energy) stored exactly, the rest of the rank a PCA of the
    other channels."""

    rank: int | None = None
    variance: float | None = None
    keep: int = 0

    def describe(self) -> str:
        text = f"pca:rank={self.rank}" if self.rank is not None else f"pca:variance={self.variance:g}"
        return text + (f",keep={self.keep}" if self.keep else "")


def parse_projection_spec(text: str) -> ProjectionSpec:
    """`pca:rank=R` (R per tap) or `pca:variance=V` (0 < V <= 1), each optionally `,keep=K`;
    ValueError naming the form otherwise."""
    match = _SPEC.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"projection: {text!r} is not 'pca:rank=R', 'pca:variance=V' (optionally ',keep=K') or a projection file"
        )
    key, value, keep_text = match.groups()
    keep = int(keep_text or 0)
    if key == "rank":
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"projection: rank must be a positive integer, got {value!r}")
        if keep >= int(value):
            raise ValueError(f"projection: keep={keep} channels must be fewer than the rank {value}")
        return ProjectionSpec(rank=int(value), keep=keep)
    share = float(value)
    if not 0.0 < share <= 1.0:
        raise ValueError(f"projection: variance must lie in (0, 1], got {value!r}")
    return ProjectionSpec(variance=share, keep=keep)


@dataclasses.dataclass
class Projection:
    """The block-diagonal P: `blocks` float32 [n_taps, r_t, H]."""

    blocks: torch.Tensor
    info: dict

    @property
    def n_taps(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def rank(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def tap_width(self) -> int:
        return int(self.blocks.shape[2])

    @property
    def in_width(self) -> int:
        return self.n_taps * self.tap_width

    @property
    def out_width(self) -> int:
        return self.n_taps * self.rank

    def to(self, device) -> Projection:
        return Projection(self.blocks.to(device), self.info)

    def apply_tap(self, tap: int, h: torch.Tensor) -> torch.Tensor:
        """z_i = P_i h_i: [..., H] -> float32 [..., r_t]."""
        return h.float() @ self.blocks[tap].t()

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        """z = P·h: [..., F] -> float32 [..., n_taps * r_t]."""
        import torch

        taps = h.unflatten(-1, (self.n_taps, self.tap_width))
        return torch.cat([self.apply_tap(i, taps[..., i, :]) for i in range(self.n_taps)], dim=-1)

    def back_tap(self, tap: int, z: torch.Tensor) -> torch.Tensor:
        """P_iᵀ z_i: [..., r_t] -> float32 [..., H]."""
        return z.float() @ self.blocks[tap]

    def back(self, z: torch.Tensor) -> torch.Tensor:
        """Pᵀ·z: [..., n_taps * r_t] -> float32 [..., F] (the reconstruction of h in the taps' space)."""
        import torch

        pieces = z.float().unflatten(-1, (self.n_taps, self.rank))
        return torch.cat([self.back_tap(i, pieces[..., i, :]) for i in range(self.n_taps)], dim=-1)

    def fold(self, weight_DR: torch.Tensor) -> torch.Tensor:
        """A linear map on projected features W' [D, r] as one on full features: W' P [D, F], in float32."""
        import torch

        if weight_DR.shape[-1] != self.out_width:
            raise ValueError(
                f"fold: the weight reads {weight_DR.shape[-1]} features, the projection gives {self.out_width}"
            )
        parts = weight_DR.float().unflatten(-1, (self.n_taps, self.rank))
        return torch.cat([parts[:, i, :] @ self.blocks[i].to(weight_DR.device) for i in range(self.n_taps)], dim=-1)


class SecondMoments:
    """Per-tap sums of h hᵀ over calibration tokens, float64, on the device of the first batch."""

    def __init__(self, n_taps: int, tap_width: int, device=None):
        import torch

        self.n_taps, self.tap_width = n_taps, tap_width
        self.sums: torch.Tensor | None = (
            None if device is None else torch.zeros(n_taps, tap_width, tap_width, dtype=torch.float64, device=device)
        )
        self.tokens = 0

    def add_tap(self, tap: int, h_NH: torch.Tensor) -> None:
        """Add the tokens [N, H] of one tap (only real tokens: leave padding out before)."""
        import torch

        if self.sums is None:
            self.sums = torch.zeros(
                self.n_taps, self.tap_width, self.tap_width, dtype=torch.float64, device=h_NH.device
            )
        h = h_NH.reshape(-1, self.tap_width).to(self.sums.device, torch.float64)
        self.sums[tap].addmm_(h.t(), h)
        self._eigen: tuple | None = None
        if tap == 0:
            self.tokens += int(h.shape[0])

    def eigen(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(eigenvalues [n_taps, H] descending, clamped >= 0; eigenvectors [n_taps, H, H] as columns),
        computed once per state of the sums."""
        import torch

        eigen = getattr(self, "_eigen", None)
        if eigen is None:
            values, vectors = torch.linalg.eigh(self.sums)  # ascending, per tap
            eigen = self._eigen = (values.flip(-1).clamp_min(0.0), vectors.flip(-1))
        return eigen

    def add(self, h_NF: torch.Tensor) -> None:
        """Add tokens [N, F] of all taps, concatenated."""
        taps = h_NF.reshape(-1, self.n_taps, self.tap_width)
        for i in range(self.n_taps):
            self.add_tap(i, taps[:, i, :])


def _canonical_signs(vectors_HR: torch.Tensor) -> torch.Tensor:
    """Eigenvectors with the sign that makes each one's largest-magnitude entry positive (eigh's
    signs are arbitrary; this makes P a function of the second moment alone)."""
    import torch

    index = vectors_HR.abs().argmax(dim=0)
    signs = torch.sign(vectors_HR.gather(0, index[None, :]))
    return vectors_HR * torch.where(signs == 0, torch.ones_like(signs), signs)


def fit_projection(
    moments: SecondMoments, spec: ProjectionSpec, *, multiple: int = 1, info: dict | None = None
) -> Projection:
    """P from the calibration sums: per tap the top eigenvectors of sum h hᵀ (with `spec.keep`: the
    tap's `keep` channels of largest energy, then the top eigenvectors of the other channels); the rank
    per tap from `spec`: as given (ValueError unless a multiple of `multiple`, a 4-bit encoding's group
    size), or the smallest that keeps the variance share in every tap, rounded up to a multiple of
    `multiple`; at most H."""
    import torch

    if moments.sums is None or moments.tokens == 0:
        raise ValueError("projection: the calibration pass saw no tokens")
    H = moments.tap_width
    if spec.keep:
        # Every rank's rows are the first rows of the full-rank ones: kept channels first, then the rest's PCA.
        rows_by_tap = [kept_channel_rows(moments.sums[i], H, spec.keep)[0] for i in range(moments.n_taps)]
        shares = torch.stack([captured_shares(rows, moments.sums[i]) for i, rows in enumerate(rows_by_tap)])
    else:
        eigenvalues, eigenvectors = moments.eigen()
        rows_by_tap = [eigenvectors[i].t() for i in range(moments.n_taps)]
        totals = eigenvalues.sum(-1)
        shares = eigenvalues.cumsum(-1) / torch.where(totals > 0, totals, torch.ones_like(totals))[:, None]
    if spec.rank is not None:
        rank = spec.rank
        if rank % multiple:  # a rank asked for is kept, or refused: never changed behind the user's back
            raise ValueError(
                f"projection: rank {rank} per tap is not a multiple of the 4-bit group size {multiple}; "
                f"ask for pca:rank={-(-rank // multiple) * multiple}, or a smaller group"
            )
    else:
        assert spec.variance is not None  # a spec has a rank or a variance
        rank = max(smallest_rank_keeping(shares[i], spec.variance) for i in range(moments.n_taps))
        rank = max(rank, spec.keep + 1)
    rank = min(H, int(math.ceil(rank / multiple) * multiple))
    if rank > H:
        raise ValueError(f"projection: rank {rank} exceeds the tap width {H}")
    blocks = torch.stack([_canonical_signs(rows[:rank].t()).t() for rows in rows_by_tap]).float().cpu()
    explained = [float(shares[i, rank - 1]) for i in range(moments.n_taps)]
    details = {
        "method": METHOD_KEPT if spec.keep else METHOD,
        "spec": spec.describe(),
        "rank_per_tap": rank,
        "n_taps": moments.n_taps,
        "tap_width": H,
        "explained": explained,
        "calibration_tokens": moments.tokens,
        **(info or {}),
    }
    return Projection(blocks, details)


def captured_shares(rows_RH: torch.Tensor, sums_HH: torch.Tensor) -> torch.Tensor:
    """Share of the second moment `sums_HH` kept by the first 1..R of the orthonormal rows (float64 [R])."""
    import torch

    rows = rows_RH.to(sums_HH.dtype)
    captured = torch.einsum("rh,hk,rk->r", rows, sums_HH, rows).clamp_min(0.0)
    total = sums_HH.trace()
    return (captured.cumsum(0) / torch.where(total > 0, total, torch.ones_like(total))).clamp(max=1.0)


def smallest_rank_keeping(shares_R: torch.Tensor, target: float) -> int:
    """The smallest rank whose share reaches `target` (shares ascending); the largest if none does."""
    import torch

    reached = torch.nonzero(shares_R >= target - 1e-12)
    return int(reached[0, 0]) + 1 if reached.numel() else int(shares_R.shape[0])


def kept_channel_rows(sums_HH: torch.Tensor, rank: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [rank, H] orthonormal, the kept channels [keep]) of one tap's P that stores its `keep`
    channels of largest energy (diagonal of sum h hᵀ) as they are and the top `rank - keep`
    eigenvectors of the other channels' second moment: a projection of the usual form (P Pᵀ = I), whose
    reconstruction Pᵀ P h is exact on the kept channels."""
    import torch

    H = sums_HH.shape[-1]
    if not 0 <= keep < rank <= H:
        raise ValueError(f"projection: keep {keep} channels needs 0 <= keep < rank <= {H}, rank is {rank}")
    channels = torch.argsort(sums_HH.diagonal(), descending=True)[:keep]
    rest = torch.ones(H, dtype=torch.bool, device=sums_HH.device)
    rest[channels] = False
    _, vectors = torch.linalg.eigh(sums_HH[rest][:, rest])
    pca = torch.zeros(H, rank - keep, dtype=sums_HH.dtype, device=sums_HH.device)
    pca[rest] = _canonical_signs(vectors.flip(-1)[:, : rank - keep])
    exact = torch.zeros(keep, H, dtype=sums_HH.dtype, device=sums_HH.device)
    exact[torch.arange(keep), channels] = 1.0
    return torch.cat([exact, pca.t()]), channels


def projection_bytes(projection: Projection) -> bytes:
    from safetensors.torch import save

    return save(
        {"blocks": projection.blocks.contiguous().float().cpu()},
        metadata={"info": json.dumps(projection.info, sort_keys=True)},
    )


def projection_from_bytes(data: bytes, where: str) -> Projection:
    import torch
    from safetensors.torch import load

    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
        info = json.loads(metadata.get("info", "{}"))
    except Exception as err:  # noqa: BLE001 - any damage to the file
        raise ValueError(f"{where}: not a readable projection file ({err})") from None
    blocks = tensors.get("blocks")
    if blocks is None or blocks.ndim != 3 or blocks.dtype != torch.float32:
        raise ValueError(f"{where}: projection file without a float32 [n_taps, rank, H] 'blocks' tensor")
    return Projection(blocks, info)


def entry_for(projection: Projection, data: bytes, file: str = PROJECTION_FILE) -> dict:
    """The manifest's `projection` entry for this projection stored as `data` under `file`."""
    info = projection.info
    return {
        "file": file,
        "bytes": len(data),
        "checksum": bytes_digest(data),
        "in_width": projection.in_width,
        "out_width": projection.out_width,
        "method": info.get("method", METHOD),
        "rank_per_tap": projection.rank,
        "explained": info.get("explained"),
        "spec": info.get("spec"),
        "calibration_tokens": info.get("calibration_tokens"),
    }


def save_projection(root: str, projection: Projection, data: bytes | None = None) -> dict:
    """Write `projection.safetensors` into the dataset directory (atomically) and return the
    manifest entry; an identical file already there is left as is. `data`: the file's bytes as
    they are (a projection reused from another dataset keeps its identity, the checksum)."""
    fs, path = io.resolve(root)
    data = projection_bytes(projection) if data is None else data
    target = io.join(path, PROJECTION_FILE)
    if not (io.exists(fs, target) and io.read_bytes(fs, target) == data):
        fs.create_dir(path, recursive=True)
        io.atomic_write_bytes(target, data, fs)
    return entry_for(projection, data)


def load_projection(root: str, entry: dict) -> Projection:
    """The projection a manifest entry names, checked against the entry's size and checksum."""
    fs, path = io.resolve(root)
    target = io.join(path, entry["file"])
    if not io.exists(fs, target):
        raise FileNotFoundError(f"{target}: projection file listed in the manifest is missing")
    data = io.read_bytes(fs, target)
    if len(data) != entry["bytes"] or bytes_digest(data) != entry["checksum"]:
        raise ValueError(
            f"{target}: projection file does not match the manifest's size/checksum (corrupted or replaced)"
        )
    projection = projection_from_bytes(data, target)
    if projection.in_width != entry["in_width"] or projection.out_width != entry["out_width"]:
        raise ValueError(
            f"{target}: maps {projection.in_width} -> {projection.out_width} features, the manifest says "
            f"{entry['in_width']} -> {entry['out_width']}"
        )
    return projection


def load_projection_file(path: str) -> tuple[Projection, bytes]:
    """A projection file given by path (to reuse another dataset's projection), and its bytes."""
    fs, local = io.resolve(path)
    if not io.exists(fs, local):
        raise ValueError(f"projection: no file at {path!r}")
    data = io.read_bytes(fs, local)
    return projection_from_bytes(data, path), data
