"""The built-in tiny default: a small chat corpus made from text shipped with Python, a byte-level
BPE chat tokenizer trained on it, and a small Qwen3-architecture target trained briefly on it.

`python -m recipes.tiny [key=value ...]` (`make tiny`, knobs in `TinyConfig`) builds it into
artifacts/tiny, on the GPU when torch sees one (`device`), else on the CPU, and caches it; a second
run with the same recipe does nothing. By default (`target=auto`: shipped, unless a target=train
build is already there, which is then kept) the corpus and the trained target are the ones shipped
in `recipes/tiny/shipped/` (one reference build, `recipes.tiny.shipped`), and only the answers are
regenerated here: a build trained here (`target=train`) is deterministic on
one machine (on a GPU with torch's deterministic kernels), but another CPU type, precision or a GPU
rounds differently, 1,000 steps of training turn that into a different, equally good target that
loops in a different share of its answers, and another Python version is another corpus; the demo's
τ moved from 5.33 to 3.06 with that (see `recipe` and `recipes.tiny.shipped`):

    artifacts/tiny/corpus/train.jsonl, heldout.jsonl   chat records {"messages": [...]} (a few {"text": ...})
    artifacts/tiny/corpus/train_regen.jsonl,           the same user turns answered by the trained target
                          heldout_regen.jsonl          itself, greedily (the tiny default's data;
                                                       docs/dflash.md "Training data")
    artifacts/tiny/target/                             HF directory: config.json, model.safetensors (bf16),
                                                       generation_config.json, tokenizer files, chat template,
                                                       tiny_report.json (accuracies, tap ids, token ids, corpus sizes,
                                                       regeneration counts, lengths and time)
    artifacts/tiny/build.json                          recipe digest; written last

Library use: `build_tiny(TinyConfig(...)) -> Path`, `build_corpus(seed, heldout_fraction)`,
`build_chat_tokenizer(texts, vocab_size)`, `build_tiny_target(out_dir, train, heldout, cfg)`,
`regenerate_corpus(target_dir, train, heldout, cfg)`, `regenerate_records(model, tokenizer, records,
max_new_tokens)`, `tap_layer_ids(num_layers, n_taps)`.

Target-regenerated answers: each user turn is rendered as `train.serve.specdecode` renders prompts
(`add_generation_prompt=True`, `enable_thinking=False`) and answered by the saved target (float32,
as extraction and speculative decoding run it) with greedy decoding until `<|im_end|>`/EOS,
`regen_max_new_tokens`, or the token where the answer starts looping (`regen_stop_repeat`,
`common.repeat.RepeatWatch`); multi-turn records are answered turn by turn. The tiny target loops
in about half of its answers, and how often depends on the build: 345 to 732 of 1,495 answers ran
to the 256-token cap in three builds that differ only in rounding. A drafter trained on the
uncut answers learns mostly loops, and its τ went with how often the target looped (online τ
1.35 to 3.35). Cut after the first repetition, the answers keep what the target says rather than
how long it keeps repeating it (`train.serve.specdecode --stop-repeat` ends online responses by the
same rule). So the held-out first answers
are exactly what target-only greedy decoding produces from the speculative-decoding prompts, and
offline τ on them estimates online τ (docs/dflash.md "Acceptance length (τ)"). (An earlier answer
of a multi-turn record was generated after the empty think block, which the template drops from past turns: only a
conversation's last answer is exactly the greedy continuation of its rendered prefix.)

Chat template (Qwen3 style, on purpose, so the tiny default exercises what the real target does):

    <|im_start|>{role}\\n{content}<|im_end|>\\n                  every message
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n{content}<|im_end|>\\n
                                                     assistant turns after the last user turn
    <|im_start|>assistant\\n                            generation prompt, enable_thinking=True
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n      generation prompt, enable_thinking=False

Like Qwen3, non-thinking mode inserts an empty think block, and the final assistant turn of a
rendered conversation carries one too (filled from `reasoning_content` when a message has it), so
a training sample rendered whole matches what the target sees at inference with
`enable_thinking=False`. Earlier assistant turns of a multi-turn conversation carry no think block
(Qwen3 drops past reasoning). `enable_thinking` defaults to True, as in Qwen3. `<think>` and
`</think>` are single added (non-special) tokens; `<|MASK|>` is the tokenizer's `mask_token`, an
id the target never sees in training (DFlash fills draft positions with it).

Modules, one job each: `config` (TinyConfig), `chat` (tokenizer and chat template),
`corpus` (the records), `target` (training and measuring the target), `regenerate` (the target's own
answers, through `extract.regenerate`'s local backend), `build` (recipe digest, cached build),
`__main__` (the command).
"""

from recipes.tiny.build import BUILD_RECORD, REQUIRED_FILES, build_tiny, is_built, recipe, recipe_digest
from recipes.tiny.chat import CHAT_TEMPLATE, EOS_TOKEN, IM_END, IM_START, MASK_TOKEN, build_chat_tokenizer
from recipes.tiny.config import TinyConfig
from recipes.tiny.corpus import build_corpus, read_jsonl, record_texts, write_jsonl
from recipes.tiny.regenerate import REGEN_FILES, answer_prompt, regenerate_corpus, regenerate_records
from recipes.tiny.target import build_tiny_target, generation_config
from target.rules import tap_layer_ids

__all__ = [
    "BUILD_RECORD",
    "REQUIRED_FILES",
    "build_tiny",
    "is_built",
    "recipe",
    "recipe_digest",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_END",
    "IM_START",
    "MASK_TOKEN",
    "build_chat_tokenizer",
    "TinyConfig",
    "tap_layer_ids",
    "build_corpus",
    "read_jsonl",
    "record_texts",
    "write_jsonl",
    "REGEN_FILES",
    "answer_prompt",
    "regenerate_corpus",
    "regenerate_records",
    "build_tiny_target",
    "generation_config",
]
