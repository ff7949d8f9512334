"""The target model: everything the stages need to know about, load from and check in a target
checkpoint. A floor of its own between `common/` (which it builds on) and the stages (`extract/`,
`train/`, which read a target through it); it never imports `shards/`, which shares its floor.
Each module's docstring is its reference:

    rules.py            defaults derived from the target's depth (taps, drafter depth), torch-free
    checkpoint.py       a target checkpoint read without building the model (config, chosen tensors)
    arch.py             can a checkpoint be a DFlash target; where its embedding and head are
    identity.py         a target's identity (config hash, weights digest, head digest)
    identity_check.py   a stage refuses a target other than the one its input was made for
    chat_template.py    `chat_template = FILE`: a Jinja template in place of the tokenizer's
    kernel_routing.py   external kernels (fla, causal-conv1d) only for the tensors they take
    load.py             loading a target for forward passes and capturing its taps (`TapHooks`)
    packing.py          whether a target's layers keep packed samples apart
    static_cache.py     a transformers `StaticCache` written at chosen positions (CUDA graphs)
    recurrent_states.py per-token states of a hybrid target's Gated DeltaNet layers (speculative rollback)

Why a package and not more of `common/`: these eleven modules (1.7 K lines) are one subsystem with one
subject, the target checkpoint, and `common/` holds small helpers that know nothing of models; why
not inside a stage: extraction, training, evaluation, export and decoding all read the target the
same way, and the rules that keep those readings equal (taps are `hidden_states[i + 1]`, the same
target at every stage) belong to no single stage.

This file imports nothing: `python -m recipes.tiny --help` reads `target.rules` before torch loads.
"""
