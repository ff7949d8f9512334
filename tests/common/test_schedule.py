"""`common.schedule.warmup_cosine`: the one warmup + cosine schedule of the trainer and the tiny target."""

from __future__ import annotations

import itertools
import math

import pytest

from common.schedule import warmup_cosine
from recipes.tiny.config import TinyConfig
from recipes.tiny.target import learning_rate
from train.step import lr_at


def test_warmup_is_linear_and_ends_at_the_peak():
    assert [warmup_cosine(d, 100, 4, 1.0) for d in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_cosine_decays_monotonically_to_the_floor_and_stays(floor):
    rates = [warmup_cosine(d, 50, 5, 2e-3, floor) for d in range(5, 60)]
    assert all(a >= b for a, b in itertools.pairwise(rates))
    assert rates[0] == pytest.approx(2e-3) and rates[45] == pytest.approx(2e-3 * floor, abs=1e-18)
    assert rates[-1] == rates[45]


def test_both_users_get_exactly_the_rates_of_their_former_closed_forms():
    """Bit-exact against the formulas each user had written out before they shared one function, so a
    training run (and the tiny target) is unchanged to the last bit."""
    for total, warmup, peak in ((1000, 50, 6e-4), (123, 7, 1.234e-3), (40, 40, 1e-3)):
        for done in range(total + 3):
            progress = (done - warmup) / max(1, total - warmup)
            cos = math.cos(math.pi * min(1.0, progress))
            trainer = peak * (done + 1) / warmup if done < warmup else peak * 0.5 * (1.0 + cos)
            tiny = peak * (done + 1) / warmup if done < warmup else peak * (0.1 + 0.9 * 0.5 * (1 + cos))
            assert lr_at(done + 1, total, warmup, peak) == trainer
            cfg = TinyConfig(steps=total, warmup_steps=warmup, lr=peak)
            assert learning_rate(done, cfg) == tiny
