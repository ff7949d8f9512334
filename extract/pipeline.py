"""The extraction run, top to bottom: check, load, plan, run the windows, commit, summarize.

    check       `checks.check_inputs`: corpora, output paths and a second writer, before the target loads;
                each split's `checks.SplitInputs` (its config settled with its corpus)
    load        the target on this rank's devices (`resolve_devices`), its layer ids and vocabulary checked,
                and its self-check without the cache (`target.self_check`: the stored logits are the model's own)
    plan        per split: the provenance (`provenance.build_provenance`) and the `SplitRun` that carries
                what the split needs; this rank's manifest lock, the resume point
                (`provenance.resume_point`), the storage tier's projection, the shard writer
    run windows `corpus.windows.read_windows` in a `corpus.windows.Prefetch` thread; a `ForwardLoop`
                launches each window's micro-batches on the device (`capture.Capturer`) and hands them
                to `host_path.HostPath`
    commit      the writer commits the last shard as it closes; the last rank merges (`merge.finish_ranks`)
    summarize   `summary`: the coverage check, the log line, the summary dict the command prints

The ranks (`extract.ranks`) and the files they write are described there. Resume: rerunning the
same command reopens each rank's manifest and skips what it lists; rejects are committed with the
shards (see `sink.RejectLog`). Batches are planned from every sample of a window, committed or not,
so a resumed run forms exactly the same micro-batches as an uninterrupted one and stores
bit-identical values (given deterministic kernels); a batch whose samples are all committed is
skipped without a forward. What may change between the runs of a dataset: `extract.provenance`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable

import pyarrow as pa
import torch

from common.config import config_to_dict, save_config
from common.hashing import json_digest
from common.io import exists_at, join_uri, remove_at, resolve
from extract import corpus as C
from extract.batching import (
    BufferPool,
    collate_packed,
    collate_right_padded,
    plan_micro_batches,
    plan_packed_micro_batches,
)
from extract.calibrate import ensure_projection
from extract.capture import Capturer, tier_for
from extract.checks import SplitInputs, check_inputs, check_mask_token_id, check_topk, local_dir
from extract.config import DATASET_KEYS, ExtractConfig
from extract.corpus import windows
from extract.corpus.files import describe_skipped
from extract.corpus.mask_token import MaskChoice, choose_mask_token
from extract.corpus.rendering import TokenizedSample
from extract.host_path import HostPath
from extract.merge import finish_ranks, remove_merge_leftovers
from extract.provenance import (
    already_complete,
    build_provenance,
    holds_nothing,
    resume_point,
)
from extract.ranks import CONFIG_FILE, FINAL_MANIFEST, SUMMARY_FILE, Ranks
from extract.sink import Progress, RejectLog, open_reject_log
from extract.summary import check_coverage, log_run, summarize_dataset, write_summary
from shards import ShardWriter, load_manifest
from shards.manifest import MERGE_WAIT_SECONDS, lock_manifest
from shards.provenance import Provenance, provenance_of
from target.arch import check_architecture
from target.chat_template import with_chat_template
from target.files import check_target_files
from target.load import Target, check_layer_ids, load_target, read_text_config
from target.packing import packing_probe, packing_refusal, use_packed_sdpa
from target.self_check import self_check

log = logging.getLogger("extract")


def run(cfg: ExtractConfig, *, target: Target | None = None, ranks: Ranks | None = None) -> dict:
    """Extract every split of `cfg`; returns {split name (or None): summary dict of this rank}."""
    ranks = ranks or Ranks.from_env()
    # Corpora (found, fingerprinted: damaged files named), output paths, a second writer and the
    # target's files, all before the target's weights load (minutes for a 27B).
    prepared = check_inputs(cfg, ranks)
    if target is None:
        check_target_files(cfg.target)
    torch.manual_seed(cfg.seed)
    if target is None:
        target = _load_checked_target(cfg, ranks)
    else:
        check_layer_ids(cfg.layer_ids, target.num_layers)
    check_topk(cfg.topk, target.vocab_size)
    check_mask_token_id(cfg.mask_token_id, target.vocab_size)
    check_stored_logits(target)
    # chat_template=FILE: the file's template renders the chats and is the one the provenance hashes.
    target = dataclasses.replace(target, tokenizer=with_chat_template(target.tokenizer, cfg.chat_template))
    restore_attention = prepare_packing(target) if cfg.packing else None
    mask = choose_mask_token(target.tokenizer, cfg.mask_token_id, [inputs.corpus for inputs in prepared.values()])
    check_mask_token_id(mask.token_id, target.vocab_size, mask.source)
    log.info("%s", mask.describe())
    summaries = {}
    python_interval = sys.getswitchinterval()
    if cfg.gil_switch_interval is not None:
        sys.setswitchinterval(cfg.gil_switch_interval)
    try:
        for name, inputs in prepared.items():
            summaries[name] = extract_split(inputs, target, ranks, mask, label=name)
    finally:
        sys.setswitchinterval(python_interval)
        if restore_attention is not None:  # a target the caller passed in stays as it came
            restore_attention()
    return summaries


def check_stored_logits(target: Target) -> None:
    """The self-check's parts that extraction's output rests on (`target.self_check`, without the cache):
    every layer returns one hidden state per token and the log-probabilities it stores are the model's
    own; ValueError (one line with the numbers) otherwise."""
    checked = self_check(target, cache=False)
    refusal = checked.refusal()
    if refusal is not None:
        raise refusal
    log.info("self-check (%.1f s): %s", checked.seconds, next(c.line for c in checked.checks if c.name == "logits"))


def prepare_packing(target: Target):
    """Refuse packing (ValueError naming why) unless the target keeps packed samples apart, checked on
    its structure and on a probe forward; SDPA switched to run per sample. Returns what undoes the
    switch (None: nothing to undo)."""
    refusal = packing_refusal(target)
    restore = use_packed_sdpa(target) if refusal is None else None  # per sample, not over the row's dense mask
    if refusal is None:
        refusal = packing_probe(target)
    if refusal is not None:
        if restore is not None:
            restore()
        raise ValueError(f"packing: refused for this target: {refusal}; run with packing=false")
    attention = getattr(target.text_config, "_attn_implementation", None)
    log.info(
        "packing: one row of several samples per forward, boundaries passed to every layer (checked on a probe)%s",
        f"; with {attention} attention the document mask is dense (N x N per row)" if attention == "eager" else "",
    )
    return restore


def _load_checked_target(cfg: ExtractConfig, ranks: Ranks) -> Target:
    """The target on this rank's devices; its layer count and vocabulary checked before any weights move."""
    text_config = read_text_config(cfg.target, cfg.trust_remote_code)
    check_architecture(cfg.target, cfg.trust_remote_code)  # a family DFlash cannot serve, in one line
    check_layer_ids(cfg.layer_ids, int(text_config.num_hidden_layers))  # before any weights move
    check_topk(cfg.topk, getattr(text_config, "vocab_size", None))
    check_mask_token_id(cfg.mask_token_id, getattr(text_config, "vocab_size", None))
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
    return target


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


