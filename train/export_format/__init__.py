"""The Hugging Face layout of a drafter (config.json, model.safetensors, the shipped `dflash.py`):
written by the export, read back by warm starts (`train.warm_start`) and by speculative decoding.
Training and serving both use it, so it sits in `train/` beside the model rather than in
`train/serve/`.

    dflash_hf.py        the exported model code (copied into every export as `dflash.py`): torch and
                        transformers only; it repeats `train.model`'s and `train.dflash2`'s math on
                        purpose, and tests hold them to the same outputs (tests/train/serve/
                        test_export.py, test_dflash2.py). It is longer than the 600-line rule: it
                        must be one self-contained file (transformers' remote code), holding both
                        drafter classes and z-lab's quick-start loop
    layout.py           a checkpoint written as a Hugging Face DFlash or DFlash2 directory, and read back
"""
