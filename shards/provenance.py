"""`Provenance`: what a dataset records about how it was made (the manifest's `provenance`), as one
frozen type. Extraction builds it; every reader (training, evaluation, the shard tools, the recipes)
reads it through it (`provenance_of(manifest)`, `ShardDataset.provenance`), never by string paths.

    provenance
      target      TargetRecord: the target's identity (config hash, weights and head digests, which
                  `target.identity_check` compares) and how it was loaded (widths, layers, class)
      tokenizer   TokenizerRecord: its hash, chat template hash and variables, eos/pad ids, and the
                  mask token (`mask_token_id`, `mask_token`: MaskToken, whose `source` is a MaskSource)
      taps        Taps: the layer ids whose outputs are stored, and what an id means
      dtype, compute_dtype, topk, max_len
      corpus      Corpus: source, format, content hash, files, records, skipped files, the regeneration
      extract_config, tool_version, git_sha
      transform   what `python -m shards transcode` derived the dataset from (a storage tier only)

`to_dict()` writes today's layout (what extraction writes, key for key: the manifest's bytes did not
change when this type came, tests/extract/golden/provenance.json); `from_dict` also reads every
earlier layout and partial records (a dataset written before the mask token's source or the head
digest was recorded, test fixtures that record only the taps): a field the record lacks is None, and
keys this type does not know are kept (`extra`). A stored record that passes through unchanged (a
resumed or merged dataset, a transcoded one) is copied as stored, not rewritten through this type.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MaskSource",
    "MaskToken",
    "TargetRecord",
    "TokenizerRecord",
    "Taps",
    "Corpus",
    "Provenance",
    "provenance_of",
    "comparable_provenance",
    "KEYS_NOT_COMPARED",
]

# These change whenever the code does; a resumed or merged dataset keeps the first writer's values
# in `provenance` and records every writer's in `writer` / per shard.
KEYS_NOT_COMPARED = ("tool_version", "git_sha")


class MaskSource(enum.StrEnum):
    """Where extraction's mask token came from (`extract.corpus.mask_token`); its value is what the
    manifest stores."""

    CONFIG = "config"  # extraction's mask_token_id
    TOKENIZER = "tokenizer"  # the tokenizer's own mask_token
    AUTO = "auto"  # a special token neither the chat template nor the corpus holds
    NONE = "none"  # none could be chosen


def _tuple(value: Any) -> tuple | None:
    return tuple(value) if isinstance(value, (list, tuple)) else None


def _table(record: Any, what: str) -> dict:
    """A record's table ({} when absent); ValueError naming it when it is something else."""
    if record is None:
        return {}
    if not isinstance(record, Mapping):
        raise ValueError(f"provenance {what}: expected a table, got {type(record).__name__}")
    return dict(record)


def _known(cls: type, table: dict) -> tuple[dict, dict]:
    """(the fields of `cls` the table holds, the keys it does not know)."""
    names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
    return {k: table[k] for k in names if k in table}, {k: v for k, v in table.items() if k not in names}


@dataclasses.dataclass(frozen=True)
class MaskToken:
    """The mask token's text and how it was chosen (its id is `TokenizerRecord.mask_token_id`)."""

    token: str | None = None
    source: MaskSource | None = None  # None: a dataset from before the source was recorded
    passed_over: tuple[int, ...] = ()  # auto: candidates skipped because the corpus holds them

    @classmethod
    def from_dict(cls, record: Any) -> MaskToken:
        table = _table(record, "tokenizer.mask_token")
        source = table.get("source")
        try:
            source = None if source is None else MaskSource(source)
        except ValueError:
            raise ValueError(
                f"provenance tokenizer.mask_token.source: {source!r} is none of {[s.value for s in MaskSource]}"
            ) from None
        return cls(table.get("token"), source, tuple(table.get("passed_over") or ()))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"token": self.token, "source": None if self.source is None else str(self.source)}
        if self.passed_over:
            out["passed_over"] = list(self.passed_over)
        return out


@dataclasses.dataclass(frozen=True)
class TargetRecord:
    """The target the features came from: its identity and how it was loaded."""

    name_or_path: str | None = None  # as given to extraction
    revision: str | None = None
    config_hash: str | None = None
    weights_digest: str | None = None
    weights_content_digest: str | None = None  # every byte of the weights (since issue 52)
    head_digest: str | None = None
    architecture: str | None = None
    loaded_as: str | None = None
    attn_implementation: str | None = None
    model_type: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: Any) -> TargetRecord:
        known, extra = _known(cls, _table(record, "target"))
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}, **self.extra}

    def identity(self) -> dict:
        """The record `target.identity_check.check_target` compares (its path and digests)."""
        keys = ("name_or_path", "config_hash", "weights_digest", "weights_content_digest", "head_digest")
        return {k: getattr(self, k) for k in keys}


