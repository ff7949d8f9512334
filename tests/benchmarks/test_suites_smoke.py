"""Every GPU suite's code where CI runs (a CPU): its smoke scale plans, runs what fits, writes ONE record and ONE
log, and renders; the SmolLM2 suites' commands (too slow for seconds on a CPU) are checked against their stages'
own configs, at both scales."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import catalogue as C
from benchmarks import render
from benchmarks.suites import real, real_data, run
from benchmarks.suites.record import check_record
from benchmarks.suites.runner import Context, SuiteLog
from tests.paths import REPO


def run_suite(tmp_path: Path, *argv: str) -> tuple[int, dict, list[str]]:
    out = tmp_path / "out"
    code = run.main([*argv, "--out", str(out), "--work", str(tmp_path / "work")])
    record = json.loads((out / f"{argv[0]}.json").read_text())
    return code, record, sorted(p.name for p in out.iterdir())


def as_gpu(record: dict, tmp_path: Path) -> render.Index:
    """The smoke record as if it were a device run, for rendering (smoke records are never rendered)."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**record, "scale": "gpu"}))
    return render.Index([(path, {**record, "scale": "gpu"})])


@pytest.mark.slow
def test_shape27b_smoke_measures_the_round_and_records_and_renders_it(tmp_path):
    code, record, files = run_suite(tmp_path, "shape27b", "--scale", "smoke", "--budget-s", "150", "only=round")
    assert code == 0 and files == ["shape27b.json", "shape27b.log"]  # the device host returns at most 8 files
    check_record(record, "smoke record")
    assert record["status"] == "complete" and record["parts"]["round"]["status"] == "ok"
    assert record["plan"]["runs"] == [{"part": "round", "units": 1, "of": 1, "unit": "run", "est_s": 20}]
    figures = record["figures"]
    for variant in ("graphed", "rollback", "eager"):
        assert figures[f"shape27b.round.{variant}.step_ms"] > 0 and figures[f"shape27b.round.{variant}.verify16_ms"] > 0
    assert figures["shape27b.round.eager.snapshot_ms"] >= 0 and "CUDA graphs" in figures["shape27b.round.graphed.how"]
    assert (
        figures["shape27b.round.rollback.rollback_ms"] > 0
        and "rollback_speedup" in figures["shape27b.round.projection"][0]
    )
    kinds = record["raw"]["round"]["variants"]["rollback"]["breakdown"]["kinds"]  # CPU range times on a CPU
    assert kinds["Gated DeltaNet"]["ms"] > 0 and kinds["MLP"]["ms"] > 0 and kinds["head"]["ms"] > 0
    assert [r["tau"] for r in figures["shape27b.round.projection"]] == list(range(2, 11))
    assert record["raw"]["round"]["shape"] == "tiny" and record["packages"]["torch"]
    lines = render.render_figures(C.ROUND, as_gpu(record, tmp_path), tmp_path)
    step = next(line for line in lines if line.startswith("| eager: one-token step |"))
    assert f"{figures['shape27b.round.eager.step_ms']:.2f} ms" in step and "r.json" in step
    extraction = render.render_figures(C.EXTRACTION, as_gpu(record, tmp_path), tmp_path)
    assert "not yet measured (`make bench-gpu suite=shape27b`)" in extraction[4]


def test_s3_smoke_measures_the_servers_own_rates(tmp_path):
    pytest.importorskip("moto.server", reason="moto[server] is not installed (the dev extra installs it)")
    code, record, files = run_suite(tmp_path, "s3", "--scale", "smoke", "--budget-s", "90", "only=ceiling")
    assert code == 0 and files == ["s3.json", "s3.log"]
    assert record["parts"]["ceiling"]["status"] == "ok"
    assert record["figures"]["s3.ceiling.put_object_MB_s"] > 0 and record["figures"]["s3.ceiling.get_direct_MB_s"] > 0
    lines = render.render_figures(C.S3[0], as_gpu(record, tmp_path), tmp_path)
    assert "MB/s" in lines[4] and "not yet measured (`make bench-gpu suite=s3`)" in lines[6]


@pytest.mark.parametrize("name", ["real", "real-data", "tiers-real"])
def test_a_budget_too_small_cuts_every_part_says_why_and_still_writes_the_record(tmp_path, name):
    code, record, files = run_suite(tmp_path, name, "--scale", "smoke", "--budget-s", "20")
    assert code == 1 and files == [f"{name}.json", f"{name}.log"]
    assert record["status"] == "partial" and not record["parts"] and not record["figures"]
    cut = {c["part"]: c["why"] for c in record["cut"]}
    assert "prefix" in cut and "at its smallest" in cut["prefix"]
    assert all("needs" in why for part, why in cut.items() if part != "prefix")
    assert "cut: prefix" in (tmp_path / "out" / f"{name}.log").read_text()


