"""What a measurement returns: :class:`SharpnessResult`, its error bars, and the convergence warning."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any


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
        stderr: standard error of ``value``: over batches for the worst case and exact relative flatness (NaN
            with one batch); over batches and samples for the average case and sampled relative flatness (see
            :func:`average_stderr`).
        converged: the certificate of the worst case (docs/method.md, "Convergence"): every batch's best point is
            stationary on the ball (its relative Frank-Wolfe gap is at most ``config["tol"]``) and, under
            ``steps="auto"``, a second start reached the same value within ``tol``: two starts agree on a
            stationary point, a local maximum, not necessarily the global one. Also True when that holds only at
            the resolution of the loss's floating type (``certificate == "certified_at_precision"``). Always True
            for measures that do not iterate (the average case, relative flatness).
        stationarity_gap: the largest relative Frank-Wolfe gap over the batches (NaN where nothing iterates): 0 at
            a stationary point, and where the loss is concave on the ball a bound on the relative distance to the
            maximum.
        convergence_note: why the result is not certified (the first such batch); when it is certified at
            precision, what was certified; None when certified within ``tol``.
        steps_used: the most points any batch evaluated after the clean one (solver steps and further starts);
            ``None`` for measures that do not iterate.
        certificate: ``"certified"`` (within ``tol``), ``"certified_at_precision"`` (stationary and agreeing only
            within the loss's resolution in its floating type, ``PRECISION_FACTOR * eps * |loss|``; the note says
            how much that is), ``"not_certified"`` (``converged`` is False; a lower bound), or ``"not_iterative"``.
    """

    value: float
    per_batch: list[float]
    clean_loss: float
    per_batch_clean_loss: list[float]
    measure: str
    config: dict[str, Any] = field(default_factory=dict)
    stderr: float = math.nan
    converged: bool = True
    stationarity_gap: float = math.nan
    convergence_note: str | None = None
    steps_used: int | None = None
    certificate: str = "not_iterative"

    def to_dict(self) -> dict[str, Any]:
        """The result as plain data (JSON-ready apart from NaN)."""
        return asdict(self)

    def __str__(self) -> str:
        error = "" if math.isnan(self.stderr) else f" +- {self.stderr:.2g}"
        flag = "" if self.converged else f", NOT converged: {self.convergence_note}"
        if self.certificate == "certified_at_precision":
            flag = f", {self.convergence_note}"
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


#: ``SharpnessResult.certificate`` of a measure that does not iterate.
NOT_ITERATIVE = "not_iterative"

_collectors: list[list[str]] = []


@contextlib.contextmanager
def collected_convergence_notes() -> Iterator[list[str]]:
    """Collect the not-converged notes of every measurement inside the block instead of warning once per call.

    For faces that run many measurements (leaderboards, the demo): they report one summary line instead of a
    warning per model and measure; each result still carries ``converged`` and ``convergence_note``."""
    notes: list[str] = []
    _collectors.append(notes)
    try:
        yield notes
    finally:
        _collectors.remove(notes)


def warn_not_converged(measure: str, config: dict[str, Any], note: str, steps_used: int) -> None:
    """Say that the worst case is not certified, why, and how to fix it: one :class:`NotConvergedWarning` (the CLI
    shows it as a log line), or a note for :func:`collected_convergence_notes`."""
    if config.get("variant") == "as23":
        fix = ("AS23's reproduced solver stops where its Euclidean projection undoes the step, which is not the "
               "maximum (docs/method.md); variant='clean' reaches it")
    elif config["steps"] != "auto":
        fix = "pass steps='auto' (it continues until the best point is stationary and a second start agrees)"
    elif "different maxima" in note:
        fix = "the landscape has several maxima at this rho: lower rho, or read the value as a lower bound"
    else:
        fix = f"raise the budget (max_steps, now {config['max_steps']}) or lower rho"
    message = (f"{measure} at rho={config['rho']} is not converged after {steps_used} steps, so it may underestimate "
               f"the maximum: {note}; {fix}.")
    if _collectors:
        _collectors[-1].append(message)
        return
    warnings.warn(message, NotConvergedWarning, stacklevel=5)
