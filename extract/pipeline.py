"""The extraction run: ranks, provenance and resume, the forward loop, background writing, merge,
and the summary.

One process per GPU (`torchrun` / `accelerate launch`; or RANK / WORLD_SIZE env vars and a
separate `python -m extract.merge`). Every rank reads and tokenizes the whole corpus and keeps the
samples whose `int(sample_id, 16) % world_size` is its rank, so the finished dataset holds the
same samples whatever the world size. Records that never get an id (unparseable lines) belong to
rank `position % world_size`. Rank r writes `r{r:03d}-shard-*.arrow`, `manifest.rank{r:03d}.json`
and `rejects.rank{r:03d}.jsonl`; when all ranks are done, `manifest.json` and `rejects.jsonl` are
merged from them.

Resume: rerunning the same command reopens each rank's manifest and skips what it lists; rejects
are committed with the shards (see `sink.RejectLog`). Batches are planned from every sample of a
window, committed or not, so a resumed run forms exactly the same micro-batches as an uninterrupted
one and stores bit-identical values (given deterministic kernels); a batch whose samples are all
committed is skipped without a forward. A changed dataset setting, target, tokenizer or corpus
refuses to resume and says what changed; runtime knobs (batch size, devices, threads) may change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator

import torch

from common.config import config_to_dict, fail, save_config
from common.hashing import json_digest, text_digest, tokenizer_digest
from common.io import (
    atomic_write_json,
    atomic_write_text,
    exists_at,
    join_uri,
    list_names,
    remove_at,
    remove_temp_files,
    resolve,
)
from common.provenance import provenance as tool_provenance
from common.target import Target, check_layer_ids, load_target, read_text_config, target_provenance
from extract import corpus as C
from extract.batching import BufferPool, HostBatch, collate_right_padded, plan_micro_batches
from extract.calibrate import ensure_projection
from extract.capture import Capturer, sample_views, tier_for
from extract.config import DATASET_KEYS, ExtractConfig
from extract.mask_token import MaskChoice, choose_mask_token
from extract.sink import Progress, RejectLog, Worker, open_reject_log, read_committed_rejects
from shards.manifest import MERGE_WAIT_SECONDS, lock_manifest

log = logging.getLogger("extract")

FINAL_MANIFEST = "manifest.json"
FINAL_REJECTS = "rejects.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "extract_config.json"
# Reasons that are the corpus's fault; `on_error = fail` stops on these. Length and loss-token
# filtering and duplicates are policy: counted and listed, never an error.
POLICY_REASONS = frozenset({C.TOO_LONG, C.TOO_FEW_LOSS_TOKENS, C.DUPLICATE, C.HOLDS_MASK_TOKEN})
UNEXPECTED = "unexpected_error"


# ----------------------------------------------------------------------------------------------
# Ranks and devices


@dataclasses.dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: bool = False  # a torch.distributed process group exists (barrier available)

    @classmethod
    def from_env(cls) -> "Ranks":
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
        group = False
        if world > 1 and "MASTER_ADDR" in os.environ:
            import torch.distributed as dist

            if not dist.is_initialized():
                # gloo: only a barrier at the end; long timeout, since ranks may finish hours apart.
                dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(hours=48))
            group = True
        return cls(rank, world, local_rank, group)

    def barrier(self) -> None:
        if self.group:
            import torch.distributed as dist

            dist.barrier()

    def owns(self, sample_id: str | None, position: int) -> bool:
        if sample_id is None:
            return position % self.world == self.rank
        return int(sample_id, 16) % self.world == self.rank

    @property
    def names(self) -> dict:
        r = f"{self.rank:03d}"
        return {"manifest": f"manifest.rank{r}.json", "prefix": f"r{r}-shard", "rejects": f"rejects.rank{r}.jsonl"}


def rank_names(rank: int) -> dict:
    return Ranks(rank=rank, world=rank + 1).names


def resolve_devices(cfg: ExtractConfig, ranks: Ranks) -> dict:
    """load_target kwargs for this rank: a device, or a device_map over this replica's GPUs."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return {"device": "cpu"}
    if not torch.cuda.is_available():
        raise ValueError(f"device: {cfg.device!r} asks for a GPU, but torch sees none")
    per = cfg.gpus_per_replica
    first = int(cfg.device.split(":")[1]) if ":" in cfg.device else ranks.local_rank * per
    gpus = list(range(first, first + per))
    if gpus[-1] >= torch.cuda.device_count():
        raise ValueError(
            f"gpus_per_replica: local rank {ranks.local_rank} needs GPUs {gpus}, but this node has "
            f"{torch.cuda.device_count()}; "
            "start (GPUs per node / gpus_per_replica) processes per node"
        )
    torch.cuda.set_device(first)
    if per == 1:
        return {"device": f"cuda:{first}"}
    max_memory = {i: int(torch.cuda.get_device_properties(i).total_memory * 0.92) for i in gpus}
    return {"device": f"cuda:{first}", "device_map": cfg.device_map or "auto", "max_memory": max_memory}


# ----------------------------------------------------------------------------------------------
# Entry point


def run(cfg: ExtractConfig, *, target: Target | None = None, ranks: Ranks | None = None) -> dict:
    """Extract every split of `cfg`; returns {split name (or None): summary dict of this rank}."""
    ranks = ranks or Ranks.from_env()
    # Corpora (found, fingerprinted: damaged files named), output paths and a second writer, all
    # before the target's weights load (minutes for a 27B).
    prepared = check_inputs(cfg, ranks)
    torch.manual_seed(cfg.seed)
    if target is None:
        text_config = read_text_config(cfg.target, cfg.trust_remote_code)
        check_layer_ids(cfg.layer_ids, int(text_config.num_hidden_layers))  # before any weights move
        check_topk(cfg.topk, getattr(text_config, "vocab_size", None))
        devices = resolve_devices(cfg, ranks)
        t0 = time.perf_counter()
        target = load_target(
            cfg.target,
            dtype=cfg.dtype,
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            **devices,
        )
        log.info(
            "loaded %s (%s, %d layers) on %s in %.1fs",
            cfg.target,
            type(target.model).__name__,
            target.num_layers,
            devices,
            time.perf_counter() - t0,
        )
    else:
        check_layer_ids(cfg.layer_ids, target.num_layers)
    check_topk(cfg.topk, target.vocab_size)
    mask = choose_mask_token(target.tokenizer, cfg.mask_token_id, [corpus for corpus, _ in prepared.values()])
    log.info("%s", mask.describe())
    summaries = {}
    python_interval = sys.getswitchinterval()
    if cfg.gil_switch_interval is not None:
        sys.setswitchinterval(cfg.gil_switch_interval)
    try:
        for name, split_cfg in cfg.split_configs().items():
            summaries[name] = extract_split(
                split_cfg, target, ranks, label=name, prepared=prepared.get(name), mask=mask
            )
    finally:
        sys.setswitchinterval(python_interval)
    return summaries


