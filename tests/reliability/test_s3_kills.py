"""Short version of the S3 kill scenario (`tests/reliability/s3_kills.py`): a few SIGKILLs of an
extraction writing to a real S3 server at random moments, each resumed to the uninterrupted run's
samples (each exactly once), counts and rejects, with no unlisted object, open upload or lock left."""

from __future__ import annotations

import uuid

import pytest

from tests.reliability import s3_kills


@pytest.mark.slow
def test_random_kills_against_s3_resume_to_the_uninterrupted_dataset(world, moto_server, monkeypatch):
    for key, value in moto_server.env().items():
        monkeypatch.setenv(key, value)
    bucket = f"kills-{uuid.uuid4().hex[:8]}"
    moto_server.create_bucket(bucket)
    outcome = s3_kills.run(world, moto_server, kills=2, seed=1, bucket=bucket, check_plain=False)
    assert outcome.passed, outcome.explain()
    assert outcome.figure.startswith("2/2 kills survived; 0 samples lost, 0 duplicated")


def test_extraction_to_s3_stores_the_local_run_and_a_rerun_has_nothing_to_do(world, moto_server, s3_uri):
    from common.config import load_config
    from extract import pipeline
    from extract.config import ExtractConfig
    from extract.ranks import Ranks
    from tests.reliability.datasets import sample_bytes

    cfg = load_config(ExtractConfig, s3_kills._config(world, "s3-in-process", s3_uri), section="extract")

    def extract():
        return pipeline.run(cfg, target=world.target, ranks=Ranks())[None]

    summary = extract()
    assert summary["complete"] and summary["this_run"]["coverage_ok"]
    reference = dict(sample_bytes(world.baseline))
    problems, lost, duplicated = s3_kills.check_final(s3_uri, world, reference, moto_server)
    assert problems == [] and lost == duplicated == 0
    again = extract()
    assert "this_run" not in again and again["samples"] == len(reference)
