"""The whole extraction on a tiny saved Qwen3 target (CPU): a valid dataset with every sample, reject
and duplicate accounted for; stored values equal a direct unbatched capture; resume after a crash
is bit-identical; changed settings refuse to resume and say what changed; ranks merge into the
same dataset as one process; NaN samples and on_error=fail."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import load_config
from extract import pipeline
from extract.capture import capture
from extract.config import ExtractConfig
from extract.ranks import Ranks
from extract.summary import format_summary
from shards import ShardDataset, verify_dataset
from target.load import reach_text_parts
from tests.extract.conftest import build_model, chat_record, mixed_corpus, write_lines

LAYERS = [0, 1, 2]
TOPK = 4


def make_config(out_dir, corpus, target="unused", **overrides):
    words = [
        f"target={target}",
        f"corpus={corpus}",
        f"out_dir={out_dir}",
        f"layer_ids={LAYERS}",
        f"topk={TOPK}",
        "max_len=256",
        "tokens_per_batch=512",
        "min_loss_tokens=4",
        "dtype=float32",
        "device=cpu",
        "shard_bytes=40000",
        "progress=false",
        "sort_window=16",
        "writer_threads=1",
    ]
    words += [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in overrides.items()]
    return load_config(ExtractConfig, None, words)


def run(cfg, target, ranks=None):
    return pipeline.run(cfg, target=target, ranks=ranks or Ranks())[None]


def samples_by_id(root, manifest_name="manifest.json"):
    return {s.sample_id: s for s in ShardDataset(root, manifest_name=manifest_name)}


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for sid in a:
        for field in ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs"):
            x, y = getattr(a[sid], field), getattr(b[sid], field)
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), (sid, field)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, loaded_target):
    """One uninterrupted extraction of the mixed corpus, shared by the tests below."""
    root = tmp_path_factory.mktemp("baseline")
    corpus, expected = mixed_corpus(root / "corpus.jsonl")
    cfg = make_config(root / "out", corpus)
    summary = run(cfg, loaded_target)
    return {"root": str(root / "out"), "corpus": corpus, "expected": expected, "summary": summary, "cfg": cfg}


def test_the_last_shards_commit_is_timed_too(tmp_path, loaded_target):
    # One shard, committed as the writer closes: its commit counts in the run's commit share.
    corpus, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    summary = run(make_config(tmp_path / "out", corpus, shard_bytes=1 << 30), loaded_target)
    assert len(ShardDataset(str(tmp_path / "out")).shards) == 1
    assert 0 < summary["this_run"]["commit_busy"] < 1


def test_dataset_is_valid_and_accounts_for_every_record(baseline):
    root, summary = baseline["root"], baseline["summary"]
    assert verify_dataset(root) == []
    ds = ShardDataset(root)
    assert ds.manifest["complete"] and len(ds) == summary["samples"] == 24
    assert summary["rejects"] == baseline["expected"] and summary["duplicates"] == 1
    assert summary["this_run"]["coverage_ok"] and summary["records"] == 24 + len(baseline["expected"]) + 1
    assert ds.manifest["counts"]["duplicates"] == 1 and ds.manifest["counts"]["rejected.invalid_json"] == 1
    # The rejects file names position, source line and reason; the blank line (index 5) is no record.
    lines = [json.loads(line) for line in Path(root, "rejects.jsonl").read_text().splitlines()]
    assert sorted(line["reason"] for line in lines) == sorted([*baseline["expected"], "duplicate"])
    corpus_lines = Path(baseline["corpus"]).read_text().split("\n")
    for line in lines:
        assert line["source"] == f"corpus.jsonl:{line['position'] + 1}"
        assert corpus_lines[line["position"]].strip()
    assert [line["position"] for line in lines] == sorted(line["position"] for line in lines)
    text = format_summary(summary)
    for reason in baseline["expected"]:
        assert reason in text
    prov = ds.provenance
    assert prov.taps.layer_ids == tuple(LAYERS) and "hidden_states[i+1]" in prov.taps.meaning and prov.topk == TOPK
    assert prov.target.num_layers == 4 and prov.extract_config["topk"] == TOPK
    assert json.loads(Path(os.path.join(root, "extract_config.json")).read_text())["layer_ids"] == LAYERS


# What the run and the library versions change (paths, the code's version, digests of files that
# record the transformers version or a torch-seeded initialization): masked before comparing.
VOLATILE = {("target", "config_hash"), ("target", "weights_digest"), ("target", "head_digest"), ("tokenizer", "hash")}
VOLATILE |= {("target", "weights_content_digest")}
VOLATILE |= {(None, "git_sha"), (None, "tool_version")}


def _masked(record, tmp: str, target: str, part: str | None = None):
    if isinstance(record, dict):
        return {
            k: "<volatile>" if (part, k) in VOLATILE and v is not None else _masked(v, tmp, target, part or k)
            for k, v in record.items()
        }
    if isinstance(record, list):
        return [_masked(v, tmp, target, part) for v in record]
    return record.replace(target, "<target>").replace(tmp, "<tmp>") if isinstance(record, str) else record


def test_the_written_provenance_is_what_extraction_wrote_before_the_type(baseline, loaded_target):
    """Issue 53: the manifest's provenance built through `shards.provenance.Provenance` is, key for
    key, what extraction wrote before (tests/extract/golden/provenance.json, written by the code of
    1258ce9 from this very fixture; since issue 52 the target also records its weights' content digest)."""
    stored = json.loads(Path(os.path.join(baseline["root"], "manifest.json")).read_text())["provenance"]
    golden = json.loads(Path(os.path.join(os.path.dirname(__file__), "golden", "provenance.json")).read_text())
    assert _masked(stored, os.path.dirname(baseline["root"]), loaded_target.path) == golden


def test_stored_values_equal_an_unbatched_capture(baseline, loaded_target):
    ds = ShardDataset(baseline["root"])
    checked = 0
    for i in range(0, len(ds), 5):
        stored = ds.torch(i)
        ids = stored["input_ids"].long()
        direct = capture(loaded_target, ids[None], [len(ids)], LAYERS, TOPK)
        expected = torch.cat([t[0] for t in direct.taps], -1).to(torch.bfloat16)
        assert stored["hidden"].shape == expected.shape  # padding never reaches the shards
        assert torch.allclose(stored["hidden"].float(), expected.float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(stored["topk_ids"][:, 0], direct.topk_ids[:, 0])
        assert torch.allclose(stored["topk_logprobs"], direct.topk_logprobs, atol=1e-4)
        checked += 1
    assert checked >= 4


def test_rerun_of_a_finished_dataset_does_nothing(baseline, loaded_target):
    summary = run(baseline["cfg"], loaded_target)
    assert "this_run" not in summary
    assert "nothing to do" in format_summary(summary) and summary["samples"] == 24


def test_crash_then_rerun_is_bit_identical(baseline, loaded_target, tmp_path, monkeypatch):
    """A run that dies mid-way (after some commits) and is rerun stores exactly the samples of an
    uninterrupted run, bit for bit, with the same reject and duplicate counts."""
    from shards import ShardWriter

    cfg = make_config(tmp_path / "out", baseline["corpus"])
    original, calls = ShardWriter.write, {"n": 0}

    def dying_write(self, sample, **kwargs):
        calls["n"] += 1
        if calls["n"] == 9:
            raise RuntimeError("simulated crash")
        return original(self, sample, **kwargs)

    monkeypatch.setattr(ShardWriter, "write", dying_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cfg, loaded_target)
    monkeypatch.setattr(ShardWriter, "write", original)
    partial = json.loads((tmp_path / "out" / "manifest.rank000.json").read_text())
    assert 0 < partial["counts"]["samples"] < 24 and not partial["complete"]
    summary = run(cfg, loaded_target)
    assert summary["this_run"]["samples"] == 24 - partial["counts"]["samples"]
    assert summary["this_run"]["skipped_batches"] > 0 and summary["this_run"]["coverage_ok"]
    assert summary["rejects"] == baseline["summary"]["rejects"] and summary["duplicates"] == 1
    assert_bit_identical(samples_by_id(str(tmp_path / "out")), samples_by_id(baseline["root"]))
    assert (tmp_path / "out" / "rejects.jsonl").read_text() == Path(
        os.path.join(baseline["root"], "rejects.jsonl")
    ).read_text()


def test_changed_settings_refuse_to_resume_and_say_what(baseline, loaded_target, tmp_path, chat_tokenizer):
    corpus = write_lines(tmp_path / "c.jsonl", [chat_record(random.Random(i), 5, 30) for i in range(6)] + ['{"bad'])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="position 6"):
        run(make_config(out, corpus, on_error="fail"), loaded_target)  # stops at the bad last line: a partial dataset
    with pytest.raises(ValueError, match=r"cannot resume: config key 'topk' is 4 in the dataset but 5 now"):
        run(make_config(out, corpus, topk=5), loaded_target)
    with pytest.raises(ValueError, match=r"config key 'layer_ids' is \[0, 1, 2\] in the dataset but \[0, 1\] now"):
        run(make_config(out, corpus, layer_ids=[0, 1]), loaded_target)
    other = reach_text_parts(build_model(loaded_target.model.config, seed=1), chat_tokenizer, path="")
    with pytest.raises(ValueError, match="target config_hash changed|target weights_digest changed"):
        run(make_config(out, corpus), other)
    with open(corpus, "a") as f:
        f.write(json.dumps(chat_record(random.Random(99), 5, 30)) + "\n")
    with pytest.raises(ValueError, match=r"corpus content changed: c.jsonl changed \(\d+ -> \d+ bytes\)"):
        run(make_config(out, corpus), loaded_target)
    # Runtime knobs may change: restore the corpus and resume with another batch size and on_error.
    lines = Path(corpus).read_text().split("\n")
    Path(corpus).write_text("\n".join(lines[:-2]) + "\n")
    summary = run(make_config(out, corpus, tokens_per_batch=300, on_error="skip"), loaded_target)
    assert summary["complete"] and summary["samples"] == 6 and summary["rejects"] == {"invalid_json": 1}


def test_nonfinite_samples_are_rejected_not_stored(tmp_path, loaded_target, chat_tokenizer):
    model = build_model(loaded_target.model.config)
    poison_token = (
        chat_tokenizer.convert_tokens_to_ids("fox")
        if "fox" in chat_tokenizer.get_vocab()
        else chat_tokenizer.encode(" fox")[0]
    )
    model.model.embed_tokens.weight[poison_token] = float("nan")
    target = reach_text_parts(model, chat_tokenizer, path="")
    rng = random.Random(3)
    records = [
        {
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "the quick dog runs far " * 3},
            ]
        }
        for _ in range(1)
    ]
    records += [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "the fox runs far away " * 3},
            ]
        }
    ]
    records += [chat_record(rng, 4, 20) for _ in range(3)]
    corpus = write_lines(tmp_path / "c.jsonl", records)
    summary = run(make_config(tmp_path / "out", corpus), target)
    bad = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert {b["reason"] for b in bad} == {"nonfinite_hidden"} and 1 in {b["position"] for b in bad}
    assert summary["samples"] + len(bad) == 5
    for sample in ShardDataset(str(tmp_path / "out")):
        assert poison_token not in sample.input_ids


