"""Results as data (benchmarks.render, benchmarks.catalogue, benchmarks/results/): docs/benchmarks.md's "Today"
and the README's results table are exactly what the records give; every record is readable, every imported one
names a log entry that exists, and the ones converted from docs/results/ hold what those files give."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import catalogue as C
from benchmarks import render
from benchmarks.suites import figures
from benchmarks.suites.record import load_records
from tests.paths import REPO


def test_the_rendered_sections_are_what_the_records_give(capsys):
    assert render.main(["--check"]) == 0, capsys.readouterr().out


def test_check_fails_when_a_record_changes_and_rendering_repairs_it(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    shutil.copytree(render.RESULTS, results)
    for name in ("DOC", "README"):
        copy = tmp_path / getattr(render, name).name
        shutil.copyfile(getattr(render, name), copy)
        monkeypatch.setattr(render, name, copy)
    monkeypatch.setattr(render, "RESULTS", results)
    monkeypatch.setattr(render, "REPO", tmp_path)
    path = results / "shape27b-2026-12-05T1239Z.json"  # the newest record of that figure
    record = json.loads(path.read_text())
    record["figures"]["shape27b.extract_packed5.full_tok_s"] = 1234
    path.write_text(json.dumps(record))
    assert render.main(["--check"]) == 1
    assert "benchmarks.md, README.md: not what benchmarks/results/ gives" in capsys.readouterr().out
    assert render.main([]) == 0 and render.main(["--check"]) == 0
    assert "| 1,234 tok/s |" in render.DOC.read_text() and "| 1,234 tok/s |" in render.README.read_text()


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors of a markdown file (outside code fences)."""
    found: set[str] = set()
    fenced = False
    for line in markdown.split("\n"):
        fenced ^= line.startswith("```")
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def test_the_suites_runs_on_an_h100_say_so_and_keep_their_logs():
    doc = render.DOC.read_text()
    for name in ("shape27b-2026-12-05T1239Z", "real-2026-12-05T1248Z"):
        assert (render.RESULTS / f"{name}.log").is_file()
        assert "H100" in json.loads((render.RESULTS / f"{name}.json").read_text())["machine"]["gpu"]
    assert "[2026-12-05, H100 80GB HBM3, 62b06fc](../benchmarks/results/shape27b-2026-12-05T1239Z.json)" in doc
    row = next(line for line in doc.split("\n") if line.startswith("| packed rows, five taps: full |"))
    assert "7,699 tok/s" in row and "H100" in row  # the H100's record is still the newest with this figure


def test_add_copies_a_record_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(render, "RESULTS", tmp_path / "results")
    (tmp_path / "results").mkdir()
    source = tmp_path / "out"
    source.mkdir()
    shutil.copyfile(REPO / "benchmarks/results/real-2026-12-05T1248Z.json", source / "real.json")
    (source / "real.log").write_text("the suite's log\n")
    target = render.add(source / "real.json")
    assert target.name == "real-2026-12-05T124847Z.json"  # to the second
    assert target.with_suffix(".log").read_text() == "the suite's log\n"


def test_every_record_reads_and_every_imported_one_names_an_entry_of_the_log():
    records = load_records(render.RESULTS)
    assert len(records) >= 20
    pages: dict[str, set[str]] = {}  # the anchors of each page a source names, read once
    for path, record in records:
        if record["status"] == "imported":
            page, anchor = record["source"].split("#", 1)
            if page not in pages:
                assert (REPO / page).is_file(), (path.name, record["source"])
                pages[page] = anchors((REPO / page).read_text())
            assert anchor in pages[page], (path.name, record["source"])
            assert "imported" in record["note"] or "from docs/results/" in record["note"]
        assert record["commit"] and record["machine"] and record["command"], path.name


def test_records_converted_from_docs_results_hold_what_those_files_give():
    converted = [(p, r) for p, r in load_records(render.RESULTS) if r.get("converted_from")]
    assert len(converted) >= 3
    for path, record in converted:
        how = record["converted_from"]
        report = json.loads((REPO / how["file"]).read_text())
        expected = getattr(figures, how["reader"])(report, *how["args"])
        assert {k: v for k, v in expected.items() if v is not None} == record["figures"], path.name


def record(date: str, figures_: dict, scale: str = "gpu", status: str = "complete") -> dict:
    machine = {"gpu": "NVIDIA H200", "gpus": 1, "cores": 16}
    return {
        "suite": "shape27b",
        "scale": scale,
        "status": status,
        "date": date,
        "commit": "abc1234",
        "machine": machine,
    }


def index(*entries: tuple[str, dict]) -> render.Index:
    return render.Index([(Path(f"/r/{name}.json"), rec) for name, rec in entries])


