"""Our exported `dflash.py` driven by a loop that keeps the contract of z-lab's `dflash_generate` (their
benchmark's decoding loop, model code 10129599), written here from that contract (issue 28):

- the drafter's cache is `transformers.DynamicCache(config=drafter.config)` with past recording on:
  its sliding layers hand back only the last `sliding_window - 1` cached keys (plus the new ones),
  while `get_seq_length()` counts every token seen;
- each round calls `drafter(target_hidden=features of the positions not in the draft cache,
  noise_embedding=the target's embedding of [anchor, mask x (n-1)], position_ids=[first uncached
  position, anchor + n), past_key_values=cache, use_cache=True)`, keeps the last n-1 hidden states,
  crops the cache back to the anchor position and asks `drafter.compute_logits(hidden, lm_head)` for
  the draft logits (n = the block size, or what the token budget leaves);
- the target verifies [anchor, drafts] in one forward; the agreeing drafts and the target's next
  token are kept.

At temperature 0 such a loop must give the target's own greedy tokens, and, the drafts being a pure
function of the drafter's inputs, exactly the rounds of the export's own `spec_generate` (which keeps
every cached key): before the fix the exported class had no `compute_logits` and, with one, built its
mask from `get_seq_length()` and failed on the sliding layers' shorter key tensors."""

from __future__ import annotations

import torch

from tests.train.serve.test_specdecode import (
    LAYER_IDS,
    MASK,
    drafter_config,
    greedy_generate,
    random_prompts,
    tiny_qwen3,
    train_drafter,
)
from train.export_format.layout import export_drafter
from train.serve.spec_target import SpecTarget


def contract_loop(drafter, target, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int], int, object]:
    """(generated tokens, tokens each round added, how many leading rounds drafted a whole block, the draft
    cache), greedy, per the module docstring."""
    from transformers import DynamicCache

    block_size, embed, head = drafter.block_size, target.get_input_embeddings(), target.lm_head
    draft_cache = DynamicCache(config=drafter.config)
    draft_cache.activate_past_recording()
    target_cache = DynamicCache(config=target.config)

    def verify(ids: list[int], first: int):
        out = target(
            torch.tensor([ids]),
            position_ids=torch.arange(first, first + len(ids))[None],
            past_key_values=target_cache,
            use_cache=True,
            output_hidden_states=True,
        )
        taps = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
        return out.logits.argmax(-1)[0].tolist(), taps

    with torch.inference_mode():
        greedy, features = verify(prompt, 0)
        tokens, start, limit, rounds = list(prompt) + [greedy[-1]], len(prompt), len(prompt) + max_new_tokens, []
        whole = None
        while start + 1 < limit:
            n = min(block_size, limit - start)
            if n < block_size and whole is None:
                whole = len(rounds)
            block = [tokens[start]] + [drafter.mask_token_id] * (n - 1)
            if n > 1:
                hidden = drafter(
                    target_hidden=features,
                    noise_embedding=embed(torch.tensor([block])),
                    position_ids=torch.arange(start - features.shape[1], start + n)[None],
                    past_key_values=draft_cache,
                    use_cache=True,
                )[:, 1 - n :, :]
                draft_cache.crop(start - draft_cache.get_seq_length())
                block[1:] = drafter.compute_logits(hidden, head).argmax(-1)[0].tolist()
            greedy, taps = verify(block, start)
            accepted = 0
            while accepted < n - 1 and block[1 + accepted] == greedy[accepted]:
                accepted += 1
            produced = min(accepted + 1, limit - start - 1)
            tokens[start + 1 :] = block[1 : accepted + 1] + [greedy[accepted]]
            tokens = tokens[: start + 1 + produced]
            start += produced
            target_cache.crop(start - target_cache.get_seq_length())
            features = taps[:, :produced]
            rounds.append(produced)
    return tokens[len(prompt) :], rounds, len(rounds) if whole is None else whole, draft_cache


def test_zlabs_loop_drives_our_export_with_a_sliding_window_cache(tmp_path):
    from transformers import AutoModel

    torch.manual_seed(0)
    target = SpecTarget.from_model(tiny_qwen3(seed=0, dtype=torch.float32), LAYER_IDS, stop_ids=[])
    prompts = random_prompts(3, lengths=(14, 20, 9), seed=11)
    cfg = drafter_config(num_hidden_layers=3, layer_types="sliding_then_full", sliding_window=8)
    trained = train_drafter(target, prompts, new_tokens=40, steps=60, config=cfg)
    export_drafter(trained.state_dict(), cfg, tmp_path / "d", dtype="float32")
    drafter = AutoModel.from_pretrained(str(tmp_path / "d"), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(drafter).__module__.endswith("dflash") and drafter.mask_token_id == MASK
    all_rounds = []
    for prompt in prompts:
        tokens, rounds, whole, cache = contract_loop(drafter, target.model, prompt, 40)
        assert tokens == greedy_generate(target, prompt, 40).tokens  # lossless
        own = drafter.spec_generate(target=target.model, input_ids=torch.tensor([prompt]), max_new_tokens=40)
        assert own[0, len(prompt) :].tolist() == tokens
        # The same drafts round for round, while both loops draft whole blocks (z-lab's shortens the last ones).
        assert whole >= 2 and rounds[:whole] == drafter.last_acceptance_lengths[:whole]
        all_rounds += rounds
        sliding = cache.layers[0]
        assert sliding.get_seq_length() > sliding.keys.shape[-2] == cfg.sliding_window - 1  # keys were dropped
    assert max(all_rounds) > 2, all_rounds  # accepted drafts were exercised, not only τ = 1


def test_compute_logits_is_the_target_head_on_the_hidden_states(tmp_path):
    from transformers import AutoModel

    cfg = drafter_config()
    from train.model import DFlashDrafter

    export_drafter(DFlashDrafter(cfg).state_dict(), cfg, tmp_path / "d", dtype="float32")
    drafter = AutoModel.from_pretrained(str(tmp_path / "d"), trust_remote_code=True, dtype=torch.float32)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(torch.float64)
    hidden = torch.randn(1, 5, cfg.hidden_size)
    assert torch.equal(drafter.compute_logits(hidden, head), head(hidden.double()))
