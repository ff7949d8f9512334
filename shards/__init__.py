"""The shard format: schema, writer, reader, manifest and verification (see shards/FORMAT.md).

from shards import Sample, ShardWriter, ShardDataset, merge_manifests, verify_dataset
"""

from shards.manifest import MANIFEST_NAME, load_manifest, merge_manifests
from shards.provenance import MaskSource, Provenance, provenance_of
from shards.reader import ShardDataset
from shards.schema import (
    DEFAULT_ENCODING,
    DEFAULT_SHARD_BYTES,
    DEFAULT_ZSTD_LEVEL,
    ENCODINGS,
    FORMAT_VERSION,
    TAP_MEANING,
    HiddenPlanes,
    Sample,
    ShardFormatError,
    sample_from_torch,
)
from shards.verify import Problem, verify_dataset
from shards.writer import ShardWriter

__all__ = [
    "DEFAULT_ENCODING",
    "DEFAULT_SHARD_BYTES",
    "DEFAULT_ZSTD_LEVEL",
    "ENCODINGS",
    "FORMAT_VERSION",
    "HiddenPlanes",
    "MANIFEST_NAME",
    "MaskSource",
    "TAP_MEANING",
    "Problem",
    "Provenance",
    "Sample",
    "ShardDataset",
    "ShardFormatError",
    "ShardWriter",
    "load_manifest",
    "merge_manifests",
    "provenance_of",
    "sample_from_torch",
    "verify_dataset",
]
