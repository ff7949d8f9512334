"""The architecture matrix's driver: the drafter command (`python -m recipes.drafter`, `make drafter`)
at the smoke scale on one family's tiny random target, in this process, with every default the command
derives (taps, drafter depth, mask token, the held-out prompts carved, dtype and attention kernel).

`run_family` returns an `Outcome`: the command's one-line refusal (it checks the target's architecture
before it writes or runs anything), or what the command chose and recorded (its derived defaults in
OUT/drafter.json, the taps, kernel and dtype in the shards, the export's taps, mask token and rope) and
whether decoding the held-out prompts was lossless twice over: the command's own check (its
speculative decoding step against the target's greedy decoding) and the export's own `spec_generate`
(z-lab's quick start, the exported dflash.py) against the same greedy decoding.

DFlash2 (`dflash2_decodings`), at the decoding and export end only (a second trained pipeline would
double the matrix's time): the trained DFlash drafter's weights in a DFlash2 drafter whose
convolutions and selector are drawn at random around their initialization (so both do something),
written as a checkpoint, exported by `python -m train.serve.export` for the family's target, then the
held-out prompts decoded by our loop (`train.serve.decoding`, the selector's walk) and by z-lab's
reference loop (`dflash.model.dflash_generate`, pip dflash 0.1.0, its own DFlash2 class reading the
export), each against the target's greedy decoding.

The prompts come with written answers and `regenerate=false`: a random-weight target's answers are
random tokens, which do not survive the decode/re-encode round trip and which regeneration therefore
rightly drops.
"""

from __future__ import annotations

import dataclasses
import json
import random
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from recipes.drafter.config import parse_drafter_args
from recipes.drafter.run import run_drafter
from shards import ShardDataset
from target.arch import check_architecture
from target.load import load_target
from tests.archs.families import Family
from train.dflash2 import build_drafter
from train.drafter_config import DrafterConfig
from train.export_format.layout import load_exported
from train.serve.decoding import DFlashProposer, greedy_generate, speculative_generate
from train.serve.prompts import prompts_from_jsonl, stop_token_ids
from train.serve.spec_target import SpecTarget
from train.warm_start import warm_start

REFUSAL = "cannot be a DFlash target: "  # what the architecture check's refusals say before the reason
WORDS = "the quick brown fox jumps over a lazy dog while birds sing in the tall green forest".split()
PROMPTS = 8  # written chats; the command carves the held-out ones from them (10%, at least 2)
ANSWER_WORDS = (36, 48)  # a word is a token of the chat tokenizer: extraction keeps answers of >= 32 tokens
# The command line of every family. device=cpu: a CPU matrix, the same rows on a GPU host (fp32 kernels
# of other shapes could flip a random target's near-ties there). report.plots=false: the plots cost
# most of a family's time and depend on no architecture (the report itself is still written).
SETTINGS = ("scale=smoke", "regenerate=false", "device=cpu", "in_process=true", "report.plots=false")
NO_REFERENCE = "z-lab's dflash (pip dflash==0.1.0) is not installed"
DFLASH2_TOKENS = 16  # tokens per held-out prompt in the DFlash2 decodings (our loop and z-lab's)


@dataclasses.dataclass
class Outcome:
    """What the command did with one family (`table.row` is its line in docs/architectures.md)."""

    family: str
    refused: str | None = None  # the command's one-line refusal
    refused_why: str | None = None  # its reason, without paths or numbers (the refused table's)
    derived: dict = dataclasses.field(default_factory=dict)  # {what: value}, the command's derived defaults
    model_class: str = ""  # the class extraction loaded the target as (recorded in the shards)
    taps: list[int] | None = None  # recorded in the shards
    attention: str | None = None  # the kernel extraction ran the target with (recorded in the shards)
    dtype: str | None = None  # the target's compute dtype in extraction (recorded in the shards)
    mask_token_id: int | None = None  # recorded in the shards
    export: dict = dataclasses.field(default_factory=dict)  # the export's config.json
    embed_tensor: str | None = None
    head_tensor: str | None = None
    embed_scale: float | None = None
    lossless: bool | None = None  # the command's speculative decoding step
    decoding_path: str | None = None  # the path that step named (train.serve.spec_target.decoding_path)
    quick_start_lossless: bool | None = None  # the export's own spec_generate
    dflash2_lossless: bool | None = None  # a DFlash2 export of the family through our decoding loop
    dflash2_reference_lossless: bool | None = None  # ... through z-lab's reference loop (None: not run, see below)
    dflash2_reference_note: str | None = None  # why z-lab's loop did not run
    tokens: int = 0  # generated in the command's speculative decoding (held-out prompts)

    @property
    def drafter_rope(self) -> str:
        params = self.export.get("rope_parameters") or {}
        kind = params.get("rope_type", "default")
        return f"theta {params.get('rope_theta'):g}" + ("" if kind == "default" else f", {kind}")


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


