"""`make tiers` (recipes.compare_tiers): the comparison table is assembled from the files the steps write
(dataset manifests, eval reports, speculative-decoding results): bytes per token, recorded error,
means over seeds and changes against lossless."""

from __future__ import annotations

import json

import pytest

from common.config import load_config
from recipes.compare_tiers import CompareTiersConfig, collect, config_from_argv, markdown, tier_name
from shards.transcode import TranscodeConfig, transcode
from tests.paths import REPO
from tests.shards.test_transcode import lossless


def eval_report(lossless_tau: float, tier_tau: float) -> dict:
    def overall(tau):
        return {"tau": tau, "position_acceptance": [tau - 1.0], "ddtree_tau_32": tau + 0.5}

    return {"checkpoints": [{"overall": overall(lossless_tau)}, {"overall": overall(tier_tau)}]}


def test_table_has_lossless_first_means_over_seeds_and_changes(tmp_path):
    src = lossless(tmp_path / "src", 6)
    transcode(str(src), str(tmp_path / "fp8"), load_config(TranscodeConfig, None, ["encoding=fp8", "progress=false"]))
    cfg = load_config(CompareTiersConfig, None, [f"out_dir={tmp_path / 'out'}", 'tiers=["fp8"]', "seeds=[0, 1]"])
    (tmp_path / "out" / "eval").mkdir(parents=True)
    for seed, (a, b) in enumerate([(2.0, 1.9), (2.2, 2.2)]):
        (tmp_path / "out" / "eval" / f"fp8-s{seed}.json").write_text(json.dumps(eval_report(a, b)))
    runs = {
        (tier, seed): tmp_path / "out" / "runs" / f"{tier_name(tier)}-s{seed}"
        for tier in ("lossless", "fp8")
        for seed in (0, 1)
    }
    for (tier, seed), run in runs.items():
        run.mkdir(parents=True)
        (run / "specdecode.json").write_text(
            json.dumps({"summary": {"tau": 3.0 if tier == "lossless" else 2.7 + 0.1 * seed}})
        )
    rows = collect(cfg, {"lossless": str(src), "fp8": str(tmp_path / "fp8")}, runs)
    assert [r["tier"] for r in rows] == ["lossless", "fp8"]
    base, fp8 = rows
    assert base["chain_tau"] == pytest.approx(2.1) and fp8["chain_tau"] == pytest.approx(2.05)
    assert fp8["delta_chain_tau"] == pytest.approx(2.05 / 2.1 - 1) and fp8["online_tau"] == pytest.approx(2.75)
    assert fp8["ddtree_tau"] == pytest.approx(2.55) and fp8["acc1"] == pytest.approx(1.05)
    assert base["rel_rms_per_tap"] == [] and len(fp8["rel_rms_per_tap"]) == 2 and 0 < max(fp8["rel_rms_per_tap"]) < 0.05
    assert fp8["ratio_to_raw_bf16"] < base["ratio_to_raw_bf16"]
    table = "\n".join(markdown(rows, cfg))
    assert "| fp8 |" in table and "2.050 (-2.4%) [1.900 / 2.200]" in table and "0 (exact)" in table


def test_tier_names_are_directory_names():
    assert tier_name("fp8") == "fp8" and tier_name("nf4-g64@pca:rank=32") == "nf4-g64-pca-rank32"
    assert tier_name("fp8@pca:rank=144,keep=4") == "fp8-pca-rank144-keep4"
    assert tier_name("fp8@/data/other/projection.safetensors") == "fp8-proj-projection"


def test_several_heldout_and_prompt_sets_each_get_their_columns(tmp_path):
    src = lossless(tmp_path / "src", 6)
    tier = "fp8@pca:rank=4"
    transcode(
        str(src),
        str(tmp_path / "proj"),
        load_config(TranscodeConfig, None, ["encoding=fp8", "projection=pca:rank=4", "progress=false"]),
    )
    cfg = load_config(
        CompareTiersConfig,
        None,
        [
            f"out_dir={tmp_path / 'out'}",
            f'tiers=["{tier}"]',
            "seeds=[0]",
            "heldout={humaneval = 'a', chat = 'b'}",
            "prompts={humaneval = 'a.jsonl', chat = 'b.jsonl'}",
        ],
    )
    for name, (a, b) in {"humaneval": (2.0, 1.8), "chat": (3.0, 3.3)}.items():
        (tmp_path / "out" / "eval" / name).mkdir(parents=True)
        (tmp_path / "out" / "eval" / name / f"{tier_name(tier)}-s0.json").write_text(json.dumps(eval_report(a, b)))
    runs = {(t, 0): tmp_path / "out" / "runs" / f"{tier_name(t)}-s0" for t in ("lossless", tier)}
    for (t, _), run in runs.items():
        run.mkdir(parents=True)
        (run / "specdecode-humaneval.json").write_text(
            json.dumps({"summary": {"tau": 2.0 if t == "lossless" else 1.5}})
        )
    rows = collect(cfg, {"lossless": str(src), tier: str(tmp_path / "proj")}, runs)
    base, projected = rows
    assert projected["chain_tau:humaneval"] == pytest.approx(1.8) and projected["chain_tau:chat"] == pytest.approx(3.3)
    assert projected["delta_chain_tau:chat"] == pytest.approx(0.1)
    assert projected["online_tau:humaneval"] == pytest.approx(1.5) and projected["online_tau:chat"] is None
    assert projected["delta_online_tau:humaneval"] == pytest.approx(-0.25)
    kept = projected["variance_kept_per_tap"]
    assert len(kept) == 2 and all(0 < k <= 1 for k in kept) and base["variance_kept_per_tap"] == []
    table = "\n".join(markdown(rows, cfg))
    assert "chain τ (humaneval)" in table and "online τ (chat)" in table and "1.500 (-25.0%) [1.500]" in table