def test_a_rank_joining_an_older_dataset_writes_its_layout(baseline, loaded_target, tmp_path, monkeypatch):
    """Rank 1 of a dataset begun by an older version (unsplit hidden columns) starts with no manifest of
    its own: it must take the dataset's split from rank 0's manifest, or the final merge refuses."""
    import shards.writer

    out = tmp_path / "out"
    cfg = make_config(out, baseline["corpus"])
    with monkeypatch.context() as patch:
        patch.setattr(shards.writer, "default_hidden_split", lambda provenance, width: 1)  # what older versions wrote
        run(cfg, loaded_target, Ranks(rank=0, world=2))
    final = run(cfg, loaded_target, Ranks(rank=1, world=2))
    assert final["complete"] and verify_dataset(str(out)) == []
    manifests = [
        json.loads((out / name).read_text())
        for name in ("manifest.rank000.json", "manifest.rank001.json", "manifest.json")
    ]
    assert [m["hidden_split"] for m in manifests] == [1, 1, 1]


def test_two_ranks_hold_the_same_samples_as_one(baseline, loaded_target, tmp_path):
    out = tmp_path / "out"
    cfg = make_config(out, baseline["corpus"])
    first = run(cfg, loaded_target, Ranks(rank=1, world=2))
    assert first["partial"] and not os.path.exists(out / "manifest.json")  # rank 0 still missing
    final = run(cfg, loaded_target, Ranks(rank=0, world=2))  # the last rank to finish merges
    assert final["complete"] and verify_dataset(str(out)) == []
    two, one = samples_by_id(str(out)), samples_by_id(baseline["root"])
    assert two.keys() == one.keys()
    for sid in one:
        assert np.array_equal(two[sid].input_ids, one[sid].input_ids) and np.array_equal(
            two[sid].topk_ids[:, 0], one[sid].topk_ids[:, 0]
        )
        a = torch.from_numpy(two[sid].hidden).view(torch.bfloat16).float()
        b = torch.from_numpy(one[sid].hidden).view(torch.bfloat16).float()
        assert torch.allclose(a, b, atol=1e-2, rtol=1e-2)
    assert final["rejects"] == baseline["summary"]["rejects"] and final["duplicates"] == 1
    assert (out / "rejects.jsonl").read_text() == Path(os.path.join(baseline["root"], "rejects.jsonl")).read_text()
    ranks = [json.loads((out / f"manifest.rank00{r}.json").read_text())["counts"]["samples"] for r in (0, 1)]
    assert min(ranks) > 0 and sum(ranks) == 24
    # The separately runnable merge step rebuilds the same manifest and rejects file.
    from extract.merge import main as merge_main

    merged = json.loads((out / "manifest.json").read_text())
    rejects = (out / "rejects.jsonl").read_text()
    os.remove(out / "manifest.json")
    os.remove(out / "rejects.jsonl")
    assert merge_main([str(out)]) == 0
    again = json.loads((out / "manifest.json").read_text())
    assert (
        again["counts"] == merged["counts"]
        and again["shards"] == merged["shards"]
        and (out / "rejects.jsonl").read_text() == rejects
    )


