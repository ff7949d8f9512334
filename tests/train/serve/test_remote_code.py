"""trust_remote_code stays off unless the user sets it (found by the reliability suite): an exported
drafter is built with this project's model code unless asked otherwise (`specdecode --drafter DIR`
used to run the directory's dflash.py), and the trainer reads the target's tokenizer with
trust_remote_code=False instead of transformers' default, which asks on the terminal."""

from __future__ import annotations

import contextlib
import json

import torch

from tests.train.serve.test_export import random_drafter, tiny_config
from train.export_format.layout import export_drafter, load_exported


def test_an_exported_drafter_runs_no_code_from_its_directory_unless_asked(tmp_path):
    cfg = tiny_config()
    export_drafter(random_drafter(cfg).state_dict(), cfg, tmp_path / "e", dtype="float32")
    marker = tmp_path / "ran"
    with open(tmp_path / "e" / "dflash.py", "a") as f:
        f.write(f"\nimport pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    safe = load_exported(tmp_path / "e")
    assert not marker.exists() and type(safe).__name__ == "DFlashDraftModel"
    remote = load_exported(tmp_path / "e", trust_remote_code=True)  # the user's explicit choice
    assert marker.exists()
    S, Q = 7, 4
    inputs = dict(
        position_ids=torch.arange(S + Q)[None],
        noise_embedding=torch.randn(1, Q, cfg.hidden_size),
        target_hidden=torch.randn(1, S, cfg.feature_width),
    )
    assert torch.equal(safe(**inputs), remote(**inputs))


def test_the_trainer_reads_a_target_tokenizer_without_running_its_code(tmp_path, monkeypatch):
    import transformers

    from tests.train.test_loop import _tokenizer
    from train.prepare import _load_tokenizer

    asked = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda *args, **kwargs: asked.append(kwargs.get("trust_remote_code", "unset")) or real(*args, **kwargs),
    )

    _tokenizer().save_pretrained(tmp_path)
    marker = tmp_path / "ran"
    tok_cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (tmp_path / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nfrom transformers import PreTrainedTokenizerFast "
        "as EvilTokenizer\n"
    )
    with contextlib.suppress(ValueError):  # refusing is fine; asking on the terminal or running the code is not
        _load_tokenizer(str(tmp_path))
    assert not marker.exists()
    assert asked == [False]  # explicitly off: transformers asks on the terminal when it is left unset
