"""The tiny default's regenerated corpus (`recipes.tiny.regenerate`): the target's own greedy answers."""

from __future__ import annotations

import random

import torch

from recipes.tiny import (
    TinyConfig,
    build_tiny_target,
)
from recipes.tiny import regenerate as tiny_regen
from tests.common.test_repeat import first_loop_reference
from tests.recipes.tiny import TINY_MODEL


def round_trip_length(tok, prompt: str, prompt_ids: list[int], answer: list[int]) -> int:
    """The kept length of an answer to "Say it." as the regeneration decides it (`fitted_length`)."""
    from extract.regenerate.conversation import Renderer, fitted_length

    no_thinking = {"enable_thinking": False}
    renderer = Renderer(tok, "disable", no_thinking, no_thinking)
    return fitted_length(renderer, [{"role": "user", "content": "Say it."}], None, prompt, prompt_ids, answer)


def test_an_answer_bpe_would_merge_is_cut_to_what_tokenizes_back(small_tokenizer):
    tok = small_tokenizer
    prompt = tiny_regen.answer_prompt(tok, [{"role": "user", "content": "Say it."}])
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    word = next(t for t, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if len(t) >= 4 and t.isalpha())
    pieces = [tok.convert_tokens_to_ids(c) for c in word]  # one token per letter: BPE would merge them
    whole = tok(prompt + "ok", add_special_tokens=False)["input_ids"][len(prompt_ids) :]
    assert round_trip_length(tok, prompt, prompt_ids, whole) == len(whole)
    kept = round_trip_length(tok, prompt, prompt_ids, whole + pieces)
    assert len(whole) <= kept < len(whole) + len(pieces)
    text = tok.decode((whole + pieces)[:kept], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert tok(prompt + text, add_special_tokens=False)["input_ids"] == prompt_ids + (whole + pieces)[:kept]


def test_batched_greedy_decoding_equals_generate_one_prompt_at_a_time(qwen3_model, monkeypatch):
    """Left-padded prompts of different lengths, rows that stop at different steps and are dropped
    from the batch: every row's tokens and stop flag equal transformers' greedy `generate` alone."""
    from transformers import DynamicCache

    model, new_tokens = qwen3_model, 10
    rng = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(10, vocab, (n,), generator=rng).tolist() for n in (3, 17, 8, 25, 5, 12, 30, 9, 14, 4, 21, 7)
    ]

    def generate_alone(prompt, stop):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=sorted(stop) or None,
                pad_token_id=0,
            )
        tokens = out[0, len(prompt) :].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in stop), None)
        return (tokens, "cap") if cut is None else (tokens[:cut], "stop")

    # Stop tokens chosen from the free-running answers so that rows stop at different steps and some never.
    free = [generate_alone(p, set())[0] for p in prompts]
    # (Batches are formed by prompt length: two rows of each batch of 6 get a stop token.)
    stop = {free[0][2], free[9][4], free[5][3], free[1][6]}
    expected = [generate_alone(p, stop) for p in prompts]
    stop_steps = {len(tokens) for tokens, end in expected if end == "stop"}
    assert len(stop_steps) >= 2 and not all(end == "stop" for _, end in expected), (stop_steps, expected)

    drops = []
    real_select = DynamicCache.batch_select_indices
    monkeypatch.setattr(
        DynamicCache, "batch_select_indices", lambda self, keep: (drops.append(len(keep)), real_select(self, keep))[1]
    )
    got = tiny_regen.greedy_answers(model, prompts, new_tokens, batch_size=6, stop_ids=stop, pad_id=0)
    assert got == expected
    assert drops, "no finished row was ever dropped from a batch: the test does not exercise that path"


def test_batched_greedy_decoding_cut_where_it_loops_equals_generate_cut_there(qwen3_model):
    """Rows of a random model loop at different steps: each row stops right after its first
    repetition (as `first_loop_reference` finds it in generate's free-running answer), or at a stop
    token before it, or at the cap; rows are dropped from the batch as they finish."""
    model, new_tokens, min_repeat = qwen3_model, 40, 6
    rng = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, model.config.vocab_size, (n,), generator=rng).tolist()
        for n in (3, 17, 8, 25, 5, 12, 30, 9, 14, 4, 21, 7)
    ]
    free = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0
            )
        free.append(out[0, len(prompt) :].tolist())
    stop = {free[1][20]}  # one stop token, so that a stop before a loop is exercised too
    expected = []
    for tokens in free:
        cut = next((i for i, t in enumerate(tokens) if t in stop), None)
        loop = first_loop_reference(tokens[:cut], min_repeat)
        expected.append(
            (tokens[:loop], "repeat") if loop else (tokens[:cut], "stop") if cut is not None else (tokens, "cap")
        )
    ends = [end for _, end in expected]
    assert {"repeat", "stop", "cap"} <= set(ends) and len({len(t) for t, end in expected if end == "repeat"}) >= 3, (
        expected
    )

    got = tiny_regen.greedy_answers(
        model, prompts, new_tokens, batch_size=6, stop_ids=stop, pad_id=0, stop_repeat=min_repeat
    )
    assert got == expected


