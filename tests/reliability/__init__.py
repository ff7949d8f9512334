"""The reliability suite: kills, corruption, I/O errors, bad inputs and security checks,
measured on a tiny random target built from a config.

    python -m tests.reliability            the full suite (`make reliability`); writes docs/reliability.md
    pytest tests/reliability               the short version of every scenario (part of `make test`)

Each scenario lives in its own module (`extract_kills`, `train_kills`, `corruption`, `io_errors`,
`bad_inputs`, `security`) with one `run(world, ...) -> Outcome` used by both: the full suite calls
it with large counts and real `python -m extract` / `python -m train` processes, the pytest
versions with small counts and forked processes.
"""
