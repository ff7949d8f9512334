"""One regeneration run: check the inputs, load the tokenizer (and the target for `local`), read the
corpus, skip what the journals hold, answer the rest through the backend, write each finished
record to the journal, print the summary, and commit the corpus when every record is finished.

    summary = run(cfg)            # this rank's summary; raises ValueError (user error), ServerStop, OSError
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator

import torch

from common.config import config_to_dict, fail
from common.hashing import json_digest, template_digest, tokenizer_digest
from common.io import atomic_write_json, join_uri
from common.provenance import provenance as tool_provenance
from extract.checks import check_out_dir
from extract.corpus.files import CorpusFiles, describe_skipped, find_corpus
from extract.corpus.reading import corpus_fingerprint, iter_records
from extract.ranks import Ranks
from extract.regenerate import store
from extract.regenerate.answer_checks import (
    MOST,
    check_answer_end,
    round_trip_share,
    round_trip_warning,
    round_trip_words,
)
from extract.regenerate.config import RegenerateConfig, dataset_keys
from extract.regenerate.conversation import Conversation, Renderer
from extract.regenerate.local import LocalGenerator, Sampling, answer_window
from extract.regenerate.server import ServerBackend, ServerStop, chunked_prefill_advice
from target.arch import check_architecture
from target.chat_template import with_chat_template
from target.checkpoint import read_config, text_config
from target.files import check_target_files
from target.identity import weights_digest
from target.load import load_target

log = logging.getLogger(__name__)

FORMAT = "dflash-offline regenerated corpus"
VERSION = 1


@dataclasses.dataclass
class RankInfo:
    rank: int = 0
    world: int = 1
    ranks: object = None  # extract.ranks.Ranks under torchrun (barrier)

    def barrier(self) -> None:
        if self.ranks is not None:
            self.ranks.barrier()


class Incomplete(Exception):
    """The run ended with records not finished (failed requests): the journal holds the rest; rerun."""


def check_inputs(cfg: RegenerateConfig) -> CorpusFiles:
    """ValueError naming the problem before any model or server is touched."""
    # The tokenizer renders every prompt; the weights are read only by the local backend.
    check_target_files(cfg.target, weights=cfg.backend == "local")
    corpus = find_corpus(cfg.corpus, cfg.corpus_format)
    out = out_location(cfg)
    if not store.on_object_store(out) and any(os.path.abspath(f).startswith(out + os.sep) for f in corpus.files):
        raise ValueError(f"out: '{cfg.out}' holds the corpus being read; write the regenerated corpus elsewhere")
    check_out_dir(cfg.out, "out")
    context_limit(cfg)  # a max_context above the target's own is refused now
    return corpus


def out_location(cfg: RegenerateConfig) -> str:
    """The output directory as an absolute local path, or the object store URI as given (s3://...)."""
    return cfg.out if store.on_object_store(cfg.out) else os.path.abspath(cfg.out)


def context_limit(cfg: RegenerateConfig) -> int | None:
    """Tokens a prompt and its answer may take: the target's max_position_embeddings, or the smaller
    `max_context`; None when neither is known. ConfigError for a max_context above the target's."""
    try:
        own = text_config(cfg.target).get("max_position_embeddings")
    except (OSError, ValueError):
        own = None
    own = int(own) if isinstance(own, int) and own > 0 else None
    if cfg.max_context is None:
        return own
    if own is not None and cfg.max_context > own:
        fail(
            "max_context",
            f"{cfg.max_context} exceeds the target's max_position_embeddings ({own}); leave it unset to use the "
            "target's, or set a smaller value",
        )
    return cfg.max_context


def target_fingerprint(target_dir: str, tokenizer) -> dict:
    config = read_config(target_dir)
    return {
        "name_or_path": os.path.abspath(target_dir),
        "config_hash": json_digest(config),
        "architecture": (config.get("architectures") or [None])[0],
        "model_type": config.get("model_type"),
        "weights_digest": weights_digest(target_dir),
        "tokenizer_hash": tokenizer_digest(tokenizer),
        "chat_template_hash": template_digest(tokenizer),
    }


def journal_header(cfg: RegenerateConfig, target: dict, fingerprint: dict) -> dict:
    """What decides the corpus: a resume must match it exactly."""
    return {
        "settings": dataset_keys(cfg),
        "target": {k: v for k, v in target.items() if k != "name_or_path"},
        "corpus": {"hash": fingerprint["hash"]},
    }


def run(cfg: RegenerateConfig, *, model=None, tokenizer=None) -> dict:
    """Regenerate `cfg.corpus` into `cfg.out`; returns this rank's summary (`model`/`tokenizer`: already loaded
    ones)."""
    entered = time.perf_counter()
    corpus = check_inputs(cfg)
    if model is None:  # a family DFlash cannot serve: refused before anything is generated
        check_architecture(cfg.target, cfg.trust_remote_code)
    info = rank_info()
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.target, trust_remote_code=cfg.trust_remote_code)
    tokenizer = with_chat_template(tokenizer, cfg.chat_template)
    renderer = Renderer(tokenizer, cfg.thinking, cfg.generation_template_kwargs(), cfg.extraction_template_kwargs())
    check_answer_end(cfg.target, tokenizer, cfg.generation_template_kwargs(), cfg.max_new_tokens)  # before any answer
    fingerprint = corpus_fingerprint(corpus, cfg.max_records)
    if corpus.skipped:
        log.warning(
            "corpus %s: %d files not read: %s", cfg.corpus, len(corpus.skipped), describe_skipped(corpus.skipped)
        )
    target = target_fingerprint(cfg.target, tokenizer)
    out = out_location(cfg)
    if not store.on_object_store(out):
        os.makedirs(out, exist_ok=True)
    backend = None
    if cfg.backend == "server":
        advice = chunked_prefill_advice(cfg.target)
        if advice:
            log.warning("%s", advice)
        backend = ServerBackend(cfg, renderer)
        backend.open()
        try:
            cfg = dataclasses.replace(cfg, model=asyncio.run(_resolved_model(backend)))
        except ServerStop as err:  # nothing done yet: a URL, model name or key to fix
            raise ValueError(f"server: {err}") from None
    header = journal_header(cfg, target, fingerprint)
    done = store.is_complete(out)
    if done is not None:
        problems = store.header_problems(done.get("journal_header"), header)
        if problems:
            raise ValueError(
                f"{out}: holds a finished regenerated corpus made with other settings: "
                + "; ".join(problems)
                + ". Choose another out directory."
            )
        log.info("%s: already complete (%d records stored); nothing to do", out, done["counts"]["stored"])
        return {"complete": True, "already_complete": True, "counts": done["counts"], "out": out}
    with store.lock_rank(out, info.rank) as lock:
        journal = store.open_journal(out, info.rank, header, cfg.fsync_every_s, lock)
        try:
            summary = _answer_rank(cfg, corpus, fingerprint, renderer, journal, info, backend, model, entered)
        finally:
            journal.close()
        summary["torn_bytes_discarded"] = journal.torn_bytes
        summary["config"] = config_to_dict(cfg)
        summary["skipped_files"] = list(corpus.skipped)
        info.barrier()
        if info.rank == 0:
            summary.update(_commit_if_finished(cfg, out, corpus, fingerprint, target, header, summary, lock))
        _write_summary(out, info, summary)
    return summary


