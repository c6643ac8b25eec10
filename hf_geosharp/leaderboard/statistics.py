"""Does a predictor rank models by their generalisation gap? Kendall tau with a bootstrap interval over models, the
paired difference of two predictors' taus, and the range tau can take where some values are only lower bounds."""

from __future__ import annotations

import math
import warnings
from itertools import permutations, product
from typing import Any

import numpy as np
from scipy import stats

MIN_MODELS_FOR_CI = 8



def kendall_taus(
    rows: list[dict[str, Any]], predictors: list[str], *, n_resamples: int = 2000, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Kendall tau (scipy's tau-b; tau-a when there are no ties) of each predictor against ``gap``, with a
    percentile bootstrap 95 % interval over models (resampled in pairs). Below ``MIN_MODELS_FOR_CI`` models the
    resamples are too few and too often degenerate for an interval, so it is nan.

    Args:
        rows: one dict per model, with ``gap`` and each predictor's value.
        predictors: the predictors' names.
        n_resamples: bootstrap resamples.
        seed: seeds the bootstrap.

    Returns:
        Predictor -> ``tau``, ``ci_low``, ``ci_high``, ``p_value`` and ``n`` (the number of models).
    """
    gap = np.array([r["gap"] for r in rows], dtype=float)
    out = {}
    for name in predictors:
        x = np.array([r[name] for r in rows], dtype=float)
        result = stats.kendalltau(x, gap)
        low = high = math.nan
        if len(rows) >= MIN_MODELS_FOR_CI:
            with warnings.catch_warnings():  # few models: constant resamples make tau undefined; the CI is then nan
                warnings.simplefilter("ignore", stats.DegenerateDataWarning)
                boot = stats.bootstrap(
                    (x, gap), lambda a, b: stats.kendalltau(a, b).statistic, paired=True, vectorized=False,
                    n_resamples=n_resamples, confidence_level=0.95, method="percentile",
                    rng=np.random.default_rng(seed),
                )
            low, high = float(boot.confidence_interval.low), float(boot.confidence_interval.high)
        out[name] = {"tau": float(result.statistic), "ci_low": low, "ci_high": high, "p_value": float(result.pvalue),
                     "n": len(rows)}
    return out


def tau_differences(
    rows: list[dict[str, Any]], predictors: list[str], baseline: str, *, n_resamples: int = 2000, seed: int = 0
) -> dict[str, dict[str, float]]:
    """``tau(predictor, gap) - tau(baseline, gap)`` of each predictor, with a percentile bootstrap 95 % interval that
    resamples the models once for both taus. Whether a measure ranks models better than a trivial predictor is a
    paired question: two separate intervals that overlap do not answer it, since both taus move with the same models.
    Below ``MIN_MODELS_FOR_CI`` models the interval is nan.

    Args:
        rows: one dict per model, with ``gap`` and each predictor's value.
        predictors: the predictors' names.
        baseline: the predictor each is compared with.
        n_resamples: bootstrap resamples.
        seed: seeds the bootstrap.

    Returns:
        Predictor -> ``difference``, ``ci_low``, ``ci_high`` and ``n`` (the number of models).
    """
    gap = np.array([r["gap"] for r in rows], dtype=float)
    base = np.array([r[baseline] for r in rows], dtype=float)

    def difference(x: np.ndarray, b: np.ndarray, g: np.ndarray) -> float:
        return float(stats.kendalltau(x, g).statistic - stats.kendalltau(b, g).statistic)

    out = {}
    for name in predictors:
        x = np.array([r[name] for r in rows], dtype=float)
        low = high = math.nan
        if len(rows) >= MIN_MODELS_FOR_CI:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", stats.DegenerateDataWarning)
                boot = stats.bootstrap((x, base, gap), difference, paired=True, vectorized=False,
                                       n_resamples=n_resamples, confidence_level=0.95, method="percentile",
                                       rng=np.random.default_rng(seed))
            low, high = float(boot.confidence_interval.low), float(boot.confidence_interval.high)
        out[name] = {"difference": difference(x, base, gap), "ci_low": low, "ci_high": high, "n": len(rows)}
    return out


def tau_if_raised(values: list[float], gap: list[float], lower_bounds: list[bool]) -> list[float]:
    """The smallest and largest Kendall tau (tau-b) against ``gap`` when each value flagged in ``lower_bounds`` is
    raised anywhere above itself (to a value no other member has). An uncertified worst-case number is the largest
    value found, so the maximum is at least it.

    Exact, by branch and bound: tau depends only on ranks, so what matters is between which of the other values each
    raised one lands (its pairs with them), and the order of the raised ones among themselves, which is free within
    one interval. The search bounds what the unplaced values can still add by their best intervals and every pair
    among them agreeing, so its cost stays small for the dozen numbers a population leaves uncertified, where trying
    every interval for each grows as (members)^(flagged) (:func:`tau_if_raised_by_enumeration`, the slow reference).

    Args:
        values: the predictor's value of each model.
        gap: each model's gap.
        lower_bounds: which values are lower bounds (an uncertified worst case), free to rise.

    Returns:
        ``[smallest, largest]`` tau; both the measured tau when nothing is flagged, NaN where tau is undefined.
    """
    x, g = np.asarray(values, dtype=float), np.asarray(gap, dtype=float)
    raised = [i for i, flag in enumerate(lower_bounds) if flag]
    if not raised:
        tau = float(stats.kendalltau(x, g).statistic)
        return [tau, tau]
    fixed = np.array([i for i, flag in enumerate(lower_bounds) if not flag], dtype=int)
    levels, counts = np.unique(x[fixed], return_counts=True)
    rank = np.searchsorted(levels, x[fixed])  # interval p lies above the levels below index p
    n = len(x)
    pairs = n * (n - 1) / 2
    _, gap_counts = np.unique(g, return_counts=True)
    x_ties, gap_ties = float((counts * (counts - 1) / 2).sum()), float((gap_counts * (gap_counts - 1) / 2).sum())
    denominator = math.sqrt((pairs - x_ties) * (pairs - gap_ties))
    if denominator == 0:
        return [math.nan, math.nan]
    fx, fg = x[fixed], g[fixed]
    s_fixed = float((np.sign(fx[:, None] - fx[None, :]) * np.sign(fg[:, None] - fg[None, :])).sum() / 2)
    scores, first = [], []  # per raised value: its pairs with the fixed ones in each interval, and its lowest interval
    for i in raised:
        agree = np.sign(g[i] - fg)
        # in interval p, a fixed value of rank < p lies below (+agree), the others above (-agree)
        below = np.array([agree[rank < p].sum() for p in range(len(levels) + 1)])
        scores.append(2 * below - agree.sum())
        first.append(int(np.searchsorted(levels, x[i], side="right")))
    gsign = np.sign(g[raised][:, None] - g[raised][None, :])
    lo = s_fixed - _best_placement([-v for v in scores], first, -gsign)
    hi = s_fixed + _best_placement(scores, first, gsign)
    return [lo / denominator, hi / denominator]


def _best_placement(scores: list[np.ndarray], first: list[int], gsign: np.ndarray) -> float:
    """The largest ``sum_i scores[i][p_i] + sum_{i<k} pair(i, k)`` over intervals ``p_i >= first[i]``, where
    ``pair`` is ``sign(p_i - p_k) * gsign[i, k]`` for different intervals and ``|gsign[i, k]|`` within one (the free
    order there is the better one): depth-first, with each unplaced value's best interval and every pair left at
    its best as the bound."""
    m = len(scores)
    best_alone = [float(s[f:].max()) for s, f in zip(scores, first, strict=True)]
    ahead = np.abs(gsign)
    rest = [sum(best_alone[d:]) + float(np.triu(ahead[d:, d:], 1).sum() + ahead[:d, d:].sum()) for d in range(m + 1)]
    options = [sorted(range(f, len(s)), key=lambda p, s=s: -s[p]) for s, f in zip(scores, first, strict=True)]
    best = [-math.inf]
    chosen: list[int] = []

    def place(d: int, total: float) -> None:
        if total + rest[d] <= best[0]:
            return
        if d == m:
            best[0] = total
            return
        for p in options[d]:
            gain = float(scores[d][p]) + sum(float(gsign[d, k]) * (1 if p > q else -1) if p != q else float(ahead[d, k])
                                             for k, q in enumerate(chosen))
            chosen.append(p)
            place(d + 1, total + gain)
            chosen.pop()

    place(0, 0.0)
    return best[0]


def tau_if_raised_by_enumeration(values: list[float], gap: list[float], lower_bounds: list[bool]) -> list[float]:
    """:func:`tau_if_raised` by trying every place for each raised value: between each two of the values above it,
    or above them all, and for raised values that share an interval every order among them. Its tries grow as
    (members)^(flagged): the slow reference, for a few flagged values.

    Args:
        values: the predictor's value of each model.
        gap: each model's gap.
        lower_bounds: which values are lower bounds, free to rise.

    Returns:
        ``[smallest, largest]`` tau over every place and order tried.
    """
    x = np.asarray(values, dtype=float)
    raised = [i for i, flag in enumerate(lower_bounds) if flag]
    levels = np.unique(x[[i for i, flag in enumerate(lower_bounds) if not flag]])
    taus = []
    for slots in product(*[range(int(np.searchsorted(levels, x[i], side="right")), len(levels) + 1)
                           for i in raised]):
        groups: dict[int, list[int]] = {}
        for i, p in zip(raised, slots, strict=True):
            groups.setdefault(p, []).append(i)
        for orders in product(*(permutations(members) for members in groups.values())):
            y = x.copy()
            for p, order in zip(groups, orders, strict=True):
                low = max([levels[p - 1]] if p > 0 else [], default=-math.inf)
                low = max(low, *(x[i] for i in order))
                high = levels[p] if p < len(levels) else low + 2.0
                for j, i in enumerate(order):  # distinct values in the interval, above each one's own
                    y[i] = low + (high - low) * (j + 1) / (len(order) + 1)
            taus.append(stats.kendalltau(y, gap).statistic)
    return [float(min(taus)), float(max(taus))]
