"""The tiny default's chat tokenizer: a deterministic byte-level BPE trained on the corpus, with
Qwen3's special tokens and a Qwen3-style chat template (see the package docstring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay inside the functions: importing this module does no work
    import transformers


EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|MASK|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END, MASK_TOKEN]
THINK_TOKENS = [THINK_OPEN, THINK_CLOSE]

# Qwen2/Qwen3 pre-tokenizer split: contractions, letter runs, single digits, punctuation runs,
# newlines and whitespace, then byte-level mapping.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' -}}"
    "{%- if message.get('reasoning_content') -%}{{- message['reasoning_content'].strip('\\n') -}}{%- endif -%}"
    "{{- '\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- "
    "endif -%}"
    "{%- endif -%}"
)

MODEL_MAX_LENGTH = 4096


def build_chat_tokenizer(texts: list[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A deterministic byte-level BPE chat tokenizer trained on `texts`.

    `vocab_size` counts everything: the BPE vocabulary (256 byte symbols + merges) plus the
    special and think tokens, which come last (as in Qwen: `<|endoftext|>`, `<|im_start|>`,
    `<|im_end|>`, `<|MASK|>`, `<think>`, `</think>`). On a small corpus the BPE may stop early, so
    `len(tokenizer)` can be below `vocab_size`; it is never above.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    n_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    n_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < n_bytes + n_added:
        raise ValueError(
            f"vocab_size must be at least {n_bytes + n_added} (256 bytes + {n_added} added tokens), got {vocab_size}"
        )
    if not texts or not any(texts):
        raise ValueError("build_chat_tokenizer needs some non-empty training text")

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Added after training so they take the last ids, as in Qwen (the mask id is a real, unused id).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    assert len(wrapped) <= vocab_size, (len(wrapped), vocab_size)
    return wrapped
