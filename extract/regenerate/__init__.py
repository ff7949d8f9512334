"""Regeneration: the target's own answers for any corpus (`python -m extract.regenerate`, `make regenerate`).

DFlash drafters learn to predict what the target says, so they train on the target's own answers
(docs/dflash.md "Training data"). This package reads a corpus in any format extraction reads
(through `extract.corpus`), keeps each record's prompt side, answers every assistant turn again
with the target, and writes a corpus in the messages format plus its provenance, which extraction
carries into its manifest.

Modules: `config.py` (`RegenerateConfig`, table `[regenerate]`), `conversation.py` (records ->
prompts, answers -> stored messages that extraction reads back exactly, thinking modes, rejects),
`local.py` (batched KV-cache generation in-process; also the tiny build's), `static_batch.py` (its
static-cache batch on CUDA, each step a CUDA graph), `answer_checks.py` (a target without an
end-of-answer token refused before generating; the round trip's cut tokens), `server.py`
(OpenAI-compatible endpoints, retries), `store.py` (journal, resume, atomic commit, one writer),
`run.py` (one run); a finished output is read back by `extract.corpus.regenerated`.
docs/regenerate.md is the guide; `benchmarks/regenerate.py` measures both backends.
"""
