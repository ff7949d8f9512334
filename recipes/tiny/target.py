"""The tiny default's target: a small Qwen3 trained by next-token prediction on the rendered training
conversations (`build_tiny_target`), saved in bf16 as a Hugging Face directory, with its held-out
next-token accuracy against always predicting the most frequent token.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.schedule import warmup_cosine
from recipes.tiny.chat import EOS_TOKEN, IM_END, MASK_TOKEN, MODEL_MAX_LENGTH, build_chat_tokenizer
from recipes.tiny.compute import Compute, build_compute
from recipes.tiny.config import TinyConfig, resolve_precision
from recipes.tiny.corpus import record_texts
from target.rules import tap_layer_ids

if TYPE_CHECKING:  # heavy imports stay inside the functions: importing this module does no work
    import torch
    import transformers


EVAL_BATCH_TOKENS = 8192
# Batch widths are rounded up to this: oneDNN keeps kernels per tensor shape, and with every width
# possible the bf16 training grew to several GB of memory.
PAD_MULTIPLE = 32


def render_record(tokenizer, record: dict) -> str:
    """The text the target is trained on: the chat template for conversations, text + EOS otherwise."""
    if "messages" in record:
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    return record["text"] + EOS_TOKEN


def encode_records(tokenizer, records: list[dict], max_len: int) -> list[list[int]]:
    texts = [render_record(tokenizer, r) for r in records]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [ids[:max_len] for ids in encoded]


def qwen3_config(cfg: TinyConfig, tokenizer) -> transformers.Qwen3Config:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},  # Qwen3's value
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # like the real target: a separate lm_head
        bos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )


def generation_config(tokenizer) -> transformers.GenerationConfig:
    from transformers import GenerationConfig

    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(EOS_TOKEN)]
    return GenerationConfig(bos_token_id=eos[1], eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False)


def length_batches(lengths: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped so each batch holds sequences of similar length and at most `batch_tokens`
    padded tokens (widths rounded up to `PAD_MULTIPLE`; one over-long sequence is a batch of its
    own); batch order shuffled. Lengths
    are compared in steps of 16 tokens, so batches are composed differently from epoch to epoch."""
    noise = [rng.random() for _ in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i] // 16, noise[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        width = max(width, padded_width(lengths[i])) if current else padded_width(lengths[i])
        if current and (len(current) + 1) * width > batch_tokens:
            batches.append(current)
            current, width = [], padded_width(lengths[i])
        current.append(i)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def padded_width(length: int) -> int:
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE


