"""Every setting that determines a measurement, frozen in one object that the public functions build and check.

The runner (:mod:`hf_geosharp.engine.runner`) reads it; results carry :meth:`RunSettings.config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .checks import Steps
from .solvers.apgd import AUTO_MAX_STEPS, CONVERGENCE_TOL, StepNormalization
from .space.perturbation_space import SpaceOptions

Mode = Literal["worst", "average"]


@dataclass(frozen=True)
class RunSettings:
    """Every setting that determines a measurement (checked by the public functions before they build one).

    ``options`` is None for adaptive sharpness; ``variant`` is None for geodesic sharpness."""

    rho: float
    mode: Mode = "worst"
    steps: Steps = 20
    seed: int = 0
    params: Literal["all", "trainable"] = "all"
    n_samples: int = 20
    tol: float = CONVERGENCE_TOL
    max_steps: int = AUTO_MAX_STEPS
    options: SpaceOptions | None = None
    step_normalization: StepNormalization = "riemannian"
    variant: Literal["clean", "as23"] | None = None

    @property
    def measure(self) -> str:
        if self.options is not None:
            return f"geodesic_{self.options.metric}_{self.mode}"
        return f"adaptive_{self.variant}_{self.mode}" if self.mode == "worst" else "adaptive_average"

    @property
    def full_gradient(self) -> bool:
        """AS23 and the Euclidean step normalisation divide by the global gradient norm, frozen and zero-weight
        coordinates included; every other solver only needs the coordinates that can move."""
        return self.variant == "as23" or self.step_normalization == "euclidean"

    def config(self) -> dict[str, Any]:
        """The settings as results carry them (``SharpnessResult.config``)."""
        common = dict(rho=self.rho, mode=self.mode, steps=self.steps, seed=self.seed, params=self.params,
                      n_samples=self.n_samples, tol=self.tol, max_steps=self.max_steps)
        if self.options is None:
            return {**common, "variant": self.variant}
        o = self.options
        return {**common, "metric": o.metric, "epsilon": o.epsilon, "second_order": o.second_order,
                "riemannian_norm": o.riemannian_norm, "horizontal_projection": o.horizontal_projection,
                "elementwise_curvature": o.elementwise_curvature, "step_normalization": self.step_normalization}

    @property
    def starts(self) -> int:
        """How many starts must agree for a worst case to count as converged: two under ``steps="auto"`` with the
        clean solver (it restarts), one otherwise."""
        return 2 if self.steps == "auto" and self.variant != "as23" else 1
