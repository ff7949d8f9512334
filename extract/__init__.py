"""Extraction: corpus -> tokens -> target forward -> shards (run once per corpus, on many GPUs)."""
