"""Finding a corpus: a path -> its files (`CorpusFiles`), each with its format and the extent that
will be read.

A corpus is a file, a directory, a glob, or a directory written by `datasets.Dataset.save_to_disk`.
Each file is read by its own format, told by its name: `.jsonl` (also `.jsonl.gz`, `.jsonl.bz2`,
`.jsonl.zst`) or `.parquet`, so one directory may mix them. `corpus_format = jsonl | parquet`
reads every file in that format (for names without a known suffix); a file whose name says the
other format is then refused rather than read as garbage. A directory's own files are read, not
its subdirectories; what is not read is listed with the reason (`CorpusFiles.skipped`). A
regeneration's output directory is read from its data file alone (`regenerated`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

from extract.corpus.regenerated import regeneration_of
from extract.corpus.streams import parquet_file

JSONL_SUFFIXES = (
    ".jsonl",
    ".jsonl.gz",
    ".jsonl.zst",
    ".jsonl.bz2",
    ".ndjson",
    ".ndjson.gz",
    ".ndjson.zst",
    ".ndjson.bz2",
)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst")


@dataclasses.dataclass
class CorpusFiles:
    format: str  # jsonl | parquet | mixed (both, each file by its name) | datasets
    files: list[str]  # the data files, in reading order (for `datasets`: the directory's files)
    root: str  # the path as given
    kinds: list[str] = dataclasses.field(default_factory=list)  # per file: jsonl | parquet (empty for `datasets`)
    # Files of a corpus directory that are not read, as {"name", "reason"} (listed in the provenance
    # and the summary: nothing is left out in silence).
    skipped: list[dict] = dataclasses.field(default_factory=list)
    # The extent read of each file: its size (and modification time) when it was found. Reading,
    # counting and checksumming stop there, so lines appended during a run are not read and the
    # fingerprint describes exactly what was (see `ExtentReader`).
    extents: list[int] = dataclasses.field(default_factory=list)
    mtimes: list[int] = dataclasses.field(default_factory=list)
    # xxh3-128 of each file's extent, once the fingerprint is taken: a file read to its end is
    # checked against it, so one rewritten while it was read stops the run.
    checksums: list[str] | None = None


def find_corpus(path: str, corpus_format: str = "auto") -> CorpusFiles:
    """Resolve a corpus path (file, directory, glob or saved `datasets` dir) into its files and the
    format of each; ValueError naming the path (or file) when that cannot be done."""
    regenerated = regeneration_of(path)
    if regenerated is not None:  # a regeneration's output directory: its data file only, not its journals or rejects
        path = regenerated[0]
    skipped: list[dict] = []
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise ValueError(f"corpus: the pattern '{path}' matches no files")
    elif os.path.isdir(path):
        _refuse_dataset_dict(path)
        if corpus_format in ("auto", "datasets") and _is_saved_dataset(path):
            files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs)
            return CorpusFiles("datasets", files, path)
        if corpus_format == "datasets":
            raise ValueError(
                f"corpus: '{path}' is not a saved `datasets` directory (no dataset_info.json / state.json)"
            )
        files, skipped = _directory_files(path, corpus_format)
        if not files:
            listed = "; ".join(f"{s['name']} ({s['reason']})" for s in skipped[:5])
            raise ValueError(
                f"corpus: directory '{path}' holds no {' / '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} files"
                + (f" (skipped: {listed}{'; ...' if len(skipped) > 5 else ''})" if skipped else "")
            )
    elif os.path.isfile(path):
        files = [path]
    elif os.path.exists(path):
        raise ValueError(f"corpus: '{path}' is neither a file nor a directory")
    else:
        raise ValueError(f"corpus: '{path}' does not exist")
    if corpus_format == "datasets":
        raise ValueError(f"corpus: corpus_format = datasets needs a saved dataset directory, got '{path}'")
    for file in files:
        check_file_name(file)
    kinds = [_file_kind(f, path, corpus_format) for f in files]
    found = sorted(set(kinds))
    corpus = CorpusFiles(found[0] if len(found) == 1 else "mixed", files, path, kinds, skipped)
    for file in files:
        stat = os.stat(file)
        corpus.extents.append(stat.st_size)
        corpus.mtimes.append(stat.st_mtime_ns)
    for file, kind in zip(files, kinds, strict=True):
        if kind == "parquet":
            parquet_file(file)  # the footer: a file that is no Parquet is named now, before any work
    return corpus


def _directory_files(path: str, corpus_format: str) -> tuple[list[str], list[dict]]:
    """The files of a corpus directory that are read (its own regular files, not hidden, whose name
    says their format, or all of them under an explicit corpus_format) and the others with the
    reason each is skipped. Subdirectories are not entered: a glob names deeper files."""
    files, skipped = [], []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        check_file_name(full)
        if name.startswith("."):
            skipped.append({"name": name, "reason": "hidden (its name starts with '.')"})
        elif os.path.isdir(full):
            skipped.append(
                {
                    "name": name + "/",
                    "reason": "a subdirectory (only the directory's own files are read; "
                    f"name deeper files with a glob such as '{os.path.join(path, '**', '*.jsonl')}')",
                }
            )
        elif not os.path.isfile(full):
            skipped.append({"name": name, "reason": "not a regular file"})
        elif corpus_format == "auto" and data_kind(name) is None:
            skipped.append(
                {
                    "name": name,
                    "reason": "its name has no known suffix (set corpus_format = jsonl or parquet to read "
                    "every file of the directory in that format)",
                }
            )
        else:
            files.append(full)
    return files, skipped


def check_file_name(path: str) -> None:
    """ValueError unless the file's name is valid text (it is recorded in the provenance and in
    every reject's source)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(path)
        raise ValueError(
            f"corpus: the file name {raw!r} is not valid UTF-8 (it is recorded in the dataset's provenance and "
            "rejects); rename it"
        ) from None


def _refuse_dataset_dict(path: str) -> None:
    """A `DatasetDict.save_to_disk` directory holds one directory per split: name one of them."""
    marker = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(marker):
        return
    try:
        with open(marker, encoding="utf-8") as f:
            splits = ", ".join(json.load(f).get("splits", [])) or "unknown"
    except (OSError, ValueError, AttributeError):
        splits = "unknown"
    raise ValueError(
        f"corpus: '{path}' is a `datasets` DatasetDict with several splits ({splits}); point `corpus` at one "
        f"split's directory, e.g. '{os.path.join(path, splits.split(', ')[0])}'"
    )


def _file_kind(file: str, path: str, corpus_format: str) -> str:
    named = data_kind(os.path.basename(file))
    if corpus_format == "auto":
        if named is None:
            raise ValueError(
                f"corpus: cannot tell the format of '{file}' from its name (known: "
                f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}); "
                "set corpus_format = jsonl or parquet"
            )
        return named
    if named is not None and named != corpus_format:
        raise ValueError(
            f"corpus: corpus_format = {corpus_format}, but '{file}' is a {named} file by its name; "
            f"use corpus_format = auto to read each file of '{path}' by its own format"
        )
    return corpus_format


def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def data_kind(name: str) -> str | None:
    """jsonl | parquet from a file name (its suffix in any case), or None."""
    name = name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def describe_skipped(skipped: list[dict], limit: int = 8) -> str:
    """'a.json (reason), sub/ (reason), ... and N more' for the files a corpus directory does not read."""
    shown = "; ".join(f"{s['name']} ({s['reason']})" for s in skipped[:limit])
    return shown + (
        f"; and {len(skipped) - limit:,} more (see the manifest's provenance)" if len(skipped) > limit else ""
    )
