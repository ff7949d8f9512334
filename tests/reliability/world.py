"""The small world every reliability scenario runs in: a tiny random Qwen3 target saved to disk with
the project's chat tokenizer, a chat corpus with a few bad records, its uninterrupted extraction
(the reference every killed run is compared with) and training arguments for a 1-layer drafter.

Built from the extraction tests' fixtures (`tests/extract/conftest.py`), in seconds, on CPU.
Everything that compares bytes or losses runs single-threaded (OMP_NUM_THREADS=1 in children,
`torch.set_num_threads(1)` here), so results are bit-identical between processes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from pathlib import Path

import tomli_w

from tests.paths import REPO, child_pythonpath  # noqa: F401 - REPO is re-exported to the scenarios

# The extraction every scenario uses: 2 taps of a 4-layer target, top-4, small shards (2-3 samples
# each) so that a run commits dozens of shards and every commit window is reached many times.
EXTRACT_SETTINGS = {
    "layer_ids": [0, 2],
    "topk": 4,
    "max_len": 256,
    "tokens_per_batch": 256,
    "min_loss_tokens": 4,
    "dtype": "float32",
    "device": "cpu",
    "shard_bytes": 30000,
    "sort_window": 24,
    "progress": False,
    "writer_threads": 1,
}

# A 1-layer drafter on the extracted shards: ~30 ms a step on one CPU thread. On the CPU also on a
# GPU host: the scenarios compare resumed runs with the uninterrupted one bit for bit, a property
# of the CPU kernels (CUDA reductions need not repeat to the bit between processes).
TRAIN_SETTINGS = [
    "data.token_budget=512",
    "data.num_buckets=2",
    "data.holdout_fraction=0",
    "data.prefetch_threads=1",
    "data.prefetch_depth=2",
    "model.num_layers=1",
    "loss.num_anchors=8",
    "log.progress=false",
    "optim.lr=3e-3",
    "device=cpu",
]


def child_env(threads: int | None = 1) -> dict:
    """Environment of every child process: one thread (None: torch's default), offline, the repository importable."""
    env = dict(
        os.environ,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONPATH=child_pythonpath(),
        PYTHONUNBUFFERED="1",
    )
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if threads is None:
            env.pop(name, None)
        else:
            env[name] = str(threads)
    return env


def single_thread() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    torch.set_num_threads(1)


@dataclasses.dataclass
class World:
    root: Path
    target_dir: Path
    corpus: Path
    n_good: int

    # ---------------------------------------------------------------- extraction

    def extract_config(self, out_dir: Path, corpus: Path | None = None, **overrides) -> Path:
        """A TOML config for `python -m extract` writing to `out_dir` (next to it: out_dir.toml)."""
        table = {"target": str(self.target_dir), "corpus": str(corpus or self.corpus), "out_dir": str(out_dir)}
        table.update(EXTRACT_SETTINGS)
        table.update(overrides)
        path = Path(f"{out_dir}.toml")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tomli_w.dumps({"extract": table}))
        return path

    def extract_cfg(self, out_dir: Path, corpus: Path | None = None, **overrides):
        from common.config import load_config
        from extract.config import ExtractConfig

        return load_config(ExtractConfig, self.extract_config(out_dir, corpus, **overrides), section="extract")

    @functools.cached_property
    def target(self):
        """The target loaded in this process (for in-process and forked extractions)."""
        from target.load import load_target

        single_thread()
        return load_target(str(self.target_dir), dtype="float32", device="cpu")

    def extract_in_process(self, out_dir: Path, corpus: Path | None = None, **overrides) -> dict:
        from extract import pipeline
        from extract.ranks import Ranks

        return pipeline.run(self.extract_cfg(out_dir, corpus, **overrides), target=self.target, ranks=Ranks())

    @functools.cached_property
    def baseline(self) -> Path:
        """The uninterrupted extraction of the corpus: the reference for every kill."""
        out = self.root / "baseline"
        if not (out / "manifest.json").exists():
            self.extract_in_process(out)
        return out

    # ---------------------------------------------------------------- training

    def train_args(self, runs: Path, run_name: str, *extra: str, shards: Path | None = None) -> list[str]:
        return [
            f"out_dir={runs}",
            f"run_name={run_name}",
            f"data.shards={shards or self.baseline}",
            *TRAIN_SETTINGS,
            *extra,
        ]

    def train_cfg(self, runs: Path, run_name: str, *extra: str, shards: Path | None = None):
        from common.config import load_config
        from train.config import TrainConfig

        return load_config(TrainConfig, None, self.train_args(runs, run_name, *extra, shards=shards))


def build_world(root: Path, n_good: int = 60, seed: int = 0) -> World:
    """Write the tiny target and the corpus under `root` (the extraction itself is lazy)."""
    single_thread()
    from recipes.tiny import build_chat_tokenizer
    from tests.extract.conftest import build_model, mixed_corpus, qwen3_config, sentence

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target_dir = root / "target"
    if not (target_dir / "config.json").exists():
        rng = random.Random(seed)
        tokenizer = build_chat_tokenizer(
            [sentence(rng, 60) for _ in range(40)] + ["user\nassistant\nsystem\n"] * 5, 400
        )
        model = build_model(qwen3_config(len(tokenizer)), seed=seed)
        model.save_pretrained(target_dir)
        tokenizer.save_pretrained(target_dir)
    corpus = root / "corpus.jsonl"
    if not corpus.exists():
        mixed_corpus(corpus, n_good=n_good, seed=seed)
    return World(root, target_dir, corpus, n_good)