def collate(seqs: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask, and labels with -100 on padding."""
    import torch

    width = padded_width(max(len(s) for s in seqs))
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def endless_batches(seqs: list[list[int]], batch_tokens: int, seed: int) -> Iterator[list[list[int]]]:
    """Epoch after epoch of length-grouped batches, reshuffled per epoch from (seed, epoch)."""
    lengths = [len(s) for s in seqs]
    epoch = 0
    while True:
        for batch in length_batches(lengths, batch_tokens, random.Random(f"{seed}/{epoch}")):
            yield [seqs[i] for i in batch]
        epoch += 1


def learning_rate(step: int, cfg: TinyConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to a tenth of it at the last step (0-based `step`)."""
    return warmup_cosine(step, cfg.steps, cfg.warmup_steps, cfg.lr, floor=0.1)


def make_optimizer(model, cfg: TinyConfig) -> torch.optim.Optimizer:
    import torch

    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]  # norms: no decay
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train_target(model, seqs: list[list[int]], cfg: TinyConfig, pad_id: int, progress: bool = True) -> list[float]:
    """Next-token training on every position of the rendered samples, on the model's device (the
    same batches and steps on a CPU and a GPU); returns the loss per step."""
    import torch
    from tqdm.auto import tqdm

    model.train()
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, cfg)
    use_bf16 = resolve_precision(cfg.precision, device.type) == "bf16"
    batches = endless_batches(seqs, cfg.batch_tokens, cfg.seed)
    losses = []
    bar = tqdm(
        range(cfg.steps),
        desc=f"train tiny target ({device.type})",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
    )
    tokens, start = 0, time.perf_counter()
    for step in bar:
        batch = {name: t.to(device) for name, t in collate(next(batches), pad_id).items()}
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            logits_BTV = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = next_token_loss(logits_BTV, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += int(batch["attention_mask"].sum())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    model.eval()
    return losses


def next_token_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's prediction of the next token (labels -100 skipped),
    computed as log-softmax + gather: torch has no deterministic CUDA kernel for nll_loss."""
    logprobs_BTV = logits_BTV[:, :-1].float().log_softmax(-1)
    targets_BT = labels_BT[:, 1:]
    valid_BT = targets_BT != -100
    picked_BT = logprobs_BTV.gather(-1, targets_BT.clamp(min=0)[..., None])[..., 0]
    return -(picked_BT * valid_BT).sum() / valid_BT.sum().clamp(min=1)


def next_token_accuracy(
    model, seqs: list[list[int]], batch_tokens: int, pad_id: int, masks: list[list[bool]] | None = None
) -> tuple[int, int]:
    """(correct, total) of the model's argmax next-token prediction over every position with a
    successor, or only where the predicted token is marked in `masks`."""
    import torch

    correct = total = 0
    lengths = [len(s) for s in seqs]
    device = next(model.parameters()).device
    with torch.inference_mode():
        for batch_idx in length_batches(lengths, batch_tokens, random.Random(0)):
            batch = {name: t.to(device) for name, t in collate([seqs[i] for i in batch_idx], pad_id).items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            predicted, target = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
            valid = target != -100
            if masks is not None:
                marked = torch.zeros(batch["attention_mask"].shape, dtype=torch.bool)
                for row, i in enumerate(batch_idx):
                    marked[row, : len(masks[i])] = torch.tensor(masks[i], dtype=torch.bool)
                valid &= marked[:, 1:].to(device)
            correct += int((predicted == target)[valid].sum())
            total += int(valid.sum())
    return correct, total


def assistant_masks(tokenizer, records: list[dict], max_len: int) -> list[list[bool]]:
    """Per token of each rendered record (as `encode_records` makes them): True inside an assistant
    answer (its content and closing `<|im_end|>`), the tokens a drafter is trained to propose."""
    masks = []
    for record in records:
        text = render_record(tokenizer, record)
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        spans = assistant_spans(text, record)
        masks.append([any(a <= start < b for a, b in spans) for start, _ in offsets[:max_len]])
    return masks


def assistant_spans(text: str, record: dict) -> list[tuple[int, int]]:
    spans, cursor = [], 0
    for message in record.get("messages", []):
        if message["role"] == "assistant":
            start = text.index(message["content"] + IM_END, cursor)
            cursor = start + len(message["content"]) + len(IM_END)
            spans.append((start, cursor))
    return spans


def frequency_baseline(
    train_seqs: list[list[int]], eval_seqs: list[list[int]], masks: list[list[bool]] | None = None
) -> tuple[int, float]:
    """(token, accuracy): always predicting the token most frequent as a training target, scored
    like `next_token_accuracy` (every position with a successor, or only the marked ones)."""
    from collections import Counter

    counts = Counter(t for s in train_seqs for t in s[1:])
    token = min(counts, key=lambda t: (-counts[t], t))
    targets = [t for i, s in enumerate(eval_seqs) for j, t in enumerate(s) if j > 0 and (masks is None or masks[i][j])]
    return token, sum(t == token for t in targets) / max(1, len(targets))


def length_summary(seqs: list[list[int]]) -> dict[str, Any]:
    lengths = sorted(len(s) for s in seqs)
    if not lengths:
        return {"records": 0, "tokens": 0}

    def pick(q: float) -> int:
        return lengths[round(q * (len(lengths) - 1))]

    edges = [128, 512, 1024, 2048]
    buckets = {}
    for lo, hi in zip([0] + edges, edges + [None], strict=True):
        name = f"{lo}-{hi - 1}" if hi else f"{lo}+"
        buckets[name] = sum(1 for n in lengths if n >= lo and (hi is None or n < hi))
    return {
        "records": len(lengths),
        "tokens": sum(lengths),
        "length_min": lengths[0],
        "length_p10": pick(0.1),
        "length_p50": pick(0.5),
        "length_p90": pick(0.9),
        "length_max": lengths[-1],
        "records_by_length": buckets,
    }


def build_tiny_target(
    out_dir: str | os.PathLike,
    train_records: list[dict],
    heldout_records: list[dict],
    cfg: TinyConfig | None = None,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Train the tokenizer and a small Qwen3 on `train_records`, save an HF directory to `out_dir`,
    measure held-out next-token accuracy of the saved (bf16) model, write `tiny_report.json`.

    Returns the report. `out_dir` gets `config.json`, `model.safetensors` (bf16),
    `generation_config.json`, the tokenizer files with the chat template, and `tiny_report.json`.
    """
    cfg = cfg or TinyConfig()
    if not train_records or not heldout_records:
        raise ValueError("build_tiny_target needs training and held-out records")
    out = Path(out_dir)
    started = time.perf_counter()
    with build_compute(cfg) as compute:
        report = train_and_report(out, train_records, heldout_records, cfg, compute, progress, started)
    report["gpu_nondeterministic_ops"] = compute.nondeterministic_ops
    (out / "tiny_report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def train_and_report(
    out: Path,
    train_records: list[dict],
    heldout_records: list[dict],
    cfg: TinyConfig,
    compute: Compute,
    progress: bool,
    started: float,
) -> dict[str, Any]:
    tokenizer = build_chat_tokenizer(record_texts(train_records), cfg.vocab_size)
    train_seqs = encode_records(tokenizer, train_records, cfg.max_len)
    heldout_seqs = encode_records(tokenizer, heldout_records, cfg.max_len)
    losses = train_and_save(out, tokenizer, train_seqs, cfg, compute.device, progress)
    train_seconds = time.perf_counter() - started
    report = {
        **evaluate_saved(out, tokenizer, train_seqs, heldout_seqs, heldout_records, cfg, compute.device),
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else None,
        "tap_layer_ids": tap_layer_ids(cfg.num_layers, cfg.n_taps),
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": len(tokenizer),
        "mask_token": MASK_TOKEN,
        "mask_token_id": tokenizer.mask_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "im_end_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "chat_template": "qwen3-style; enable_thinking=False adds an empty <think> block (see recipes/tiny/)",
        "device": compute.device.type,
        "precision": resolve_precision(cfg.precision, compute.device.type),
        "threads": torch_threads(),
        "train_seconds": round(train_seconds, 1),
        "corpus": {"train": length_summary(train_seqs), "heldout": length_summary(heldout_seqs)},
    }
    return report


def train_and_save(
    out: Path, tokenizer, train_seqs: list[list[int]], cfg: TinyConfig, device: torch.device, progress: bool
) -> list[float]:
    """Train a fresh Qwen3 from `cfg.seed` on `device`; save it in bf16 (as the real target ships) with the
    tokenizer."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(qwen3_config(cfg, tokenizer))  # initialized on the CPU: the same weights on every device
    model.generation_config = generation_config(tokenizer)
    losses = train_target(model.to(device), train_seqs, cfg, tokenizer.pad_token_id, progress)
    model.to("cpu", torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return losses


def evaluate_saved(
    out: Path,
    tokenizer,
    train_seqs: list[list[int]],
    heldout_seqs: list[list[int]],
    heldout_records: list[dict],
    cfg: TinyConfig,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Next-token accuracy of the model as saved (reloaded in bf16, as extraction will run it), on
    every held-out position and on answer tokens only, against always predicting the most
    frequent token; plus the accuracy on as many training samples, to show the generalization gap."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, trust_remote_code=False).to(device).eval()
    pad = tokenizer.pad_token_id
    answers = assistant_masks(tokenizer, heldout_records, cfg.max_len)
    correct, total = next_token_accuracy(model, heldout_seqs, EVAL_BATCH_TOKENS, pad)
    answer_correct, answer_total = next_token_accuracy(model, heldout_seqs, EVAL_BATCH_TOKENS, pad, answers)
    train_correct, train_total = next_token_accuracy(model, train_seqs[: len(heldout_seqs)], EVAL_BATCH_TOKENS, pad)
    baseline_token, baseline = frequency_baseline(train_seqs, heldout_seqs)
    _, answer_baseline = frequency_baseline(train_seqs, heldout_seqs, answers)
    return {
        "heldout_next_token_accuracy": correct / max(1, total),
        "heldout_positions": total,
        "heldout_answer_next_token_accuracy": answer_correct / max(1, answer_total),
        "heldout_answer_positions": answer_total,
        "train_probe_next_token_accuracy": train_correct / max(1, train_total),
        "most_frequent_token_accuracy": baseline,
        "most_frequent_token_answer_accuracy": answer_baseline,
        "most_frequent_token": tokenizer.convert_ids_to_tokens(baseline_token),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