@dataclasses.dataclass
class SplitRun:
    """What one split's extraction needs once its target is loaded and its provenance built, passed
    down the plan, the forward loop and the commit (as `train.prepare.Run` serves the training step)."""

    cfg: ExtractConfig  # the split's, settled (`checks.SplitInputs`)
    target: Target
    ranks: Ranks
    label: str | None  # the split's name (the progress bar's); None for a single corpus
    corpus: C.CorpusFiles
    fingerprint: dict  # `corpus_fingerprint`: file checksums and the record count
    fresh: Provenance  # this run's provenance (`build_provenance`); a resumed dataset keeps its own
    root: str  # the dataset root: an absolute local path, or the URI of an object store
    entered: float  # perf_counter when the split started: the summary's startup_seconds count from here
    created: list[str]  # what a start that commits nothing removes again (grows as files are made)

    @property
    def names(self) -> dict:
        """This rank's file names in the dataset (`Ranks.names`)."""
        return self.ranks.names


def extract_split(
    inputs: SplitInputs, target: Target, ranks: Ranks, mask: MaskChoice, label: str | None = None
) -> dict:
    """Extract one corpus into `inputs.cfg.out_dir` (this rank's share), then merge if all ranks are
    done. `mask`: the mask token of the whole run (`extract.corpus.mask_token`)."""
    entered = time.perf_counter()  # the summary's startup_seconds count from here
    cfg, corpus = inputs.cfg, inputs.corpus
    root = local_dir(cfg.out_dir)
    if corpus.skipped:
        log.warning(
            "corpus %s: %d files not read: %s", cfg.corpus, len(corpus.skipped), describe_skipped(corpus.skipped)
        )
    fresh = build_provenance(cfg, target, corpus, inputs.fingerprint, inputs.regeneration, mask)
    remote = "://" in root  # an object store: no directories to make or remove
    created = [] if remote else _missing_dirs(root)
    if not remote:
        os.makedirs(root, exist_ok=True)
    split = SplitRun(cfg, target, ranks, label, corpus, inputs.fingerprint, fresh, root, entered, created)
    fs, fs_root = resolve(root)
    try:
        with lock_manifest(
            fs, fs_root, split.names["manifest"]
        ):  # one writer per rank of a dataset; released by the OS on a crash (a lease on an object store)
            return _extract_locked(split)
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


