"""Extraction: corpus -> tokens -> target forward -> shards (run once per corpus, on many GPUs).

The modules, in the order data flows through a run (each module's docstring is its reference):

    __main__.py    `python -m extract`: the command
    config.py      `ExtractConfig` (`[extract]`), settled once by its `check`
    checks.py      what is checked before the target loads; each split's `SplitInputs`
    corpus/        the corpus side, which regeneration reads through too: files, records, rendering
                   through the chat template, windows of samples, the mask token (corpus/__init__.py)
    provenance.py  what a dataset records about how it was made; the rules of resuming it
    pipeline.py    the run, top to bottom: check, load, plan (`SplitRun`), the forward loop, commit
    calibrate.py   storage tiers: the projection fitted on a calibration pass before the first shard
    batching.py    micro-batches (padded, or packed rows) and the pinned host buffers
    capture.py     one forward -> taps and the top-k of the true final logits, laid out as stored
    host_path.py   after a forward is launched: the device-to-host copy cut into samples, written
    sink.py        the worker threads, the rejects file, the progress bar
    ranks.py       which rank extracts which sample; the files each rank writes
    merge.py       the rank manifests merged into the dataset (`python -m extract.merge`)
    summary.py     the coverage check, summary.json and the report the command prints
    regenerate/    `python -m extract.regenerate`: the target's own answers for a corpus
"""