def test_a_set_name_that_is_no_file_name_is_refused():
    with pytest.raises(ValueError, match="heldout.*plain file name"):
        load_config(CompareTiersConfig, None, ["heldout={'a/b' = 'x'}"])


@pytest.mark.parametrize("path", ["configs/smollm2-135m.toml", "configs/smollm2-135m-tiers-cpu.toml"])
def test_real_target_tier_configs_give_every_stage_a_valid_command(path):
    from shards.projection import parse_projection_spec
    from shards.quant import parse_encoding
    from train.config import TrainConfig
    from train.eval.config import EvalConfig
    from train.serve.cli import SpecDecodeConfig

    cfg = config_from_argv([str(REPO / path)])
    assert cfg.config.endswith("configs/smollm2-135m.toml") and set(cfg.heldout) == {"humaneval", "chat_heldout"}
    assert set(cfg.prompts) == {"humaneval", "chat_heldout"} and len(cfg.seeds) >= 2
    train = load_config(TrainConfig, str(REPO / "configs/smollm2-135m.toml"), cfg.train_overrides, section="train")
    assert train.data.shards == cfg.lossless
    evaluation = load_config(EvalConfig, None, [f"data={cfg.heldout['humaneval']}", *cfg.eval_overrides])
    assert cfg.budget in evaluation.budgets
    load_config(SpecDecodeConfig, None, ["target=t", "drafter=d", *cfg.specdecode_overrides])
    for tier in cfg.tiers:
        encoding, _, projection = tier.partition("@")
        spec = parse_encoding(encoding)
        if projection:
            rank = parse_projection_spec(projection).rank
            assert rank is None or spec is None or not spec.four_bit or rank % spec.group_size == 0, tier


def test_the_plan_ties_each_step_to_what_it_reads(tmp_path):
    """Steps 2-5 as the runner's steps: a training is done only at its final checkpoint and redone
    when its transcode is; an evaluation needs both runs it compares; a decoding its export."""
    from recipes.compare_tiers import plan

    cfg = load_config(
        CompareTiersConfig, None, [f"out_dir={tmp_path}", 'tiers=["fp8"]', "seeds=[0]", "prompts={a = 'a.jsonl'}"]
    )
    datasets, runs, groups = plan(cfg, "TARGET")
    names = [[s.name for s in group] for group in groups]
    assert names == [
        ["transcode fp8"],
        ["train lossless-s0", "train fp8-s0"],
        ["eval fp8-s0"],
        ["export lossless-s0", "export fp8-s0"],
        ["specdecode lossless-s0 (a)", "specdecode fp8-s0 (a)"],
    ]
    by_name = {s.name: s for group in groups for s in group}
    fp8 = by_name["train fp8-s0"]
    assert fp8.training_run == str(runs[("fp8", 0)]) and fp8.needs == ("transcode fp8",) and not fp8.records
    assert f"data.shards={datasets['fp8']}" in fp8.args
    assert by_name["eval fp8-s0"].needs == ("train lossless-s0", "train fp8-s0")
    decoding = by_name["specdecode fp8-s0 (a)"]
    assert decoding.needs == ("export fp8-s0",) and decoding.args[:2] == ("--target", "TARGET")
    assert decoding.records == (str(runs[("fp8", 0)] / "specdecode-a.json"),)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["no-such.toml"], "config file 'no-such.toml' does not exist"),
        (["zz=1"], "unknown config key 'zz'"),
        (["seeds=abc"], "config key 'seeds': expected a list"),
        (["config=no-such.toml"], "config key 'config': the experiment's config file 'no-such.toml' does not exist"),
        (["train_overrides=['optim.lr=abc']"], "[train] with train_overrides: config key 'optim.lr'"),
    ],
)
def test_config_errors_are_one_line_before_any_step(argv, said, capsys, monkeypatch):
    """Issue 45: a ConfigError traceback; a missing config file noticed after three transcodes."""
    from recipes import compare_tiers

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(compare_tiers, "run_all", lambda cfg: pytest.fail("a step ran"))
    assert compare_tiers.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compare_tiers: ") and said in err and "\n" not in err