def _extract_locked(split: SplitRun) -> dict:
    """One split under this rank's manifest lock: nothing to do if complete, else plan (resume point,
    config, projection, writer), run the windows, commit, merge if this is the last rank; its summary."""
    cfg, ranks, root, names = split.cfg, split.ranks, split.root, split.names
    fs, fs_root = resolve(root)
    done = already_complete(fs, root, split.fresh)
    if done is not None:
        log.info("%s: already complete (%d samples); nothing to do", root, done["counts"]["samples"])
        if not exists_at(join_uri(root, SUMMARY_FILE)):  # killed between manifest.json and summary.json
            with lock_manifest(fs, fs_root, FINAL_MANIFEST, wait_seconds=MERGE_WAIT_SECONDS):
                remove_merge_leftovers(root)
                return write_summary(root, done)
        return summarize_dataset(root, done, this_run=None)

    start = resume_point(fs, fs_root, root, split.fresh, ranks)
    if start.new:
        split.created += [join_uri(root, n) for n in (names["manifest"], names["rejects"])]
    config_path = join_uri(root, CONFIG_FILE)
    if ranks.rank == 0:
        if not exists_at(config_path):
            split.created.append(config_path)
        save_config(cfg, config_path)

    # Storage tier with projection: P is settled (calibration pass, or reused) before any shard.
    projection, projection_entry = ensure_projection(cfg, split.target, ranks, root)
    hidden_width = projection.out_width if projection is not None else len(cfg.layer_ids) * split.target.hidden_size
    started = time.time()
    try:
        with ShardWriter(
            root,
            provenance=start.provenance,
            hidden_width=hidden_width,
            topk=cfg.topk,
            manifest_name=names["manifest"],
            shard_prefix=names["prefix"],
            hidden_split=start.hidden_split,
            shard_bytes=cfg.shard_bytes,
            zstd_level=cfg.zstd_level,
            hidden_encoding=cfg.hidden_encoding,
            projection=projection_entry,
        ) as writer:
            _record_run_start(writer, split, start.stage_state, started)
            rejects = open_reject_log(join_uri(root, names["rejects"]), int(writer.stage_state.get("rejects_bytes", 0)))
            writer.before_save.append(rejects.upload)  # an object store's rejects object: before the manifest
            try:
                run_stats = _extract_into(split, writer, rejects)
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
        _discard_if_empty(root, names, split.created)
        raise
    # The last shard is committed as the writer closes: count it in the run's time and commit share.
    run_stats["seconds"] = time.time() - started
    run_stats["commit_seconds"] = writer.commit_seconds
    run_stats["writer_timings"] = dict(writer.timings)
    check_coverage(manifest, run_stats)
    log_run(ranks, run_stats)
    merged = finish_ranks(root, ranks)
    if merged is None:
        return summarize_dataset(root, load_manifest(fs, fs_root, names["manifest"]), this_run=run_stats, partial=True)
    return summarize_dataset(root, merged, this_run=run_stats)


def _record_run_start(writer: ShardWriter, split: SplitRun, stage_state: dict, started: float) -> None:
    """This rank's stage state in the manifest: the world, and this run appended to the runs so far."""
    writer.stage_state["world_size"] = split.ranks.world
    writer.stage_state["rank"] = split.ranks.rank
    runs = list(stage_state.get("runs", []))
    runs.append(
        {
            "started": _iso(started),
            "config_digest": json_digest(config_to_dict(split.cfg)),
            "runtime": _runtime_keys(split.cfg),
        }
    )
    writer.stage_state["runs"] = runs


def _discard_if_empty(root: str, names: dict, created: list) -> None:
    """After a failed start: remove the files this run created if it committed nothing (a rerun then
    starts afresh with whatever settings it is given, and an out_dir this run made disappears)."""
    fs, fs_root = resolve(root)
    try:
        if not holds_nothing(load_manifest(fs, fs_root, names["manifest"])):
            return
    except (ValueError, OSError):
        return  # unreadable or absent: leave everything for a person to look at
    for path in created:
        if "://" in path or not os.path.isdir(path):
            with contextlib.suppress(FileNotFoundError):
                remove_at(path)


def has_committed_work(cfg: ExtractConfig, ranks: Ranks) -> bool:
    """Whether any dataset of `cfg` holds committed work of this rank (something a rerun resumes)."""
    for split_cfg in cfg.split_configs().values():
        try:
            fs, fs_root = resolve(local_dir(split_cfg.out_dir))
            if not holds_nothing(load_manifest(fs, fs_root, ranks.names["manifest"])):
                return True
        except (ValueError, OSError):
            continue
    return False