def check_inputs(cfg: ExtractConfig, ranks: Ranks | None = None) -> dict:
    """ValueError naming the key for what would fail later: a corpus that cannot be found or read
    as its format (a damaged compressed file included: the fingerprint reads every byte), an output
    path that cannot be a directory, a dataset another process is writing. Returns {split name:
    (corpus files, fingerprint)}, which the split's extraction then uses as they are."""
    prepared = {}
    for name, split_cfg in cfg.split_configs().items():
        where = "" if name is None else f"splits.{name}: "
        key = "out_dir" if name is None else f"out_dir (split {name})"
        check_out_dir(split_cfg.out_dir, key)
        if ranks is not None:
            check_no_other_writer(split_cfg.out_dir, ranks)
        try:
            with_regeneration(split_cfg)
            corpus = C.find_corpus(split_cfg.corpus, split_cfg.corpus_format)
            prepared[name] = (corpus, corpus_fingerprint(corpus, split_cfg.max_records))
        except ValueError as err:
            raise ValueError(f"{where}{err}") from None
    return prepared


def check_no_other_writer(out_dir: str, ranks: Ranks) -> None:
    """LockedError (a ValueError) if another process holds this rank's lock of the dataset."""
    from shards.manifest import check_manifest_unlocked

    root = _local_dir(out_dir)
    if os.path.isdir(root):
        check_manifest_unlocked(resolve(root)[0], root, ranks.names["manifest"])


