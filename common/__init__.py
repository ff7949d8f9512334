"""Small helpers shared by every stage, the floor below all others (it imports no other package of
the project). Each module's docstring is its reference:

    config.py           stage configs: `knob`, the command-line grammar of every entry point
                        (`parse_command`), loading, checking, saving, `--help` (`describe`)
    locations.py        path settings (`knob(..., path=KIND)`): parsed at load, checked before any work
    io.py               local paths and `pyarrow.fs` URIs; atomic writes (temporary name, fsync, rename)
    objstore.py         object stores (S3, GCS): resolving, checking a location, the one
                        classification of store errors, retries of a store that stops answering
    locks.py            one writer at a time: `flock` locally, a lock object on S3
    hashing.py          xxh3-128 digests: sample ids, files, tokenizer, chat template
    provenance.py       tool version and git sha
    device.py           device, precision and CPU-thread choices
    schedule.py         the learning-rate schedule (the trainer's and the tiny target's)
    processes.py        the project's own commands as child processes (one, or side by side), each in
                        a process group of its own that is stopped when the parent is
    interrupts.py       Ctrl-C and SIGTERM: one line and 128 + the signal from every entry point (`run_main`)
    repeat.py           where a greedy answer starts looping (`RepeatWatch`)
    chat_template.py    `chat_template = FILE`: a Jinja template in place of the tokenizer's
    target_rules.py     defaults derived from the target's depth (taps, drafter depth), torch-free
    hf_target.py        a target checkpoint read without building the model (config, chosen tensors)
    target_files.py     a target directory holds config.json, weights and a tokenizer (checked before any load)
    target_arch.py      can a checkpoint be a DFlash target; where its embedding and head are
    target_identity.py  a target's identity (config hash, weights digest, head digest)
    target_check.py     a stage refuses a target other than the one its input was made for
    target.py           loading a target for forward passes and capturing its taps (`TapHooks`)
    kernel_routing.py   external kernels (fla, causal-conv1d) only for the tensors they take
    packing.py          whether a target's layers keep packed samples apart
    static_cache.py     a transformers `StaticCache` written at chosen positions (CUDA graphs)

Inside common, imports point one way: `objstore` < `io` < `locks`, and `kernel_routing` <
{`target`, `packing`}.
"""
