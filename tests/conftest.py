"""Shared test setup: small thread counts (the suite runs two workers on two cores) and fixed seeds."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The weight-digest cache (target.file_digests) of the tests' own targets: not the user's ~/.cache.
os.environ.setdefault("DFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="dflash-test-cache-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def moto_server():
    """A real S3 server (`moto_server`) on a free loopback port for the session; skipped where moto is missing."""
    from benchmarks.s3_server import MotoServer, moto_server_command

    if moto_server_command() is None:
        pytest.skip("moto[server] is not installed (the dev extra installs it): no S3 server to test against")
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_uri(moto_server, monkeypatch, request):
    """A fresh bucket on the moto server and the URI of a prefix in it; credentials set in the environment."""
    import uuid

    for key, value in moto_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DFLASH_S3_RETRIES", "3")
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    moto_server.create_bucket(bucket)
    return moto_server.uri(f"{bucket}/data")
