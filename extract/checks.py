"""The checks an extraction makes before it loads anything (the target's weights take minutes for a
27B): every corpus found and readable as its format (each file fingerprinted, which reads every
byte once, so a damaged compressed file is named now), every `out_dir` a directory that something
can be created in, no other process writing this rank's part of the dataset, and `topk` and the
mask token within the target's vocabulary. Each failure is a ValueError (or ConfigError) naming the key.

`check_inputs` also settles the one part of a split's config that depends on its corpus rather than
on the config alone (`ExtractConfig.check` settles the rest): a regenerated corpus's chat template
variables (`provenance.with_regeneration`). Its `SplitInputs` are what the split's run then uses.
"""

from __future__ import annotations

import dataclasses
import os

from common.config import fail
from common.io import resolve
from common.locations import check_problem
from extract import corpus as C
from extract.config import ExtractConfig
from extract.provenance import with_regeneration
from extract.ranks import Ranks
from shards.manifest import check_manifest_unlocked
from shards.provenance import MaskSource


@dataclasses.dataclass(frozen=True)
class SplitInputs:
    """One split's inputs, checked before the target loads."""

    cfg: ExtractConfig  # the split's config, settled: a regenerated corpus's chat template variables
    regeneration: dict | None  # what the manifest carries of the regeneration the corpus came from
    corpus: C.CorpusFiles
    fingerprint: dict  # `corpus_fingerprint`: the checksums a resume compares, the record count


def check_inputs(cfg: ExtractConfig, ranks: Ranks | None = None) -> dict[str | None, SplitInputs]:
    """ValueError naming the key for what would fail later: a corpus that cannot be found or read
    as its format (a damaged compressed file included: the fingerprint reads every byte), an output
    path that cannot be a directory, a dataset another process is writing. Returns {split name:
    `SplitInputs`}, which the split's extraction then uses as they are."""
    prepared = {}
    for name, split_cfg in cfg.split_configs().items():
        where = "" if name is None else f"splits.{name}: "
        key = "out_dir" if name is None else f"out_dir (split {name})"
        check_out_dir(split_cfg.out_dir, key)
        if ranks is not None:
            check_no_other_writer(split_cfg.out_dir, ranks)
        try:
            settled, regeneration = with_regeneration(split_cfg)
            corpus = C.find_corpus(split_cfg.corpus, split_cfg.corpus_format)
            fingerprint = C.corpus_fingerprint(corpus, split_cfg.max_records)
            prepared[name] = SplitInputs(settled, regeneration, corpus, fingerprint)
        except ValueError as err:
            raise ValueError(f"{where}{err}") from None
    return prepared


def check_no_other_writer(out_dir: str, ranks: Ranks) -> None:
    """LockedError (a ValueError) if another process holds this rank's lock of the dataset."""
    root = local_dir(out_dir)
    if os.path.isdir(root):
        check_manifest_unlocked(resolve(root)[0], root, ranks.names["manifest"])


def check_out_dir(out_dir: str, key: str) -> None:
    """ConfigError unless `out_dir` is (or can become) a writable local directory, or is on an
    object store whose bucket this process can reach (`common.locations`, docs/object-storage.md)."""
    problem = check_problem(out_dir, "data_out")
    if problem:
        fail(key, problem)


def check_topk(topk: int, vocab_size: int | None) -> None:
    """ConfigError naming `topk` if the target's vocabulary has fewer entries (torch.topk would fail mid-run)."""
    if vocab_size is not None and topk > int(vocab_size):
        fail("topk", f"{topk} exceeds the target's vocabulary of {vocab_size} tokens")


def check_mask_token_id(token_id: int | None, vocab_size: int | None, source: MaskSource = MaskSource.CONFIG) -> None:
    """ValueError naming the setting if the mask token lies outside the target's vocabulary (the
    drafter embeds it with the target's embedding; training would refuse the dataset)."""
    if token_id is None or vocab_size is None or 0 <= int(token_id) < int(vocab_size):
        return
    message = f"{token_id} lies outside the target's vocabulary (ids 0..{int(vocab_size) - 1})"
    if source is MaskSource.CONFIG:
        fail("mask_token_id", message)
    raise ValueError(f"the tokenizer's mask_token = {message}; set mask_token_id to a special token of the vocabulary")


def local_dir(out_dir: str) -> str:
    """The dataset root: an absolute local path, or the URI as given (an object store)."""
    if "://" in out_dir:
        return out_dir.rstrip("/")
    return os.path.abspath(out_dir)
