"""Extraction on the real target SmolLM2-135M-Instruct (CPU, float32): the stored taps and top-k equal
transformers' own `output_hidden_states` and final logits, and the mask token is chosen
automatically, recorded, never a token of the data (extract.corpus.mask_token)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from common.config import load_config
from extract import corpus as C
from extract import pipeline
from extract.config import ExtractConfig
from extract.corpus.mask_token import choose_mask_token, mask_token_candidates
from extract.ranks import Ranks
from shards import ShardDataset
from shards.provenance import MaskSource, MaskToken

TAPS = [1, 8, 14, 21, 27]  # configs/smollm2-135m.toml
CHATS = [
    ("Write a Python function that reverses a string.", "def reverse(s):\n    return s[::-1]\n"),
    ("What does `len` do?", "It returns the number of items in a container, such as a list or a string."),
    ("Explain the for statement.", "A for loop runs its body once for each item of an iterable, in order."),
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def extracted(smollm2_dir, tmp_path_factory):
    from target.load import load_target

    tmp = tmp_path_factory.mktemp("smol")
    corpus = write_jsonl(tmp / "chat.jsonl", [chat(u, a) for u, a in CHATS])
    cfg = load_config(
        ExtractConfig,
        None,
        [
            f"target={smollm2_dir / 'target'}",
            f"corpus={corpus}",
            f"out_dir={tmp / 'shards'}",
            f"layer_ids={TAPS}",
            "topk=8",
            "min_loss_tokens=4",
            "dtype=float32",
            "device=cpu",
            "progress=false",
            "writer_threads=1",
        ],
    )
    target = load_target(str(smollm2_dir / "target"), dtype="float32", device="cpu")
    pipeline.run(cfg, target=target, ranks=Ranks())
    return target, ShardDataset(str(tmp / "shards"))


def test_taps_and_topk_equal_transformers_on_the_same_inputs(extracted):
    target, ds = extracted
    assert len(ds) == len(CHATS)
    for i in range(len(ds)):
        sample = ds.torch(i)
        with torch.inference_mode():
            out = target.model(input_ids=sample["input_ids"].long()[None], output_hidden_states=True)
        # Tap id i is the output of decoder layer i = hidden_states[i + 1], stored as bf16 (one rounding).
        ref = torch.cat([out.hidden_states[t + 1][0] for t in TAPS], dim=-1)
        stored = sample["hidden"].float()
        torch.testing.assert_close(stored, ref.bfloat16().float(), rtol=2**-7, atol=1e-3)
        logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
        top = logprobs.topk(8, dim=-1)
        torch.testing.assert_close(sample["topk_logprobs"], top.values, rtol=0, atol=1e-4)
        clear = (top.values[:, 0] - top.values[:, 1]) > 1e-3  # top-1 where it is not a near-tie
        assert torch.equal(sample["topk_ids"][clear, 0].long(), top.indices[clear, 0])


def test_the_mask_token_is_chosen_and_recorded(extracted):
    target, ds = extracted
    tokenizer = ds.provenance.tokenizer
    assert tokenizer.mask_token_id == 3
    assert tokenizer.mask_token == MaskToken("<repo_name>", MaskSource.AUTO)
    assert ds.manifest["provenance"]["tokenizer"]["mask_token"] == {"token": "<repo_name>", "source": "auto"}
    for i in range(len(ds)):
        assert 3 not in ds[i].input_ids


def test_candidates_are_special_tokens_the_template_and_text_never_produce(smollm2_tokenizer):
    candidates = mask_token_candidates(smollm2_tokenizer)
    assert candidates == list(range(3, 17))  # 0 unk, 1 bos <|im_start|>, 2 eos/pad <|im_end|>
    text = smollm2_tokenizer.convert_ids_to_tokens(candidates)
    builder = C.SampleBuilder(smollm2_tokenizer, C.SamplePolicy(512, "truncate", 1, {}))
    raw = C.RawRecord(0, "x:1", chat("Use " + " ".join(text), "Here: " + " ".join(text)))
    (sample,) = builder.build([raw])
    assert not set(candidates) & set(sample.input_ids.tolist())  # record text never forges them


def test_a_corpus_holding_the_first_candidate_makes_it_pick_another(smollm2_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [1, 3, 100, 200, 2]}, chat(*CHATS[0])])
    choice = choose_mask_token(smollm2_tokenizer, None, [C.find_corpus(str(path))])
    assert (choice.token_id, choice.source, choice.passed_over) == (4, "auto", (3,))
    assert "skipped [3]" in choice.describe()
    # The same in Parquet, where only the input_ids column is read; a text corpus holds no candidate.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": [[1, 100, 2], [1, 3, 4, 2]]}), tmp_path / "tok.parquet")
    choice = choose_mask_token(smollm2_tokenizer, None, [C.find_corpus(str(tmp_path / "tok.parquet"))])
    assert (choice.token_id, choice.passed_over) == (5, (3, 4))
    text_only = write_jsonl(tmp_path / "text.jsonl", [chat(*CHATS[1]), {"text": "input_ids <repo_name>"}])
    assert choose_mask_token(smollm2_tokenizer, None, [C.find_corpus(str(text_only))]).token_id == 3


def test_a_configured_mask_token_the_data_holds_is_refused(smollm2_tokenizer, tmp_path, caplog):
    path = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [1, 5, 100, 2]}])
    with pytest.raises(ValueError, match="config key 'mask_token_id' = 5 .* occurs in the corpus"):
        choose_mask_token(smollm2_tokenizer, 5, [C.find_corpus(str(path))])
    # A plain word as the mask token: allowed with a warning, and every sample holding it is rejected.
    word = smollm2_tokenizer.convert_tokens_to_ids("the")
    with caplog.at_level(logging.WARNING):
        choice = choose_mask_token(smollm2_tokenizer, word, [C.find_corpus(str(path))])
    assert choice.source == "config" and "not a special token" in caplog.text
    builder = C.SampleBuilder(smollm2_tokenizer, C.SamplePolicy(512, "truncate", 1, {}, mask_token_id=word))
    raw = C.RawRecord(0, "x:1", {"input_ids": [1, 100, word, 2]})
    (reject,) = builder.build([raw])
    assert isinstance(reject, C.Reject) and reject.reason == C.HOLDS_MASK_TOKEN
    ok = builder.build([C.RawRecord(1, "x:2", {"input_ids": np.array([1, 100, 2]).tolist()})])
    assert isinstance(ok[0], C.TokenizedSample)