def write_chats(path: Path, n: int, seed: int) -> Path:
    """`n` chat records of random words, each a user turn and a written assistant answer."""
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": words(4, 10)},
                    {"role": "assistant", "content": words(*ANSWER_WORDS)},
                ]
            }
        )
        for _ in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_family(family: Family, tokenizer, work: Path) -> Outcome:
    """The command on the family's target (OUT = work/out); a ValueError it raises is the refusal
    (an error of any step is raised: it is a bug of the matrix or of the stages)."""
    target = build_target(family, tokenizer, work / "target")
    prompts = write_chats(work / "prompts.jsonl", PROMPTS, 0)
    outcome = Outcome(family.name)
    try:
        summary = run_drafter(
            parse_drafter_args([f"target={target}", f"prompts={prompts}", f"out={work / 'out'}", *SETTINGS])
        )
    except ValueError as exc:
        outcome.refused = str(exc)
        outcome.refused_why = getattr(exc, "reason", None) or str(exc).split(REFUSAL, 1)[-1]
        return outcome
    return recorded(outcome, target, summary)


def recorded(outcome: Outcome, target: Path, summary: dict) -> Outcome:
    """What the command chose (drafter.json), what its steps recorded, and both lossless checks."""
    paths = summary["paths"]
    record = json.loads(Path(summary["out"], "drafter.json").read_text())
    outcome.derived = {d["what"]: d["value"] for d in record["derived"]}
    provenance = ShardDataset(str(Path(paths["shards"], "train"))).provenance
    outcome.model_class, outcome.taps = provenance.target.loaded_as, list(provenance.taps.layer_ids)
    outcome.attention, outcome.dtype = provenance.target.attn_implementation, provenance.compute_dtype
    outcome.mask_token_id = summary["mask_token"]["id"]
    outcome.export = json.loads(Path(paths["export"], "config.json").read_text())
    arch = check_architecture(target)
    outcome.embed_tensor, outcome.head_tensor, outcome.embed_scale = (
        arch.embed_tensor,
        arch.head_tensor,
        arch.embed_scale,
    )
    outcome.lossless, outcome.decoding_path = summary["specdecode"]["lossless"], summary["specdecode"]["decoding_path"]
    outcome.tokens = json.loads(Path(paths["specdecode"]).read_text())["summary"]["new_tokens"]
    heldout, new_tokens = summary["prompts"]["files"]["heldout"], summary["specdecode"]["max_new_tokens"]
    loaded = load_target(str(target), dtype=outcome.dtype, attn_implementation=outcome.attention, device="cpu")
    prompts = prompts_from_jsonl(heldout, loaded.tokenizer, None)
    drafter = load_exported(Path(paths["export"]), dtype=getattr(torch, outcome.dtype))
    spec = SpecTarget(loaded, drafter.target_layer_ids, stop_token_ids(loaded))
    greedy = [greedy_generate(spec, prompt, new_tokens).tokens for prompt in prompts]
    outcome.quick_start_lossless = quick_start(spec, drafter, prompts, greedy, new_tokens)
    exported = dflash2_export(target, Path(paths["run"]), Path(summary["out"]))
    # The first DFLASH2_TOKENS of each greedy continuation (its prefix: greedy decoding is deterministic).
    tokens = min(new_tokens, DFLASH2_TOKENS)
    outcome.dflash2_lossless, outcome.dflash2_reference_lossless, outcome.dflash2_reference_note = dflash2_decodings(
        spec, exported, prompts, [g[:tokens] for g in greedy], tokens
    )
    return outcome