async def _resolved_model(backend) -> str:
    try:
        return await backend.resolve_model()
    finally:
        await backend.close()  # the clients are made again inside the run's own event loop


def rank_info() -> RankInfo:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return RankInfo()
    ranks = Ranks.from_env()
    return RankInfo(ranks.rank, ranks.world, ranks)


# ----------------------------------------------------------------------------------------------
# This rank's records


class Tally:
    """This run's counts, the progress bar and the journal writes."""

    def __init__(self, journal: store.Journal, total: int | None, enabled: bool, desc: str):
        from tqdm.auto import tqdm

        self.journal = journal
        self.counts = {
            "records_seen": 0,
            "records_owned": 0,
            "already_done": 0,
            "stored": 0,
            "rejected": 0,
            "failed": 0,
            "answers": 0,
            "answer_tokens": 0,
            "prompt_tokens": 0,
            "answers_at_cap": 0,
            "answers_cut": 0,
            "round_trip_tokens": 0,
            "round_trip_cut_tokens": 0,
        }
        self.rejected_by_reason: dict[str, int] = {}
        self.failures: list[dict] = []
        self.bar = tqdm(total=total, desc=desc, unit="rec", disable=not enabled, dynamic_ncols=True, smoothing=0.05)
        self.started = time.perf_counter()

    def finished(self, conversation: Conversation) -> None:
        outcome = conversation.outcome
        assert outcome is not None
        self.journal.append(outcome.journal_entry())
        stats = outcome.stats
        for key in ("round_trip_tokens", "round_trip_cut_tokens"):  # stored and rejected records alike
            self.counts[key] += stats.get(key, 0)
        if outcome.record is not None:
            self.counts["stored"] += 1
            for key, name in (
                ("answers", "answers"),
                ("answer_tokens", "answer_tokens"),
                ("prompt_tokens", "prompt_tokens"),
                ("at_cap", "answers_at_cap"),
                ("cut", "answers_cut"),
            ):
                self.counts[name] += stats.get(key, 0)
        else:
            self.counts["rejected"] += 1
            self.rejected_by_reason[outcome.reason] = self.rejected_by_reason.get(outcome.reason, 0) + 1
        self._advance()

    def failed(self, conversation: Conversation, detail: str) -> None:
        self.counts["failed"] += 1
        entry = {
            "id": conversation.record_id,
            "position": conversation.position,
            "source": conversation.source,
            "status": "failed",
            "detail": detail,
        }
        self.journal.append(entry)
        if len(self.failures) < 20:
            self.failures.append(entry)
        self._advance()

    def _advance(self) -> None:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        self.bar.update(1)
        postfix = {"tok/s": f"{self.counts['answer_tokens'] / seconds:,.0f}"}
        if self.counts["rejected"]:
            postfix["rejected"] = self.counts["rejected"]
        if self.counts["failed"]:
            postfix["failed"] = self.counts["failed"]
        self.bar.set_postfix(postfix, refresh=False)


