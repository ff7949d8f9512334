"""The baselines any user of transformers has without a drafter, decoded beside ours on the same
prompts: `model.generate` greedy ("generate") and prompt-lookup decoding ("prompt_lookup",
`prompt_lookup_num_tokens`: drafts copied from earlier n-grams of the prompt and the output, verified
by the target), and `generate` with a static cache ("generate_static", `cache_implementation="static"`,
which transformers compiles with CUDA graphs on a GPU: the fastest plain decoding it offers). All are
greedy, so all must produce target-only greedy decoding's tokens; each is timed over its whole call
(wall clock, prefill included), as a user would time it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from train.serve.cli import PEERS
from train.serve.decoding import Generation


@torch.inference_mode()
def hf_generate(
    target, prompt_ids: Sequence[int], max_new_tokens: int, *, prompt_lookup: int | None = None, static: bool = False
):
    """transformers' own greedy decoding of one prompt (prompt-lookup decoding with `prompt_lookup`
    draft tokens; with `static`, a static cache, which transformers compiles the forward for on CUDA),
    as a `train.serve.decoding.Generation` (tokens after the prompt, up to and with the first stop
    token; its time all in `decode_s`)."""
    model = target.model
    ids_1T = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    stops = sorted(target.stop_ids)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops or None,
        pad_token_id=stops[0] if stops else 0,
        attention_mask=torch.ones_like(ids_1T),
    )
    if prompt_lookup is not None:
        kwargs["prompt_lookup_num_tokens"] = int(prompt_lookup)
    if static:
        kwargs["cache_implementation"] = "static"
    started = time.perf_counter()
    out = model.generate(ids_1T, **kwargs)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    seconds = time.perf_counter() - started
    tokens = [int(t) for t in out[0, ids_1T.shape[1] :].tolist()]
    stop_at = next((i for i, t in enumerate(tokens) if t in target.stop_ids), None)
    if stop_at is not None:
        tokens = tokens[: stop_at + 1]
    stop = "eos" if stop_at is not None else "length"
    return Generation(prompt_len=len(prompt_ids), tokens=tokens, stop=stop, decode_s=seconds)


def peer_generate(name: str, target, prompt_ids: Sequence[int], max_new_tokens: int, lookup_tokens: int):
    assert name in PEERS, name
    lookup = lookup_tokens if name == "prompt_lookup" else None
    return hf_generate(target, prompt_ids, max_new_tokens, prompt_lookup=lookup, static=name == "generate_static")
