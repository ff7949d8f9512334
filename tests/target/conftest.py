"""The target tests share the extraction tests' fixtures: the project's chat tokenizer and a saved tiny Qwen3."""

from tests.extract.conftest import chat_tokenizer, qwen3_model, saved_target  # noqa: F401  (fixtures)
