"""Offline evaluation (`train.eval`) with a tiny target, tiny synthetic shards and a real run: the
block-level tests run on the CPU; the trainer run and the CLI tests use device=auto (CUDA on a GPU host).

Proves: an oracle drafter (its predictions forced to equal the labels) gets τ = 16 and every block
fully accepted, a drafter forced wrong gets τ = 1; the batched evaluation of a real tiny drafter
(many blocks per forward, sequences split and packed) gives per block exactly what a one-block-at-a-
time loop with the inference mask (attn_mask=None, context = positions < anchor) gives, and so the
same per-position acceptance and DDTree τ; the anchor / valid-length rule; the CLI on a real
trainer run evaluates only the held-out split, lists the empty length bucket as empty, writes a
JSON from which the printed table is reproduced exactly; two checkpoints are compared on the same
blocks with ratio second / first; incompatible shards are refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from common.config import config_from_dict, load_config
from common.hashing import json_digest, sample_id
from shards import Sample, ShardDataset, ShardWriter
from train.dflash2 import build_drafter
from train.drafter_config import DrafterConfig
from train.eval.__main__ import main
from train.eval.anchors import block_anchors, block_targets, response_run_lengths
from train.eval.baseline import label_baseline, label_frequency_topk
from train.eval.checkpoints import EvalModel, read_checkpoint
from train.eval.config import EvalConfig
from train.eval.ddtree import ConditionalTopK, build_ddtree, build_selector_ddtree, draft_topk, walk_tree
from train.eval.drafting import Runtime
from train.eval.render import render_report
from train.eval.run import metric_ratios
from train.eval.scoring import run_blocks, summarize_model
from train.eval.selection import bucket_table, select_eval_data
from train.kernels import KernelPlan
from train.model import TargetHead
from train.samples import holdout_mask

V, H, LAYERS, TAPS, TOPK = 64, 32, 4, [0, 2], 4
MASK_ID = V - 1
K = 16
D = K - 1


def label_of_position(p):
    """The synthetic target's greedy token for position p (a function of the position only)."""
    return p % (V - 1)