def test_a_rank_starting_late_adopts_the_datasets_provenance(baseline, loaded_target, tmp_path):
    """Rank 1 starts for the first time after rank 0 ran with another batch size (a runtime knob):
    it takes over rank 0's provenance, so the ranks still merge."""
    out = tmp_path / "out"
    run(make_config(out, baseline["corpus"], tokens_per_batch=512), loaded_target, Ranks(rank=0, world=2))
    final = run(make_config(out, baseline["corpus"], tokens_per_batch=300), loaded_target, Ranks(rank=1, world=2))
    assert final["complete"] and final["samples"] == 24
    with pytest.raises(ValueError, match="config key 'topk'"):
        run(make_config(tmp_path / "other", baseline["corpus"]), loaded_target, Ranks(rank=0, world=2))
        run(make_config(tmp_path / "other", baseline["corpus"], topk=3), loaded_target, Ranks(rank=1, world=2))


def test_empty_corpus_says_so(tmp_path, loaded_target):
    corpus = write_lines(tmp_path / "empty.jsonl", [])
    summary = run(make_config(tmp_path / "out", corpus), loaded_target)
    assert summary["complete"] and summary["samples"] == 0
    assert "the corpus holds no records" in format_summary(summary)


def test_splits_and_cli(tmp_path, saved_target, capsys):
    from extract.__main__ import main

    rng = random.Random(5)
    train = write_lines(tmp_path / "train.jsonl", [chat_record(rng, 4, 25) for _ in range(4)])
    held = write_lines(tmp_path / "held.jsonl", [chat_record(rng, 4, 25) for _ in range(2)])
    config = tmp_path / "x.toml"
    config.write_text(
        f'[extract]\ntarget = "{saved_target}"\nout_dir = "{tmp_path / "out"}"\nsplits = {{ train = "{train}", '
        f'heldout = "{held}" }}\n'
        "layer_ids = [1, 2]\ntopk = 3\nmax_len = 128\ntokens_per_batch = 256\nmin_loss_tokens = 4\ndtype = "
        '"float32"\ndevice = "cpu"\nprogress = false\n'
    )
    assert main([str(config)]) == 0
    out = capsys.readouterr().out
    assert "[train]" in out and "[heldout]" in out and "rejects   none" in out
    assert (
        len(ShardDataset(str(tmp_path / "out" / "train"))) == 4
        and len(ShardDataset(str(tmp_path / "out" / "heldout"))) == 2
    )
    assert main([str(config), "layer_ids=[1,7]"]) == 2
    assert "'layer_ids': [7] out of range: the target has 4 decoder layers" in capsys.readouterr().err
    assert main([str(config), "topk=zero"]) == 2


