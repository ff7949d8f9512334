"""Fixtures of the GPU tier: the project's chat tokenizer, as the extraction tests build it."""

from tests.extract.conftest import chat_tokenizer  # noqa: F401 - a session fixture, shared