def write_shards(root, target_dir, *, n=24, seed=0, taps=TAPS, identity=None, tokenizer_hash="tok"):
    """Synthetic shards of the tiny target; `identity`: the target identity fields the provenance records."""
    target = {"name_or_path": str(target_dir), "num_layers": LAYERS, "hidden_size": H, "vocab_size": V}
    prov = {
        "target": {**target, **(identity or {})},
        "tokenizer": {"hash": tokenizer_hash, "mask_token_id": MASK_ID},
        "taps": {"layer_ids": taps, "meaning": "id i = output of decoder layer i = hidden_states[i+1]"},
        "dtype": "bfloat16",
        "topk": TOPK,
    }
    rng = np.random.default_rng(seed)
    width = len(taps) * H
    with ShardWriter(str(root), provenance=prov, hidden_width=width, topk=TOPK, shard_bytes=1 << 15) as writer:
        for i in range(n):
            T = int(rng.integers(12, 41))
            ids = rng.integers(0, V - 1, T).astype(np.int32)
            lm = (np.arange(T) >= T // 4).astype(np.uint8)
            if i % 3 == 0:
                lm[T // 2] = 0  # a second turn: two responses separated by a non-response token
            hidden = (rng.normal(0, 1, (T, width)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            top1 = label_of_position(np.arange(1, T + 1))
            rest = np.stack([rng.permutation(np.setdiff1d(np.arange(V - 1), [t]))[: TOPK - 1] for t in top1])
            topk = np.concatenate([top1[:, None], rest], 1).astype(np.int32)
            logprobs = -np.sort(rng.exponential(1.0, (T, TOPK)).astype(np.float32), 1)
            writer.write(Sample(sample_id(ids, lm), ids, lm, hidden, topk, logprobs))
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3 target, 24 synthetic samples, and a 2-step trainer run with a checkpoint per step."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from train.config import TrainConfig
    from train.loop import train

    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    write_shards(root / "shards", root / "target")
    train_cfg = load_config(
        TrainConfig,
        None,
        [
            f"out_dir={root / 'runs'}",
            "run_name=r",
            f"data.shards={root / 'shards'}",
            "data.token_budget=200",
            "data.boundaries=[20, 30, 1000]",
            "data.holdout_fraction=0.25",
            "data.prefetch_threads=1",
            "data.prefetch_depth=2",
            "model.num_layers=1",
            "model.intermediate_size=32",
            "loss.num_anchors=6",
            "optim.max_steps=2",
            "optim.lr=1e-2",
            "checkpoint.every=1",
            "checkpoint.keep_last=2",
            "log.progress=false",
        ],
    )
    train(train_cfg)
    return root


def eval_config(*overrides) -> EvalConfig:
    return load_config(EvalConfig, None, ["progress=false", "load_threads=1", *overrides])


def random_drafter_model(**layout) -> EvalModel:
    torch.manual_seed(1)
    cfg = DrafterConfig(
        hidden_size=H,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        target_layer_ids=TAPS,
        num_target_layers=LAYERS,
        mask_token_id=MASK_ID,
        **layout,
    )
    drafter = build_drafter(cfg).eval()
    # Larger weights than the init so the random drafter's top-k is peaked and varied, not near-uniform
    # (a DFlash2 drafter's convolution projections and selector codebooks too).
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)
    head = TargetHead(torch.randn(V, H), torch.randn(V, H) * 0.3)
    return EvalModel(drafter, head, K, MASK_ID, cfg.mask_rules)


class PositionOracle(nn.Module):
    """A stub drafter whose output, through an identity lm_head, puts all mass on label_of_position
    of each block token's absolute position (+ `shift`): right for shift 0, wrong otherwise."""

    def __init__(self, shift: int):
        super().__init__()
        self.shift = shift

    def forward(self, noise_embedding_BQD, target_hidden_BSF, position_ids_BP, attn_mask=None):
        S = target_hidden_BSF.shape[1]
        token_BQ = (label_of_position(position_ids_BP[:, S:]) + self.shift) % (V - 1)
        logits_BQV = torch.nn.functional.one_hot(token_BQ, V).float() * 20.0
        if self.shift:
            # The right token is the least likely one, so no DDTree can reach it either.
            right_BQ = label_of_position(position_ids_BP[:, S:])
            logits_BQV.scatter_(2, right_BQ[..., None], -20.0)
        return logits_BQV


def oracle_model(shift: int) -> EvalModel:
    eye = torch.eye(V)
    return EvalModel(PositionOracle(shift), TargetHead(eye, eye.clone()), K, MASK_ID)


def evaluate(models, tiny, cfg, boundaries=(), background=False):
    ds = ShardDataset(str(tiny / "shards"))
    data = select_eval_data(ds, str(tiny / "shards"), split="all", holdout_fraction=None, max_samples=cfg.max_samples)
    buckets, bucket_of_sample = bucket_table(list(boundaries), data.lengths)
    runtime = Runtime(KernelPlan(torch.device("cpu"), None, "sdpa", False, "test"), score_in_background=background)
    table, scores = run_blocks(models, data, cfg, runtime, bucket_of_sample)
    return data, buckets, table, scores


# ----------------------------------------------------------------------------------------------


def test_anchor_rule_valid_lengths_and_targets():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    assert response_run_lengths(mask).tolist() == [0, 0, 3, 2, 1, 0, 5, 4, 3, 2, 1]
    anchors, valid = block_anchors(mask, 3)
    # 4 is a response token followed by a non-response one and 10 is the last: neither makes a block.
    assert anchors.tolist() == [2, 3, 6, 7, 8, 9]
    assert valid.tolist() == [2, 1, 3, 3, 2, 1]
    full, _ = block_anchors(mask, 3, min_valid_len=3)
    assert full.tolist() == [6, 7]

    top1 = torch.arange(100, 111)
    targets = block_targets(top1, anchors, 3)
    assert targets[0].tolist() == [102, 103, 104]  # y_k for the anchor at 2 is top1[2 + k - 1]
    assert targets[-1].tolist() == [109, 110, 0]  # past the end: a placeholder beyond the valid length

    long_mask = torch.ones(200, dtype=torch.bool)
    a1, _ = block_anchors(long_mask, 15, max_anchors=10, seed=3, sample_id="s")
    a2, _ = block_anchors(long_mask, 15, max_anchors=10, seed=3, sample_id="s")
    a3, _ = block_anchors(long_mask, 15, max_anchors=10, seed=3, sample_id="t")
    assert a1.tolist() == a2.tolist() and a1.tolist() == sorted(set(a1.tolist())) and len(a1) == 10
    assert a1.tolist() != a3.tolist()  # the draw depends on the sample id
    assert set(a1.tolist()) <= set(range(199))


def test_oracle_drafter_accepts_everything_and_a_wrong_one_nothing(tiny):
    cfg = eval_config("min_valid_len=15")
    _, buckets, table, scores = evaluate([oracle_model(0), oracle_model(5)], tiny, cfg)
    assert table.n_blocks > 50 and bool((table.valid_len_N == D).all())
    right = summarize_model(table, scores[0], buckets)["overall"]
    wrong = summarize_model(table, scores[1], buckets)["overall"]
    assert right["tau"] == 16.0 and right["all_accepted"] == 1.0
    assert right["position_acceptance"] == [1.0] * D and right["conditional_acceptance"] == [1.0] * D
    assert right["ddtree_tau_8"] == 9.0  # 8 nodes reach depth 8 at most: the chain of the labels
    assert right["ddtree_tau_16"] == right["ddtree_tau_32"] == right["ddtree_tau_64"] == 16.0
    assert right["surrogate_tau"] == pytest.approx(16.0, abs=1e-3)
    assert wrong["tau"] == 1.0 and wrong["all_accepted"] == 0.0 and wrong["position_acceptance"] == [0.0] * D
    assert all(wrong[f"ddtree_tau_{b}"] == 1.0 for b in (8, 16, 32, 64))

    # Without the filter, cut blocks near response ends count as online rounds do: τ = 1 + L.
    _, buckets, table, scores = evaluate([oracle_model(0)], tiny, eval_config())
    summary = summarize_model(table, scores[0], buckets)["overall"]
    assert summary["n_cut"] > 0
    assert summary["tau"] == pytest.approx(1 + table.valid_len_N.double().mean().item())
    assert summary["all_accepted"] == pytest.approx((table.valid_len_N == D).double().mean().item())


def brute_force_blocks(model: EvalModel, ds, sample_positions, dataset_indices):
    """One block at a time, inference style: context = hidden[:a], no mask, positions 0..a+K-1."""
    rows = []
    for position, i in zip(sample_positions, dataset_indices, strict=True):
        s = ds.torch(int(i))
        mask = s["loss_mask"].bool().tolist()
        T = len(mask)
        for a in range(T - 1):
            if not (mask[a] and mask[a + 1]):
                continue
            L = 0
            while L < D and a + L + 1 < T and mask[a + L + 1]:
                L += 1
            block = torch.full((1, K), MASK_ID, dtype=torch.long)
            block[0, 0] = s["input_ids"][a]
            with torch.no_grad():
                out = model.model(model.head.embed(block), s["hidden"][None, :a], torch.arange(a + K)[None], None)
                logits = model.head.logits(out[0, 1:])
            lp, ids = draft_topk(logits[None], 64)
            target = torch.tensor([int(s["topk_ids"][a + k - 1, 0]) if a + k - 1 < T else -1 for k in range(1, K)])
            agree = [bool(ids[0, k - 1, 0] == target[k - 1]) for k in range(1, L + 1)]
            streak = next((j for j, ok in enumerate(agree) if not ok), L)
            taus = {b: 1 + walk_tree(build_ddtree(lp[0], ids[0], b), target, L) for b in (8, 16, 32, 64)}
            rows.append(
                {
                    "sample": position,
                    "anchor": a,
                    "L": L,
                    "draft": ids[0, :, 0],
                    "agree": agree,
                    "streak": streak,
                    "ddtree": taus,
                }
            )
    return rows


def test_batched_evaluation_equals_a_one_block_at_a_time_loop(tiny):
    model = random_drafter_model()
    # 7 blocks per forward: long sequences are split and short pieces of several samples share a forward.
    cfg = eval_config("max_samples=8", "blocks_per_forward=7")
    data, buckets, table, scores = evaluate([model], tiny, cfg, boundaries=[25])
    rows = brute_force_blocks(model, data.dataset, range(data.n_samples), data.indices)

    assert table.sample_N.tolist() == [r["sample"] for r in rows]
    assert table.anchor_N.tolist() == [r["anchor"] for r in rows]
    assert table.valid_len_N.tolist() == [r["L"] for r in rows]
    assert torch.equal(scores[0].draft_ids_ND, torch.stack([r["draft"] for r in rows]))
    for b in (8, 16, 32, 64):
        assert scores[0].ddtree_tau[b].tolist() == [r["ddtree"][b] for r in rows], b

    summary = summarize_model(table, scores[0], buckets)["overall"]
    agree_counts = [sum(1 for r in rows if len(r["agree"]) >= k and r["agree"][k - 1]) for k in range(1, K)]
    valid_counts = [sum(1 for r in rows if r["L"] >= k) for k in range(1, K)]
    expected = [a / v if v else None for a, v in zip(agree_counts, valid_counts, strict=True)]
    assert summary["position_acceptance"] == expected
    assert summary["position_count"] == valid_counts
    assert summary["tau"] == pytest.approx(1 + np.mean([r["streak"] for r in rows]))
    assert 0 < sum(agree_counts) < sum(valid_counts)  # the drafter is neither always right nor always wrong
    assert summary["ddtree_tau_64"] > summary["tau"]  # trees accept more than the chain

    # The batch layout changes nothing: everything at once, or one block per forward with the DDTree
    # scoring in a background thread (the CUDA default) far behind the drafting.
    for per_forward, background in (("blocks_per_forward=1000", False), ("blocks_per_forward=1", True)):
        _, _, table2, scores2 = evaluate(
            [model], tiny, eval_config("max_samples=8", per_forward), boundaries=[25], background=background
        )
        assert torch.equal(table2.anchor_N, table.anchor_N)
        assert torch.equal(scores2[0].draft_ids_ND, scores[0].draft_ids_ND)
        assert torch.allclose(scores2[0].top1_logprob_ND, scores[0].top1_logprob_ND, atol=1e-5)
        assert all(torch.equal(scores2[0].ddtree_tau[b], scores[0].ddtree_tau[b]) for b in (8, 16, 32, 64))


@pytest.mark.parametrize("sliding_in_block", ["causal", "bidirectional"])
def test_batched_evaluation_with_sliding_layers_equals_one_block_at_a_time(tiny, sliding_in_block):
    """Offline evaluation of a sliding_then_full drafter (window 6, shorter than most contexts) runs many
    blocks per forward under the per-type training masks; each block alone at inference agrees."""
    model = random_drafter_model(layer_types="sliding_then_full", sliding_window=6, sliding_in_block=sliding_in_block)
    data, _, table, scores = evaluate([model], tiny, eval_config("max_samples=4", "blocks_per_forward=9"))
    rows = brute_force_blocks(model, data.dataset, range(data.n_samples), data.indices)
    assert table.anchor_N.tolist() == [r["anchor"] for r in rows] and max(r["anchor"] for r in rows) > 6
    assert torch.equal(scores[0].draft_ids_ND, torch.stack([r["draft"] for r in rows]))


def test_a_dflash2_drafters_selector_proposals_equal_one_block_at_a_time(tiny):
    """A DFlash2 drafter is scored on its selector's walk (chain) and on the conditional tree of its q over the
    candidates (DDTree), beside its unary proposals: per block, what `DFlash2Drafter.propose` proposes for that
    block alone, and the tree built from q computed here parent by parent with `CandidateSelector.scores`."""
    model = random_drafter_model(arch="dflash2", selector_rank=8, selector_top_k=5)
    data, buckets, table, scores = evaluate([model], tiny, eval_config("max_samples=4", "blocks_per_forward=9"))
    unary = brute_force_blocks(model, data.dataset, range(data.n_samples), data.indices)
    assert torch.equal(scores[0].draft_ids_ND, torch.stack([r["draft"] for r in unary]))  # unary: as for DFlash
    own = scores[0].selector
    selector, walks, taus = model.model.candidate_selector, [], {b: [] for b in (8, 64)}
    for position, i in zip(range(data.n_samples), data.indices, strict=True):
        s = data.dataset.torch(int(i))
        for a, L, _targets in ((r["anchor"], r["L"], None) for r in unary if r["sample"] == position):
            block = torch.full((1, K), MASK_ID, dtype=torch.long)
            block[0, 0] = s["input_ids"][a]
            with torch.no_grad():
                hidden = model.model(model.head.embed(block), s["hidden"][None, :a], torch.arange(a + K)[None])[:, 1:]
                walks.append(model.model.propose(hidden, model.head.lm_head_VD, block[:, 0])[0])
                logits = model.head.logits(hidden[0]).float()
                unary_Dk, cand_Dk = logits.topk(5, dim=-1)
                rows = []
                for j in range(D):
                    parents = block[0, :1].expand(5) if j == 0 else cand_Dk[j - 1]
                    h = hidden[0, j].expand(5, -1)
                    rows.append(selector.scores(h, unary_Dk[j].expand(5, -1), cand_Dk[j].expand(5, -1), parents))
            logq = torch.stack(rows).log_softmax(-1)
            lp, slot = logq.sort(dim=-1, descending=True, stable=True)
            lattice = ConditionalTopK(lp[None], slot[None], cand_Dk[None])
            y = torch.tensor(
                [int(s["topk_ids"][a + k - 1, 0]) if a + k - 1 < len(s["topk_ids"]) else -1 for k in range(1, K)]
            )
            for b in taus:
                taus[b].append(1 + walk_tree(build_selector_ddtree(lattice, b), y, L))
    assert torch.equal(own.draft_ids_ND, torch.stack(walks))
    assert (own.draft_ids_ND != scores[0].draft_ids_ND).any()  # the selector changed some proposals
    for b in taus:
        assert own.ddtree_tau[b].tolist() == taus[b], b
    summary = summarize_model(table, scores[0], buckets)
    assert summary["proposals"] == "selector" and summary["unary"]["overall"]["n_blocks"] == table.n_blocks
    assert summary["overall"]["tau"] == pytest.approx(1 + own.chain(table).streak_N.double().mean().item())
    assert summary["unary"]["overall"]["tau"] == pytest.approx(
        1 + scores[0].chain(table).streak_N.double().mean().item()
    )


def test_most_frequent_label_baseline_on_the_same_blocks(tiny):
    data, buckets, table, _ = evaluate([random_drafter_model()], tiny, eval_config("max_samples=8"), boundaries=[25])
    labels = [int(y) for row, n in zip(table.target_ids_ND, table.valid_len_N, strict=True) for y in row[: int(n)]]
    counts = {y: labels.count(y) for y in set(labels)}
    order = sorted(counts, key=lambda y: (-counts[y], y))  # most frequent first, ties: smaller id
    lp, ids = label_frequency_topk(table, 5)
    assert ids.tolist() == order[:5]
    assert torch.allclose(lp.exp(), torch.tensor([counts[y] / len(labels) for y in order[:5]]))

    summary = summarize_model(table, label_baseline(table, [8, 64], 64), buckets)["overall"]
    best = order[0]
    streaks = []
    for row, n in zip(table.target_ids_ND.tolist(), table.valid_len_N.tolist(), strict=True):
        streaks.append(next((j for j, y in enumerate(row[:n]) if y != best), n))
    assert summary["tau"] == pytest.approx(1 + np.mean(streaks))
    k1 = [
        row[0] == best
        for row, n in zip(table.target_ids_ND.tolist(), table.valid_len_N.tolist(), strict=True)
        if n >= 1
    ]
    assert summary["position_acceptance"][0] == pytest.approx(np.mean(k1))
    # Best-first trees grow by adding nodes: a larger budget never accepts less.
    assert summary["ddtree_tau_8"] <= summary["ddtree_tau_64"]


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv] + ["progress=false", "load_threads=1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    table, _, wrote = captured.out.rstrip("\n").rpartition("\n\n")
    return table, wrote


def test_cli_on_a_trained_run_holdout_buckets_and_json(tiny, tmp_path, capsys):
    run_dir = tiny / "runs" / "r"
    out = tmp_path / "eval.json"
    table, wrote = run_cli(capsys, run_dir, "--data", tiny / "shards", "--out", out)
    assert wrote == f"wrote {out}"
    report = json.loads(out.read_text())

    # The JSON holds everything the table shows: the table is reproduced from the file alone.
    assert render_report(report) == table

    ds = ShardDataset(str(tiny / "shards"))
    ids = ds.index.column("sample_id").to_pylist()
    held = np.flatnonzero(holdout_mask(ids, 0.25))
    assert 0 < held.size < len(ids)
    data = report["data"]
    assert (
        data["split"] == "holdout"
        and data["holdout_fraction"] == 0.25
        and "this dataset trained r/step-00000002" in data["split_reason"]
    )
    assert data["samples"] == held.size and data["manifest_digest"] == json_digest(ds.manifest)
    resolved = config_from_dict(EvalConfig, report["config"])  # the resolved config loads back
    assert resolved.data == str(tiny / "shards") and resolved.split == "holdout" and resolved.holdout_fraction == 0.25
    # device=auto: on a GPU host the CLI evaluates on CUDA (bf16, 512 blocks per forward), elsewhere on the CPU.
    # The drafter's head_dim 8 is below what flex's CUDA kernel takes, so auto picks sdpa on both, saying why.
    on_cuda = torch.cuda.is_available()
    assert (
        resolved.out == str(out) and resolved.device == ("cuda" if on_cuda else "cpu") and resolved.attention == "sdpa"
    )
    assert resolved.blocks_per_forward == (512 if on_cuda else 128)
    assert report["kernels"]["attention"] == "sdpa" and (
        "head_dim >= 16" in report["kernels"]["reason"] if on_cuda else "on cpu" in report["kernels"]["reason"]
    )
    assert f"attention sdpa ({report['kernels']['reason']})" in table
    ckpt = report["checkpoints"][0]
    assert ckpt["path"] == str(run_dir / "checkpoints" / "step-00000002") and ckpt["step"] == 2

    # Buckets are the run's (data_plan.json): <=20, 21-30, 31-1000 and an empty >1000.
    assert data["boundaries"] == [20, 30, 1000] and "data_plan.json" in data["boundaries_from"]
    assert [b["label"] for b in report["buckets"]] == ["<=20", "21-30", "31-1000", ">1000"]
    last = ckpt["buckets"][3]
    assert last["n_blocks"] == 0 and last["tau"] is None and last["position_acceptance"] == [None] * D
    assert report["buckets"][3]["n_samples"] == 0
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("metric"))
    blocks_line = next(line for line in lines if line.startswith("blocks"))
    assert header.split()[-1] == ">1000" and blocks_line.split()[-1] == "empty"
    assert sum(b["n_blocks"] for b in ckpt["buckets"]) == ckpt["overall"]["n_blocks"] == data["blocks"]

    # Every metric the summary has is in the table, overall, with the JSON's value.
    tau_line = next(line for line in table.splitlines() if line.startswith("tau chain "))
    assert tau_line.split()[2] == f"{ckpt['overall']['tau']:.3f}"
    baseline = report["baseline"]
    assert baseline["overall"]["n_blocks"] == ckpt["overall"]["n_blocks"]  # the same blocks as the drafter
    base_line = next(line for line in lines if line.startswith("most-frequent-label baseline: tau chain"))
    assert base_line.split()[4] == f"{baseline['overall']['tau']:.3f}"
    assert f"always token {baseline['token']}" in table
    for b in (8, 16, 32, 64):
        line = next(line for line in table.splitlines() if line.startswith(f"tau DDTree-{b} "))
        assert line.split()[2] == f"{ckpt['overall'][f'ddtree_tau_{b}']:.3f}"


def test_two_checkpoints_side_by_side_with_ratios(tiny, tmp_path, capsys):
    ckpts = tiny / "runs" / "r" / "checkpoints"
    first, second = ckpts / "step-00000001", ckpts / "step-00000002"
    out = tmp_path / "cmp.json"
    table, _ = run_cli(capsys, first, second, "--data", tiny / "shards", "--out", out, "split=all", "max_samples=10")
    report = json.loads(out.read_text())
    a, b = (c["overall"] for c in report["checkpoints"])
    assert a["n_blocks"] == b["n_blocks"] and a["position_count"] == b["position_count"]  # the same blocks
    # Each column is its own checkpoint's evaluation: equal to evaluating that checkpoint alone. (Two
    # training steps need not change tau: on CUDA in bf16 both checkpoints can accept the same tokens.)
    for ckpt, overall in ((first, a), (second, b)):
        alone = tmp_path / f"{ckpt.name}.json"
        run_cli(capsys, ckpt, "--data", tiny / "shards", "--out", alone, "split=all", "max_samples=10")
        assert json.loads(alone.read_text())["checkpoints"][0]["overall"] == overall
    ratio = report["ratio"]["overall"]
    assert ratio["tau"] == pytest.approx(b["tau"] / a["tau"])
    assert ratio["ddtree_tau_64"] == pytest.approx(b["ddtree_tau_64"] / a["ddtree_tau_64"])
    assert ratio["position_acceptance"] == [
        None if x in (None, 0) else y / x
        for x, y in zip(a["position_acceptance"], b["position_acceptance"], strict=True)
    ]
    assert "n_blocks" not in ratio and "tau_histogram" not in ratio
    for i, bucket in enumerate(report["ratio"]["buckets"]):
        ba, bb = report["checkpoints"][0]["buckets"][i], report["checkpoints"][1]["buckets"][i]
        assert bucket == metric_ratios(ba, bb)
    assert report["ratio"]["buckets"][3]["tau"] is None  # the empty bucket has no ratio
    assert render_report(report) == table
    tau_line = next(line for line in table.splitlines() if line.startswith("tau chain "))
    assert tau_line.split()[2:] == [f"{a['tau']:.3f}", f"{b['tau']:.3f}", f"{ratio['tau']:.3f}"]
    assert "bucket 3: length >1000" in table

    # The same checkpoint twice: every defined ratio is exactly 1.
    run_cli(capsys, first, first, "--data", tiny / "shards", "--out", out, "split=all", "max_samples=4", "budgets=[8]")
    same = json.loads(out.read_text())["ratio"]["overall"]
    values = [v for v in same.values() if not isinstance(v, list)] + same["position_acceptance"]
    defined = [v for v in values if v is not None]  # None: a metric that is 0 for both (e.g. all accepted)
    assert len(defined) > 10 and all(v == 1.0 for v in defined)


def dflash2_checkpoint(dflash_checkpoint, out):
    """A DFlash2 checkpoint holding a DFlash checkpoint's backbone, with identity convolutions and a fresh
    selector (what a warm start from it begins with), under the same saved train config."""
    import dataclasses

    from train import checkpoint as ck

    info = read_checkpoint(dflash_checkpoint)
    cfg = dataclasses.replace(info.drafter_config, arch="dflash2", selector_rank=8, selector_top_k=6)
    drafter = build_drafter(cfg)
    missing = drafter.load_state_dict(load_file(str(info.path / "model.safetensors")), strict=False).missing_keys
    assert missing and all("conv" in k or "selector" in k for k in missing)
    state = json.loads((info.path / "state.json").read_text())
    optimizer = torch.optim.AdamW(drafter.parameters())
    return ck.write_checkpoint(out, ck.take_snapshot(info.step, drafter, optimizer, state, cfg.to_dict()))


def test_a_dflash2_checkpoint_beside_its_dflash_backbone(tiny, tmp_path, capsys):
    """The report of a DFlash2 checkpoint says which proposals it scored, keeps its unary ones beside them,
    and prints both; a fresh selector (no pair term yet) proposes the backbone's argmax, so its chain is
    the DFlash checkpoint's on the same blocks."""
    first = tiny / "runs" / "r" / "checkpoints" / "step-00000002"
    second = dflash2_checkpoint(first, tmp_path / "runs" / "d2" / "checkpoints")
    out = tmp_path / "cmp.json"
    table, _ = run_cli(capsys, first, second, "--data", tiny / "shards", "--out", out, "split=all", "max_samples=6")
    report = json.loads(out.read_text())
    dflash, dflash2 = report["checkpoints"]
    assert (dflash["proposals"], dflash2["proposals"]) == ("argmax", "selector") and "unary" not in dflash
    assert dflash2["overall"]["tau"] == dflash2["unary"]["overall"]["tau"] == dflash["overall"]["tau"]
    assert dflash2["unary"]["overall"]["ddtree_tau_64"] == dflash["overall"]["ddtree_tau_64"]
    assert render_report(report) == table
    assert "DFlash2: the selector's proposals" in table and "unary: tau DDTree-64" in table
    alone = tmp_path / "alone.json"
    table, _ = run_cli(capsys, second, "--data", tiny / "shards", "--out", alone, "split=all", "max_samples=6")
    assert render_report(json.loads(alone.read_text())) == table
    unary_line = next(line for line in table.splitlines() if line.startswith("unary: tau chain "))
    assert unary_line.split()[3] == f"{dflash2['unary']['overall']['tau']:.3f}"


def test_refuses_incompatible_shards_and_bad_requests(tiny, tmp_path, capsys):
    other = write_shards(tmp_path / "other", tiny / "target", n=3, taps=[1, 3])
    run_dir = tiny / "runs" / "r"
    assert main([str(run_dir), "--data", str(other), "progress=false"]) == 2
    err = capsys.readouterr().err
    assert "provenance.taps.layer_ids" in err and str(other) in err

    assert (
        main([str(run_dir), "--data", str(tiny / "shards"), "split=holdout", "holdout_fraction=0", "progress=false"])
        == 2
    )
    assert "holdout" in capsys.readouterr().err
    assert main([str(tmp_path), "--data", str(tiny / "shards")]) == 2
    assert "neither a checkpoint directory" in capsys.readouterr().err
    assert main([str(run_dir), "--data", str(tiny / "shards"), "budgets=[]"]) == 2
    assert "budgets" in capsys.readouterr().err


def test_cli_takes_any_path_the_filesystem_takes(tiny, tmp_path, capsys):
    """--data DIR with a character outside Unicode's basic plane failed (the path went
    through json.dumps into TOML, whose escapes cannot spell a surrogate pair)."""
    import shutil

    odd = tmp_path / 'a=b "quoted" \U0001f600 1e3'
    shutil.copytree(tiny / "shards", odd / "shards")
    shutil.copytree(tiny / "runs" / "r", odd / "run=2024-06-01")
    out = odd / "out \U0001f600.json"
    table, wrote = run_cli(capsys, odd / "run=2024-06-01", "--data", odd / "shards", f"--out={out}")
    assert wrote == f"wrote {out}"
    report = json.loads(out.read_text())
    assert report["config"]["data"] == str(odd / "shards") and report["checkpoints"][0]["path"].startswith(
        str(odd / "run=2024-06-01")
    )