def _extract_into(split: SplitRun, writer: ShardWriter, rejects: RejectLog) -> dict:
    """The forward loop: this rank's windows through the target (`Capturer`) and the host path into
    `writer`; the run's counters and timings."""
    cfg = split.cfg
    loop = _forward_loop(split, writer, rejects)
    host_path, progress, stats = loop.host_path, loop.progress, loop.stats
    reading = windows.Prefetch(windows.read_windows(cfg, split.corpus, loop.builder, split.ranks), depth=2)
    try:
        for window in reading:
            stats["records_owned"] += window.records_owned
            loop.run_window(window)
        launched_all = time.perf_counter()
        host_path.finish()
        # Fixed costs around the forwards, which a long run amortizes: setting up until the first
        # forward is launched, and writing what is still in flight after the last one is launched.
        stats["startup_seconds"] = stats.pop("first_launch_at", launched_all) - split.entered
        stats["drain_seconds"] = time.perf_counter() - launched_all
    except BaseException:
        reading.close()
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


@dataclasses.dataclass
class ForwardLoop:
    """The parts of one split's forward loop (`_forward_loop` builds them): a window's micro-batches
    launched on the device, then handed to the host path."""

    cfg: ExtractConfig
    builder: C.SampleBuilder
    capturer: Capturer
    host_path: HostPath
    progress: Progress
    stats: dict  # this run's counters (records_owned, samples, tokens, batches, ...)
    is_done: Callable[[TokenizedSample], bool]  # the dataset already holds it (committed or rejected)
    pad_id: int

    def run_window(self, window: windows.Window) -> None:
        cfg, host_path, progress, stats = self.cfg, self.host_path, self.progress, self.stats
        lengths = [s.n_tokens for s in window.samples]
        total_tokens = sum(lengths)
        rejects_share = window.span if not total_tokens else 0.0
        host_path.put_rejects(window.rejects, rejects_share)
        plan = plan_packed_micro_batches if cfg.packing else plan_micro_batches
        for batch in plan(lengths, cfg.tokens_per_batch):
            samples = [window.samples[i] for i in batch]
            share = window.span * sum(lengths[i] for i in batch) / total_tokens
            to_write = [not self.is_done(s) for s in samples]
            if not any(to_write):
                stats["skipped_batches"] += 1
                progress.skipped(len(samples))
                progress.advance(share)
                continue
            host = host_path.acquire()
            stats.setdefault("first_launch_at", time.perf_counter())
            sequences = [torch.from_numpy(s.input_ids) for s in samples]
            if cfg.packing:
                input_ids_BT, batch_lengths = collate_packed(sequences)
            else:
                input_ids_BT, batch_lengths = collate_right_padded(sequences, self.pad_id)
            inflight = self.capturer.launch(input_ids_BT, batch_lengths, host, packed=cfg.packing)
            stats["batches"] += 1
            stats["padded_tokens"] += int(input_ids_BT.numel())
            stats["budget_tokens"] += cfg.tokens_per_batch
            host_path.put_batch(inflight, samples, to_write, share)


def _forward_loop(split: SplitRun, writer: ShardWriter, rejects: RejectLog) -> ForwardLoop:
    """The tokenizer's policy, the capturer (with the dataset's storage tier), the pinned buffers, the
    progress bar and the host path of one split, set to write into `writer`."""
    cfg, target, ranks = split.cfg, split.target, split.ranks
    tokenizer = target.tokenizer
    policy = C.SamplePolicy(
        cfg.max_len,
        cfg.length_policy,
        cfg.min_loss_tokens,
        cfg.chat_template_kwargs,
        target.vocab_size,
        provenance_of(writer.manifest).tokenizer.mask_token_id,
    )
    builder = C.SampleBuilder(tokenizer, policy)
    committed, done_positions = writer.committed_ids(), set(rejects.positions)
    n_taps = len(cfg.layer_ids)
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    stats = {
        "records_owned": 0,
        "samples": 0,
        "tokens": 0,
        "batches": 0,
        "skipped_batches": 0,
        "padded_tokens": 0,
        "budget_tokens": 0,
    }
    desc = f"extract {split.label or os.path.basename(cfg.out_dir)}" + (
        f" rank {ranks.rank}/{ranks.world}" if ranks.world > 1 else ""
    )
    progress = Progress(split.fingerprint["records"], desc, enabled=cfg.progress and ranks.rank == 0)
    capturer = Capturer(
        target,
        cfg.layer_ids,
        cfg.topk,
        cfg.logits_chunk,
        cfg.launch_ahead_layers,
        tier=tier_for(writer, target.output_device),
    )
    if cfg.packing and capturer.tier is not None:  # a tier the dataset already holds, which the config may not name
        raise ValueError(
            "packing: not with a storage tier yet (its error sums are kept per row); run with packing=false"
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
    return ForwardLoop(cfg, builder, capturer, host_path, progress, stats, is_done, pad_id)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def _runtime_keys(cfg: ExtractConfig) -> dict:
    data = config_to_dict(cfg)
    return {k: v for k, v in data.items() if k not in DATASET_KEYS}
