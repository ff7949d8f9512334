"""The numeric tools behind the training-health report, on data whose answer is known."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from train.report.stats import (
    eta_squared,
    fit_mixture2,
    linear_gain,
    longest_run,
    ranges,
    sarle_bc,
    smooth,
    trend_with_groups,
)

RNG = np.random.default_rng(0)
NORMAL = RNG.normal(1.0, 0.1, 2000)
TWO_MODES = np.concatenate([RNG.normal(0.91, 0.1, 1000), RNG.normal(2.73, 0.15, 1000)])
SKEWED = RNG.exponential(1.0, 2000)


def test_bimodality_coefficient_separates_one_mode_from_two():
    assert abs(sarle_bc(NORMAL) - 1 / 3) < 0.05  # a normal distribution gives 1/3
    assert sarle_bc(TWO_MODES) > 5 / 9
    assert math.isnan(sarle_bc(np.array([1.0, 2.0, 3.0])))
    assert math.isnan(sarle_bc(np.ones(10)))


def test_mixture_finds_both_modes_and_their_separation():
    mix = fit_mixture2(TWO_MODES)
    assert abs(mix.means[0] - 0.91) < 0.03 and abs(mix.means[1] - 2.73) < 0.03
    assert abs(mix.weights[0] - 0.5) < 0.03
    assert mix.two_better and mix.separation > 10
    assert (mix.labels[:1000] == 0).mean() > 0.99 and (mix.labels[1000:] == 1).mean() > 0.99


def test_a_skewed_single_mode_is_not_cleanly_separated():
    # Exponential data fool the bimodality coefficient; the mixture's separation does not.
    assert sarle_bc(SKEWED) > 5 / 9
    assert fit_mixture2(SKEWED).separation < 2
    assert fit_mixture2(np.ones(20)) is None and fit_mixture2(np.arange(5.0)) is None


def test_eta_squared_is_one_when_groups_are_the_values_and_zero_when_unrelated():
    groups = np.repeat([0, 1, 2], 50)
    assert eta_squared(groups * 1.0, groups) == 1.0
    values = np.tile(np.arange(50.0), 3)
    assert abs(eta_squared(values, groups)) < 1e-12


def test_smooth_ignores_nan_and_trails_when_asked():
    x = np.array([1.0, np.nan, 3.0, 5.0, 7.0])
    assert np.allclose(smooth(x, 3), [1.0, 2.0, 4.0, 5.0, 6.0])
    trailing = smooth(np.array([0.0, 0.0, 0.0, 9.0]), 2, centred=False)
    assert trailing[2] == 0.0 and trailing[3] == 4.5  # nothing from the future leaks backwards


def test_linear_gain_and_trend_with_groups_recover_known_slopes():
    x = np.arange(100.0)
    assert abs(linear_gain(x, 0.01 * x) - 0.99) < 1e-9
    # Group 1 is better by 0.2 but comes first in time: plain means would hide it.
    groups = (x < 50).astype(int)
    y = 0.01 * x + 0.2 * groups
    slope, levels = trend_with_groups(x, y, groups)
    assert abs(slope - 0.01) < 1e-9 and abs(levels[1] - levels[0] - 0.2) < 1e-9
    assert abs(y[groups == 1].mean() - y[groups == 0].mean() - 0.2) > 0.25


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60))
def test_longest_run_is_the_longest_block_of_equal_values(seq):
    length, value, start = longest_run(np.array(seq))
    assert seq[start : start + length] == [value] * length
    brute = max(j - i for i in range(len(seq)) for j in range(i + 1, len(seq) + 1) if len(set(seq[i:j])) == 1)
    assert length == brute


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(-50, 50), max_size=40))
def test_ranges_cover_exactly_the_values(values):
    spans = ranges(values)
    assert sorted(v for a, b in spans for v in range(a, b + 1)) == sorted(values)
    assert all(a <= b for a, b in spans)
    assert all(a2 > b1 + 1 for (_, b1), (a2, _) in itertools.pairwise(spans))  # separated by a gap
