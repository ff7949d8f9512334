"""What a dataset records about how it was made, and the rules of resuming it.

`build_provenance` is the manifest's `provenance` (`shards.provenance.Provenance`: target,
tokenizer, taps, corpus fingerprint, the regeneration a corpus came from, the resolved config). A
rerun of the same command resumes: `resume_point` reopens the dataset's rank manifest, whose
provenance must agree with this run's on every dataset setting, the target, the tokenizer and the
corpus content (`resume_problems` says what changed; runtime knobs such as batch size, devices and
threads may change). A rank manifest that holds nothing (left by a start that committed nothing)
never blocks a run with other settings, and a finished dataset made with other settings is refused
(`already_complete`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from common.config import config_to_dict, fail
from common.hashing import template_digest, tokenizer_digest
from common.io import exists_at, join_uri, list_names, remove_at, resolve
from common.provenance import provenance as tool_provenance
from extract import corpus as C
from extract.config import DATASET_KEYS, ExtractConfig
from extract.corpus.mask_token import MaskChoice
from extract.corpus.regenerated import provenance_for_manifest, regeneration_of
from extract.ranks import FINAL_MANIFEST, Ranks
from shards import TAP_MEANING, load_manifest
from shards.manifest import hidden_split_of
from shards.provenance import Corpus, Provenance, Taps, TargetRecord, TokenizerRecord, provenance_of
from target.load import Target, target_provenance

log = logging.getLogger("extract")


# ----------------------------------------------------------------------------------------------
# Provenance


def tokenizer_provenance(tokenizer, mask: MaskChoice, template_kwargs: dict) -> TokenizerRecord:
    return TokenizerRecord(
        hash=tokenizer_digest(tokenizer),
        chat_template_hash=template_digest(tokenizer),
        chat_template_kwargs=dict(template_kwargs),
        mask_token_id=mask.token_id,
        mask_token=mask.record(),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def with_regeneration(cfg: ExtractConfig) -> tuple[ExtractConfig, dict | None]:
    """For a corpus written by `python -m extract.regenerate`: the config with the chat template
    variables its answers were generated for (so the template and loss mask follow its thinking
    choice; an explicit different choice is refused) and the provenance the manifest carries."""
    found = regeneration_of(cfg.corpus) if cfg.corpus else None
    if found is None:
        return cfg, None
    provenance = found[1]
    kwargs = dict(provenance.get("chat_template_kwargs") or {})
    if cfg.chat_template_kwargs and cfg.chat_template_kwargs != kwargs:
        mode = provenance.get("thinking", {}).get("mode")
        fail(
            "chat_template_kwargs",
            f"{cfg.chat_template_kwargs} differs from {kwargs}, the variables the regenerated corpus "
            f"'{cfg.corpus}' was answered for (thinking = {mode}); leave chat_template_kwargs unset "
            "(extraction then takes the regeneration's) or make them equal",
        )
    return dataclasses.replace(cfg, chat_template_kwargs=kwargs), provenance_for_manifest(provenance)


def check_regeneration_target(
    regeneration: dict | None, target: TargetRecord, tokenizer: TokenizerRecord | None = None
) -> None:
    """Warn when the corpus was answered by another target than the one extracted (a drafter learns
    what the answering model says); refuse it when it was answered through another chat template
    (`tokenizer`: this run's tokenizer provenance; its answers fit the regeneration's prompts)."""
    if regeneration is None:
        return
    answered_with = regeneration.get("target", {}).get("chat_template_hash")
    renders_with = tokenizer.chat_template_hash if tokenizer is not None else None
    if answered_with and renders_with and answered_with != renders_with:
        file = regeneration.get("chat_template_file")
        source = f"'{file}'" if file else "the tokenizer's own"
        fail(
            "chat_template",
            f"the regenerated corpus was answered with another chat template ({source}, hash {answered_with}) than "
            f"extraction renders with (hash {renders_with}); give extraction the same chat_template",
        )
    answered_by = regeneration.get("target", {})
    for key in ("config_hash", "weights_digest"):
        ours = getattr(target, key)
        if answered_by.get(key) and ours and answered_by[key] != ours:
            log.warning(
                "the regenerated corpus was answered by %s (%s %s), not by the target extracted now (%s %s)",
                answered_by.get("name_or_path"),
                key,
                answered_by[key],
                key,
                ours,
            )
            return


def build_provenance(
    cfg: ExtractConfig,
    target: Target,
    corpus: C.CorpusFiles,
    fingerprint: dict,
    regeneration: dict | None,
    mask: MaskChoice,
) -> Provenance:
    if mask.token_id is None:
        log.warning(
            "no mask token: the tokenizer has no special token to spare and mask_token_id is not set; the "
            "trainer will need one (model.mask_token_id)"
        )
    target_info = TargetRecord.from_dict(target_provenance(target))
    tokenizer_info = tokenizer_provenance(target.tokenizer, mask, cfg.chat_template_kwargs)
    check_regeneration_target(regeneration, target_info, tokenizer_info)
    corpus_info = Corpus(
        source=cfg.corpus,
        format=corpus.format,
        hash=fingerprint["hash"],
        files=tuple(fingerprint["files"]),
        records=fingerprint["records"],
        skipped=tuple(fingerprint["skipped"]) if fingerprint.get("skipped") else None,
        regeneration=regeneration,
    )
    tool = tool_provenance()
    return Provenance(
        target=target_info,
        tokenizer=tokenizer_info,
        taps=Taps(tuple(cfg.layer_ids), TAP_MEANING),
        dtype="bfloat16",  # of the stored hidden states
        compute_dtype=cfg.dtype,
        topk=cfg.topk,
        max_len=cfg.max_len,
        corpus=corpus_info,
        extract_config=config_to_dict(cfg),
        tool_version=tool["tool_version"],
        git_sha=tool["git_sha"],
    )


# ----------------------------------------------------------------------------------------------
# Resume rules


@dataclasses.dataclass
class ResumePoint:
    """Where this rank's run starts in its dataset."""

    provenance: dict  # what the writer records: the dataset's first run's as stored, or this run's for a new dataset
    stage_state: dict  # this rank's own from its manifest (runs so far, rejects_bytes), else empty
    hidden_split: list | None  # the dataset's column layout when it exists, else None (the writer's default)
    new: bool  # no rank manifest to continue from: this run creates this rank's manifest and rejects file


