"""Every GPU suite's code where CI runs (a CPU): its smoke scale plans, runs what fits, writes ONE record and ONE
log, and renders; the SmolLM2 suites' commands (too slow for seconds on a CPU) are checked against their stages'
own configs, at both scales, and `real` runs through its own runner at the smoke scale with each step replaced by
the files it writes (DFlash2 beside DFlash)."""

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
    trainings = {(part, units): cfg for (part, _, units), (m, cfg) in parsed.items() if m == "train"}
    assert {u for _, u in trainings} == ({300, 1000} if scale == "gpu" else {5, 30})
    assert all(cfg.optim.max_steps == units for (_, units), cfg in trainings.items())
    # The DFlash2 drafter: the same shards and settings but its class, its own run
    for (part, units), cfg in trainings.items():
        dflash = trainings[("training", units)]
        assert cfg.model.arch == ("dflash2" if part == "training-dflash2" else "dflash")
        assert cfg.run_name == ("bench-real-dflash2" if part == "training-dflash2" else "bench-real")
        assert cfg.data.shards == dflash.data.shards and cfg.loss.num_anchors == dflash.loss.num_anchors
        assert cfg.model.num_layers == dflash.model.num_layers and cfg.seed == dflash.seed == 0
    decodings = {(part, units): cfg for (part, _, units), (m, cfg) in parsed.items() if m == "train.serve.specdecode"}
    # On a GPU every HumanEval prompt, as many as fit the part's time; on a CPU the planned number; the DFlash2
    # drafter the planned number (at most DFlash's), without the peers
    assert {cfg.num_prompts for (p, u), cfg in decodings.items() if p == "decoding"} == (
        {0} if scale == "gpu" else {u for p, u in decodings if p == "decoding"}
    )
    twin = {u: cfg for (p, u), cfg in decodings.items() if p == "decoding-dflash2"}
    assert twin and all(cfg.num_prompts == u and not cfg.peer_baselines for u, cfg in twin.items())
    assert all(cfg.drafter == "runs/bench-real-dflash2/export" for cfg in twin.values())
    assert {cfg.time_limit_s for cfg in decodings.values()} == {300.0 - real.DECODING_MARGIN_S}
    evaluations = [part for (part, _, _), (m, _) in parsed.items() if m == "train.eval"]
    assert sorted(set(evaluations)) == ["evaluation", "evaluation-dflash2"]


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


def fake_real_step(argv: list[str]) -> None:
    """What a `real` step writes that its part's collector reads, its numbers told apart by the drafter's run: a
    DFlash2 drafter's offline τ is 1.1 x DFlash's (its unary 0.9 x); DFlash's decoding stops 1 prompt short."""
    words = dict(w.split("=", 1) for w in argv[2:] if "=" in w)
    dflash2 = "bench-real-dflash2" in " ".join(argv)
    if argv[1] == "train.eval":
        base = {"humaneval": 2.0, "chat_heldout": 3.0}[Path(words["out"]).stem.removeprefix("eval_")]
        own = 1.1 * base if dflash2 else base

        def overall(tau):
            return {"n_blocks": 40, "tau": tau, "ddtree_tau_64": tau + 1, "position_acceptance": [0.5]}

        checkpoint = {"overall": overall(own)} | ({"unary": {"overall": overall(0.9 * base)}} if dflash2 else {})
        write(words["out"], {"checkpoints": [checkpoint], "baseline": {"overall": overall(1.0)}})
    if argv[1] == "train.serve.specdecode":
        asked = int(words["num_prompts"])
        done = asked if dflash2 else asked - 1
        summary = {"prompts": done, "tau": 2.4 if dflash2 else 2.0, "speedup_wall": 1.2, "mismatches": []}
        summary |= {"spec": {"wall_s": 1.0, "decode_tokens_per_s": 100.0}, "baseline": {"decode_tokens_per_s": 80.0}}
        stopped = {} if dflash2 else {"stopped": {"at": done, "of": asked}}
        write(words["out"], {"summary": summary, "config": {}, **stopped})


def write(path: str, doc: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc))


def test_real_at_smoke_scale_measures_dflash2_beside_dflash_at_the_same_steps_and_prompts(tmp_path, monkeypatch):
    """`real` at the smoke scale, planned and run by the suite's own runner with each step replaced by the files it
    writes: the DFlash2 parts run right after the DFlash ones, train the same steps, decode the prompts DFlash
    decoded, and give their figures and the ratios, which render."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)  # runs/ and artifacts/ of the suite's steps
    order, argvs = [], {}

    def run_stages(ctx, part, stages, seconds, jobs=0):
        order.append(part)
        for stage in stages:
            for _, argv in stage:
                argvs.setdefault(part, []).append(argv)
                fake_real_step(argv)
        return {"status": "ok", "seconds": {"training": 10.0, "training-dflash2": 11.5}.get(part, 1.0), "steps": []}

    monkeypatch.setattr(run, "run_stages", run_stages)
    code, record, files = run_suite(tmp_path, "real", "--scale", "smoke", "--budget-s", "1110")
    assert code == 0 and record["status"] == "complete" and files == ["real.json", "real.log"]
    check_record(record, "smoke record")
    assert order == [p.name for p in real.parts("smoke", {})]  # every DFlash2 part right after its DFlash one
    runs = {r["part"]: r["units"] for r in record["plan"]["runs"]}
    assert 5 < runs["training"] == runs["training-dflash2"] < 30  # grown together, short of the full 30
    parts, figures = record["parts"], record["figures"]
    assert parts["training"]["units"] == parts["training-dflash2"]["units"] == figures["real.dflash2.training.steps"]
    assert "model.arch=dflash2" in argvs["training-dflash2"][0] and "model.arch=dflash2" not in argvs["training"][0]
    assert parts["decoding"]["units"] == parts["decoding-dflash2"]["units"] == figures["real.online.prompts"]
    assert f"num_prompts={parts['decoding']['units']}" in argvs["decoding-dflash2"][0]  # the prompts DFlash decoded
    assert "peer_baselines=false" in argvs["decoding-dflash2"][0]
    for split, base in (("humaneval", 2.0), ("chat_heldout", 3.0)):
        assert figures[f"real.eval.{split}.tau"] == base and f"real.eval.{split}.unary_tau" not in figures
        assert figures[f"real.dflash2.eval.{split}.tau"] == pytest.approx(1.1 * base)
        assert figures[f"real.dflash2.eval.{split}.unary_tau"] == pytest.approx(0.9 * base)
        assert figures[f"real.dflash2.eval.{split}.unary_ddtree_tau_64"] == pytest.approx(0.9 * base + 1)
        assert figures[f"real.dflash2.eval.{split}.tau_over_dflash"] == pytest.approx(1.1)
    assert figures["real.dflash2.online.prompts"] == parts["decoding-dflash2"]["units"]
    assert figures["real.dflash2.online.tau_over_dflash"] == pytest.approx(1.2)
    assert figures["real.dflash2.training_s_over_dflash"] == pytest.approx(1.15)
    assert figures["real.suite_s"] == 1 + 10 + 1 + 1  # prefix, training, evaluation, decoding: DFlash's alone
    lines = render.render_figures(C.REAL_DFLASH2, as_gpu(record, tmp_path), tmp_path)
    row = next(line for line in lines if line.startswith("| chain τ / DFlash's, HumanEval |"))
    assert "| 1.100 | > 1 |" in row and "r.json" in row
    assert not any("not yet measured" in line for line in lines)
