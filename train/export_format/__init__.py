"""The Hugging Face layout of a drafter (config.json, model.safetensors, the shipped `dflash.py`):
written by the export, read back by warm starts (`train.warm_start`) and by speculative decoding.
Training and serving both use it, so it sits in `train/` beside the model rather than in
`train/serve/`.

    dflash_hf.py        the exported model code (copied into every export as `dflash.py`): torch and
                        transformers only; it repeats `train.model`'s math on purpose, and a test
                        holds the two to the same outputs
    layout.py           a checkpoint written as a Hugging Face DFlash directory, and read back
"""
