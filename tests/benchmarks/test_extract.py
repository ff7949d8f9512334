"""The GPU benchmark's CPU path (`--shape tiny`) runs end to end and reports consistent numbers:
both phases see every synthetic token, and the dataset written holds them all."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks import extract as bench


def test_length_mix_is_bounded_and_sums_to_the_budget():
    lengths = bench.length_mix(50_000, 500, 8000, np.random.default_rng(0))
    assert 50_000 <= sum(lengths) < 50_500 and min(lengths) >= 500 and max(lengths) <= 8000
    assert len(set(lengths)) > len(lengths) // 2  # a mix, not one length


def test_tiny_bench_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        bench.main(
            [
                "--shape",
                "tiny",
                "--tokens",
                "3000",
                "--max-len",
                "200",
                "--workdir",
                str(tmp_path / "w"),
                "--out",
                str(out),
                "--warmup-batches",
                "1",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    [rank] = report["per_rank"]
    # The untimed warm-up covered the first micro-batch only, not the whole corpus.
    assert 0 < rank["warmup_tokens"] < rank["bare_tokens"] and rank["warmup_seconds"] > 0
    assert rank["bare_tokens"] == rank["full_tokens"] == report["dataset"]["tokens"] >= 3000
    assert rank["bare_tok_s"] > 0 and rank["full_tok_s"] > 0 and rank["full_over_bare"] > 0
    assert report["parameters"] > 0 and report["kernels"]["fla_importable"] in (True, False)
    assert report["dataset"]["bytes"] > 0 and report["world_size"] == 1
    assert "(b)/(a)" in capsys.readouterr().out
    assert not (tmp_path / "w" / "shards").exists()  # cleaned up without --keep


def test_packed_rows_are_refused_where_the_gated_deltanet_runs_in_torch(tmp_path, capsys):
    """The tiny shape is a hybrid Qwen3.5: on the CPU its torch Gated DeltaNet would carry one
    sample's state into the next, so --packing stops at once and says why."""
    argv = ["--shape", "tiny", "--tokens", "500", "--max-len", "100", "--workdir", str(tmp_path / "w"), "--packing"]
    assert bench.main(argv) == 2
    assert "--packing refused for this target: its Gated DeltaNet layers" in capsys.readouterr().err


def test_a_multi_rank_corpus_gives_every_rank_the_same_tokens(tmp_path):
    """Ranks own samples by content hash; the bench's corpus is drawn so each rank owns the same
    tokens (within one sequence), checked here with the pipeline's own ownership rule."""
    from common.hashing import sample_id
    from extract.ranks import Ranks

    lengths = bench.length_mix(40_000, 50, 800, np.random.default_rng(1))
    owned = bench.write_token_corpus(str(tmp_path / "c.jsonl"), lengths, 1000, seed=0, world=3)
    assert sum(owned) == sum(lengths) and max(owned) - min(owned) <= 800
    recounted = [0, 0, 0]
    for line in (tmp_path / "c.jsonl").read_text().splitlines():
        ids = np.array(json.loads(line)["input_ids"], dtype=np.int32)
        sid = sample_id(ids, np.ones(ids.size, dtype=np.uint8))
        recounted[[r for r in range(3) if Ranks(rank=r, world=3).owns(sid, 0)][0]] += ids.size
    assert recounted == owned


def test_variants_run_the_full_phase_once_each_and_restore_the_interpreter(tmp_path):
    import sys

    before = sys.getswitchinterval()
    out = tmp_path / "bench.json"
    args = [
        "--shape",
        "tiny",
        "--tokens",
        "2000",
        "--max-len",
        "200",
        "--workdir",
        str(tmp_path / "w"),
        "--out",
        str(out),
        "--no-warmup",
        "--variant",
        "",
        "--variant",
        "gil_switch_interval=0.0005,launch_ahead_layers=2",
    ]
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    assert [v["overrides"] for v in report["variants"]] == [[], ["gil_switch_interval=0.0005", "launch_ahead_layers=2"]]
    assert all(v["per_rank"][0]["full_tokens"] == report["dataset"]["tokens"] for v in report["variants"])
    assert sys.getswitchinterval() == before


def test_the_random_corpus_holds_none_of_the_tokenizers_own_ids(tmp_path):
    """Extraction refuses a corpus holding the mask token (extract.corpus.mask_token), so a long random
    corpus must never draw the benchmark tokenizer's special ids (at 300 K tokens over 248 K ids it
    would, almost surely, if the draw started at 0)."""
    from recipes.tiny import build_chat_tokenizer

    tokenizer = build_chat_tokenizer(["benchmark corpus of random token ids " * 8], 300)
    path = str(tmp_path / "corpus.jsonl")
    bench.write_token_corpus(path, [20_000] * 10, 600, seed=0)
    ids = np.concatenate([json.loads(line)["input_ids"] for line in Path(path).read_text().splitlines()])
    assert ids.size == 200_000 and ids.max() < 600
    assert len(tokenizer) <= bench.FIRST_CORPUS_ID == ids.min()
    assert not set(tokenizer.all_special_ids) & set(ids.tolist())
