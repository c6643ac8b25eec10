"""The range Kendall tau can take where some values are only lower bounds (an uncertified worst case raised anywhere
above itself): the branch and bound against random raises and against the enumeration of every place and order."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hf_geosharp.leaderboard import tau_if_raised
from hf_geosharp.leaderboard.statistics import tau_if_raised_by_enumeration


def test_tau_if_raised_is_the_range_over_every_raise_of_the_lower_bounds() -> None:
    """Against a slow reference: tau at many random raises of the flagged values stays in the range and reaches both
    ends."""
    from scipy import stats

    rng = np.random.default_rng(0)
    for _ in range(5):
        x, gap = rng.normal(size=12), rng.normal(size=12)
        flags = [False] * 12
        for i in rng.choice(12, size=2, replace=False):
            flags[i] = True
        low, high = tau_if_raised(list(x), list(gap), flags)
        raised = np.flatnonzero(flags)
        seen = {stats.kendalltau(x, gap).statistic}
        for _ in range(3000):
            y = x.copy()
            y[raised] += rng.exponential(scale=rng.choice([0.1, 1.0, 5.0]), size=2)
            seen.add(stats.kendalltau(y, gap).statistic)
        assert low - 1e-12 <= min(seen) and max(seen) <= high + 1e-12
        assert math.isclose(min(seen), low) and math.isclose(max(seen), high)
    assert tau_if_raised([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [False, False, True]) == [1.0, 1.0]  # already the top
    assert tau_if_raised([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [True, False, False]) == pytest.approx([-1 / 3, 1.0])


def test_tau_if_raised_equals_the_enumeration_of_every_place_and_order() -> None:
    """The branch and bound against the slow reference (every interval for each raised value and every order of the
    raised values that share one), with ties among the values and among the gaps."""
    rng = np.random.default_rng(1)
    for trial in range(40):
        n, k = int(rng.integers(4, 10)), int(rng.integers(1, 4))
        x, gap = rng.normal(size=n), rng.normal(size=n)
        if trial % 3 == 0:
            gap = np.round(gap)
        if trial % 4 == 0:
            x[1] = x[0]
        flags = [False] * n
        for i in rng.choice(n, size=k, replace=False):
            flags[i] = True
        assert tau_if_raised(list(x), list(gap), flags) == pytest.approx(
            tau_if_raised_by_enumeration(list(x), list(gap), flags))