def resume_point(fs, fs_root: str, root: str, fresh: Provenance, ranks: Ranks) -> ResumePoint:
    """This rank's rank manifest if it exists, else another rank's (whose provenance and layout this
    rank adopts); ValueError if it was made with other settings (`refuse_changed`)."""
    names = ranks.names
    existing = _existing_rank_manifest(root, names["manifest"])
    if existing is not None:
        stored = load_manifest(fs, fs_root, existing)
        if holds_nothing(stored) and resume_problems(provenance_of(stored), fresh):
            # Left by a start that committed nothing (killed, or refused before its first commit):
            # nothing to resume, so it must not block a corrected run.
            log.info("%s: %s holds nothing yet and was made with other settings; starting afresh", root, existing)
            if existing == names["manifest"]:
                _remove_stub(root, names)
            existing = None
    if existing is None:
        return ResumePoint(fresh.to_dict(), {}, None, new=True)
    # A rank that starts after others (or resumes) writes the dataset's layout, never its own default.
    hidden_split = hidden_split_of(stored)
    refuse_changed(root, stored, fresh, ranks)
    # Every rank keeps the provenance of the dataset's first run (merging needs them equal).
    stage_state = stored.get("stage_state", {}) if existing == names["manifest"] else {}
    return ResumePoint(stored["provenance"], stage_state, hidden_split, new=False)


RESUME_COMPARED = {
    "target": (
        "config_hash",
        "weights_digest",
        "architecture",
        "model_type",
        "num_layers",
        "hidden_size",
        "vocab_size",
    ),
    "tokenizer": ("hash", "chat_template_hash", "mask_token_id", "eos_token_id", "pad_token_id"),
}


