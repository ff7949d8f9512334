"""The pipeline at smoke scale on one family's tiny target: regeneration, extraction, a few training
steps, export, speculative decoding, each through its stage's library function.

`run_family` returns an `Outcome`: either the one-line refusal of the first stage (regeneration,
which checks the target before anything is generated), or what every stage recorded (taps, the
embedding and head tensors found, the embedding scale, the drafter's rope) and whether speculative
decoding of the held-out prompts equals the target's own greedy decoding.

The stages are called one by one here; `recipes/drafter.py` (the one command, `make drafter`) will
run the same chain, and `run_stages` is the function to replace by it.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from common.config import load_config
from common.target import load_target
from common.target_arch import check_architecture
from extract import pipeline as extraction
from extract.config import ExtractConfig
from extract.ranks import Ranks
from extract.regenerate import run as regeneration
from extract.regenerate.config import RegenerateConfig
from shards import ShardDataset
from tests.archs.families import Family
from train.config import TrainConfig
from train.loop import train
from train.serve.decoding import DFlashProposer, greedy_generate, speculative_generate
from train.serve.export_format import export_checkpoint, load_exported
from train.serve.prompts import prompts_from_jsonl, stop_token_ids
from train.serve.spec_target import SpecTarget

WORDS = "the quick brown fox jumps over a lazy dog while birds sing in the tall green forest".split()
LAYER_IDS = [0, 1]  # taps of the 3-layer targets: every layer but the last
TRAIN_PROMPTS, HELDOUT_PROMPTS = 6, 2
NEW_TOKENS = 12  # per answer (regeneration) and per held-out prompt (speculative decoding)
BLOCK = 8  # the smallest block size with a published loss gamma
STEPS = 2


@dataclasses.dataclass
class Outcome:
    """What the pipeline did with one family (`row` is its line in docs/architectures.md)."""

    family: str
    model_class: str = ""
    refused: str | None = None  # the first stage's one-line error
    taps: list[int] | None = None
    embed_tensor: str | None = None
    head_tensor: str | None = None
    embed_scale: float | None = None
    drafter_rope: str | None = None
    attention: str | None = None  # the implementation transformers chose for the target (recorded by extraction)
    lossless: bool | None = None
    tokens: int = 0  # generated in speculative decoding (held-out prompts)


def build_target(family: Family, tokenizer, out: Path) -> Path:
    """A random-weight target of the family saved with the tokenizer (seeded: the same bytes every run)."""
    token_ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if family.seq2seq else AutoModelForCausalLM
    model = auto.from_config(family.config(len(tokenizer), token_ids))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_chats(path: Path, n: int, seed: int, answers: bool) -> Path:
    """`n` chat records of random words: user turns only (prompts), or with an assistant answer each."""
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    lines = []
    for _ in range(n):
        messages = [{"role": "user", "content": words(4, 10)}]
        if answers:
            messages.append({"role": "assistant", "content": words(12, 24)})
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_family(family: Family, tokenizer, work: Path) -> Outcome:
    target = build_target(family, tokenizer, work / "target")
    return run_stages(target, work, Outcome(family.name))


def run_stages(target: Path, work: Path, outcome: Outcome) -> Outcome:
    """Every stage on `target`; a family the first stage refuses stops there with its one-line error
    (an error of any later stage is raised: it is a bug of the matrix or of the stages).

    Extraction reads written answers, not the regenerated ones: a random-weight target's answers
    are random tokens, which regeneration rightly drops when they do not tokenize back to themselves.
    Every stage that loads the target takes transformers' own attention choice for it (`auto`)."""
    try:
        regenerate(target, write_chats(work / "prompts.jsonl", TRAIN_PROMPTS, 0, answers=False), work / "regen")
    except ValueError as exc:
        outcome.refused = str(exc)
        return outcome
    arch = check_architecture(target)
    outcome.model_class, outcome.embed_scale = arch.model_class, arch.embed_scale
    outcome.embed_tensor, outcome.head_tensor = arch.embed_tensor, arch.head_tensor
    corpus = write_chats(work / "chats.jsonl", TRAIN_PROMPTS, 0, answers=True)
    shards = extract(target, corpus, work / "shards")
    provenance = ShardDataset(str(shards)).provenance
    outcome.taps, outcome.attention = provenance["taps"]["layer_ids"], provenance["target"]["attn_implementation"]
    run_dir = train_drafter(shards, target, work / "runs")
    exported = export_checkpoint(run_dir, work / "export", dtype="float32", target=str(target))
    outcome.drafter_rope = _rope(json.loads((exported / "config.json").read_text()))
    heldout = write_chats(work / "heldout.jsonl", HELDOUT_PROMPTS, 1, answers=False)
    outcome.lossless, outcome.tokens = decode(target, exported, heldout)
    return outcome


