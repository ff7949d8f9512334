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
    processes.py        the project's own commands as child processes, side by side
    repeat.py           where a greedy answer starts looping (`RepeatWatch`)

Inside common, imports point one way: `objstore` < `io` < `locks`.
"""