def _conversations(
    cfg, corpus, renderer, info: RankInfo, tally: Tally, done: set[str], seen: list
) -> Iterator[Conversation]:
    """This rank's conversations that still need answers; bad records go to the journal at once."""
    limit = context_limit(cfg)
    for raw in iter_records(corpus, streaming=cfg.streaming, max_records=cfg.max_records):
        seen[0] += 1
        if raw.position % info.world != info.rank:
            continue
        tally.counts["records_owned"] += 1
        conversation = Conversation(raw, renderer, cfg.at_cap, limit)
        if conversation.record_id in done:
            tally.counts["already_done"] += 1
            tally.bar.update(1)
            continue
        if conversation.outcome is not None:
            tally.finished(conversation)
            continue
        yield conversation


def _answer_rank(cfg, corpus, fingerprint, renderer, journal, info: RankInfo, backend, model, entered: float) -> dict:
    done = store.done_ids(out_location(cfg))
    total = fingerprint["records"]
    tally = Tally(
        journal,
        None if total is None else -(-total // info.world),
        cfg.progress and info.rank == 0,
        f"regenerate ({cfg.backend})" + (f" rank {info.rank}/{info.world}" if info.world > 1 else ""),
    )
    journal.append(
        {
            "status": "run",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rank": info.rank,
            "world_size": info.world,
            "backend": cfg.backend,
            "urls": list(cfg.urls),
            "model": cfg.model,
        }
    )
    seen = [0]
    conversations = _conversations(cfg, corpus, renderer, info, tally, done, seen)
    stop = None
    try:
        if cfg.backend == "local":
            backend_stats = _run_local(cfg, renderer, conversations, tally, info, model)
        else:
            backend_stats, stop = _run_server(backend, conversations, tally)
    finally:
        tally.bar.close()
    seconds = time.perf_counter() - tally.started
    counts = tally.counts
    counts["records_seen"] = seen[0]
    summary = {
        "rank": info.rank,
        "world_size": info.world,
        "backend": cfg.backend,
        "out": out_location(cfg),
        "counts": counts,
        "rejected_by_reason": tally.rejected_by_reason,
        "failures": tally.failures,
        "seconds": round(seconds, 3),
        "startup_seconds": round(tally.started - entered, 3),
        "records_per_s": round((counts["stored"] + counts["rejected"]) / max(seconds, 1e-9), 3),
        "answer_tokens_per_s": round(counts["answer_tokens"] / max(seconds, 1e-9), 1),
        **backend_stats,
        "stopped": stop,
        "complete": False,
    }
    if stop is None and counts["failed"] == 0:
        journal.append({"status": "run_finished", "rank": info.rank, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return summary


def _run_local(cfg, renderer, conversations: Iterator[Conversation], tally: Tally, info: RankInfo, model) -> dict:
    if model is None:
        model = load_local_model(cfg, info)
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    generator = LocalGenerator(
        model,
        renderer.tokenizer,
        cfg.max_new_tokens,
        cfg.batch_size,
        Sampling(cfg.temperature, cfg.top_p, cfg.top_k),
        cfg.seed,
        cache=cfg.cache,
    )
    batches = 0
    window: list[Conversation] = []

    def flush() -> None:
        nonlocal batches
        answer_window(window, generator)
        for conversation in window:
            tally.finished(conversation)
        batches += 1
        window.clear()

    for conversation in conversations:
        window.append(conversation)
        if len(window) >= cfg.window_records:
            flush()
    if window:
        flush()
    return {
        "windows": batches,
        "device": str(model.get_input_embeddings().weight.device),
        "dtype": str(next(model.parameters()).dtype),
    }


def load_local_model(cfg: RegenerateConfig, info: RankInfo):
    device = cfg.device
    if device == "auto":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', info.rank))}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', info.rank))}"
    target = load_target(
        cfg.target,
        dtype=cfg.dtype,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
        device=device,
    )
    return target.model


