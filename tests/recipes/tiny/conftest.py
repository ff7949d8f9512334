"""Shared fixtures of the tiny default's tests: the corpus and a small chat tokenizer trained on it."""

from __future__ import annotations

import os

import pytest

from recipes.tiny import (
    build_chat_tokenizer,
    build_corpus,
    record_texts,
)


@pytest.fixture(autouse=True)
def _restore_omp_env(monkeypatch):
    # tiny.main sets OMP_WAIT_POLICY for the torch it is about to load; undo that after each test.
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))


@pytest.fixture(scope="session")
def corpus():
    return build_corpus(seed=0)


@pytest.fixture(scope="session")
def small_tokenizer(corpus):
    train, _ = corpus
    return build_chat_tokenizer(record_texts(train[:300]), 600)
