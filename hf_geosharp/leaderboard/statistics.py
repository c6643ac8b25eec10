"""Does a predictor rank models by their generalisation gap? Kendall tau with a bootstrap interval over models."""

from __future__ import annotations

import math
import warnings
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
