"""Shared fixtures for the extraction tests: the project's chat tokenizer (recipes.tiny), tiny random
Qwen3 and Qwen3.5 (hybrid Gated DeltaNet) targets built from configs, a saved target directory,
and corpus writers. Everything is CPU, float32 unless a test asks otherwise, and seconds to build.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

WORDS = (
    "the quick brown fox jumps over a lazy dog while birds sing in the tall green forest and "
    "rivers run toward the sea under a bright morning sky as people talk about python code"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="session")
def chat_tokenizer():
    from recipes.tiny import build_chat_tokenizer

    rng = random.Random(0)
    return build_chat_tokenizer([sentence(rng, 60) for _ in range(40)] + ["user\nassistant\nsystem\n"] * 5, 400)


def qwen3_config(vocab_size: int, layers: int = 4, **overrides):
    from transformers import Qwen3Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def qwen35_text_config(vocab_size: int, layers: int = 4, **overrides):
    from transformers import Qwen3_5TextConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        full_attention_interval=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return Qwen3_5TextConfig(**kwargs)


def build_model(config, dtype=torch.float32, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def qwen3_model(chat_tokenizer):
    return build_model(qwen3_config(len(chat_tokenizer)))


@pytest.fixture(scope="session")
def qwen35_model(chat_tokenizer):
    return build_model(qwen35_text_config(len(chat_tokenizer)))


@pytest.fixture(scope="session")
def saved_target(tmp_path_factory, chat_tokenizer, qwen3_model):
    """A checkpoint directory (weights, config, tokenizer) of the tiny random Qwen3."""
    path = tmp_path_factory.mktemp("target")
    qwen3_model.save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def loaded_target(saved_target):
    from target.load import load_target

    return load_target(saved_target, dtype="float32", device="cpu")


def chat_record(rng: random.Random, user_words: int, assistant_words: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": sentence(rng, user_words)},
            {"role": "assistant", "content": sentence(rng, assistant_words)},
        ]
    }


def write_lines(path, lines) -> str:
    """Write JSONL: dicts are dumped, strings written verbatim (for broken lines)."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def mixed_corpus(path, n_good: int = 24, seed: int = 0) -> tuple[str, dict]:
    """A small corpus with good chat records and one of each kind of bad line; returns the path
    and the expected reject counts by reason."""
    rng = random.Random(seed)
    good = [chat_record(rng, rng.randint(3, 12), rng.randint(12, 60)) for _ in range(n_good)]
    bad = {
        "invalid_json": '{"messages": [oops',
        "not_an_object": "[1, 2, 3]",
        "missing_field": {"foo": "bar"},
        "empty_conversation": {"messages": []},
        "unknown_role": {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "x"}]},
        "non_string_content": {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
        "no_assistant_turn": {"messages": [{"role": "user", "content": "hello there"}]},
        "too_few_loss_tokens": {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        },
    }
    lines = list(good)
    for i, line in enumerate(bad.values()):
        lines.insert(2 + 3 * i, line)
    lines.insert(5, "")  # a blank line: not a record
    lines.append(good[3])  # an exact duplicate
    expected = {reason: 1 for reason in bad}
    return write_lines(path, lines), expected


# A chat template that renders tools the way Qwen3.6's does (written for these tests; the tiny
# template of recipes/tiny/ has no tool calls): contents trimmed, a <think> block in the turns
# after the last user query, tool calls as <tool_call><function=NAME><parameter=KEY> blocks inside
# the assistant turn, tool results as <tool_response> blocks inside one user turn, tools listed in
# the system turn.
QWEN_TOOL_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- '\\n\\n' + messages[0]['content'] | trim -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] | trim + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 "
    "-%}{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] | trim -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{- '<think>\\n' -}}{% generation %}{{- (message.get('reasoning_content') or '') | trim -}}{% endgeneration "
    "%}{{- '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{% generation %}{{- content -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- if loop.first and content -%}{{- '\\n\\n' -}}{%- elif not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n<function=' + call['function']['name'] + '>\\n' -}}"
    "{%- for key, value in call['function']['arguments'] | items -%}"
    "{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}{% endgeneration %}{{- '\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def tool_chat_tokenizer():
    """The project's chat tokenizer with the Qwen-style tool template (a fresh object: tests may change it)."""
    from recipes.tiny import build_chat_tokenizer

    rng = random.Random(0)
    tokenizer = build_chat_tokenizer([sentence(rng, 60) for _ in range(40)] + ["user\nassistant\nsystem\n"] * 5, 400)
    tokenizer.chat_template = QWEN_TOOL_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def tool_tokenizer():
    return tool_chat_tokenizer()
