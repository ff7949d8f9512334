"""Tests of the tiny default (`recipes/tiny/`)."""

# Sizes that make a whole build take a few seconds.
TINY_MODEL = dict(
    target="train",
    vocab_size=400,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    n_taps=2,
    steps=2,
    batch_tokens=2048,
    warmup_steps=1,
    threads=1,
)
