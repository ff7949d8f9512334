"""Multi-rank datasets merge into one manifest (refusing disagreement and duplicates); concurrent
readers get the right samples; the inspect/show/merge commands print what they promise."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from shards import ShardDataset, ShardWriter, merge_manifests, verify_dataset
from shards.__main__ import main
from tests.shards.synth import TOPK, WIDTH, assert_same, make_sample, provenance


def write_rank(root, rank, indices, prov=None, complete=True):
    w = ShardWriter(
        root,
        provenance=prov or provenance(),
        hidden_width=WIDTH,
        topk=TOPK,
        shard_bytes=6_000,
        manifest_name=f"manifest-r{rank}.json",
        shard_prefix=f"r{rank}",
    )
    for i in indices:
        w.write(make_sample(i))
    w.extra_counts["rejected"] += rank + 1
    w.stage_state["rank"] = rank
    w.close(complete=complete)


def test_merge_of_two_ranks(tmp_path):
    write_rank(tmp_path, 0, range(0, 20, 2))
    write_rank(tmp_path, 1, range(1, 20, 2))
    merged = merge_manifests(str(tmp_path), ["manifest-r0.json", "manifest-r1.json"])
    ds = ShardDataset(str(tmp_path))
    assert len(ds) == 20 and merged["complete"] is True
    assert sorted(s.sample_id for s in ds) == sorted(make_sample(i).sample_id for i in range(20))
    assert ds.manifest["counts"]["rejected"] == 3
    assert ds.manifest["counts"]["tokens"] == sum(make_sample(i).n_tokens for i in range(20))
    assert ds.manifest["stage_state"]["merged_from"]["manifest-r1.json"] == {"rank": 1}
    assert_same(ds.get(make_sample(7).sample_id), make_sample(7))
    assert verify_dataset(str(tmp_path)) == []
    # Each rank's own manifest still reads as its part.
    assert len(ShardDataset(str(tmp_path), manifest_name="manifest-r1.json")) == 10


def test_merge_is_incomplete_if_a_rank_is(tmp_path):
    write_rank(tmp_path, 0, range(3))
    write_rank(tmp_path, 1, range(3, 6), complete=False)
    assert merge_manifests(str(tmp_path), ["manifest-r0.json", "manifest-r1.json"])["complete"] is False


def test_merge_refuses_a_sample_listed_twice(tmp_path):
    write_rank(tmp_path, 0, range(0, 5))
    write_rank(tmp_path, 1, range(4, 8))
    with pytest.raises(ValueError, match=make_sample(4).sample_id):
        merge_manifests(str(tmp_path), ["manifest-r0.json", "manifest-r1.json"])
    assert not (tmp_path / "manifest.json").exists()


def test_merge_refuses_ranks_that_disagree_naming_the_field(tmp_path):
    write_rank(tmp_path, 0, range(3))
    write_rank(tmp_path, 1, range(3, 6), prov=provenance(tokenizer={"hash": "other"}))
    with pytest.raises(ValueError, match=r"manifest-r1\.json.*provenance\.tokenizer\.hash"):
        merge_manifests(str(tmp_path), ["manifest-r0.json", "manifest-r1.json"])


def test_concurrent_reads_from_threads_return_the_right_samples(tmp_path):
    with ShardWriter(tmp_path / "ds", provenance=provenance(), hidden_width=WIDTH, topk=TOPK, shard_bytes=5_000) as w:
        for i in range(40):
            w.write(make_sample(i))
    ds = ShardDataset(str(tmp_path / "ds"), verify_checksums=True, max_open_shards=3)
    order = np.random.default_rng(0).integers(0, 40, 400).tolist()

    def read(i):
        return i, ds[i] if i % 2 else ds.torch(i)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i, got in pool.map(read, order):
            expected = make_sample(i)
            if isinstance(got, dict):
                assert np.array_equal(got["hidden"].view(dtype=__import__("torch").uint16).numpy(), expected.hidden)
                assert np.array_equal(got["topk_ids"].numpy(), expected.topk_ids)
            else:
                assert_same(got, expected)


def test_cli_inspect_shows_counts_sizes_and_histogram(tmp_path, capsys):
    write_rank(tmp_path, 0, range(10))
    assert main(["merge", str(tmp_path), str(tmp_path / "manifest-r0.json")]) == 0
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    tokens = sum(make_sample(i).n_tokens for i in range(10))
    assert f"10 samples, {tokens} tokens" in out
    assert "B/token" in out and "raw bf16 hidden is 32 B/token" in out
    assert "rejected=1" in out and "hidden_states[i+1]" in out
    histogram_counts = [int(line.split(")")[1].split()[0]) for line in out.splitlines() if line.strip().startswith("[")]
    assert sum(histogram_counts) == 10


def test_cli_inspect_of_an_empty_dataset_says_so(tmp_path, capsys):
    ShardWriter(tmp_path, provenance=provenance(), hidden_width=WIDTH, topk=TOPK).close()
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 samples" in out and "no samples: nothing to histogram" in out


def test_cli_show_by_position_and_id(tmp_path, capsys):
    write_rank(tmp_path, 0, range(5))
    sample = make_sample(2)
    assert main(["show", str(tmp_path), "2", "--manifest", "manifest-r0.json", "--positions", "3"]) == 0
    by_position = capsys.readouterr().out
    assert main(["show", str(tmp_path), sample.sample_id, "--manifest", "manifest-r0.json", "--positions", "3"]) == 0
    by_id = capsys.readouterr().out
    assert by_position == by_id
    assert sample.sample_id in by_position and "t=2" in by_position and "t=3" not in by_position
    values = (sample.hidden.astype(np.uint32) << 16).view(np.float32).reshape(sample.n_tokens, 2, -1)
    tap_rows = [line.split() for line in by_position.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [int(row[1]) for row in tap_rows] == [1, 2]  # layer ids from the provenance
    for tap, row in enumerate(tap_rows):
        assert float(row[4]) == pytest.approx(np.abs(values[:, tap]).max(), rel=1e-3)
    assert main(["show", str(tmp_path), "99", "--manifest", "manifest-r0.json"]) == 2
    assert "out of range" in capsys.readouterr().err


def test_cli_show_decodes_with_a_local_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(1000)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path / "tok")
    write_rank(tmp_path / "ds", 0, range(2))
    assert (
        main(
            ["show", str(tmp_path / "ds"), "0", "--manifest", "manifest-r0.json", "--tokenizer", str(tmp_path / "tok")]
        )
        == 0
    )
    out = capsys.readouterr().out
    first = int(make_sample(0).input_ids[0])
    assert f"in={first}'w{first}'" in out
    assert "text" in out


def test_each_command_lists_its_keys_and_refuses_an_unknown_one(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    assert "no_checksums = False  (bool)" in capsys.readouterr().out
    assert main(["verify", str(tmp_path), "--checksums-off"]) == 2
    assert "unknown option '--checksums-off'" in capsys.readouterr().err
    assert main(["bogus"]) == 2