def stage_configs():
    """What parses each stage's command line (the stage's own config loader)."""
    from common.config import parse_cli
    from extract.config import ExtractConfig
    from extract.regenerate.config import RegenerateConfig
    from recipes.compare_tiers import config_from_argv
    from recipes.smollm2.config import SmolConfig
    from train.config import TrainConfig
    from train.eval.__main__ import parse_args as parse_eval
    from train.serve.cli import parse_export_args, parse_specdecode_args

    return {
        "recipes.smollm2": lambda a: parse_cli(SmolConfig, a, section="smollm2"),
        "extract.regenerate": lambda a: parse_cli(RegenerateConfig, a, section="regenerate"),
        "extract": lambda a: parse_cli(ExtractConfig, a, section="extract"),
        "train": lambda a: parse_cli(TrainConfig, a, section="train"),
        "train.eval": lambda a: parse_eval(a)[1],
        "train.serve.export": parse_export_args,
        "train.serve.specdecode": parse_specdecode_args,
        "recipes.compare_tiers": config_from_argv,
        "train.report": lambda a: a,
    }


@pytest.mark.parametrize("scale", ["gpu", "smoke"])
@pytest.mark.parametrize("name", ["real", "real-data", "tiers-real"])
def test_every_smollm2_suite_command_parses_with_its_stage_config(tmp_path, monkeypatch, name, scale):
    import importlib

    from benchmarks.suites import SUITES

    monkeypatch.setattr(real_data, "dataset_samples", lambda config, overrides: 5481)  # the pool, as 2026-12-02
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)  # the data sources' corpus folders are made where the suite runs
    parsers = stage_configs()
    log = SuiteLog(tmp_path / "log")
    ctx = Context(name, scale, tmp_path, tmp_path, Path(".whl"), {}, log, state={"parts": {"tiers": {"units": 300}}})
    ctx.allowed_s = 300.0  # the part's time: the decoding command gets it, less its margin
    parsed = {}
    for part in importlib.import_module(SUITES[name]).parts(scale, {}):
        for units in {part.min_units, part.units}:
            for stage in part.stages(ctx, units):
                for step, argv in stage:
                    assert argv[0] == "-m" and argv[1] in parsers, (part.name, step, argv)
                    parsed[(part.name, step, units)] = (argv[1], parsers[argv[1]](argv[2:]))
    log.close()
    modules = {module for module, _ in parsed.values()}
    assert {"recipes.smollm2", "extract.regenerate", "extract"} <= modules
    check = {"real": check_real, "real-data": check_real_data, "tiers-real": check_tiers}[name]
    check(parsed, scale)


def check_real(parsed: dict, scale: str) -> None:
    trainings = {units: cfg for (part, _, units), (m, cfg) in parsed.items() if m == "train"}
    assert set(trainings) == ({300, 1000} if scale == "gpu" else {5, 30})
    assert all(cfg.optim.max_steps == units for units, cfg in trainings.items())
    decodings = {units: cfg for (part, _, units), (m, cfg) in parsed.items() if m == "train.serve.specdecode"}
    # On a GPU every HumanEval prompt, as many as fit the part's time; on a CPU the planned number
    assert {cfg.num_prompts for cfg in decodings.values()} == ({0} if scale == "gpu" else set(decodings))
    assert {cfg.time_limit_s for cfg in decodings.values()} == {300.0 - real.DECODING_MARGIN_S}


def check_real_data(parsed: dict, scale: str) -> None:
    trainings = [cfg for (part, step, units), (m, cfg) in parsed.items() if m == "train" and part == "ladder"]
    assert {cfg.optim.max_steps for cfg in trainings} == ({200, 1000} if scale == "gpu" else {3, 30})
    kl = [cfg for cfg in trainings if cfg.loss.kl_weight > 0]
    assert kl and {cfg.seed for cfg in kl} == {0, 1} and all(cfg.data.max_samples for cfg in kl)
    shares = {cfg.data.max_samples for cfg in trainings if cfg.loss.kl_weight == 0}
    assert len(shares) >= (4 if scale == "gpu" else 2)  # at least four points of the pool (None: all of it)
    regens = [cfg for (part, _, _), (m, cfg) in parsed.items() if m == "extract.regenerate" and part == "sampled"]
    assert regens and all(cfg.temperature == 0.8 and cfg.top_p == 0.95 for cfg in regens)


def check_tiers(parsed: dict, scale: str) -> None:
    runs = {part: cfg for (part, _, _), (m, cfg) in parsed.items() if m == "recipes.compare_tiers"}
    assert not runs["tiers"].online and runs["tiers-online"].online
    assert runs["tiers"].seeds == [0] and runs["tiers"].out_dir == "runs/bench-tiers"
    assert any(o.startswith("optim.max_steps=") for o in runs["tiers"].train_overrides)
    assert "optim.max_steps=300" in runs["tiers-online"].train_overrides  # the steps `tiers` trained, as recorded
