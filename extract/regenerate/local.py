"""The `local` backend: batched generation in this process with transformers, a KV cache, greedy or
sampled; under `torchrun` each rank answers its share of the records (position % world size).

`generate_batch` decodes left-padded prompts together: position ids count each row's real tokens
and padding is masked out, so every row decodes as it would alone (tests hold it to transformers'
`generate`, one prompt at a time). Rows that finish are dropped from the batch (and its cache) once
a quarter of the batch has finished. Sampling draws each row's token at each step from a hash of
the row's seed (from seed, record id and turn) and the step, so an answer does not depend on which
records share its batch, and a rerun after a kill samples the same answer.

`answer_window` answers a window of conversations turn by turn: all first answers (batched by
prompt length), then all second answers, and so on. The tiny build (`recipes.tiny`) regenerates
its corpus through this same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xxhash

from common.repeat import RepeatWatch
from extract.regenerate.conversation import Conversation, Generated
from target.static_cache import cache_kwarg

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def answer_seed(seed: int, record_id: str, turn: int) -> int:
    """The seed of one answer: a function of the run's seed, the record and the turn only."""
    return xxhash.xxh3_64_intdigest(f"{seed}:{record_id}:{turn}".encode()) & ((1 << 63) - 1)


def answer_stop_ids(model, tokenizer) -> set[int]:
    """Ids that end an answer: the generation config's EOS ids and the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def pad_token_id(tokenizer) -> int:
    return next((int(i) for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)


# ----------------------------------------------------------------------------------------------
# Decoding


def generate_answers(
    model,
    prompts: list[list[int]],
    max_new_tokens: int | Sequence[int],
    batch_size: int,
    stop_ids: set[int],
    pad_id: int,
    sampling: Sampling = Sampling(),
    seeds: Sequence[int] | None = None,
    on_batch: Callable[[int], None] | None = None,
    stop_repeat: int = 0,
    cache: str = "dynamic",
) -> list[tuple[list[int], str]]:
    """(tokens before the first stop token, how the answer ended: see `generate_batch`) per prompt,
    at most `max_new_tokens` generated (one cap, or one per prompt); prompts batched by length (less
    padding), results in input order."""
    caps = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    results: list[tuple[list[int], str]] = [([], "cap")] * len(prompts)
    for at in range(0, len(order), batch_size):
        batch = order[at : at + batch_size]
        batch_seeds = None if seeds is None else [seeds[i] for i in batch]
        for i, answer in zip(
            batch,
            generate_batch(
                model,
                [prompts[i] for i in batch],
                [caps[i] for i in batch],
                stop_ids,
                pad_id,
                sampling,
                batch_seeds,
                stop_repeat,
                cache,
            ),
            strict=True,
        ):
            results[i] = answer
        if on_batch is not None:
            on_batch(len(batch))
    return results


def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int | Sequence[int],
    stop_ids: set[int],
    pad_id: int,
    sampling: Sampling = Sampling(),
    seeds: Sequence[int] | None = None,
    stop_repeat: int = 0,
    cache: str = "dynamic",
) -> list[tuple[list[int], str]]:
    """Decoding of left-padded prompts with a KV cache (see the module docstring). Each answer ends
    before its first stop token ("stop"), where it starts looping if `stop_repeat` > 0 ("repeat":
    `common.repeat.RepeatWatch`; the looping tokens that show it are kept), or after
    `max_new_tokens` tokens ("cap"; one cap for all rows, or one per row). `cache`: "dynamic"
    (transformers' growing cache), "static" (`static_batch`: a static cache, each step a CUDA graph
    on CUDA) or "auto" (`batch_decoder`)."""
    import torch

    caps = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    max_new_tokens = max(caps)

    device = model.get_input_embeddings().weight.device
    rows, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    decoder = batch_decoder(model, input_ids.to(device), mask.to(device), max_new_tokens, cache)
    seeds_B = None
    if not sampling.greedy:
        seeds_B = torch.tensor([int(x) for x in (seeds if seeds is not None else range(rows))], device=device)
    tokens: list[list[int]] = [[] for _ in prompts]
    ends: list[str | None] = [None] * rows
    alive = list(range(rows))  # batch row -> prompt index
    watch = RepeatWatch(rows, max_new_tokens, stop_repeat) if stop_repeat else None
    with torch.inference_mode():
        logits = decoder.prefill()
        for step in range(max_new_tokens):
            next_ids = logits.argmax(-1) if seeds_B is None else sample_rows(logits, sampling, seeds_B, step)
            next_list = next_ids.tolist()
            looping = watch.push(next_list) if watch else [False] * len(alive)
            for row, token, loops in zip(alive, next_list, looping, strict=True):
                if ends[row] is not None:
                    continue
                if token in stop_ids:
                    ends[row] = "stop"
                else:
                    tokens[row].append(token)
                    if loops:
                        ends[row] = "repeat"
                    elif len(tokens[row]) >= caps[row]:
                        ends[row] = "cap"  # this row's own cap, below the batch's
            running = [n for n, row in enumerate(alive) if ends[row] is None]
            if not running or step == max_new_tokens - 1:
                break
            if 4 * (len(alive) - len(running)) >= len(alive):
                keep = torch.tensor(running, device=device)
                decoder.keep(keep)
                next_ids = next_ids[keep]
                seeds_B = seeds_B[keep] if seeds_B is not None else None
                if watch:
                    watch.keep_rows(running)
                alive = [alive[n] for n in running]
            logits = decoder.step(next_ids)
    return [(t, end or "cap") for t, end in zip(tokens, ends, strict=True)]


CACHES = ("auto", "static", "dynamic")


def batch_decoder(model, ids_BW: torch.Tensor, real_BW: torch.Tensor, max_new_tokens: int, cache: str):
    """The decoding state of one batch: `prefill()` -> logits [B, V], `step(next_ids_B)` -> logits,
        `keep(rows)`. "auto" takes the static cache on CUDA where the model's layers allow it (on a CPU,
    attending over every slot of a static cache costs more than the dynamic cache saves)."""
    # static_batch imports torch, and this module is imported by `python -m recipes.tiny --help` (its
    # recipe digest), which answers before torch loads.
    from extract.regenerate.static_batch import StaticBatch, new_static_cache

    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, not {cache!r}")
    if cache == "static" or (cache == "auto" and ids_BW.device.type == "cuda"):
        static = new_static_cache(model, ids_BW.shape[1] + max_new_tokens)
        if static is not None:
            return StaticBatch(model, static, ids_BW, real_BW, graphs=True)
        if cache == "static":
            raise ValueError("cache='static': this model's cache layers are not all full attention; use 'auto'")
    return DynamicBatch(model, ids_BW, real_BW)


class DynamicBatch:
    """One batch on transformers' dynamic cache: the mask grows by a column per step."""

    def __init__(self, model, ids_BW: torch.Tensor, real_BW: torch.Tensor):
        self.model, self.ids_BW, self.mask = model, ids_BW, real_BW
        self.positions = (real_BW.cumsum(1) - 1).clamp(min=0)
        self.cache_kwarg = cache_kwarg(model)

    def prefill(self) -> torch.Tensor:
        out = self.model(
            input_ids=self.ids_BW,
            attention_mask=self.mask,
            position_ids=self.positions,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache, self.last = cache_of(out), self.positions[:, -1:]
        return out.logits[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        select_cache_rows(self.cache, rows)
        self.mask, self.last = self.mask[rows], self.last[rows]

    def step(self, next_ids_B: torch.Tensor) -> torch.Tensor:
        import torch

        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.mask), 1))], dim=1)
        self.last = self.last + 1
        out = self.model(
            input_ids=next_ids_B[:, None],
            attention_mask=self.mask,
            position_ids=self.last,
            use_cache=True,
            **{self.cache_kwarg: self.cache},
        )
        self.cache = cache_of(out)
        return out.logits[:, -1]


def cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def select_cache_rows(cache, keep: torch.Tensor) -> None:
    """Keep only the rows `keep` of a KV cache. Linear-attention layers (Qwen3.5/3.6 Gated DeltaNet:
    conv and recurrent states) have no `batch_select_indices` in transformers 5.x; their
    `reorder_cache` selects rows the same way."""
    layers = getattr(cache, "layers", None)
    if layers is None or all(hasattr(layer, "batch_select_indices") for layer in layers):
        cache.batch_select_indices(keep)
        return
    for layer in layers:
        select = getattr(layer, "batch_select_indices", None) or layer.reorder_cache
        select(keep)


def sample_rows(logits_RV: torch.Tensor, sampling: Sampling, seeds_R: torch.Tensor, step: int) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), cut to top-k and top-p, by inverting the
    row's distribution at one uniform draw `row_uniforms(seeds_R, step)`: a row's tokens depend on its
    seed and the step only, never on which rows share its batch, and the whole batch draws in a few
    kernels (one generator per row cost a launch per row per step: half of a sampled regeneration's time)."""
    import torch

    scores_RV = logits_RV.float() / sampling.temperature
    if sampling.top_k:
        kth_R1 = torch.topk(scores_RV, min(sampling.top_k, scores_RV.shape[-1]), dim=-1).values[:, -1:]
        scores_RV = scores_RV.masked_fill(scores_RV < kth_R1, float("-inf"))
    if sampling.top_p < 1.0:
        scores_RV = cut_top_p(scores_RV, sampling.top_p)
    # float64: the running sum over 49 K tokens keeps every kept token's own share of the mass.
    cdf_RV = scores_RV.softmax(-1).double().cumsum(-1)
    target_R1 = (row_uniforms(seeds_R, step) * cdf_RV[:, -1])[:, None]
    # The first token whose running sum passes the draw: a dropped token (probability 0) never does.
    index_R = torch.searchsorted(cdf_RV, target_R1, right=True)[:, 0]
    return index_R.clamp(max=scores_RV.shape[-1] - 1)


TOP_P_CANDIDATES = 256


def cut_top_p(scores_RV: torch.Tensor, top_p: float, candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """`scores_RV` with -inf for every token outside its row's nucleus: the tokens ranked after the
    first ones whose probabilities sum to `top_p` (the top token is always kept).

    A row's nucleus is found among its `candidates` best tokens (one top-k, no sort of the vocabulary:
    a full sort of 1,024 x 49 K scores per step cost more than the model's step) whenever those hold
    `top_p` of its mass; only the rows whose nucleus is wider are sorted in full."""
    import torch

    V = scores_RV.shape[-1]
    K = min(int(candidates), V)
    top_RK, order_RK = scores_RV.topk(K, dim=-1)  # sorted, best first
    p_RK = (top_RK - torch.logsumexp(scores_RV, -1, keepdim=True)).exp()
    before_RK = p_RK.cumsum(-1) - p_RK  # mass of the tokens ranked above
    inside_R = before_RK[:, -1] + p_RK[:, -1] >= top_p  # the K candidates hold the nucleus
    cut_RV = torch.full_like(scores_RV, float("-inf")).scatter(
        -1, order_RK, top_RK.masked_fill(before_RK >= top_p, float("-inf"))
    )
    if K == V or bool(inside_R.all()):
        return cut_RV
    wide_W = (~inside_R).nonzero()[:, 0]
    cut_RV[wide_W] = _cut_top_p_sorted(scores_RV[wide_W], top_p)
    return cut_RV


def _cut_top_p_sorted(scores_RV: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_RV, order_RV = scores_RV.sort(dim=-1, descending=True)
    p_RV = sorted_RV.softmax(-1)
    before_RV = p_RV.cumsum(-1) - p_RV
    return scores_RV.scatter(-1, order_RV, sorted_RV.masked_fill(before_RV >= top_p, float("-inf")))


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), in 16-bit halves so that no product overflows int64."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" constants): every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_uniforms(seeds_R: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform draw in (0, 1) per row (float64), a hash of (the row's 63-bit seed, `step`): the same
    integers, so the same draws, on every device."""
    import torch

    seeds_R = seeds_R.to(torch.int64)
    x = _mix32(((seeds_R >> 32) & _M32) ^ 0x9E3779B9)
    x = _mix32(x ^ (seeds_R & _M32))
    x = _mix32(x ^ (int(step) & _M32))
    return (x.double() + 0.5) / 2.0**32


# ----------------------------------------------------------------------------------------------
# Conversations


@dataclasses.dataclass
class LocalGenerator:
    """A loaded model and how it answers: what `answer_window` needs."""

    model: object
    tokenizer: object
    max_new_tokens: int
    batch_size: int
    sampling: Sampling = Sampling()
    seed: int = 0
    stop_ids: set[int] | None = None
    stop_repeat: int = 0  # > 0: cut answers where they start looping (`generate_batch`)
    cache: str = "dynamic"  # the KV cache of batched decoding (`batch_decoder`)

    def __post_init__(self):
        if self.stop_ids is None:
            self.stop_ids = answer_stop_ids(self.model, self.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer)


def answer_window(
    conversations: list[Conversation], generator: LocalGenerator, on_batch: Callable[[int], None] | None = None
) -> None:
    """Answer every conversation, turn by turn (all answers of one depth batched together)."""
    while True:
        todo = [c for c in conversations if c.wants_turn()]
        if not todo:
            return
        prompts = [c.prompt()[1] for c in todo]
        caps = [c.answer_budget(generator.max_new_tokens) for c in todo]  # never past the target's context
        seeds = (
            None
            if generator.sampling.greedy
            else [answer_seed(generator.seed, c.record_id, c.stats["answers"]) for c in todo]
        )
        answers = generate_answers(
            generator.model,
            prompts,
            caps,
            generator.batch_size,
            generator.stop_ids,
            generator.pad_id,
            generator.sampling,
            seeds,
            on_batch,
            generator.stop_repeat,
            generator.cache,
        )
        for conversation, (ids, end) in zip(todo, answers, strict=True):
            conversation.finish_turn(Generated(ids=ids, at_cap=end == "cap", at_repeat=end == "repeat"))
