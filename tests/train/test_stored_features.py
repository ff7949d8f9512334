"""Storage tiers in training, evaluation, export and speculative decoding.

Proves: a quantized dataset reaches the step as compact bytes that dequantize (on the step's device)
to exactly what the reader gives; projection folding is exact (the trained-on-projected forward equals
the exported forward on full features within fp32 tolerance, and online speculative decoding with the
export on full features makes the same rounds as the projected model); eval of a projected drafter on
full features matches eval on its projected data up to bf16 rounding of the stored features; mixed
encodings and projection mismatches are refused, naming what differs.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from torch import nn

from common.config import load_config
from common.io import resolve
from shards import ShardDataset
from shards.manifest import RESERVED_COUNTS, load_manifest, save_manifest
from shards.projection import SecondMoments, fit_projection, load_projection, parse_projection_spec
from shards.transcode import TranscodeConfig, transcode
from tests.train.serve.test_specdecode import LAYER_IDS, B, drafter_config, random_prompts, tiny_qwen3, train_drafter
from tests.train.test_loop import config, tiny  # noqa: F401  (the fixture)
from train.data import DataStream
from train.eval.config import EvalConfig
from train.eval.run import evaluate_checkpoints
from train.export_format.layout import export_checkpoint, export_drafter, load_exported
from train.loop import train
from train.model import DFlashDrafter
from train.serve.decoding import DFlashProposer, greedy_generate, speculative_generate
from train.serve.spec_target import SpecTarget
from train.stored_features import CompactHidden, fold_projection


def tier(tiny, name: str, *words) -> str:  # noqa: F811
    """A storage tier of the test_loop shards (cached per module)."""
    out = tiny / f"tier-{name}"
    if not (out / "manifest.json").exists():
        transcode(str(tiny / "shards"), str(out), load_config(TranscodeConfig, None, ["progress=false", *words]))
    return str(out)


def fitted_projection(h_NF: torch.Tensor, n_taps: int, rank: int):
    moments = SecondMoments(n_taps, h_NF.shape[-1] // n_taps)
    moments.add(h_NF)
    return fit_projection(moments, parse_projection_spec(f"pca:rank={rank}"))


def identity(projection) -> dict:
    return {"checksum": "test", "in_width": projection.in_width, "out_width": projection.out_width}


# ----------------------------------------------------------------------------------------------
# Quantized datasets: compact bytes to the step


def test_quantized_batches_stay_compact_and_dequantize_to_what_the_reader_gives(tiny, tmp_path):  # noqa: F811
    root = tier(tiny, "fp8", "encoding=fp8")
    cfg = config(tiny, tmp_path, f"data.shards={root}")
    stream = DataStream(cfg.data)
    ds = ShardDataset(root)
    for _ in range(3):
        batch = next(stream)
        assert isinstance(batch.hidden, CompactHidden) and batch.hidden.shape[2] == ds.hidden_width
        assert batch.hidden.nbytes <= 0.55 * 2 * batch.hidden.shape.numel()  # ~1 byte per value (+ scales), not 2
        hidden = batch.hidden.to("cpu", non_blocking=True)
        assert hidden.dtype == torch.bfloat16 and hidden.shape == batch.hidden.shape
        ids = ds.index.column("sample_id").to_pylist()
        for row, sid in enumerate(batch.sample_ids):
            T = int(batch.lengths[row])
            assert torch.equal(hidden[row, :T], ds.torch(ids.index(sid))["hidden"])
            assert not hidden[row, T:].any()
    stream.close()


@pytest.mark.parametrize("name, words", [("fp8", ["encoding=fp8"]), ("nf4", ["encoding=nf4-g16"])])
def test_training_runs_on_quantized_shards(tiny, tmp_path, name, words):  # noqa: F811
    root = tier(tiny, name, *words)
    summary = train(config(tiny, tmp_path, f"data.shards={root}", "optim.max_steps=3"))
    records = [json.loads(line) for line in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert summary is not None and len(records) == 3 and all(r["loss"] is not None and r["loss"] > 0 for r in records)


# ----------------------------------------------------------------------------------------------
# Refusals


def test_a_dataset_whose_shards_mix_encodings_is_refused_naming_the_shards(tiny, tmp_path):  # noqa: F811
    mixed = tmp_path / "mixed"
    shutil.copytree(tiny / "shards", mixed)
    quantized = ShardDataset(tier(tiny, "fp8", "encoding=fp8"))
    fs, path = resolve(str(mixed))
    manifest = load_manifest(fs, path)
    entry = dict(quantized.shards[0], file="q-00000.arrow", index_file="q-00000.index.arrow")
    shutil.copy(f"{quantized.root}/{quantized.shards[0]['file']}", mixed / entry["file"])
    shutil.copy(f"{quantized.root}/{quantized.shards[0]['index_file']}", mixed / entry["index_file"])
    manifest["shards"].append(entry)
    for key, field in zip(RESERVED_COUNTS, ("samples", "tokens", "loss_tokens"), strict=True):
        manifest["counts"][key] += entry[field]
    save_manifest(fs, path, "manifest.json", manifest)
    with pytest.raises(ValueError, match=r"shard 'q-00000.arrow' has encoding 'fp8' but the dataset's is 'planes'"):
        train(config(tiny, tmp_path, f"data.shards={mixed}"))


def test_drafter_config_that_disagrees_with_the_dataset_projection_is_refused(tiny, tmp_path):  # noqa: F811
    projected = tier(tiny, "proj", "encoding=planes", "projection=pca:rank=8")
    checksum = ShardDataset(projected).projection["checksum"]
    with pytest.raises(
        ValueError, match=r"manifest field 'projection' = \w+ \(64 -> 16 features\) but the drafter config expects full"
    ):
        train(config(tiny, tmp_path, f"data.shards={projected}", "model.projection=none"))
    with pytest.raises(
        ValueError, match=rf"'model.projection' = 'abc' but the shards dataset has projection {checksum}"
    ):
        train(config(tiny, tmp_path, f"data.shards={projected}", "model.projection=abc"))
    with pytest.raises(ValueError, match=r"'model.projection' = 'abc' but the shards dataset has no projection"):
        train(config(tiny, tmp_path, "model.projection=abc"))


# ----------------------------------------------------------------------------------------------
# Folding P into fc


def test_trained_on_projected_forward_equals_folded_and_exported_forward_on_full_features(tmp_path):
    torch.manual_seed(0)
    h = torch.randn(2, 40, 64) @ torch.randn(64, 64) / 8  # correlated features: PCA has something to keep
    projection = fitted_projection(h.reshape(-1, 64), n_taps=2, rank=12)
    cfg = drafter_config(projection=identity(projection))
    trained = DFlashDrafter(cfg).eval()
    state, full_cfg = fold_projection(trained.state_dict(), cfg, projection)
    assert full_cfg.projection is None and state["fc.weight"].shape == (32, 64)
    folded = DFlashDrafter(full_cfg).eval()
    folded.load_state_dict(state)
    noise = torch.randn(2, B, 32)
    positions = torch.arange(40 + B)[None].expand(2, -1)
    with torch.no_grad():
        on_projected = trained(noise, projection.apply(h), positions)
        on_full = folded(noise, h, positions)
    torch.testing.assert_close(on_full, on_projected, rtol=1e-5, atol=1e-5)
    export_drafter(state, full_cfg, tmp_path / "export", dtype="float32")
    exported = load_exported(tmp_path / "export")
    with torch.no_grad():
        served = exported(position_ids=positions, noise_embedding=noise, target_hidden=h)
    torch.testing.assert_close(served, on_projected, rtol=1e-5, atol=1e-5)


class ProjectingDrafter(nn.Module):
    """An exported-format drafter whose fc reads projected features: it projects what it is given."""

    def __init__(self, exported, fc_prime: torch.Tensor, projection):
        super().__init__()
        self.inner = copy.deepcopy(exported)
        self.inner.fc = nn.Linear(fc_prime.shape[1], fc_prime.shape[0], bias=False).to(fc_prime.dtype)
        self.inner.fc.weight.data.copy_(fc_prime)
        self.projection = projection
        self.block_size, self.mask_token_id, self.target_layer_ids = (
            exported.block_size,
            exported.mask_token_id,
            exported.target_layer_ids,
        )

    def forward(self, *, target_hidden, **kwargs):
        z = self.projection.apply(target_hidden.double()).to(target_hidden.dtype)
        return self.inner(target_hidden=z, **kwargs)


def test_online_decoding_with_the_export_on_full_features_equals_the_projected_model(tmp_path):
    """Real speculative decoding: rounds, τ and tokens of the exported (folded) drafter reading full
    target features are those of the trained model reading P·h (float64, so no rounding differs)."""
    target = SpecTarget.from_model(tiny_qwen3(seed=0, dtype=torch.float64), LAYER_IDS, stop_ids=[])
    prompts = random_prompts(3, lengths=(5, 9, 14), seed=11)
    features = [
        target.teacher_forced(torch.tensor(p + greedy_generate(target, p, 40).tokens)[None])[1].float() for p in prompts
    ]
    projection = fitted_projection(torch.cat(features), n_taps=2, rank=12)
    cfg = drafter_config(projection=identity(projection))
    drafter = train_drafter(target, prompts, 40, steps=80, config=cfg, features_of=projection.apply)
    state, full_cfg = fold_projection(drafter.state_dict(), cfg, projection)
    export_drafter(state, full_cfg, tmp_path / "export", dtype="float32")
    exported = load_exported(tmp_path / "export", dtype=torch.float64)
    projecting = ProjectingDrafter(exported, drafter.fc.weight.detach().double(), projection)
    taus = []
    for prompt in prompts:
        full = speculative_generate(target, DFlashProposer(exported, target), prompt, 40)
        projected = speculative_generate(target, DFlashProposer(projecting, target), prompt, 40)
        assert full.tokens == projected.tokens == greedy_generate(target, prompt, 40).tokens
        assert full.taus == projected.taus
        taus += full.taus
    assert sum(taus) / len(taus) > 1.5, taus  # the drafter accepts: the comparison covers real rounds


def test_projected_run_exports_folded_and_evaluates_on_full_features_as_on_its_own(tiny, tmp_path):  # noqa: F811
    projected = tier(tiny, "proj", "encoding=planes", "projection=pca:rank=8")
    train(config(tiny, tmp_path, f"data.shards={projected}", "optim.max_steps=20", "checkpoint.every=20"))
    run = tmp_path / "runs" / "r"
    saved = json.loads(next((run / "checkpoints").iterdir()).joinpath("drafter_config.json").read_text())
    assert saved["projection"]["checksum"] == ShardDataset(projected).projection["checksum"]
    out = export_checkpoint(run, tmp_path / "export", dtype="float32")
    exported_config = json.loads((out / "config.json").read_text())
    assert (
        "projection" not in exported_config
        and json.loads((out / "dflash_export.json").read_text())["folded_projection"]
    )
    exported = load_exported(out)
    assert exported.fc.weight.shape == (32, 64)  # reads the full 2 x 32 tap features

    def evaluate(data: str) -> dict:
        cfg = load_config(
            EvalConfig,
            None,
            [f"data={data}", "split=all", "progress=false", f"out={tmp_path / 'e.json'}", "budgets=[8]"],
        )
        return evaluate_checkpoints([str(run)], cfg)[0]["checkpoints"][0]["overall"]

    on_projected, on_full = evaluate(projected), evaluate(str(tiny / "shards"))
    assert on_full["n_blocks"] == on_projected["n_blocks"] and on_full["tau"] > 1.0  # some drafts are accepted
    assert on_full["tau"] == pytest.approx(on_projected["tau"], abs=0.02)  # the stored P·h is rounded to bf16
    assert on_full["position_acceptance"][0] == pytest.approx(on_projected["position_acceptance"][0], abs=0.02)
    projection = load_projection(projected, ShardDataset(projected).projection)
    assert projection.out_width == 16
