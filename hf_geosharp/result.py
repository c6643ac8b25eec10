"""What a measurement returns: :class:`SharpnessResult`, its error bars, and the convergence warning."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

@dataclass
class SharpnessResult:
    """A sharpness measurement.

    Attributes:
        value: mean over batches of (max or mean perturbed loss) minus clean loss.
        per_batch: the value of each batch, in batch order.
        clean_loss: mean clean loss over batches.
        per_batch_clean_loss: the clean loss of each batch.
        measure: e.g. ``"geodesic_inv_worst"`` or ``"adaptive_clean_worst"``.
        config: every setting that determines the number (rho, steps, seed, epsilon, ...).
        stderr: standard error of ``value``: over batches for the worst case (NaN with one batch); over batches
            and samples for the average case and relative flatness (see :func:`average_stderr`).
        converged: whether every batch's best value gained at most ``config["tol"]`` (relative) over the last
            quarter of its steps (always True for the average case, which does not iterate).
        convergence_gain: the largest such relative gain over the batches (NaN for the average case).
        steps_used: the most solver steps any batch used (``steps="auto"`` may use more than its first block);
            ``None`` for measures that do not iterate.
    """

    value: float
    per_batch: list[float]
    clean_loss: float
    per_batch_clean_loss: list[float]
    measure: str
    config: dict[str, Any] = field(default_factory=dict)
    stderr: float = math.nan
    converged: bool = True
    convergence_gain: float = math.nan
    steps_used: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        error = "" if math.isnan(self.stderr) else f" +- {self.stderr:.2g}"
        flag = "" if self.converged else f", NOT converged (gain {self.convergence_gain:.2%} in the last quarter)"
        return (
            f"{self.measure}: {self.value:.6g}{error} (clean loss {self.clean_loss:.6g}, "
            f"{len(self.per_batch)} batches, rho={self.config.get('rho')}{flag})"
        )


def _sample_var(xs: list[float]) -> float:
    n = len(xs)
    mean = sum(xs) / n
    return sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else math.nan


def batch_stderr(per_batch: list[float]) -> float:
    """Standard error of the mean over batches (the batches are the random draw); NaN with one batch."""
    return math.sqrt(_sample_var(per_batch) / len(per_batch)) if len(per_batch) > 1 else math.nan


def average_stderr(samples: list[list[float]]) -> float:
    """Standard error of the mean of batch means for per-batch samples (``samples[b]``: one batch's draws).

    With two or more batches, the spread of the batch means (it contains the sampling noise of each mean as well
    as the spread between batches; the cluster estimator); with one batch, the spread of its samples over their
    number. NaN with one sample in all."""
    if len(samples) > 1:
        return batch_stderr([sum(s) / len(s) for s in samples])
    only = samples[0]
    return math.sqrt(_sample_var(only) / len(only)) if len(only) > 1 else math.nan


class NotConvergedWarning(UserWarning):
    """A worst-case value was still rising when the solver stopped (``SharpnessResult.converged`` is False)."""


_collectors: list[list[str]] = []


@contextlib.contextmanager
def collected_convergence_notes() -> Iterator[list[str]]:
    """Collect the not-converged notes of every measurement inside the block instead of warning once per call.

    For faces that run many measurements (leaderboards, the demo): they report one summary line instead of a
    warning per model and measure; each result still carries ``converged`` and ``convergence_gain``."""
    notes: list[str] = []
    _collectors.append(notes)
    try:
        yield notes
    finally:
        _collectors.remove(notes)


def warn_not_converged(measure: str, config: dict[str, Any], gain: float, steps_used: int) -> None:
    """Say that the worst case is still rising, and how to fix it (logger and :class:`NotConvergedWarning`)."""
    if config["steps"] == "auto":
        fix = f"raise the budget (max_steps, now {config['max_steps']}) or lower rho"
    else:
        fix = f"pass steps='auto' (or more steps, e.g. steps={max(200, 10 * steps_used)})"
    message = (
        f"{measure} at rho={config['rho']} is not converged: the best value still rose by {gain:.2%} over the last "
        f"quarter of its {steps_used} steps (tolerance {config['tol']:.2%}), so it underestimates the maximum; {fix}."
    )
    if _collectors:
        _collectors[-1].append(message)
        return
    logger.warning(message)
    warnings.warn(message, NotConvergedWarning, stacklevel=5)