@dataclasses.dataclass(frozen=True)
class TokenizerRecord:
    hash: str | None = None
    chat_template_hash: str | None = None
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mask_token_id: int | None = None
    mask_token: MaskToken = MaskToken()
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: Any) -> TokenizerRecord:
        known, extra = _known(cls, _table(record, "tokenizer"))
        known["chat_template_kwargs"] = dict(known.get("chat_template_kwargs") or {})
        known["mask_token"] = MaskToken.from_dict(known.get("mask_token"))
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        return {
            "hash": self.hash,
            "chat_template_hash": self.chat_template_hash,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
            "mask_token_id": self.mask_token_id,
            "mask_token": self.mask_token.to_dict(),
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            **self.extra,
        }


@dataclasses.dataclass(frozen=True)
class Taps:
    layer_ids: tuple[int, ...] | None = None  # None: the record names no taps
    meaning: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: Any) -> Taps:
        known, extra = _known(cls, _table(record, "taps"))
        return cls(_tuple(known.get("layer_ids")), known.get("meaning"), extra)

    def to_dict(self) -> dict:
        ids = None if self.layer_ids is None else list(self.layer_ids)
        return {"layer_ids": ids, "meaning": self.meaning, **self.extra}


@dataclasses.dataclass(frozen=True)
class Corpus:
    source: str | None = None
    format: str | None = None
    hash: str | None = None
    files: tuple[Mapping[str, Any], ...] = ()  # {"name", "bytes", "checksum"} per file read
    records: int | None = None
    skipped: tuple[Mapping[str, Any], ...] | None = None  # files of the corpus not read ({"name", "reason"})
    regeneration: Mapping[str, Any] | None = None  # the regeneration's record, when the corpus is one
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: Any) -> Corpus:
        known, extra = _known(cls, _table(record, "corpus"))
        known["files"] = tuple(known.get("files") or ())
        known["skipped"] = _tuple(known.get("skipped"))
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "source": self.source,
            "format": self.format,
            "hash": self.hash,
            "files": list(self.files),
        }
        out["records"] = self.records
        if self.skipped:
            out["skipped"] = list(self.skipped)
        if self.regeneration is not None:
            out["regeneration"] = self.regeneration
        return {**out, **self.extra}


@dataclasses.dataclass(frozen=True)
class Provenance:
    target: TargetRecord = TargetRecord()
    tokenizer: TokenizerRecord = TokenizerRecord()
    taps: Taps = Taps()
    dtype: str | None = None  # of the stored hidden states
    compute_dtype: str | None = None  # the target's forward
    topk: int | None = None
    max_len: int | None = None
    corpus: Corpus = Corpus()
    extract_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tool_version: str | None = None
    git_sha: str | None = None
    transform: Mapping[str, Any] | None = None  # a transcoded dataset's source and encoding
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: Any) -> Provenance:
        """Any layout a manifest has held (see the module docstring); ValueError naming the field
        when a part is not a table or the mask token's source is unknown."""
        known, extra = _known(cls, _table(record, "record"))
        parts: dict[str, Any] = {"target": TargetRecord, "tokenizer": TokenizerRecord, "taps": Taps, "corpus": Corpus}
        for name, part in parts.items():
            known[name] = part.from_dict(known.get(name))
        known["extract_config"] = dict(known.get("extract_config") or {})
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        """Today's layout, as a manifest stores it."""
        out: dict[str, Any] = {
            "target": self.target.to_dict(),
            "tokenizer": self.tokenizer.to_dict(),
            "taps": self.taps.to_dict(),
            "dtype": self.dtype,
            "compute_dtype": self.compute_dtype,
            "topk": self.topk,
            "max_len": self.max_len,
            "corpus": self.corpus.to_dict(),
            "extract_config": dict(self.extract_config),
            "tool_version": self.tool_version,
            "git_sha": self.git_sha,
        }
        if self.transform is not None:
            out["transform"] = self.transform
        return {**out, **self.extra}

    @property
    def n_taps(self) -> int | None:
        return None if self.taps.layer_ids is None else len(self.taps.layer_ids)


def provenance_of(manifest: Mapping[str, Any]) -> Provenance:
    """A manifest's provenance, typed (an empty record when it has none)."""
    return Provenance.from_dict(manifest.get("provenance"))


def comparable_provenance(record: Mapping[str, Any]) -> dict:
    """A stored record without the keys that change with the code (`KEYS_NOT_COMPARED`): what two
    writers of one dataset must agree on."""
    return {k: v for k, v in record.items() if k not in KEYS_NOT_COMPARED}