def test_every_prefill_of_a_hybrid_target_runs_whole(tmp_path, qwen35_model, chat_tokenizer, monkeypatch):
    """A hybrid target's recurrent layers give other values for a prefill split into chunks (the argmax
    moves at ~7% of positions on Qwen3.5-9B): every sample goes through the decoder in one forward,
    as one row of its micro-batch, however long it is against the token budget."""
    rng = random.Random(3)
    corpus = write_lines(tmp_path / "corpus.jsonl", [chat_record(rng, 8, rng.randint(20, 90)) for _ in range(12)])
    target = reach_text_parts(qwen35_model, chat_tokenizer)
    rows: list[int] = []
    checking = []
    self_check = pipeline.check_stored_logits
    monkeypatch.setattr(
        pipeline, "check_stored_logits", lambda t: checking.append(1) or self_check(t) or checking.pop()
    )

    def record_rows(module, args, kwargs):
        if checking or "forward" in vars(
            module
        ):  # the self-check's probe; the head's call (target.head: no layer runs)
            return
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        rows.extend(int(n) for n in mask.sum(-1)) if mask is not None else rows.extend([ids.shape[1]] * ids.shape[0])

    hook = target.decoder.register_forward_pre_hook(record_rows, with_kwargs=True)
    try:
        cfg = make_config(tmp_path / "out", corpus, layer_ids=[0, 1], max_len=128, tokens_per_batch=128)
        run(cfg, target)
    finally:
        hook.remove()
    stored = sorted(len(s.input_ids) for s in ShardDataset(str(tmp_path / "out")))
    assert len(stored) >= 10 and max(stored) > 64  # some samples longer than half the token budget
    assert sorted(rows) == stored  # one row per sample, each as long as the sample
