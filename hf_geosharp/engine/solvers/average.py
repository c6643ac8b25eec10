"""The average case: the mean loss increase at random points of the sphere."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..defaults import N_SAMPLES
from .certificate import SolveResult
from .interface import ObjectiveFn, Space


def average_case(
    space: Space,
    objective: ObjectiveFn,
    *,
    rho: float,
    n_samples: int = N_SAMPLES,
    generator: torch.Generator,
    on_step: Callable[[int, float], None] | None = None,
) -> SolveResult:
    """Average case ``E_xi L(Exp(w0; xi)) - L(w0)`` with ``xi = rho * horizontal(z)``, ``z`` metric-isotropic
    (docs/spec.md §3.2)."""
    clean_loss, _ = objective(space.zero(), False)
    losses = []
    for s in range(n_samples):
        xi = rho * space.random_tangent_vector(generator)
        losses.append(objective(xi, False)[0])
        if on_step is not None:
            on_step(s, sum(losses) / len(losses) - clean_loss)
    return SolveResult(sum(losses) / n_samples, clean_loss, [clean_loss] + losses)
