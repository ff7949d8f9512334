"""Serving a trained drafter: the Hugging Face export command and real speculative decoding against a
target (the export's layout itself is `train.export_format`).

The modules, in the order data flows (each module's docstring is its reference); each imports only
modules above it in this list, so the decoding loop knows nothing of the agreement check, the
CUDA-graph versions or the peers (tests/test_layering.py holds the loop to that):

    cli.py              the command lines of both commands, built without torch
    export.py           `python -m train.serve.export`: the command
    prompts.py          prompts from chat JSONL or shards; a target's stop tokens
    spec_target.py      `SpecTarget`: the target's cached forwards that also return the taps; how a
                        round cuts the cache back (crop, a hybrid's per-token states, the copy fallback)
    decoding.py         the round loop (`speculative_generate`), target-only greedy, `DFlashProposer`
                        (a DFlash2 drafter proposes its selector's walk)
    tree_decode.py      DDTree verification with a node budget
    fusion.py           the target's layers compiled by inductor while its CUDA graphs are captured
    static_target.py    the target on a `StaticCache`, its forwards replayed as CUDA graphs
    static_drafter.py   the drafter's round on a slot cache, as one CUDA graph
    peers.py            the baselines without a drafter (transformers `generate`, prompt lookup)
    results.py          τ and speed summaries, the lossless check, the per-prompt records
    agreement.py        offline chain τ against online τ on the decoded continuations
    specdecode_run.py   the work of the command: load, pick the implementations, decode, report
    specdecode.py       `python -m train.serve.specdecode`: the command
"""
