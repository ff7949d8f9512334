"""How the drafter reads features stored in a tier (shards/FORMAT.md, "Storage tiers"; writing
them is `shards.tiers`):

- quantized datasets: the data stream collates the **compact** codes and scales (`CompactHidden`,
  pinned host memory) and the step dequantizes them on its device (`CompactHidden.to`), so the
  loader moves 1 (fp8) or ~0.5 (4-bit) bytes per value instead of 2;
- projected datasets: the drafter's fc reads P·h (`DrafterConfig.projection`); `fold_projection`
  turns such a drafter into an ordinary one on full features (fc = fc'·P), which export and eval
  use;
- checks: a dataset whose shards mix encodings, and a drafter whose projection differs from the
  dataset's, are refused up front, naming what differs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from common.hashing import bytes_digest
from common.io import exists, join, resolve
from shards.manifest import load_manifest
from shards.projection import PROJECTION_FILE, load_projection, load_projection_file
from shards.quant import QuantizedHidden, decode_pieces, parse_encoding, scales_to_torch

PROJECTION_CHOICES_HELP = (
    "auto = the dataset's projection (if any), none = refuse a projected dataset, or a projection checksum"
)


@dataclasses.dataclass
class CompactHidden:
    """A batch's quantized hidden states as stored: per column piece, codes uint8 [B, S, code width]
    and scales [B, S, scale width] (right padding is zeros, which decode to 0.0). `.to(device)`
    copies these bytes to the device and dequantizes there, returning bf16 [B, S, W], the tensor a
    lossless batch holds, so the step treats both alike."""

    encoding: str
    codes: list[torch.Tensor]
    scales: list[torch.Tensor]
    width: int

    @property
    def shape(self) -> torch.Size:
        B, S = self.codes[0].shape[:2]
        return torch.Size((B, S, self.width))

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def nbytes(self) -> int:
        """Bytes moved to the device (the compact form)."""
        return sum(t.numel() * t.element_size() for t in (*self.codes, *self.scales))

    def to(self, device, non_blocking: bool = False) -> torch.Tensor:
        spec = parse_encoding(self.encoding)
        pairs = [
            (c.to(device, non_blocking=non_blocking), s.to(device, non_blocking=non_blocking))
            for c, s in zip(self.codes, self.scales, strict=True)
        ]
        return decode_pieces(pairs, spec, torch.bfloat16)

    def dequantize(self) -> torch.Tensor:
        return self.to("cpu")


def hidden_nbytes(hidden) -> int:
    """Bytes of a batch's hidden states as they travel to the device."""
    if isinstance(hidden, CompactHidden):
        return hidden.nbytes
    return hidden.numel() * hidden.element_size()


def collate_compact(samples: list[QuantizedHidden], S: int, pin: bool) -> CompactHidden:
    """Right-pad the samples' codes and scales into [B, S, ...] buffers (zeros past each sample)."""
    first = samples[0]
    B = len(samples)

    def stack(arrays: list[np.ndarray]) -> torch.Tensor:
        width = arrays[0].shape[1]
        # bf16 scale bits travel as int16 (torch copies that dtype to every device; uint16 on disk).
        out = torch.empty((B, S, width), dtype=scales_to_torch(arrays[0][:0]).dtype, pin_memory=pin)
        # Filled through numpy (a plain memcpy): torch's copy would start OpenMP teams in every loader
        # thread, whose spinning workers slowed the step down several-fold on a small machine.
        view = out.numpy().view(arrays[0].dtype)
        for i, array in enumerate(arrays):
            T = array.shape[0]
            view[i, :T] = array
            view[i, T:] = 0
        return out

    codes = [stack([s.codes[j] for s in samples]) for j in range(len(first.codes))]
    scales = [stack([s.scales[j] for s in samples]) for j in range(len(first.scales))]
    return CompactHidden(first.encoding, codes, scales, first.width)


# ----------------------------------------------------------------------------------------------
# Checks


def mixed_encoding_problems(manifest: dict) -> list[str]:
    """One line per shard whose encoding is not the dataset's (shards without the field, written
    before storage tiers, are taken to have the dataset's)."""
    dataset = manifest.get("encoding")
    return [
        f"manifest shard '{entry.get('file')}' has encoding {entry['encoding']!r} but the dataset's is {dataset!r}: "
        "a dataset's shards must share one encoding (transcode them into one dataset)"
        for entry in manifest.get("shards", [])
        if "encoding" in entry and entry["encoding"] != dataset
    ]