def test_round_trip_keeps_the_longest_prefix_that_survives(small_tokenizer):
    tok = small_tokenizer
    prompt = tiny_regen.answer_prompt(tok, [{"role": "user", "content": "Say it."}])
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]

    def survives(answer, n):
        text = tok.decode(answer[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return tok(prompt + text, add_special_tokens=False)["input_ids"] == prompt_ids + answer[:n]

    rng = random.Random(0)
    words = [w for w in tok.get_vocab() if len(w) >= 3]
    for _ in range(40):
        text = "".join(rng.choice(words) for _ in range(4)).replace("Ġ", " ").replace("Ċ", "\n")
        whole = tok(prompt + text, add_special_tokens=False)["input_ids"][len(prompt_ids) :]
        # Split one token of it into its characters: BPE would merge them back.
        at = rng.randrange(len(whole))
        piece = tok.convert_ids_to_tokens(whole[at])
        chars = [tok.convert_tokens_to_ids(c) for c in piece]
        if len(chars) < 2 or tok.unk_token_id in chars:
            continue
        answer = whole[:at] + chars + whole[at + 1 :]
        longest = max((n for n in range(len(answer) + 1) if survives(answer, n)), default=0)
        assert round_trip_length(tok, prompt, prompt_ids, answer) == longest, (text, at)


def test_regenerated_answers_are_the_targets_greedy_decoding(tmp_path, corpus):
    """Against transformers' own `generate` (greedy), one prompt at a time; the batched, left-padded
    decoding must not change a token, and the saved text must tokenize back to the generated ids."""
    from target.load import load_target

    train, heldout = corpus
    # Trained a little, so its greedy answers round-trip through the tokenizer (a near-random model's do not).
    build_tiny_target(tmp_path, train[:200], heldout[:10], TinyConfig(**{**TINY_MODEL, "steps": 60}), progress=False)
    target = load_target(str(tmp_path), dtype="float32")
    model, tok = target.model, target.tokenizer
    multi_turn = {
        "messages": [
            {"role": "user", "content": "Describe `os.path`."},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "And `os.sep`?"},
            {"role": "assistant", "content": "y"},
        ]
    }
    records = heldout[:7] + [multi_turn, {"text": "plain text has no user turn"}]
    out, stats = tiny_regen.regenerate_records(model, tok, records, max_new_tokens=12, batch_size=3)
    alone, _ = tiny_regen.regenerate_records(model, tok, records, max_new_tokens=12, batch_size=1)
    assert out == alone
    assert stats["skipped_no_user_turn"] == 1
    assert (
        stats["records_out"] + stats["dropped_empty_answer"] + stats["skipped_no_user_turn"]
        == len(records)
        == stats["records_in"]
    )
    assert len(out) == stats["records_out"] >= 4

    stop = sorted(tiny_regen.answer_stop_ids(model, tok))
    checked = 0
    for record in out:
        messages = record["messages"]
        assert [m["role"] for m in messages[::2]] == ["user"] * (len(messages) // 2)
        for turn in range(1, len(messages), 2):
            prompt = tiny_regen.answer_prompt(tok, messages[:turn])
            prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            answer_ids = tok(prompt + messages[turn]["content"], add_special_tokens=False)["input_ids"]
            assert answer_ids[: len(prompt_ids)] == prompt_ids and len(answer_ids) > len(prompt_ids)
            with torch.no_grad():
                generated = model.generate(
                    torch.tensor([prompt_ids]),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=12,
                    eos_token_id=stop,
                    pad_token_id=tok.pad_token_id,
                )
            reference = generated[0, len(prompt_ids) :].tolist()
            reference = reference[: next((i for i, t in enumerate(reference) if t in stop), len(reference))]
            new = answer_ids[len(prompt_ids) :]
            assert new == reference[: len(new)], (prompt, new, reference)
            checked += 1
    assert checked == stats["answers"] and checked >= len(out)


# ----------------------------------------------------------------------------------------------
# Cached build
