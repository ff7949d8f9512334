"""common.repeat: where a greedy answer starts looping, against a brute-force reading of the definition."""

from __future__ import annotations

import random

import pytest

from common.repeat import REPEAT_MAX_PERIOD, RepeatWatch


def first_loop_reference(tokens, min_repeat, max_period=REPEAT_MAX_PERIOD):
    """Straight from the definition: the length of the shortest prefix whose last n tokens repeat
    the p tokens before them, for some p <= max_period and n >= max(p, min_repeat); None if none."""
    for end in range(1, len(tokens) + 1):
        for p in range(1, min(max_period, end - 1) + 1):
            n = 0
            while n < end - p and tokens[end - 1 - n] == tokens[end - 1 - n - p]:
                n += 1
            if n >= max(p, min_repeat):
                return end
    return None


def test_repeat_watch_finds_where_each_row_starts_looping():
    rng = random.Random(0)
    rows, length, min_repeat = 40, 120, 8
    seqs = []
    for _ in range(rows):  # random text with a loop of random period planted at a random place (or none)
        seq = [rng.randrange(50) for _ in range(length)]
        if rng.random() < 0.8:
            period, at = rng.choice([1, 2, 3, 7, 13, 30, 64, 65]), rng.randrange(length)
            for i in range(at + period, length):
                seq[i] = seq[i - period]
        seqs.append(seq)
    expected = [first_loop_reference(s, min_repeat) for s in seqs]
    assert len({e for e in expected if e}) >= 10 and None in expected  # loops found at many places, and not everywhere

    watch = RepeatWatch(rows, length, min_repeat)
    alive, found = list(range(rows)), {}
    for step in range(length):
        for row, loops in zip(alive, watch.push([seqs[row][step] for row in alive]), strict=True):
            if loops and row not in found:
                found[row] = step + 1
        if step % 17 == 16:  # finished rows leave the batch (some of them), as in greedy_batch
            keep = [n for n, row in enumerate(alive) if row not in found or n % 2]
            watch.keep_rows(keep)
            alive = [alive[n] for n in keep]
    assert len(alive) < rows
    assert [found.get(row) for row in range(rows)] == expected


def test_a_watch_refuses_more_tokens_than_it_holds_and_bad_settings():
    watch = RepeatWatch(1, 2, 4)
    watch.push([1])
    watch.push([1])
    with pytest.raises(ValueError, match="holds 2 tokens"):
        watch.push([1])
    with pytest.raises(ValueError, match="min_repeat"):
        RepeatWatch(1, 2, 0)