def _run_server(backend, conversations: Iterator[Conversation], tally: Tally) -> tuple[dict, str | None]:
    async def go() -> str | None:
        backend.open()
        try:
            first = next(conversations, None)
            if first is None:
                return None
            await backend.preflight(first)
            await backend.run(_chain(first, conversations), tally.finished, tally.failed)
            return None
        except ServerStop as err:
            return str(err)
        finally:
            await backend.close()

    stop = asyncio.run(go())
    stats = dataclasses.asdict(backend.stats)
    stats["model"] = backend.model
    return stats, stop


def _chain(first, rest):
    yield first
    yield from rest


# ----------------------------------------------------------------------------------------------
# Commit and summary


def _commit_if_finished(cfg, out: str, corpus, fingerprint, target: dict, header: dict, summary: dict, lock) -> dict:
    """Commit the corpus if every record is finished (in every journal); else say what is left."""
    records = summary["counts"]["records_seen"]  # every rank reads every record (and owns its share)
    finished = len(store.done_ids(out))
    if finished < records:
        return {"complete": False, "finished_records": finished, "total_records": records}
    runs = [run for scan in store.scan_all(out).values() for run in scan.runs]
    provenance = build_provenance(cfg, corpus, fingerprint, target, header, runs)
    counts = store.commit_corpus(out, records, provenance, lock)
    return {"complete": True, "finished_records": records, "total_records": records, "corpus_counts": counts}


