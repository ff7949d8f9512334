"""`EvalConfig`: every knob of `python -m train.eval`, the `[eval]` table of a config file."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Literal

from common.config import fail, knob


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Every knob of `python -m train.eval` (the `[eval]` table of a config file)."""

    data: str | None = knob(None, help="shards dataset root to evaluate on (also --data)", path="data_in")
    manifest: str = knob("manifest.json", help="manifest file name inside the shards root")
    out: str | None = knob(
        None,
        help="JSON output path (also --out); none = eval_<data-name>.json inside the first checkpoint directory",
        path="file_out",
    )
    split: Literal["auto", "holdout", "all"] = knob(
        "auto",
        help="auto: the held-out split if --data is the dataset a run trained on, else every sample; holdout: "
        "only is_holdout samples; all: every sample",
    )
    holdout_fraction: float | None = knob(
        None,
        help="fraction for split=holdout; none = the run's data.holdout_fraction (the smaller one of two runs "
        "trained on this data)",
        min=0.0,
        max=1.0,
    )
    max_samples: int | None = knob(
        None,
        help="evaluate at most this many samples (a fixed, uniformly spread subset by sample-id hash); none = all",
        min=1,
    )
    max_anchors: int | None = knob(
        None,
        help="anchors per sequence; none = every eligible position; fewer are drawn uniformly without "
        "replacement, seeded by (seed, sample id)",
        min=1,
    )
    min_valid_len: int = knob(
        1,
        help="skip anchors whose block has fewer target tokens than this (block_size-1 = only full blocks); 1 "
        "keeps every block, cut ones included, as online decoding meets them",
        min=1,
    )
    seed: int = knob(0, help="seed of the anchor subsample (max_anchors)", min=0)
    budgets: list[int] = knob(
        factory=lambda: [8, 16, 32, 64],
        help="DDTree node budgets; the drafter's top-max(budgets) log-probs per depth are kept",
        min=1,
        max=4096,
    )
    boundaries: list[int] | None = knob(
        None,
        help="sequence-length bucket upper edges (inclusive, strictly increasing); none = the run's "
        "data_plan.json boundaries (one bucket if it has none)",
        min=1,
    )
    target: str | None = knob(
        None,
        help="target checkpoint directory for the frozen embedding and lm_head; none = the one the run was "
        "trained with",
        path="local_in",
    )
    allow_target_mismatch: bool = knob(
        False,
        help="evaluate with a target other than the one the run trained with or the shards were extracted from "
        "(config hash, weights digest or embedding and head digest differ): for a deliberate copy, such as the "
        "same weights re-saved in another dtype; the report records what differed",
    )
    projection: str | None = knob(
        None,
        help="a drafter trained on projected features, evaluated on full ones: the projection file to fold into "
        "fc; none = its training dataset's",
        path="local_in",
    )
    device: Literal["auto", "cpu", "cuda"] = knob("auto", help="auto = cuda when available")
    precision: Literal["auto", "bf16", "fp32"] = knob(
        "auto", help="bf16 autocast or fp32; auto = bf16 on CUDA, fp32 on CPU"
    )
    attention: Literal["auto", "flex", "sdpa"] = knob(
        "auto",
        help="attention kernel for the many-block mask: auto = flex where its CUDA kernel works for the head dim "
        "(16..256, Triton), else sdpa with a dense mask (train.kernels)",
    )
    blocks_per_forward: int | None = knob(
        None,
        help="blocks per drafter forward (a long sequence is split, short ones share a forward); none = 128 on "
        "CPU (the dense mask's cost grows with it), 512 on CUDA",
        min=1,
    )
    chunk_rows: int = knob(
        2048, help="block tokens per lm_head chunk: full-vocabulary logits exist for this many rows at once", min=1
    )
    load_threads: int = knob(2, help="background threads reading samples", min=1, max=64)
    progress: bool = knob(True, help="show a tqdm progress bar (on stderr)")

    def check(self) -> None:
        if not self.budgets:
            fail("budgets", "needs at least one DDTree budget")
        if len(set(self.budgets)) != len(self.budgets):
            fail("budgets", f"has duplicates: {self.budgets}")
        if self.boundaries is not None and any(a >= b for a, b in itertools.pairwise(self.boundaries)):
            fail("boundaries", f"must be strictly increasing, got {self.boundaries}")

    @property
    def topk(self) -> int:
        """Top-k log-probs kept per depth: the largest budget (a tree of B nodes uses <= B per depth)."""
        return max(self.budgets)
