"""Training: DFlash and DFlash2 drafters trained from shards, then evaluated, exported and served.

The modules, roughly in the order a run uses them (each module's docstring is its reference):

    __main__.py         `python -m train`: the command
    config.py           `TrainConfig` (`[train]`) and its nested tables
    layer_types.py      the drafter's layer types and named layouts, torch-free
    drafter_config.py   `DrafterConfig`: the drafter's shape and class (`arch`: dflash or dflash2)
    model.py            `DFlashDrafter` (its forward is the drafter's contract), the target's frozen
                        embedding and head (`TargetHead`)
    dflash2.py          `DFlash2Drafter`: block convolutions and the candidate selector; `build_drafter`
                        builds either class from a `DrafterConfig`
    alignment.py        the block and label alignment, the one implementation every block builder uses
    blocks.py           anchor sampling, block inputs, labels and loss weights
    attention.py        the mask rules (`MaskRule`) as a flex `BlockMask` and as a dense mask
    kernels.py          device, autocast, attention kernel and compilation, chosen in one place
    loss.py             chunked lm_head + weighted cross-entropy, per-position accuracy
    selector_loss.py    DFlash2's selector loss, its weight schedule and what it measures
    buckets.py          length buckets, token-budget batches, stride interleaving; the data-parallel split
    samples.py          which samples a run trains on; does a dataset fit the drafter
    stored_features.py  how the drafter reads features stored in a tier (quantized, projected)
    data.py             `DataStream`: shards -> batches, prefetched, resumable to the batch
    distributed.py      data parallel: the process group, DDP that sums, host reductions, `PeerLost`
    prepare.py          `Run.prepare`: everything a run needs, resume or warm start, the run files
    run_dir.py          the run directory: one training per directory
    warm_start.py       `model.init_from=DIR`: a drafter directory's weights as the first weights
    target_init.py      `model.init_from_target`: drafter layers copied from the target's (an ablation)
    step.py             `train_step`: one optimizer step on one global batch, or a skipped one
    step_log.py         the metrics.jsonl record, wandb, the progress bar
    loop.py             `train(cfg)`: the loop, checkpoints, stopping on non-finite steps
    checkpoint.py       atomic background checkpoints, the last K kept
    metrics.py          `metrics.jsonl`, one line per step
    export_format/      the Hugging Face layout of a drafter, written by the export, read by warm
                        starts and decoding (export_format/__init__.py)
    eval/               `python -m train.eval`: offline evaluation (eval/__init__.py)
    serve/              export and speculative decoding (serve/__init__.py)
    report/             `python -m train.report`: the training-health report (report/__init__.py)

The contracts they keep with the other stages (the batch, the run directory, metrics.jsonl, data
parallel) are in docs/ARCHITECTURE.md.
"""
