"""The recipes' tests share the extraction tests' fixtures: the project's chat tokenizer and tiny random targets."""

from tests.extract.conftest import (  # noqa: F401  (fixtures)
    chat_tokenizer,
    loaded_target,
    qwen3_model,
    qwen35_model,
    saved_target,
    tool_tokenizer,
)
