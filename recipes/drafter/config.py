"""`DrafterRecipeConfig`: every knob of `python -m recipes.drafter` (`make drafter`), the `[drafter]` table
of a config file. Torch-free, so that `--help` and a bad key answer at once.

A word `STAGE.key=value` on the command line (STAGE one of `STAGES`) is that stage's own setting,
e.g. `train.optim.max_steps=200` or `specdecode.max_new_tokens=64`; it lands in `overrides.STAGE`
and wins over everything else. A config file given as the first argument is read twice: its
`[drafter]` table here, and its stage tables (`[regenerate]`, `[extract]`, `[train]`, `[eval]`) by the
stages themselves, as their base settings.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

from common.config import ATTN_IMPLEMENTATIONS, ConfigError, fail, knob, parse_cli

# Every stage of the command, in order; the names of their `overrides` and of their config tables.
STAGES = ("regenerate", "extract", "train", "eval", "export", "specdecode", "report")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class DrafterRecipeConfig:
    target: str = knob(
        help="the target: a local Hugging Face model directory (config.json, weights, tokenizer)", path="local_in"
    )
    prompts: str = knob(
        help='your prompts: a JSONL file of chat records {"messages": [...]} (or {"text": ...}); the target answers '
        "them itself, and those answers are what the drafter learns",
        path="local_in",
    )
    heldout: str = knob(
        "",
        help="held-out prompts (same format) for evaluation and speculative decoding; empty = carved from `prompts` "
        "(heldout_prompts of them, by a seeded hash of each record)",
        path="local_in",
    )
    heldout_prompts: int = knob(
        0,
        help="with no `heldout` file: how many prompts to hold out; 0 = auto (10% of them, at least 2, at most 64)",
        min=0,
    )
    out: str = knob(
        "",
        help="output directory; empty = runs/drafter-<the target directory's name>-<8 hex digits of its resolved "
        "path> (two targets in folders of one name get two folders); a folder that holds another target's drafter is "
        "refused",
        path="dir_out",
    )
    server: str = knob(
        "",
        help="regenerate through a running OpenAI-compatible server (vLLM, SGLang, transformers serve) at this "
        "base URL, e.g. http://127.0.0.1:8000/v1, instead of loading the target here",
    )
    scale: Literal["full", "smoke"] = knob(
        "full",
        help="full: the stages' own defaults (the published recipe); smoke: a few prompts, short answers and a few "
        "training steps, to check that your target goes through every stage (minutes on a CPU)",
    )
    regenerate: bool = knob(
        True,
        help="let the target answer the prompts itself (greedy); false = the prompts' assistant turns are already "
        "the target's own answers (extraction reads them as they are)",
    )
    device: Literal["auto", "cpu", "cuda"] = knob(
        "auto", help="where every stage runs; auto = cuda when torch sees one"
    )
    dtype: str = knob(
        "auto",
        help="the target's compute dtype in every stage that runs it (regeneration, extraction, speculative "
        "decoding); auto = float32 on a CPU and for a target of at most 2 GB of weights on a GPU, else bfloat16 "
        "(float16 on a GPU without it)",
        choices=DTYPE_CHOICES,
    )
    attn_implementation: str = knob(
        "auto",
        help="the target's attention kernel in every stage that runs it; auto = sdpa where the target's "
        "transformers class supports it, else eager",
        choices=ATTN_IMPLEMENTATIONS,
    )
    chat_template: str = knob(
        "",
        help="a Jinja chat template file for a target without one (a base model), used wherever the target's "
        "chat is rendered (regeneration, extraction, speculative decoding); empty = the tokenizer's own",
        path="local_in",
    )
    config: str = knob(
        "",
        help="a TOML file whose [regenerate], [extract], [train] and [eval] tables are the stages' base settings "
        "(a config file given as the first argument is this one too)",
        path="local_in",
    )
    arch: Literal["dflash", "dflash2"] = knob(
        "dflash",
        help="the drafter class (train's model.arch): dflash, or dflash2 (a block convolution around every sublayer "
        "and a candidate selector; block 8). DFlash stays the default until DFlash2 wins on both the tiny default "
        "and SmolLM2 (docs/benchmarks.md)",
    )
    seed: int = knob(0, help="seed of the held-out carve, the drafter's init and its data order", min=0)
    allow_cache_mismatch: bool = knob(
        False,
        help="accept a target whose forward through its cache differs from its full recompute beyond the self-check's "
        'tolerance (docs/own-target.md, "The self-check"): the drafter is trained on the true outputs, but '
        "speculative decoding through that cache is not exactly the target's greedy decoding; recorded in drafter.json",
    )
    in_process: bool = knob(
        False,
        help="run every stage in this process instead of one process each (faster to start: tests, the architecture "
        "matrix); a stage's crash then ends the command",
    )
    overrides: dict[str, list[str]] = knob(
        factory=dict,
        help="each stage's own key=value settings, {stage = [...]}; on the command line STAGE.key=value (stages: "
        + ", ".join(STAGES)
        + ")",
    )

    def check(self) -> None:
        if not self.target:
            fail("target", "name the target model directory (target=DIR)")
        if not self.prompts:
            fail("prompts", "name your prompts file (prompts=FILE: JSONL of chat records)")
        for stage, words in self.overrides.items():
            if stage not in STAGES:
                fail(f"overrides.{stage}", f"no such stage; stages: {', '.join(STAGES)}")
            for word in words:
                if "=" not in word or word.startswith("="):
                    fail(f"overrides.{stage}", f"{word!r} is not key=value")
        if self.server and not self.server.startswith(("http://", "https://")):
            fail("server", f"expected an http(s) base URL such as http://127.0.0.1:8000/v1, got {self.server!r}")
        if self.config and not os.path.isfile(self.config):
            fail("config", f"{self.config} is not a file")
        if self.server and not self.regenerate:
            fail("server", "set, but regenerate = false: nothing is generated")

    @property
    def out_dir(self) -> str:
        """Where everything goes: `out`, or `default_out(target)`."""
        return self.out or default_out(self.target)


def default_out(target: str) -> str:
    """runs/drafter-<the target directory's name>-<xxh3-64 of its resolved path, 8 hex digits>: `/A/target`
    and `/B/target` get two folders, the same directory (however it is spelt) one."""
    name = os.path.basename(os.path.normpath(target))
    return os.path.join("runs", f"drafter-{name}-{xxhash.xxh3_64_hexdigest(os.path.realpath(target).encode())[:8]}")


def legacy_out(target: str) -> str:
    """The default folder before the digest was part of its name (runs/drafter-<name>): still used for a
    target whose drafter is there, so that a rerun continues it."""
    return os.path.join("runs", "drafter-" + os.path.basename(os.path.normpath(target)))


def parse_drafter_args(argv: Sequence[str]) -> DrafterRecipeConfig:
    """The command line: [CONFIG.toml] key=value ... STAGE.key=value ...; ConfigError naming the key."""
    words, per_stage = [], {}
    for word in argv:
        stage, dot, _ = word.partition(".")
        if dot and stage in STAGES and "=" in word.partition(".")[2]:
            per_stage.setdefault(stage, []).append(word.partition(".")[2])
        else:
            words.append(word)
    first = words[0] if words else ""
    config = first if first.endswith(".toml") and os.path.isfile(first) else ""
    if config and not has_table(config, "drafter"):
        words = words[1:]  # only stage tables: the stages read them, this command has none of its own
    cfg = parse_cli(DrafterRecipeConfig, words, section="drafter")
    merged = {stage: list(cfg.overrides.get(stage, [])) + per_stage.get(stage, []) for stage in STAGES}
    cfg = dataclasses.replace(cfg, config=cfg.config or config, overrides={s: w for s, w in merged.items() if w})
    cfg.check()
    return cfg


def has_table(path: str, name: str) -> bool:
    try:
        with open(path, "rb") as f:
            return isinstance(tomllib.load(f).get(name), dict)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc}") from None
