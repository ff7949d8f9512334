"""Serving a trained drafter: the Hugging Face export (`export`, with `dflash_hf.py` copied into it as the
exported model code) and real speculative decoding against a target (`specdecode`)."""
