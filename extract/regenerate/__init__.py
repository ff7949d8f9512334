"""Regeneration: the target's own answers for any corpus (`python -m extract.regenerate`, `make regenerate`).

DFlash drafters learn to predict what the target says, so they train on the target's own answers
(docs/dflash.md "Training data"). This package reads a corpus in any format extraction reads, keeps each record's
prompt side, answers every assistant turn again with the target, and writes a corpus in the
messages format plus its provenance, which extraction carries into its manifest.

Modules: `config.py` (`RegenerateConfig`, table `[regenerate]`), `conversation.py` (records ->
prompts, answers -> stored messages that extraction reads back exactly, thinking modes, rejects),
`local.py` (batched KV-cache generation in-process; also the tiny build's), `server.py`
(OpenAI-compatible endpoints, retries), `store.py` (journal, resume, atomic commit, one writer),
`run.py` (one run), `bench.py` (throughput of both backends). docs/regenerate.md is the guide.
"""