def check_out_dir(out_dir: str, key: str) -> None:
    """ConfigError unless `out_dir` is (or can become) a writable local directory, or is on an
    object store whose bucket this process can reach (docs/object-storage.md)."""
    import tempfile

    if "://" in out_dir:
        from common.objstore import check_location

        try:
            check_location(out_dir, write=True)
        except ValueError as err:
            fail(key, str(err))
        return
    root = _local_dir(out_dir)
    existing = root
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == root else f"lies under '{existing}', which is a file"
        fail(key, f"'{root}' {where}, not a directory; choose another out_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(key, f"'{existing}' is not writable by this user")
    # os.access answers yes for root, and on file systems where nothing can be made (/proc, /sys,
    # a read-only mount): make (and remove) a directory there to know.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dflash-probe-", dir=existing))
    except OSError as err:
        fail(key, f"cannot create anything under '{existing}' ({err.strerror or err}); choose another out_dir")


def check_topk(topk: int, vocab_size: int | None) -> None:
    """ConfigError naming `topk` if the target's vocabulary has fewer entries (torch.topk would fail mid-run)."""
    if vocab_size is not None and topk > int(vocab_size):
        fail("topk", f"{topk} exceeds the target's vocabulary of {vocab_size} tokens")


def extract_split(
    cfg: ExtractConfig,
    target: Target,
    ranks: Ranks,
    label: str | None = None,
    prepared: tuple | None = None,
    mask: MaskChoice | None = None,
) -> dict:
    """Extract one corpus into `cfg.out_dir` (this rank's share), then merge if all ranks are done.
    `prepared`: (corpus files, fingerprint) from `check_inputs`, else found here. `mask`: the mask
    token of the whole run (`extract.mask_token`; chosen for this corpus alone if not given)."""
    from shards import DEFAULT_ENCODING, DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL

    # The saved config and the provenance name the storage settings actually used.
    cfg = dataclasses.replace(
        cfg,
        hidden_encoding=cfg.hidden_encoding or DEFAULT_ENCODING,
        zstd_level=cfg.zstd_level or DEFAULT_ZSTD_LEVEL,
        shard_bytes=cfg.shard_bytes or DEFAULT_SHARD_BYTES,
    )
    entered = time.perf_counter()  # the summary's startup_seconds count from here
    root = _local_dir(cfg.out_dir)
    cfg, regeneration = with_regeneration(cfg)
    if prepared is None:
        corpus = C.find_corpus(cfg.corpus, cfg.corpus_format)
        prepared = corpus, corpus_fingerprint(corpus, cfg.max_records)
    corpus, fingerprint = prepared
    if corpus.skipped:
        log.warning(
            "corpus %s: %d files not read: %s", cfg.corpus, len(corpus.skipped), describe_skipped(corpus.skipped)
        )
    mask = mask or choose_mask_token(target.tokenizer, cfg.mask_token_id, [corpus])
    fresh = build_provenance(cfg, target, corpus, fingerprint, regeneration, mask)
    names = ranks.names
    remote = "://" in root  # an object store: no directories to make or remove
    created = [] if remote else _missing_dirs(root)  # what a start that commits nothing removes again
    if not remote:
        os.makedirs(root, exist_ok=True)
    fs, fs_root = resolve(root)
    try:
        with lock_manifest(
            fs, fs_root, names["manifest"]
        ):  # one writer per rank of a dataset; released by the OS on a crash (a lease on an object store)
            return _extract_locked(cfg, target, ranks, root, corpus, fingerprint, fresh, label, entered, created)
    except BaseException:
        for path in created:
            if os.path.isdir(path):
                with contextlib.suppress(OSError):
                    os.rmdir(path)  # only if empty: the run left nothing in it
        raise


def _missing_dirs(root: str) -> list[str]:
    """`root` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not os.path.lexists(root):
        missing.append(root)
        root = os.path.dirname(root)
    return missing


def _extract_locked(
    cfg, target, ranks: Ranks, root: str, corpus, fingerprint: dict, fresh: dict, label, entered: float, created: list
) -> dict:
    from shards import ShardWriter, load_manifest
    from shards.manifest import hidden_split_of

    fs, fs_root = resolve(root)
    names = ranks.names
    done = _already_complete(fs, root, fresh, load_manifest)
    if done is not None:
        log.info("%s: already complete (%d samples); nothing to do", root, done["counts"]["samples"])
        if not exists_at(join_uri(root, SUMMARY_FILE)):  # killed between manifest.json and summary.json
            with lock_manifest(fs, fs_root, FINAL_MANIFEST, wait_seconds=MERGE_WAIT_SECONDS):
                remove_merge_leftovers(root)
                return write_summary(root, done)
        return summarize_dataset(root, done, this_run=None)

    provenance, stage_state, hidden_split = fresh, {}, None
    existing = _existing_rank_manifest(root, names["manifest"])
    if existing is not None:
        stored = load_manifest(fs, fs_root, existing)
        if _holds_nothing(stored) and resume_problems(stored["provenance"], fresh):
            # Left by a start that committed nothing (killed, or refused before its first commit):
            # nothing to resume, so it must not block a corrected run.
            log.info("%s: %s holds nothing yet and was made with other settings; starting afresh", root, existing)
            if existing == names["manifest"]:
                _remove_stub(root, names)
            existing = None
    if existing is not None:
        # A rank that starts after others (or resumes) writes the dataset's layout, never its own default.
        hidden_split = hidden_split_of(stored)
        _refuse_changed(root, stored, fresh, ranks)
        # Every rank keeps the provenance of the dataset's first run (merging needs them equal).
        provenance = stored["provenance"]
        if existing == names["manifest"]:
            stage_state = stored.get("stage_state", {})
    else:
        created += [join_uri(root, n) for n in (names["manifest"], names["rejects"])]
    config_path = join_uri(root, CONFIG_FILE)
    if ranks.rank == 0:
        if not exists_at(config_path):
            created.append(config_path)
        save_config(cfg, config_path)

    # Storage tier with projection: P is settled (calibration pass, or reused) before any shard.
    projection, projection_entry = ensure_projection(cfg, target, ranks, root)
    writer_kwargs = dict(
        shard_bytes=cfg.shard_bytes,
        zstd_level=cfg.zstd_level,
        hidden_encoding=cfg.hidden_encoding,
        projection=projection_entry,
    )
    hidden_width = projection.out_width if projection is not None else len(cfg.layer_ids) * target.hidden_size
    started = time.time()
    try:
        with ShardWriter(
            root,
            provenance=provenance,
            hidden_width=hidden_width,
            topk=cfg.topk,
            manifest_name=names["manifest"],
            shard_prefix=names["prefix"],
            hidden_split=hidden_split,
            **writer_kwargs,
        ) as writer:
            writer.stage_state["world_size"] = ranks.world
            writer.stage_state["rank"] = ranks.rank
            runs = list(stage_state.get("runs", []))
            runs.append(
                {
                    "started": _iso(started),
                    "config_digest": json_digest(config_to_dict(cfg)),
                    "runtime": _runtime_keys(cfg),
                }
            )
            writer.stage_state["runs"] = runs
            rejects = open_reject_log(join_uri(root, names["rejects"]), int(writer.stage_state.get("rejects_bytes", 0)))
            writer.before_save.append(rejects.upload)  # an object store's rejects object: before the manifest
            try:
                run_stats = _extract_into(cfg, target, ranks, corpus, fingerprint, writer, rejects, label, entered)
            finally:
                writer.stage_state["rejects_bytes"] = rejects.sync()
                rejects.close()
            run_stats["seconds"] = time.time() - started
            run_stats["rank"], run_stats["world"] = ranks.rank, ranks.world
            writer.stage_state["runs"][-1].update(
                finished=_iso(time.time()), **{k: run_stats[k] for k in ("tokens", "samples", "seconds")}
            )
            writer.stage_state["records_owned"] = run_stats["records_owned"]
            manifest = writer.manifest
    except BaseException:
        _discard_if_empty(root, names, created)
        raise
    # The last shard is committed as the writer closes: count it in the run's time and commit share.
    run_stats["seconds"] = time.time() - started
    run_stats["commit_seconds"] = writer.commit_seconds
    run_stats["writer_timings"] = dict(writer.timings)
    _check_coverage(manifest, run_stats)
    log.info(
        "rank %d/%d: %s samples (%s tokens) written this run in %.1fs (%.0f tok/s); write thread busy %.0f%% of it "
        "(committing shards: fsync, index, rename, manifest %.0f%%)",
        ranks.rank,
        ranks.world,
        f"{run_stats['samples']:,}",
        f"{run_stats['tokens']:,}",
        run_stats["seconds"],
        run_stats["tokens"] / max(run_stats["seconds"], 1e-9),
        100 * run_stats.get("write_busy_seconds", 0.0) / max(run_stats["seconds"], 1e-9),
        100 * run_stats.get("commit_seconds", 0.0) / max(run_stats["seconds"], 1e-9),
    )
    merged = finish_ranks(root, ranks)
    if merged is None:
        return summarize_dataset(root, load_manifest(fs, fs_root, names["manifest"]), this_run=run_stats, partial=True)
    return summarize_dataset(root, merged, this_run=run_stats)


def _holds_nothing(manifest: dict) -> bool:
    """A rank manifest with no shard, no committed reject and not complete: a start that committed nothing."""
    state = manifest.get("stage_state") or {}
    return not manifest["shards"] and not manifest.get("complete") and not state.get("rejects_bytes")


def _remove_stub(root: str, names: dict) -> None:
    for name in (names["manifest"], names["rejects"]):
        with contextlib.suppress(FileNotFoundError):
            remove_at(join_uri(root, name))


def _discard_if_empty(root: str, names: dict, created: list) -> None:
    """After a failed start: remove the files this run created if it committed nothing (a rerun then
    starts afresh with whatever settings it is given, and an out_dir this run made disappears)."""
    from shards import load_manifest

    fs, fs_root = resolve(root)
    try:
        if not _holds_nothing(load_manifest(fs, fs_root, names["manifest"])):
            return
    except (ValueError, OSError):
        return  # unreadable or absent: leave everything for a person to look at
    for path in created:
        if "://" in path or not os.path.isdir(path):
            with contextlib.suppress(FileNotFoundError):
                remove_at(path)


def has_committed_work(cfg: ExtractConfig, ranks: Ranks) -> bool:
    """Whether any dataset of `cfg` holds committed work of this rank (something a rerun resumes)."""
    from shards import load_manifest

    for split_cfg in cfg.split_configs().values():
        try:
            fs, fs_root = resolve(_local_dir(split_cfg.out_dir))
            if not _holds_nothing(load_manifest(fs, fs_root, ranks.names["manifest"])):
                return True
        except (ValueError, OSError):
            continue
    return False


def _existing_rank_manifest(root: str, own: str) -> str | None:
    """This rank's manifest if it exists, else another rank's (whose provenance this rank adopts)."""
    present = list_names(root)
    if own in present:
        return own
    others = sorted(f for f in present if f.startswith("manifest.rank") and f.endswith(".json"))
    return others[0] if others else None


def _local_dir(out_dir: str) -> str:
    """The dataset root: an absolute local path, or the URI as given (an object store)."""
    if "://" in out_dir:
        return out_dir.rstrip("/")
    return os.path.abspath(out_dir)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def _runtime_keys(cfg: ExtractConfig) -> dict:
    data = config_to_dict(cfg)
    return {k: v for k, v in data.items() if k not in DATASET_KEYS}


# ----------------------------------------------------------------------------------------------
# Provenance and resume checks


def corpus_fingerprint(corpus: C.CorpusFiles, max_records: int | None) -> dict:
    """Content checksums of the corpus files (what a resume compares) and the record count, of the
    extent of each file found at the start (a JSONL file in one pass for both). The checksums are
    also kept in `corpus`, so that reading checks each file it reads to its end against them."""
    from extract.reading import extent_checksum, parquet_file, scan_jsonl

    files, lines = [], 0
    for i, f in enumerate(corpus.files):
        extent = corpus.extents[i] if corpus.extents else os.path.getsize(f)
        if corpus.format != "datasets" and corpus.kinds[i] == "jsonl":
            count, checksum = scan_jsonl(f, extent)
            lines += count
        else:
            checksum = extent_checksum(f, extent)
        name = os.path.relpath(f, corpus.root) if corpus.format == "datasets" else os.path.basename(f)
        files.append({"name": name, "bytes": extent, "checksum": checksum})
    if corpus.format != "datasets":
        corpus.checksums = [f["checksum"] for f in files]
        records = lines + sum(
            parquet_file(f).metadata.num_rows for f, kind in zip(corpus.files, corpus.kinds) if kind != "jsonl"
        )
    else:
        records = C.count_records(corpus)
    if records is not None and max_records is not None:
        records = min(records, max_records)
    fingerprint = {
        "files": files,
        "hash": json_digest([[f["bytes"], f["checksum"]] for f in files]),
        "records": records,
    }
    if corpus.skipped:
        fingerprint["skipped"] = list(corpus.skipped)
    return fingerprint


def tokenizer_provenance(tokenizer, mask: MaskChoice, template_kwargs: dict) -> dict:
    return {
        "hash": tokenizer_digest(tokenizer),
        "chat_template_hash": text_digest(tokenizer.chat_template)
        if isinstance(getattr(tokenizer, "chat_template", None), str)
        else None,
        "chat_template_kwargs": dict(template_kwargs),
        "mask_token_id": mask.token_id,
        "mask_token": mask.provenance(),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def with_regeneration(cfg: ExtractConfig) -> tuple[ExtractConfig, dict | None]:
    """For a corpus written by `python -m extract.regenerate`: the config with the chat template
    variables its answers were generated for (so the template and loss mask follow its thinking
    choice; an explicit different choice is refused) and the provenance the manifest carries."""
    from extract.regenerate.store import provenance_for_manifest, regeneration_of

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


def check_regeneration_target(regeneration: dict | None, target: dict) -> None:
    """Warn when the corpus was answered by another target than the one extracted (a drafter learns
    what the answering model says)."""
    if regeneration is None:
        return
    answered_by = regeneration.get("target", {})
    for key in ("config_hash", "weights_digest"):
        if answered_by.get(key) and target.get(key) and answered_by[key] != target[key]:
            log.warning(
                "the regenerated corpus was answered by %s (%s %s), not by the target extracted now (%s %s)",
                answered_by.get("name_or_path"),
                key,
                answered_by[key],
                key,
                target[key],
            )
            return


def build_provenance(
    cfg: ExtractConfig,
    target: Target,
    corpus: C.CorpusFiles,
    fingerprint: dict,
    regeneration: dict | None,
    mask: MaskChoice,
) -> dict:
    from shards import TAP_MEANING

    if mask.token_id is None:
        log.warning(
            "no mask token: the tokenizer has no special token to spare and mask_token_id is not set; the "
            "trainer will need one (model.mask_token_id)"
        )
    target_info = target_provenance(target)
    check_regeneration_target(regeneration, target_info)
    corpus_info = {
        "source": cfg.corpus,
        "format": corpus.format,
        "hash": fingerprint["hash"],
        "files": fingerprint["files"],
        "records": fingerprint["records"],
    }
    if fingerprint.get("skipped"):
        corpus_info["skipped"] = fingerprint["skipped"]
    if regeneration is not None:
        corpus_info["regeneration"] = regeneration
    return {
        "target": target_info,
        "tokenizer": tokenizer_provenance(target.tokenizer, mask, cfg.chat_template_kwargs),
        "taps": {"layer_ids": list(cfg.layer_ids), "meaning": TAP_MEANING},
        "dtype": "bfloat16",  # of the stored hidden states
        "compute_dtype": cfg.dtype,
        "topk": cfg.topk,
        "max_len": cfg.max_len,
        "corpus": corpus_info,
        "extract_config": config_to_dict(cfg),
        **tool_provenance(),
    }


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


def resume_problems(stored: dict, fresh: dict) -> list[str]:
    """What differs between a dataset's provenance and this run's, in words (empty: may resume)."""
    problems = []
    old_cfg, new_cfg = stored.get("extract_config", {}), fresh["extract_config"]
    for key in DATASET_KEYS:
        if old_cfg.get(key) != new_cfg.get(key):
            problems.append(f"config key '{key}' is {old_cfg.get(key)!r} in the dataset but {new_cfg.get(key)!r} now")
    for part, keys in RESUME_COMPARED.items():
        for key in keys:
            old, new = stored.get(part, {}).get(key), fresh[part].get(key)
            if old != new:
                problems.append(
                    f"{part} {key} changed: {old!r} in the dataset, {new!r} now "
                    f"({fresh[part].get('name_or_path', '')})".replace(" ()", "")
                )
    old_corpus, new_corpus = stored.get("corpus", {}), fresh["corpus"]
    if old_corpus.get("hash") != new_corpus["hash"]:
        old_files = {f["name"]: f for f in old_corpus.get("files", [])}
        new_files = {f["name"]: f for f in new_corpus["files"]}
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


def _refuse_changed(root: str, stored_manifest: dict, fresh: dict, ranks: Ranks) -> None:
    problems = resume_problems(stored_manifest["provenance"], fresh)
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
        k: (v, fresh["extract_config"][k])
        for k, v in stored_manifest["provenance"].get("extract_config", {}).items()
        if k not in DATASET_KEYS and fresh["extract_config"].get(k) != v
    }
    if changed:
        log.info(
            "resuming with changed runtime settings (allowed): %s",
            ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())),
        )


def _already_complete(fs, root: str, fresh: dict, load_manifest) -> dict | None:
    if not exists_at(join_uri(root, FINAL_MANIFEST)):
        return None
    manifest = load_manifest(fs, resolve(root)[1], FINAL_MANIFEST)
    if not manifest.get("complete"):
        return None
    problems = resume_problems(manifest["provenance"], fresh)
    if problems:
        raise ValueError(
            f"{root}: holds a finished dataset made with other settings: "
            + "; ".join(problems)
            + ". Write to a new out_dir."
        )
    return manifest


# ----------------------------------------------------------------------------------------------
# Reading: records -> windows of this rank's samples


@dataclasses.dataclass
class Window:
    span: float  # input positions this window covers (for the progress bar)
    records_owned: int
    samples: list  # TokenizedSample, deduplicated, this rank's
    rejects: list  # Reject, this rank's (including duplicates)


def _windows(cfg: ExtractConfig, corpus: C.CorpusFiles, builder: C.SampleBuilder, ranks: Ranks) -> Iterator[Window]:
    records = C.iter_records(corpus, streaming=cfg.streaming, max_records=cfg.max_records)
    seen: dict[str, int] = {}
    end = 0
    while True:
        chunk = list(itertools.islice(records, cfg.sort_window))
        if not chunk:
            return
        window = Window(chunk[-1].position + 1 - end, 0, [], [])
        end = chunk[-1].position + 1
        for result in _build_guarded(builder, chunk):
            if not ranks.owns(result.sample_id, result.position):
                continue
            window.records_owned += 1
            if isinstance(result, C.Reject):
                window.rejects.append(result)
            elif result.sample_id in seen:
                window.rejects.append(
                    C.Reject(
                        result.position,
                        result.source,
                        C.DUPLICATE,
                        f"same tokens and loss mask as position {seen[result.sample_id]}",
                        result.sample_id,
                    )
                )
            else:
                seen[result.sample_id] = result.position
                window.samples.append(result)
        yield window


def _build_guarded(builder: C.SampleBuilder, chunk: list) -> list:
    """`builder.build`, but a record that breaks the tokenizer becomes a reject, not a crash."""
    try:
        return builder.build(chunk)
    except C.CorpusError:
        raise
    except Exception:  # noqa: BLE001 - find the record(s) responsible, one by one
        out = []
        for raw in chunk:
            try:
                out.extend(builder.build([raw]))
            except C.CorpusError:
                raise
            except Exception as err:  # noqa: BLE001
                out.append(C.Reject(raw.position, raw.source, UNEXPECTED, f"{type(err).__name__}: {err}"))
        return out


class _Prefetch:
    """Runs an iterator in a thread, `depth` items ahead (tokenization overlaps the forwards)."""

    def __init__(self, iterator: Iterator, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iterator,), name="extract-read", daemon=True)
        self._thread.start()

    def _run(self, iterator) -> None:
        try:
            for item in iterator:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
            self._put(("error", err))

    def _put(self, entry) -> bool:
        """Queue `entry` unless the consumer has gone away (then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        while True:
            kind, value = self._queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value

    def close(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------------------------
# The forward loop


class HostPath:
    """The host side of the forward loop, in two worker threads (see `sink.Worker`):

        "assemble": wait for a micro-batch's device-to-host copy and cut its samples out of the
                    pinned buffer as views (the device already laid them out as stored: no copy)
        "write":    reject the samples the device flagged non-finite; write the others with
                    `ShardWriter.write(..., hidden_known_finite=True)` (the flags cover exactly the
                    stored bf16 values; zstd runs in pyarrow's threads); counters; then give the
                    buffer back to the pool

    A buffer returns to the pool only when every sample cut from it is written (or its batch is
    dropped after an error), so the pool bounds the batches on the host and a slow writer slows
    the forward loop down. `benchmarks.extract_host` measures this class on synthetic batches.
    """

    def __init__(
        self,
        writer,
        rejects: RejectLog,
        pool: BufferPool,
        progress: Progress,
        stats: dict,
        *,
        on_error: str,
        depth: int,
    ):
        self.writer, self.rejects, self.pool, self.progress, self.stats = writer, rejects, pool, progress, stats
        self.on_error = on_error
        self.writing = Worker("write", self._write, maxsize=2, on_discard=self._release)
        self.assembling = Worker("assemble", self._assemble, maxsize=depth, on_discard=self._release)

    # -- the forward loop's side

    def acquire(self) -> HostBatch:
        """A free buffer, waiting while all are in flight but re-raising a worker's error."""
        while True:
            self.check()
            try:
                return self.pool.acquire(timeout=0.2)
            except queue.Empty:
                continue

    def put_rejects(self, rejects: list, share: float) -> None:
        self.assembling.put(("rejects", rejects, share), also_check=(self.writing,))

    def put_batch(self, inflight, samples: list, to_write: list[bool], share: float) -> None:
        lease = _Lease(self.pool, inflight.host)
        try:
            self.assembling.put(("batch", (lease, inflight, samples, to_write), share), also_check=(self.writing,))
        except BaseException:
            inflight.wait()  # a worker failed: take the buffer back, once the device is done writing into it
            lease.release()
            raise

    def check(self) -> None:
        self.assembling.check()
        self.writing.check()

    def finish(self) -> None:
        self.assembling.finish()
        self.writing.finish()

    def abandon(self) -> None:
        self.assembling.abandon()
        self.writing.abandon()

    # -- worker threads

    def _assemble(self, item) -> None:
        kind, payload, share = item
        if kind == "rejects":
            self.writing.put(item)
            return
        lease, inflight, samples, to_write = payload
        inflight.wait()
        self.writing.put(("samples", (lease, self.cut(inflight, samples, to_write)), share))

    def _write(self, item) -> None:
        kind, payload, share = item
        if kind == "rejects":
            for reject in payload:
                self.record_reject(reject)
        else:
            lease, out = payload
            try:
                self.store(out)
            finally:
                lease.release()  # the views into the buffer are dead from here on
        self.progress.advance(share)

    # -- the work itself (also called directly by benchmarks.extract_host)

    @staticmethod
    def cut(inflight, samples: list, to_write: list[bool]) -> list[tuple]:
        """(tokenized, Sample of views into the buffer, hidden_ok, logits_ok) of each wanted sample of a landed
        batch."""
        from shards import Sample

        out = []
        offsets = inflight.offsets
        for b, (tokenized, wanted) in enumerate(zip(samples, to_write)):
            if wanted:
                hidden, topk_ids, topk_logprobs, hidden_ok, logits_ok = sample_views(inflight, b, offsets[b])
                sample = Sample(
                    tokenized.sample_id, tokenized.input_ids, tokenized.loss_mask, hidden, topk_ids, topk_logprobs
                )
                out.append((tokenized, sample, hidden_ok, logits_ok))
        return out

    def store(self, out: list[tuple]) -> None:
        """Write (or reject) the samples `cut` returned, in order."""
        for tokenized, sample, hidden_ok, logits_ok in out:
            self._write_sample(tokenized, sample, hidden_ok, logits_ok)

    def _write_sample(self, tokenized, sample, hidden_ok: bool, logits_ok: bool) -> None:
        if not (hidden_ok and logits_ok):
            reason = C.NONFINITE_HIDDEN if not hidden_ok else C.NONFINITE_LOGITS
            what = "tap hidden states" if not hidden_ok else "final logits"
            self.record_reject(
                C.Reject(tokenized.position, tokenized.source, reason, f"NaN/Inf in the {what}", tokenized.sample_id)
            )
            return
        writer = self.writer
        writer.stage_state["rejects_bytes"] = self.rejects.sync()  # committed with the next shard
        writer.write(sample, hidden_known_finite=True)
        self.stats["samples"] += 1
        self.stats["tokens"] += sample.n_tokens
        self.progress.wrote(1, sample.n_tokens, writer.bytes_written)

    def record_reject(self, reject) -> None:
        new = self.rejects.add(reject)
        if new:
            key = "duplicates" if reject.reason == C.DUPLICATE else f"rejected.{reject.reason}"
            self.writer.extra_counts[key] += 1
            self.progress.rejected()
        if self.on_error == "fail" and reject.reason not in POLICY_REASONS:
            self.writer.stage_state["rejects_bytes"] = self.rejects.sync()
            self.writer.flush()
            raise ValueError(
                f"{reject.source} (position {reject.position}): {reject.reason}: {reject.detail}. "
                "Stopping because on_error = fail; on_error=skip counts such records and goes on."
            )

    @staticmethod
    def _release(item) -> None:
        """A dropped item (after an error) gives its buffer back."""
        if item[0] in ("batch", "samples"):
            item[1][0].release()


class _Lease:
    """A pool buffer on loan to one batch; `release` gives it back once, however often it is called
    (the write thread's `finally` and a worker's discard handler may both reach it)."""

    def __init__(self, pool: BufferPool, host: HostBatch):
        self._pool, self._host = pool, host
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            host, self._host = self._host, None
        if host is not None:
            self._pool.release(host)


def _extract_into(
    cfg, target: Target, ranks: Ranks, corpus, fingerprint, writer, rejects: RejectLog, label, entered: float
) -> dict:
    import pyarrow as pa

    tokenizer = target.tokenizer
    policy = C.SamplePolicy(
        cfg.max_len,
        cfg.length_policy,
        cfg.min_loss_tokens,
        cfg.chat_template_kwargs,
        target.vocab_size,
        writer.manifest["provenance"]["tokenizer"].get("mask_token_id"),
    )
    builder = C.SampleBuilder(tokenizer, policy)
    committed, done_positions = writer.committed_ids(), set(rejects.positions)
    n_taps = len(cfg.layer_ids)
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    stats = {"records_owned": 0, "samples": 0, "tokens": 0, "batches": 0, "skipped_batches": 0, "padded_tokens": 0}
    desc = f"extract {label or os.path.basename(cfg.out_dir)}" + (
        f" rank {ranks.rank}/{ranks.world}" if ranks.world > 1 else ""
    )
    progress = Progress(fingerprint["records"], desc, enabled=cfg.progress and ranks.rank == 0)
    capturer = Capturer(
        target,
        cfg.layer_ids,
        cfg.topk,
        cfg.logits_chunk,
        cfg.launch_ahead_layers,
        tier=tier_for(writer, target.output_device),
    )
    pool = BufferPool(
        cfg.inflight_batches,
        n_taps=n_taps,
        hidden_size=target.hidden_size,
        token_budget=cfg.tokens_per_batch,
        topk=cfg.topk,
        pin=capturer.cuda,
        encoding=writer.encoding,
        hidden_split=writer.hidden_split,
        stored_width=writer.hidden_width,
    )
    pa.set_cpu_count(cfg.writer_threads)  # zstd runs on pyarrow's pool while the write thread waits

    def is_done(sample) -> bool:
        return sample.sample_id in committed or sample.position in done_positions

    host_path = HostPath(writer, rejects, pool, progress, stats, on_error=cfg.on_error, depth=cfg.inflight_batches)
    windows = _Prefetch(_windows(cfg, corpus, builder, ranks), depth=2)
    try:
        for window in windows:
            stats["records_owned"] += window.records_owned
            _run_window(window, cfg, capturer, host_path, progress, is_done, pad_id, stats)
        launched_all = time.perf_counter()
        host_path.finish()
        # Fixed costs around the forwards, which a long run amortizes: setting up until the first
        # forward is launched, and writing what is still in flight after the last one is launched.
        stats["startup_seconds"] = stats.pop("first_launch_at", launched_all) - entered
        stats["drain_seconds"] = time.perf_counter() - launched_all
    except BaseException:
        windows.close()
        host_path.abandon()
        raise
    finally:
        progress.close()
    stats["bytes"] = writer.bytes_written
    # Seconds each host thread spent working (or blocked downstream): a write thread busy all the
    # run means the host path, not the GPU, set the pace.
    stats["write_busy_seconds"] = host_path.writing.busy_seconds
    stats["write_cpu_seconds"] = host_path.writing.busy_cpu_seconds
    stats["assemble_busy_seconds"] = host_path.assembling.busy_seconds
    return stats


def _run_window(window: Window, cfg, capturer, host_path: HostPath, progress, is_done, pad_id, stats) -> None:
    lengths = [s.n_tokens for s in window.samples]
    total_tokens = sum(lengths)
    rejects_share = window.span if not total_tokens else 0.0
    host_path.put_rejects(window.rejects, rejects_share)
    for batch in plan_micro_batches(lengths, cfg.tokens_per_batch):
        samples = [window.samples[i] for i in batch]
        share = window.span * sum(lengths[i] for i in batch) / total_tokens
        to_write = [not is_done(s) for s in samples]
        if not any(to_write):
            stats["skipped_batches"] += 1
            progress.skipped(len(samples))
            progress.advance(share)
            continue
        host = host_path.acquire()
        stats.setdefault("first_launch_at", time.perf_counter())
        input_ids_BT, batch_lengths = collate_right_padded([torch.from_numpy(s.input_ids) for s in samples], pad_id)
        inflight = capturer.launch(input_ids_BT, batch_lengths, host)
        stats["batches"] += 1
        stats["padded_tokens"] += int(input_ids_BT.numel())
        host_path.put_batch(inflight, samples, to_write, share)


def _check_coverage(manifest: dict, run_stats: dict) -> None:
    """Every record this rank owns is a committed sample, a reject or a duplicate, exactly once."""
    counts = manifest["counts"]
    accounted = (
        counts["samples"] + sum(v for k, v in counts.items() if k.startswith("rejected.")) + counts.get("duplicates", 0)
    )
    run_stats["coverage_ok"] = accounted == run_stats["records_owned"]
    if not run_stats["coverage_ok"]:
        log.error(
            "coverage mismatch: this rank owns %d records but the dataset accounts for %d (samples %d + rejects + "
            "duplicates); please report this",
            run_stats["records_owned"],
            accounted,
            counts["samples"],
        )


# ----------------------------------------------------------------------------------------------
# Merging ranks and the summary


def finish_ranks(root: str, ranks: Ranks) -> dict | None:
    """Merge the rank manifests into manifest.json once every rank is done; the merged manifest, or None."""
    ranks.barrier()
    if ranks.group and ranks.rank != 0:
        return None
    return merge_ranks(root, ranks.world, required=ranks.group)


def merge_ranks(root: str, world: int, *, required: bool = True) -> dict | None:
    """Merge `manifest.rank*.json` of ranks 0..world-1 into manifest.json and the rejects files
    into rejects.jsonl. With required=False, returns None if some rank has not finished yet."""
    from shards import load_manifest

    fs, fs_root = resolve(root)
    if "://" not in root:
        root = fs_root
    names = [rank_names(r) for r in range(world)]
    present = list_names(root)
    missing = [n["manifest"] for n in names if n["manifest"] not in present]
    unfinished = missing + [
        n["manifest"]
        for n in names
        if n["manifest"] not in missing and not load_manifest(fs, fs_root, n["manifest"]).get("complete")
    ]
    if unfinished:
        if required:
            raise ValueError(f"{root}: cannot merge, ranks not finished: {', '.join(unfinished)}")
        log.info(
            "%s: waiting for %s; the last rank to finish merges (or run `python -m extract.merge %s`)",
            root,
            ", ".join(unfinished),
            root,
        )
        return None
    extra = sorted(
        f
        for f in present
        if f.startswith("manifest.rank") and f.endswith(".json") and f not in {n["manifest"] for n in names}
    )
    if extra:
        raise ValueError(f"{root}: found {extra} from a run with more ranks; merge with that world size or remove them")
    with lock_manifest(
        fs, fs_root, FINAL_MANIFEST, wait_seconds=MERGE_WAIT_SECONDS
    ):  # the last two ranks may finish together
        return _merge_locked(root, names)


def _merge_locked(root: str, names: list[dict]) -> dict:
    from shards import load_manifest, merge_manifests

    fs, fs_root = resolve(root)
    if "://" not in root:
        root = fs_root
    remove_merge_leftovers(root)
    # rejects.jsonl before manifest.json: a complete manifest.json makes a rerun stop at once
    # ("already complete"), so everything else the merge writes must exist by then.
    entries = []
    for n in names:
        committed = load_manifest(fs, fs_root, n["manifest"]).get("stage_state", {}).get("rejects_bytes", 0)
        entries += read_committed_rejects(join_uri(root, n["rejects"]), committed)
    entries.sort(key=lambda e: e["position"])
    atomic_write_text(join_uri(root, FINAL_REJECTS), "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
    merged = merge_manifests(root, [n["manifest"] for n in names], FINAL_MANIFEST)
    write_summary(root, merged)
    return merged


def remove_merge_leftovers(root: str) -> None:
    """Temporaries of the merged files left by a killed merge (the shard writers clean only their own)."""
    fs, root = resolve(root)
    remove_temp_files(
        fs, root, prefixes=tuple(f"{name}." for name in (FINAL_REJECTS, FINAL_MANIFEST, SUMMARY_FILE, CONFIG_FILE))
    )


def write_summary(root: str, manifest: dict) -> dict:
    summary = summarize_dataset(root, manifest, this_run=None)
    atomic_write_json(join_uri(root, SUMMARY_FILE), summary)
    return summary


def summarize_dataset(root: str, manifest: dict, *, this_run: dict | None, partial: bool = False) -> dict:
    counts = manifest["counts"]
    rejects = {k.split(".", 1)[1]: v for k, v in counts.items() if k.startswith("rejected.")}
    nbytes = sum(e["bytes"] + e.get("index_bytes", 0) for e in manifest["shards"])
    summary = {
        "root": root,
        "complete": bool(manifest.get("complete")) and not partial,
        "partial": partial,
        "samples": counts["samples"],
        "tokens": counts["tokens"],
        "loss_tokens": counts["loss_tokens"],
        "duplicates": counts.get("duplicates", 0),
        "rejects": dict(sorted(rejects.items(), key=lambda kv: -kv[1])),
        "records": counts["samples"] + sum(rejects.values()) + counts.get("duplicates", 0),
        "input_lines": None if partial else manifest["provenance"].get("corpus", {}).get("records"),
        "shards": len(manifest["shards"]),
        "bytes": nbytes,
        "bytes_per_token": nbytes / counts["tokens"] if counts["tokens"] else None,
        "skipped_files": list(manifest["provenance"].get("corpus", {}).get("skipped", [])),
    }
    if this_run is not None:
        keys = (
            "rank",
            "world",
            "samples",
            "tokens",
            "seconds",
            "batches",
            "skipped_batches",
            "padded_tokens",
            "coverage_ok",
            "startup_seconds",
            "drain_seconds",
        )
        summary["this_run"] = {k: this_run[k] for k in keys if k in this_run}
        if this_run.get("seconds"):
            summary["this_run"]["tok_per_s"] = this_run["tokens"] / this_run["seconds"]
        if this_run.get("padded_tokens"):
            summary["this_run"]["pad_efficiency"] = this_run["tokens"] / this_run["padded_tokens"]
        if this_run.get("seconds") and "write_busy_seconds" in this_run:
            summary["this_run"]["write_thread_busy"] = this_run["write_busy_seconds"] / this_run["seconds"]
            summary["this_run"]["commit_busy"] = this_run.get("commit_seconds", 0.0) / this_run["seconds"]
            summary["this_run"]["write_thread_cpu"] = this_run.get("write_cpu_seconds", 0.0) / this_run["seconds"]
            for key, value in this_run.get("writer_timings", {}).items():
                share = value if key.endswith("_calls") else value / this_run["seconds"]
                summary["this_run"]["writer_" + key.removesuffix("_seconds")] = share
    return summary


def no_samples_reason(summary: dict) -> str:
    """Why a finished dataset holds no sample, in one line (the extraction then exits non-zero)."""
    where = summary["root"]
    if not summary["records"]:
        lines = summary.get("input_lines")
        what = "the corpus holds no records" + (f" ({lines:,} blank lines)" if lines else " (it is empty)")
    else:
        rejects = ", ".join(f"{k} {v:,}" for k, v in summary["rejects"].items())
        dupes = f", duplicates {summary['duplicates']:,}" if summary["duplicates"] else ""
        what = (
            f"every one of its {summary['records']:,} records was rejected ({rejects}{dupes}); see "
            f"{join_uri(where, FINAL_REJECTS)}"
        )
    return (
        f"0 samples written to {where}: {what}. Fix the corpus or the settings, then delete {where} "
        "(it is a finished, empty dataset) or write to another out_dir."
    )


def describe_skipped(skipped: list[dict], limit: int = 8) -> str:
    """'a.json (reason), sub/ (reason), ... and N more' for the files a corpus directory does not read."""
    shown = "; ".join(f"{s['name']} ({s['reason']})" for s in skipped[:limit])
    return shown + (
        f"; and {len(skipped) - limit:,} more (see the manifest's provenance)" if len(skipped) > limit else ""
    )


def format_summary(summary: dict) -> str:
    """The end-of-run report, in words; says so when a group is empty."""
    lines = [
        f"dataset   {summary['root']}"
        + (
            ""
            if summary["complete"]
            else "  (this rank's part; other ranks still running)"
            if summary.get("partial")
            else "  (incomplete)"
        )
    ]
    line = f"records   {summary['records']:,} accounted for = samples + rejects + duplicates"
    lines_in = summary.get("input_lines")
    if lines_in is not None and lines_in > summary["records"]:
        line += f" (of {lines_in:,} input lines; the other {lines_in - summary['records']:,} are blank)"
    elif lines_in is not None and lines_in < summary["records"]:
        line += f" (but the corpus was counted as {lines_in:,} input lines; please report this)"
    lines.append(line)
    if not summary["records"]:
        lines.append("samples   none: the corpus holds no records")
    elif summary["samples"]:
        lines.append(
            f"samples   {summary['samples']:,} in {summary['shards']} shards; {summary['tokens']:,} tokens, "
            f"{summary['loss_tokens']:,} loss tokens"
        )
        lines.append(f"bytes     {summary['bytes'] / 1e6:,.1f} MB on disk = {summary['bytes_per_token']:,.0f} B/token")
    else:
        lines.append("samples   none: every record was rejected or a duplicate (see rejects.jsonl)")
    lines.append(f"duplicates {summary['duplicates']:,}" if summary["duplicates"] else "duplicates none")
    skipped = summary.get("skipped_files") or []
    if skipped:
        lines.append(
            f"skipped   {len(skipped):,} files of the corpus directory, not read: " + describe_skipped(skipped)
        )
    if summary["rejects"]:
        lines.append(
            f"rejects   {sum(summary['rejects'].values()):,}: "
            + ", ".join(f"{k} {v:,}" for k, v in summary["rejects"].items())
        )
    else:
        lines.append("rejects   none")
    run = summary.get("this_run")
    if run is None:
        lines.append("this run  nothing to do (already complete)")
    else:
        who = f" (rank {run['rank']} of {run['world']})" if run.get("world", 1) > 1 else ""
        line = f"this run{who}  {run['samples']:,} samples, {run['tokens']:,} tokens in {run['seconds']:.1f}s"
        if run.get("tok_per_s"):
            line += f" = {run['tok_per_s']:,.0f} tok/s"
        if run.get("pad_efficiency"):
            line += f", padding efficiency {run['pad_efficiency']:.1%}"
        if run.get("skipped_batches"):
            line += f"; {run['skipped_batches']} batches already committed"
        lines.append(line)
        if run.get("coverage_ok") is False:
            lines.append("WARNING   some records are not accounted for (coverage mismatch); see the log")
    return "\n".join(lines)