def build_provenance(
    cfg: RegenerateConfig, corpus, fingerprint: dict, target: dict, header: dict, runs: list[dict]
) -> dict:
    """regenerate.json: what extraction carries into its manifest (docs/regenerate.md)."""
    urls = sorted({url for run in runs for url in run.get("urls", [])})
    backend = {
        "kind": cfg.backend,
        "model": cfg.model or None,
        "api": cfg.api if cfg.backend == "server" else None,
        "endpoints": urls,
        "world_sizes": sorted({run.get("world_size", 1) for run in runs}),
    }
    if cfg.backend == "local":
        backend.update(dtype=cfg.dtype, device=cfg.device)
    return {
        "format": FORMAT,
        "version": VERSION,
        "data_file": store.DATA_FILE,
        "rejects_file": store.REJECTS_FILE,
        "target": target,
        "backend": backend,
        "sampling": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "seed": cfg.seed,
            "at_cap": cfg.at_cap,
        },
        "thinking": {"mode": cfg.thinking, "generation_chat_template_kwargs": cfg.generation_template_kwargs()},
        "chat_template_kwargs": cfg.extraction_template_kwargs(),
        "chat_template_file": cfg.chat_template,  # None: the tokenizer's own (target.chat_template_hash either way)
        "corpus": {
            "source": cfg.corpus,
            "format": corpus.format,
            "hash": fingerprint["hash"],
            "files": fingerprint["files"],
            "records": fingerprint["records"],
            **({"skipped": fingerprint["skipped"]} if fingerprint.get("skipped") else {}),
        },
        "config": config_to_dict(cfg),
        "journal_header": header,
        "runs": runs,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **tool_provenance(),
    }


def _write_summary(out: str, info: RankInfo, summary: dict) -> None:
    name = store.SUMMARY_FILE if info.world == 1 else f"summary.rank{info.rank:03d}.json"
    atomic_write_json(join_uri(out, name), summary)


def format_summary(summary: dict) -> str:
    if summary.get("already_complete"):
        c = summary["counts"]
        return (
            f"{summary['out']}: already complete: {c['stored']:,} records stored, {c['rejected']:,} rejected; "
            "nothing to do"
        )
    c = summary["counts"]
    lines = [
        f"regenerated {c['stored'] + c['rejected']:,} records this run in {summary['seconds']:.1f} s "
        f"({summary['records_per_s']:.2f} records/s): "
        f"{c['stored']:,} stored, {c['rejected']:,} rejected, {c['failed']:,} failed; {c['already_done']:,} were "
        "already done",
        f"answers: {c['answers']:,} ({c['answer_tokens']:,} tokens, {summary['answer_tokens_per_s']:,.0f} tok/s; "
        f"prompts {c['prompt_tokens']:,} tokens); "
        f"{c['answers_at_cap']:,} reached max_new_tokens, {c['answers_cut']:,} cut to what the template and "
        f"tokenizer give back ({round_trip_words(c)})",
    ]
    if round_trip_share(c) > MOST:
        lines.append(f"WARNING: {round_trip_warning(c)}")
    if summary.get("rejected_by_reason"):
        lines.append("rejected: " + ", ".join(f"{k} {v:,}" for k, v in sorted(summary["rejected_by_reason"].items())))
    if "requests" in summary:
        lines.append(
            f"requests: {summary['requests']:,} ({summary['retries']:,} retries) to "
            + ", ".join(f"{url} {n:,}" for url, n in summary["by_url"].items())
            + f"; model {summary.get('model')!r}"
        )
    if summary.get("skipped_files"):
        skipped = summary["skipped_files"]
        lines.append(f"skipped: {len(skipped):,} files of the corpus directory, not read: {describe_skipped(skipped)}")
    if summary.get("torn_bytes_discarded"):
        lines.append(f"resumed after a kill: discarded {summary['torn_bytes_discarded']} bytes of a torn journal line")
    if summary.get("stopped"):
        lines.append(f"STOPPED: {summary['stopped']}")
    for failure in summary.get("failures", [])[:5]:
        lines.append(f"failed: {failure['source']}: {failure['detail']}")
    if summary.get("complete"):
        cc = summary["corpus_counts"]
        lines.append(
            f"committed {os.path.join(summary['out'], store.DATA_FILE)}: {cc['stored']:,} records "
            f"({cc['rejected']:,} rejected, listed in {store.REJECTS_FILE}); provenance in {store.PROVENANCE_FILE}"
        )
    elif summary.get("rank", 0) == 0 and "total_records" in summary:
        lines.append(
            f"not complete: {summary['finished_records']:,} of {summary['total_records']:,} records finished; "
            "rerun the same command to finish the rest"
        )
    return "\n".join(lines)


def summary_json(summary: dict) -> str:
    return json.dumps(summary, indent=2, sort_keys=True)