def resume_problems(stored: Provenance, fresh: Provenance) -> list[str]:
    """What differs between a dataset's provenance and this run's, in words (empty: may resume)."""
    problems = []
    old_cfg, new_cfg = stored.extract_config, fresh.extract_config
    for key in DATASET_KEYS:
        if old_cfg.get(key) != new_cfg.get(key):
            problems.append(f"config key '{key}' is {old_cfg.get(key)!r} in the dataset but {new_cfg.get(key)!r} now")
    for part, keys in RESUME_COMPARED.items():
        for key in keys:
            old, new = getattr(getattr(stored, part), key), getattr(getattr(fresh, part), key)
            if old != new:
                problems.append(
                    f"{part} {key} changed: {old!r} in the dataset, {new!r} now "
                    f"({getattr(getattr(fresh, part), 'name_or_path', '')})".replace(" ()", "")
                )
    old_corpus, new_corpus = stored.corpus, fresh.corpus
    if old_corpus.hash != new_corpus.hash:
        old_files = {f["name"]: f for f in old_corpus.files}
        new_files = {f["name"]: f for f in new_corpus.files}
        what = [f"{n} added" for n in new_files.keys() - old_files.keys()] + [
            f"{n} removed" for n in old_files.keys() - new_files.keys()
        ]
        what += [
            f"{n} changed ({old_files[n]['bytes']} -> {new_files[n]['bytes']} bytes)"
            for n in new_files.keys() & old_files.keys()
            if old_files[n] != new_files[n]
        ]
        problems.append(f"corpus content changed: {', '.join(sorted(what)) or 'files renamed or reordered'}")
    return problems


def refuse_changed(root: str, stored_manifest: dict, fresh: Provenance, ranks: Ranks) -> None:
    """ValueError naming every change that forbids resuming (a dataset setting, the target, the tokenizer, the
    corpus, the world size); the runtime settings that changed are logged."""
    stored = provenance_of(stored_manifest)
    problems = resume_problems(stored, fresh)
    world = stored_manifest.get("stage_state", {}).get("world_size")
    if world is not None and world != ranks.world:
        problems.append(
            f"world size is {ranks.world} but the dataset is being extracted by {world} ranks (resume with {world} "
            "processes)"
        )
    if problems:
        raise ValueError(
            f"{root}: cannot resume: "
            + "; ".join(problems)
            + ". Use the dataset's settings, or write to a new out_dir."
        )
    changed = {
        k: (v, fresh.extract_config[k])
        for k, v in stored.extract_config.items()
        if k not in DATASET_KEYS and fresh.extract_config.get(k) != v
    }
    if changed:
        log.info(
            "resuming with changed runtime settings (allowed): %s",
            ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())),
        )


def already_complete(fs, root: str, fresh: Provenance) -> dict | None:
    """The merged manifest if `root` holds a finished dataset of these settings; ValueError if of others."""
    if not exists_at(join_uri(root, FINAL_MANIFEST)):
        return None
    manifest = load_manifest(fs, resolve(root)[1], FINAL_MANIFEST)
    if not manifest.get("complete"):
        return None
    problems = resume_problems(provenance_of(manifest), fresh)
    if problems:
        raise ValueError(
            f"{root}: holds a finished dataset made with other settings: "
            + "; ".join(problems)
            + ". Write to a new out_dir."
        )
    return manifest


def holds_nothing(manifest: dict) -> bool:
    """A rank manifest with no shard, no committed reject and not complete: a start that committed nothing."""
    state = manifest.get("stage_state") or {}
    return not manifest["shards"] and not manifest.get("complete") and not state.get("rejects_bytes")


def _remove_stub(root: str, names: dict) -> None:
    for name in (names["manifest"], names["rejects"]):
        with contextlib.suppress(FileNotFoundError):
            remove_at(join_uri(root, name))


def _existing_rank_manifest(root: str, own: str) -> str | None:
    """This rank's manifest if it exists, else another rank's (whose provenance this rank adopts)."""
    present = list_names(root)
    if own in present:
        return own
    others = sorted(f for f in present if f.startswith("manifest.rank") and f.endswith(".json"))
    return others[0] if others else None