def projection_problems(manifest: dict, expected: dict | None) -> list[str]:
    """Why a drafter reading features through projection `expected` (None: the taps themselves)
    cannot train or evaluate on this dataset."""
    have = manifest.get("projection")
    if have is None and expected is None:
        return []
    if have is None:
        return [
            f"manifest has no 'projection' (full tap features) but the drafter config expects projected features "
            f"(projection checksum {expected.get('checksum')}, {expected.get('in_width')} -> "
            f"{expected.get('out_width')})"
        ]
    if expected is None:
        return [
            f"manifest field 'projection' = {have['checksum']} ({have['in_width']} -> {have['out_width']} "
            "features) but the drafter "
            "config expects full tap features (model.projection = none, or a checkpoint trained without projection)"
        ]
    return [
        f"manifest field 'projection.{key}' = {have.get(key)!r} but the drafter config expects {expected.get(key)!r}"
        for key in ("checksum", "in_width", "out_width")
        if have.get(key) != expected.get(key)
    ]


def drafter_projection(choice: str, manifest: dict) -> dict | None:
    """The drafter config's `projection` for train config `model.projection` and a dataset: the
    dataset's (auto), none, or the one with this checksum (a mismatch is reported by the checks)."""
    have = manifest.get("projection")
    if choice == "auto":
        return None if have is None else projection_identity(have)
    if choice is None or choice == "none":
        return None  # a projected dataset is then refused by projection_problems
    if have is not None and have.get("checksum") == choice:
        return projection_identity(have)
    found = f"projection {have['checksum']}" if have is not None else "no projection (full tap features)"
    raise ValueError(f"config key 'model.projection' = {choice!r} but the shards dataset has {found}")


def projection_identity(entry: dict) -> dict:
    return {"checksum": entry["checksum"], "in_width": int(entry["in_width"]), "out_width": int(entry["out_width"])}


# ----------------------------------------------------------------------------------------------
# Folding P into fc


def fold_projection(state: dict[str, torch.Tensor], cfg, projection) -> tuple[dict[str, torch.Tensor], object]:
    """(weights, config) of the same drafter on full features: fc.weight [D, r] -> fc'·P [D, F]
    (computed in float32, stored in the weight's dtype), `projection` cleared from the config."""
    if cfg.projection is None:
        return state, cfg
    expected = cfg.projection
    if projection.out_width != expected["out_width"] or projection.in_width != expected["in_width"]:
        raise ValueError(
            f"projection maps {projection.in_width} -> {projection.out_width}, the drafter expects "
            f"{expected['in_width']} -> {expected['out_width']}"
        )
    weight = state["fc.weight"]
    folded = dict(state)
    folded["fc.weight"] = projection.fold(weight).to(weight.dtype)
    return folded, dataclasses.replace(cfg, projection=None)


def projection_for_drafter(cfg, shards_root: str | None, override: str | None = None):
    """The `Projection` a projected drafter was trained with: the file `override`, else the
    projection of the dataset it trained on (`shards_root`); its checksum must be the drafter's."""
    want = cfg.projection["checksum"]
    if override:
        projection, data = load_projection_file(override)
        if bytes_digest(data) != want:
            raise ValueError(
                f"projection file {override!r} has checksum {bytes_digest(data)}, the drafter was trained with {want}"
            )
        return projection
    if not shards_root:
        raise ValueError(
            f"the drafter reads projected features (projection {want}) and its training dataset is unknown: "
            "pass the projection file (--projection PATH)"
        )
    fs, root = resolve(shards_root)
    if not exists(fs, join(root, PROJECTION_FILE)):
        raise ValueError(
            f"the drafter reads projected features (projection {want}) but its training dataset '{shards_root}' has no "
            f"{PROJECTION_FILE} (moved?): pass the projection file (--projection PATH)"
        )
    entry = load_manifest(fs, root).get("projection") or {}
    if entry.get("checksum") != want:
        raise ValueError(
            f"the drafter was trained with projection {want}, dataset '{shards_root}' now holds "
            f"{entry.get('checksum')}: "
            "pass the right projection file (--projection PATH)"
        )
    return load_projection(shards_root, entry)


def for_data(info, manifest: dict, override: str | None = None):
    """An eval `CheckpointInfo` adapted to the data: a drafter trained on projected features meets
    full-feature data with P folded into fc (the exported drafter, in effect); on projected data it
    stays as trained (`check_compatible` then requires the same projection)."""
    cfg = info.drafter_config
    if cfg.projection is None or manifest.get("projection") is not None:
        return info
    projection = projection_for_drafter(cfg, info.train_value("data.shards"), override)
    return dataclasses.replace(info, drafter_config=dataclasses.replace(cfg, projection=None), fold=projection)