def quick_start(spec: SpecTarget, drafter, prompts: list, greedy: list, new_tokens: int) -> bool:
    """Whether the export's own `spec_generate` (z-lab's quick start) equals the target's greedy
    decoding on every prompt, the target run as the command ran it (its dtype and kernel)."""
    lossless = True
    for prompt, tokens in zip(prompts, greedy, strict=True):
        quick = drafter.spec_generate(
            target=spec.model, input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, stop_token_ids=spec.stop_ids
        )
        lossless &= quick[0, len(prompt) :].tolist() == tokens
    return lossless


def dflash2_export(target: Path, run: Path, out: Path) -> Path:
    """The run's last DFlash checkpoint as a DFlash2 drafter (module docstring) in its own run directory,
    exported by the export command for the target; the export's path."""
    from train import checkpoint as ck
    from train.serve.export import main as export_main

    last = ck.latest_checkpoint(run / "checkpoints")
    cfg = DrafterConfig.from_dict(json.loads((last / ck.DRAFTER_CONFIG_FILE).read_text()))
    cfg = dataclasses.replace(cfg, arch="dflash2", selector_rank=16, selector_top_k=8, conv_group_size=8)
    drafter = build_drafter(cfg)
    warm_start(drafter, last)  # every DFlash tensor, strictly; the convolutions and the selector at their init
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "selector" in name:  # around the identity / the fresh selector, not on them
                p.add_(torch.randn(p.shape, generator=generator) * (0.5 if "codebook" in name else 0.05))
    state = json.loads((last / ck.STATE_FILE).read_text())
    snapshot = ck.take_snapshot(state["step"], drafter, torch.optim.AdamW(drafter.parameters()), state, cfg.to_dict())
    (out / "run-dflash2").mkdir()
    (out / "run-dflash2" / "run.json").write_bytes((run / "run.json").read_bytes())  # the target it trained on
    checkpoint = ck.write_checkpoint(out / "run-dflash2" / "checkpoints", snapshot)
    if export_main([str(checkpoint), str(out / "export-dflash2"), f"target={target}", "dtype=float32"]) != 0:
        raise AssertionError(f"the export command failed on the DFlash2 checkpoint {checkpoint}")
    return out / "export-dflash2"


def dflash2_decodings(spec: SpecTarget, exported: Path, prompts: list, greedy: list, new_tokens: int):
    """(our loop lossless on every prompt, z-lab's reference loop lossless or None, why it did not run or None).

    z-lab's loop keeps the target's cache in a `DynamicCache(config=...)` that it crops after every
    round; on a hybrid target (recurrent layers) the installed transformers fails inside that loop, which
    is recorded as the reason rather than raised (on any other target an error is raised)."""
    drafter = load_exported(exported, dtype=spec.embed_VD.dtype)
    assert type(drafter).__name__ == "DFlash2DraftModel"
    proposer = DFlashProposer(drafter, spec)
    ours = all(
        speculative_generate(spec, proposer, p, new_tokens).tokens == g for p, g in zip(prompts, greedy, strict=True)
    )
    try:
        from dflash.model import DFlash2DraftModel, dflash_generate
    except ImportError:
        return ours, None, NO_REFERENCE
    reference = DFlash2DraftModel.from_pretrained(str(exported), dtype=spec.embed_VD.dtype).eval()
    layer_types = getattr(spec.target.text_config, "layer_types", None) or []
    hybrid = any(t not in ("full_attention", "sliding_attention") for t in layer_types)
    theirs = True
    for prompt, tokens in zip(prompts, greedy, strict=True):
        try:
            with warnings.catch_warnings():  # z-lab's loop passes `past_key_values`, which transformers deprecates
                warnings.simplefilter("ignore", FutureWarning)
                output = dflash_generate(
                    reference, spec.model, torch.tensor([prompt]), new_tokens, sorted(spec.stop_ids)
                )
        except Exception as exc:  # noqa: BLE001 - only on a hybrid target, named in the row
            if not hybrid:
                raise
            return ours, None, f"z-lab's loop fails on the hybrid cache ({type(exc).__name__})"
        theirs &= output[0, len(prompt) :].tolist() == tokens
    return ours, theirs, None
