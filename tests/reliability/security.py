"""Scenario 6: security.

- Load sites, by reading the source (AST) of common/, shards/, extract/, train/: every
  `torch.load` passes `weights_only=True`; nothing imports pickle-like modules or calls
  `np.load(allow_pickle=True)`; no call passes `trust_remote_code=True` (the user's
  `trust_remote_code` knob is passed through); model weights are read with safetensors.
- Behaviour: a checkpoint whose optimizer.pt is a pickle that runs code (and whose state.json
  lists its checksum, as an attacker would) is refused and the code never runs; a shard whose
  schema carries a pickled Arrow extension type is refused by verify and never unpickled by the
  reader; a target or an exported drafter shipping Python code is never executed unless the user
  sets trust_remote_code.
- Paths: what a tool may write is decided per tool, and checked by running it from an empty
  working directory and listing every file that appeared:
    extract: only under `out_dir` (split NAME under out_dir/NAME; names that could leave it are refused);
    train:   only under `out_dir/run_name` (run names are plain names); a resumed run never writes
             into the run or the shards it reads from;
    shards merge: only a manifest inside the dataset directory (`--out` is a plain file name);
    export: only OUT_DIR and its temporary sibling; an unrelated non-empty directory is refused.
Figure: checks passed.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.cli import call_main
from tests.reliability.outcome import Outcome
from tests.reliability.world import REPO, World

PACKAGES = ("common", "shards", "target", "extract", "train", "recipes", "benchmarks")
# Files allowed to leave trust_remote_code unset, and why (they only read what they just wrote).
UNSET_ALLOWED: dict[str, str] = {}  # files allowed to leave trust_remote_code unset, with the reason
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "marshal", "shelve", "cloudpickle"}


class Checks:
    def __init__(self, outcome: Outcome):
        self.outcome, self.passed, self.total = outcome, 0, 0

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.total += 1
        self.passed += bool(ok)
        if not ok:
            self.outcome.fail(f"{name}: {detail}")


# ----------------------------------------------------------------------------------------------
# Source scan


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def _call_name(node: ast.Call) -> str:
    func = node.func
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def _keyword(node: ast.Call, name: str):
    for kw in node.keywords:
        if kw.arg == name:
            return kw.value
    return None


def scan_sources() -> dict:
    """Every load site and every suspicious construct, by file:line."""
    found = {
        "torch_load": [],
        "torch_load_unsafe": [],
        "pickle_imports": [],
        "allow_pickle": [],
        "trust_remote_code_true": [],
        "trust_remote_code_unset": [],
        "safetensors": [],
    }
    for path in source_files():
        rel = path.relative_to(REPO)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(rel))
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                found["pickle_imports"] += [where for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
                found["pickle_imports"].append(where)
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            if name in ("torch.load",):
                found["torch_load"].append(where)
                value = _keyword(node, "weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    found["torch_load_unsafe"].append(where)
            if (
                name.endswith(("np.load", "numpy.load"))
                or name == "load"
                and _keyword(node, "allow_pickle") is not None
            ):
                value = _keyword(node, "allow_pickle")
                if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
                    found["allow_pickle"].append(where)
            value = _keyword(node, "trust_remote_code")
            if isinstance(value, ast.Constant) and value.value is True:
                found["trust_remote_code_true"].append(where)
            # transformers' Auto classes ask on the terminal when trust_remote_code is left at None:
            # every call must pass it (or pass a **kwargs dict that holds it).
            if (
                name.startswith("Auto")
                and name.endswith(".from_pretrained")
                and value is None
                and not any(kw.arg is None for kw in node.keywords)
                and str(rel) not in UNSET_ALLOWED
            ):
                found["trust_remote_code_unset"].append(where)
            if name.split(".")[-1] in ("load_file", "safe_open"):
                found["safetensors"].append(where)
    return found


# ----------------------------------------------------------------------------------------------
# Behaviour


class Marker:
    """Unpickling this creates a file: proof that code ran."""

    path = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def evil_pickle(marker: Path) -> bytes:
    Marker.path = str(marker)
    return pickle.dumps({"state": Marker(), "param_groups": []})


def malicious_checkpoint(world: World, work: Path, checks: Checks) -> None:
    """optimizer.pt replaced by a code-running pickle, state.json resealed to match."""
    from train import checkpoint as ck
    from train.loop import train

    runs = work / "sec-runs"
    train(world.train_cfg(runs, "victim", "optim.max_steps=1", "checkpoint.every=1"))
    path = ck.latest_checkpoint(runs / "victim" / "checkpoints")
    marker = work / "pwned-optimizer"
    (path / ck.OPTIMIZER_FILE).write_bytes(evil_pickle(marker))
    state = json.loads((path / ck.STATE_FILE).read_text())
    state[ck.FILE_CHECKSUMS_KEY][ck.OPTIMIZER_FILE] = ck._file_digest(path / ck.OPTIMIZER_FILE)
    state[ck.STATE_CHECKSUM_KEY] = ck._state_digest(state)
    (path / ck.STATE_FILE).write_text(json.dumps(state, sort_keys=True))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note about the pickle protocol
            ck.load_checkpoint(path)
        refused, message = False, "loaded"
    except ValueError as exc:
        refused, message = ck.OPTIMIZER_FILE in str(exc), str(exc)
    checks.check("checkpoint: a code-running optimizer.pt is refused naming the file", refused, message[:300])
    checks.check("checkpoint: the pickle's code never ran", not marker.exists(), "marker file created")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(world.train_cfg(runs, "victim", "optim.max_steps=2", "checkpoint.every=1"))
        resumed = "resumed"
    except ValueError as exc:
        resumed = str(exc)
    checks.check(
        "checkpoint: resuming from it stops with that message",
        ck.OPTIMIZER_FILE in resumed and not marker.exists(),
        resumed[:300],
    )


def malicious_shard(world: World, work: Path, checks: Checks) -> None:
    """A listed shard whose schema carries a pickled extension type (resealed manifest, right checksum)."""
    import pyarrow as pa

    from common.hashing import bytes_digest
    from shards import ShardDataset, verify_dataset
    from shards.manifest import seal

    root = work / "sec-shards"
    shutil.copytree(world.baseline, root)
    manifest = json.loads((root / "manifest.json").read_text())
    entry = manifest["shards"][0]
    marker = work / "pwned-shard"
    Marker.path = str(marker)
    metadata = {
        b"ARROW:extension:name": b"arrow.py_extension_type",
        b"ARROW:extension:metadata": pickle.dumps(Marker()),
    }
    original = pa.ipc.open_file(pa.memory_map(str(root / entry["file"]))).read_all()
    fields = [f.with_metadata(metadata) if f.name == "input_ids" else f for f in original.schema]
    table = pa.Table.from_arrays(original.columns, schema=pa.schema(fields, metadata=original.schema.metadata))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1):
            writer.write_batch(batch)
    data = sink.getvalue().to_pybytes()
    (root / entry["file"]).write_bytes(data)
    entry.update(bytes=len(data), checksum=bytes_digest(data))
    (root / "manifest.json").write_text(json.dumps(seal(manifest)))
    problems = [str(p) for p in verify_dataset(str(root))]
    checks.check(
        "shards: verify refuses a shard whose schema carries a pickled extension type",
        any(entry["file"] in p and "schema" in p for p in problems),
        str(problems[:2]),
    )
    try:
        for i in range(entry["samples"]):
            ShardDataset(str(root), verify_checksums=True)[i]
    except Exception:  # noqa: BLE001 - refusing is fine; running the pickle is not
        pass
    checks.check("shards: reading it never unpickles anything", not marker.exists(), "marker file created")
    scan = [
        name
        for name in ("reader.py", "schema.py", "verify.py", "manifest.py", "writer.py", "shard_file.py")
        if "pickle" in (REPO / "shards" / name).read_text()
    ]
    checks.check("shards: no shards module mentions pickle", not scan, str(scan))


def remote_code_target(world: World, work: Path, checks: Checks) -> None:
    """A target whose config asks for its own Python code: never run unless trust_remote_code is set."""
    target = work / "remote-code-target"
    shutil.copytree(world.target_dir, target)
    marker = work / "pwned-target"
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
    }
    (target / "config.json").write_text(json.dumps(config))
    code = (
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nfrom transformers import Qwen3Config\nclass "
        "EvilConfig(Qwen3Config):\n    pass\n"
    )
    (target / "configuration_evil.py").write_text(code)
    (target / "modeling_evil.py").write_text(
        code.replace("Qwen3Config", "Qwen3ForCausalLM").replace("EvilConfig", "EvilModel")
    )
    tok_cfg = json.loads((target / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (target / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (target / "tokenization_evil.py").write_text(
        code.replace("Qwen3Config", "PreTrainedTokenizerFast").replace("EvilConfig", "EvilTokenizer")
    )

    from extract.__main__ import main as extract_main

    # A known model_type: transformers builds its own class and ignores the shipped code.
    status, err = call_main(extract_main, [str(world.extract_config(work / "remote-out", target=str(target)))])
    checks.check(
        "extract: a target shipping code (known model_type) runs none of it by default",
        not marker.exists() and status == 0,
        f"exit {status}: {err[-300:]}",
    )
    # An unknown model_type: only the shipped code could build it, so the run must stop, clearly.
    config["model_type"] = "evil_remote_model"
    (target / "config.json").write_text(json.dumps(config))
    status, err = call_main(extract_main, [str(world.extract_config(work / "remote-out-2", target=str(target)))])
    checks.check(
        "extract: a target that needs its own code is refused with a clear error, the code not run",
        not marker.exists() and status == 2 and "trust_remote_code" in err and "Traceback" not in err,
        f"exit {status}: {err[-300:]}",
    )
    from common.config import load_config
    from extract.config import ExtractConfig

    checks.check(
        "extract: trust_remote_code defaults to false",
        load_config(ExtractConfig, None, ["target=x", "out_dir=y", "corpus=z"]).trust_remote_code is False,
    )

    from train.prepare import _load_tokenizer

    with contextlib.suppress(Exception):  # refusing is fine
        _load_tokenizer(str(target))
    checks.check(
        "train: reading the target's tokenizer runs no remote code", not marker.exists(), "marker file created"
    )

    from train.export_format.layout import export_checkpoint, load_exported
    from train.loop import train

    runs = work / "sec-runs"
    train(world.train_cfg(runs, "export-src", "optim.max_steps=1", "checkpoint.every=1"))
    export_dir = work / "export"
    export_checkpoint(runs / "export-src", export_dir, dtype="float32")
    drafter_marker = work / "pwned-drafter"
    with open(export_dir / "dflash.py", "a") as f:
        f.write(f"\nimport pathlib\npathlib.Path({str(drafter_marker)!r}).touch()\n")
    model = load_exported(export_dir)
    checks.check(
        "specdecode: loading an exported drafter runs no code from its directory (trust_remote_code off)",
        not drafter_marker.exists() and type(model).__name__ == "DFlashDraftModel",
        "marker file created",
    )


# ----------------------------------------------------------------------------------------------
# Paths


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def in_fresh_cwd(work: Path, name: str):
    cwd = work / name
    cwd.mkdir(parents=True, exist_ok=True)
    return cwd


def path_checks(world: World, work: Path, checks: Checks, examples: int) -> None:
    _name_checks(work, checks, examples)
    _extract_paths(world, work, checks)
    _train_paths(world, work, checks)
    _merge_and_export_paths(world, work, checks)


def _name_checks(work: Path, checks: Checks, examples: int) -> None:
    """Generated split and run names: each refused, or a child of out_dir."""
    from common.config import ConfigError, load_config
    from extract.config import ExtractConfig
    from train.config import TrainConfig

    names = st.one_of(
        st.sampled_from(
            ["..", ".", "../x", "a/../../b", "/etc", "~", "a\\..\\b", "x\x00y", "..\\x", " ..", "\n", "a" * 300]
        ),
        st.text(max_size=30),
    )
    bad_names: list = []

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(names)
    def split_names(name):
        out = work / "split-out"
        try:
            cfg = load_config(
                ExtractConfig, None, ["target=t", f"out_dir={out}", f'splits={{{json.dumps(name)} = "c.jsonl"}}']
            )
        except ConfigError:
            return
        except Exception as exc:  # noqa: BLE001
            bad_names.append(f"split {name!r}: {type(exc).__name__}: {exc}")
            return
        for split in cfg.split_configs().values():
            if Path(os.path.abspath(split.out_dir)).parent != Path(os.path.abspath(out)) or len(name.encode()) > 255:
                bad_names.append(f"split {name!r} writes to {split.out_dir}")

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(names)
    def run_names(name):
        try:
            cfg = load_config(TrainConfig, None, [f"out_dir={work / 'runs-x'}"], values={"run_name": name})
        except ConfigError:
            return
        except Exception as exc:  # noqa: BLE001
            bad_names.append(f"run_name {name!r}: {type(exc).__name__}: {exc}")
            return
        run_dir = Path(os.path.abspath(Path(cfg.out_dir) / cfg.run_name))
        if run_dir.parent != Path(os.path.abspath(work / "runs-x")) or len(cfg.run_name) > 255:
            bad_names.append(f"run_name {name!r} -> {run_dir}")

    split_names()
    run_names()
    checks.check(
        "extract splits / train run_name: every generated name is refused or stays a child of out_dir",
        not bad_names,
        str(bad_names[:5]),
    )


def _extract_paths(world: World, work: Path, checks: Checks) -> None:
    """extract: only out_dir gets files."""
    cwd = in_fresh_cwd(work, "cwd-extract")
    before_target, before_corpus = snapshot(world.target_dir), world.corpus.stat().st_mtime_ns
    out = cwd / "out"
    config = world.extract_config(work / "extract-paths")
    text = config.read_text().replace(f'out_dir = "{work / "extract-paths"}"', f'out_dir = "{out}"')
    config.write_text(text)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        from extract.__main__ import main as extract_main

        status, err = call_main(extract_main, [str(config)])
    finally:
        os.chdir(old)
    outside = sorted(f for f in files_under(cwd) if not f.startswith("out"))
    checks.check(
        "extract: writes only under out_dir",
        status == 0 and not outside,
        f"exit {status}, outside: {outside[:5]} {err[-200:]}",
    )
    checks.check(
        "extract: never writes to the target or the corpus",
        snapshot(world.target_dir) == before_target and world.corpus.stat().st_mtime_ns == before_corpus,
    )


def _train_paths(world: World, work: Path, checks: Checks) -> None:
    """train: only out_dir/run_name; the shards and a run it resumes from stay untouched."""
    from train.__main__ import main as train_main

    cwd = in_fresh_cwd(work, "cwd-train")
    shards_before = snapshot(world.baseline)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        status, err = call_main(
            train_main, world.train_args(Path("runs"), "first", "optim.max_steps=2", "checkpoint.every=1")
        )
        first = snapshot(cwd / "runs" / "first")
        ckpt = sorted((cwd / "runs" / "first" / "checkpoints").iterdir())[-1]
        status2, err2 = call_main(
            train_main,
            world.train_args(
                Path("runs"), "second", "optim.max_steps=2", "checkpoint.every=1", f"resume={ckpt}", "stop_after=2"
            ),
        )
    finally:
        os.chdir(old)
    outside = sorted(f for f in files_under(cwd) if not f.startswith(("runs/first", "runs/second")) and f != "runs")
    checks.check(
        "train: writes only under out_dir/run_name",
        status == 0 and status2 == 0 and not outside,
        f"exit {status}/{status2}, outside: {outside[:5]} {err[-200:]} {err2[-200:]}",
    )
    checks.check("train: never writes into the shards it reads", snapshot(world.baseline) == shards_before)
    checks.check(
        "train: resuming from another run's checkpoint leaves that run untouched",
        snapshot(cwd / "runs" / "first") == first,
    )
    elsewhere = work / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    (cwd / "runs" / "linked").symlink_to(elsewhere, target_is_directory=True)
    status, err = call_main(train_main, world.train_args(cwd / "runs", "linked", "optim.max_steps=1"))
    checks.check(
        "train: a run directory that is a symlink out of out_dir is refused with a clear error",
        status == 2 and "run_name" in err and not any(elsewhere.iterdir()) and "Traceback" not in err,
        f"exit {status}: {err[-300:]}",
    )


def _merge_and_export_paths(world: World, work: Path, checks: Checks) -> None:
    """shards merge: --out must be a plain name; export: refuses to replace an unrelated non-empty directory."""
    from shards.__main__ import main as shards_main

    root = work / "merge-ds"
    shutil.copytree(world.baseline, root)
    status, err = call_main(shards_main, ["merge", str(root), "manifest.rank000.json", "--out", "../escaped.json"])
    checks.check(
        "shards merge: --out cannot leave the dataset directory",
        status == 2 and not (work / "escaped.json").exists() and "Traceback" not in err,
        f"exit {status}: {err[-200:]}",
    )

    from train.serve.export import main as export_main

    victim = work / "not-an-export"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    status, err = call_main(export_main, [str(work / "sec-runs" / "export-src"), str(victim)])
    checks.check(
        "export: refuses to replace an unrelated non-empty directory",
        status != 0 and (victim / "precious.txt").read_text() == "keep me" and "Traceback" not in err,
        f"exit {status}: {err[-200:]}",
    )


def run(world: World, *, work: Path, examples: int = 200) -> Outcome:
    outcome = Outcome(6, "Security")
    start = time.perf_counter()
    checks = Checks(outcome)
    scan = scan_sources()
    checks.check(
        "every torch.load passes weights_only=True", not scan["torch_load_unsafe"], str(scan["torch_load_unsafe"])
    )
    checks.check("no pickle-like module is imported", not scan["pickle_imports"], str(scan["pickle_imports"]))
    checks.check("no np.load(allow_pickle=True)", not scan["allow_pickle"], str(scan["allow_pickle"]))
    checks.check(
        "no call passes trust_remote_code=True", not scan["trust_remote_code_true"], str(scan["trust_remote_code_true"])
    )
    checks.check(
        "every Auto*.from_pretrained passes trust_remote_code (None would prompt)",
        not scan["trust_remote_code_unset"],
        str(scan["trust_remote_code_unset"]),
    )
    outcome.details.append(f"torch.load sites (all weights_only=True): {', '.join(scan['torch_load'])}")
    outcome.details.append(f"safetensors load sites: {', '.join(scan['safetensors'])}")
    outcome.details.append(
        "allowed to leave trust_remote_code unset: " + "; ".join(f"{k} ({v})" for k, v in UNSET_ALLOWED.items())
    )
    malicious_checkpoint(world, work, checks)
    malicious_shard(world, work, checks)
    remote_code_target(world, work, checks)
    path_checks(world, work, checks, examples)
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{checks.passed}/{checks.total} checks passed")