def test_a_figure_comes_from_the_newest_record_that_holds_it():
    old = {**record("2026-12-01T00:00:00Z", {}), "figures": {"k.a": 1.0, "k.b": 5}}
    new = {**record("2026-12-05T00:00:00Z", {}), "figures": {"k.a": 2.0}}
    table = C.Figures(
        "t", "suite:shape27b", (C.Fig("a", "k.a", "{:.1f}"), C.Fig("b", "k.b", "{:,}"), C.Fig("c", "k.c"))
    )
    lines = render.render_figures(table, index(("old", old), ("new", new)), Path("/r"))
    assert lines[4] == "| a | 2.0 |  | [2026-12-05, H200, abc1234](new.json) |"
    assert lines[5] == "| b | 5 |  | [2026-12-01, H200, abc1234](old.json) |"
    assert lines[6] == "| c | not yet measured (`make bench-gpu suite=shape27b`) |  | |"


def test_a_series_shows_the_rows_of_the_newest_record_or_what_measures_it():
    rows = [{"tau": 2, "graphed_speedup": 1.5}, {"tau": 3, "graphed_speedup": None}]
    rec = {**record("2026-12-05T00:00:00Z", {}), "status": "imported", "figures": {"shape27b.round.projection": rows}}
    lines = render.render_series(C.PROJECTION, index(("p", rec)), Path("/r"))
    assert lines[4] == "| 2 | — | 1.50x | — | — | — | — |" and lines[5] == "| 3 | — | — | — | — | — | — |"
    assert lines[6] == "\nRecord: [2026-12-05, H200, abc1234, log](p.json); —: not measured in it."
    empty = render.render_series(C.PROJECTION, index(), Path("/r"))
    assert empty[4].startswith("| not yet measured (`make bench-gpu suite=shape27b`) |")


def test_smoke_records_are_never_rendered_nor_added(tmp_path):
    smoke = {**record("2026-12-05T00:00:00Z", {}, scale="smoke"), "figures": {"k.a": 1.0}}
    assert index(("s", smoke)).latest("k.a") is None
    path = tmp_path / "s.json"
    path.write_text(json.dumps({**smoke, "schema": 1, "packages": {}, "command": "x"}))
    with pytest.raises(ValueError, match="smoke-scale record"):
        render.add(path)


def test_a_file_without_its_markers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs the lines"):
        render.splice("no markers here", render.README_MARKERS, "body", tmp_path / "README.md")
    text = f"a\n{render.README_MARKERS[0]}\nold\n{render.README_MARKERS[1]}\nb"
    assert render.splice(text, render.README_MARKERS, "new", Path("x")).split("\n")[2] == "new"


def complete_record(**changes) -> dict:
    """A record of a GPU suite as a run writes it, with `changes`."""
    return {
        **record("2026-12-05T14:32:12Z", {}),
        "schema": 1,
        "packages": {"torch": "2.13.0"},
        "command": "python3 -m benchmarks.suites shape27b",
        "figures": {"shape27b.round.tau": 3.0},
        **changes,
    }


@pytest.fixture
def results(tmp_path, monkeypatch):
    """benchmarks/results/ and the rendered files as copies: what --add writes lands there."""
    copy = tmp_path / "checkout" / "benchmarks" / "results"
    shutil.copytree(render.RESULTS, copy)
    for name in ("DOC", "README"):
        target = tmp_path / "checkout" / getattr(render, name).relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(getattr(render, name), target)
        monkeypatch.setattr(render, name, target)
    monkeypatch.setattr(render, "RESULTS", copy)
    monkeypatch.setattr(render, "REPO", tmp_path / "checkout")
    return copy


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"machine": "H200"}, "'machine' must be a JSON object"),
        ({"suite": "../../../escaped"}, "'suite' '../../../escaped' is none of the suites"),
        ({"suite": "/tmp/abs"}, "is none of the suites"),
        ({"commit": 7}, "'commit' must be a JSON string"),
        ({"figures": [1]}, "figures must be an object"),
        ({"date": "yesterday"}, "is not YYYY-MM-DDTHH:MM:SSZ"),
        ({"wall_s": "long", "status": "complete"}, "cannot be rendered"),
    ],
)
def test_a_malformed_record_is_refused_in_one_line_and_nothing_is_written(results, tmp_path, capsys, changes, said):
    """Issue 54: --add copied a record with `machine` a string, after which every rendering crashed until the
    file was removed by hand; an unchecked `suite` named a file outside the checkout."""
    before = sorted(p.name for p in results.iterdir())
    path = tmp_path / "shape27b.json"
    path.write_text(json.dumps(complete_record(**changes)))
    assert render.main(["--add", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and str(path) in err and "\n" not in err and "Traceback" not in err, err
    assert sorted(p.name for p in results.iterdir()) == before
    assert not list((tmp_path / "checkout").parent.glob("escaped*")) and not Path("/tmp/abs-2026").exists()
    assert render.main(["--check"]) == 0  # the rendering still works


def test_two_records_of_a_suite_in_the_same_second_are_both_kept(results, tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(complete_record()))
    second.write_text(json.dumps(complete_record(figures={"shape27b.round.tau": 3.5})))
    kept = [render.add(first), render.add(second), render.add(first)]
    assert kept[0].name == "shape27b-2026-12-05T143212Z.json" and kept[1].name == "shape27b-2026-12-05T143212Z-2.json"
    assert kept[2] == kept[0]  # the same record again: already there, not a third copy
    assert json.loads(kept[1].read_text())["figures"]["shape27b.round.tau"] == 3.5
    assert not list(results.glob(".*.tmp"))