def regenerate(target: Path, prompts: Path, out: Path) -> Path:
    cfg = load_config(
        RegenerateConfig,
        None,
        [
            f"target={target}",
            f"corpus={prompts}",
            f"out={out}",
            f"max_new_tokens={NEW_TOKENS}",
            "dtype=float32",
            "device=cpu",
            "thinking=disable",
            "attn_implementation=auto",
        ],
    )
    regeneration.run(cfg)
    return out / "data.jsonl"


def extract(target: Path, corpus: Path, out: Path) -> Path:
    cfg = load_config(
        ExtractConfig,
        None,
        [
            f"target={target}",
            f"corpus={corpus}",
            f"out_dir={out}",
            f"layer_ids={LAYER_IDS}",
            "topk=4",
            "min_loss_tokens=2",
            "dtype=float32",
            "device=cpu",
            "progress=false",
            "writer_threads=1",
            "attn_implementation=auto",
        ],
    )
    extraction.run(cfg, ranks=Ranks())
    return out


def train_drafter(shards: Path, target: Path, out: Path) -> Path:
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"out_dir={out}",
            "run_name=r",
            f"data.shards={shards}",
            f"model.target={target}",
            "data.holdout_fraction=0",
            "data.num_buckets=1",
            "data.token_budget=256",
            "data.prefetch_threads=1",
            "data.min_loss_tokens=2",
            "model.num_layers=1",
            f"model.block_size={BLOCK}",
            "loss.num_anchors=4",
            f"optim.max_steps={STEPS}",
            "device=cpu",
            "precision=fp32",
            "compile=false",
            "log.progress=false",
        ],
    )
    train(cfg)
    return out / "r"


def decode(target: Path, exported: Path, prompts: Path) -> tuple[bool, int]:
    """(lossless, tokens generated): on every prompt, our speculative decoding and the export's own
    `spec_generate` (z-lab's quick start, the exported dflash.py) equal the target's greedy decoding."""
    loaded = load_target(str(target), dtype="float32", attn_implementation="auto", device="cpu")
    drafter = load_exported(exported, dtype=torch.float32)
    stops = stop_token_ids(loaded)
    spec = SpecTarget(loaded, drafter.target_layer_ids, stops)
    proposer = DFlashProposer(drafter, spec, context_cache=True)
    lossless, tokens = True, 0
    for prompt in prompts_from_jsonl(prompts, loaded.tokenizer, None):
        greedy = greedy_generate(spec, prompt, NEW_TOKENS).tokens
        drafted = speculative_generate(spec, proposer, prompt, NEW_TOKENS).tokens
        quick = drafter.spec_generate(
            target=loaded.model, input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, stop_token_ids=stops
        )
        lossless &= drafted == greedy and quick[0, len(prompt) :].tolist() == greedy
        tokens += len(drafted)
    return lossless, tokens


def _rope(config: dict) -> str:
    params = config.get("rope_parameters") or {}
    kind = params.get("rope_type", "default")
    return f"theta {params.get('rope_theta'):g}" + ("" if kind == "default" else f", {kind}")
