"""Every setting that determines a measurement, frozen in one object that checks itself once, on every path.

The public functions build a :class:`RunSettings`; its constructor refuses bad values (before any work, and the same
way for the single-process and the sharded run), and the runner (:mod:`hf_geosharp.engine.runner`) reads it. Results
carry :meth:`RunSettings.config`. Default values come from :mod:`hf_geosharp.engine.defaults`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from .capture import capture_choice
from .defaults import ADAPTIVE_VARIANT, COMPILE, MODE, N_SAMPLES, PARAMS, SEED, STEP_NORMALIZATION, STEPS
from .geometry.gl_quotient import Metric
from .solvers.apgd import AUTO_MAX_STEPS
from .solvers.certificate import CONVERGENCE_TOL
from .solvers.interface import StepNormalization
from .space.perturbation_space import BALLS, SpaceOptions

Mode = Literal["worst", "average"]
Steps = int | Literal["auto"]
Params = Literal["all", "trainable"]
Variant = Literal["clean", "as23"]
MODES: tuple[Mode, ...] = get_args(Mode)
PARAMS_CHOICES: tuple[Params, ...] = get_args(Params)
VARIANTS: tuple[Variant, ...] = get_args(Variant)
METRICS: tuple[Metric, ...] = get_args(Metric)
STEP_NORMALIZATIONS: tuple[StepNormalization, ...] = get_args(StepNormalization)


def measure_name(family: str, mode: Mode, *, metric: str | None = None, variant: str | None = None) -> str:
    """The engine's name of a measure run in ``mode`` (``SharpnessResult.measure``, a leaderboard column):
    ``geodesic_<metric>_<mode>``, ``adaptive_<variant>_worst`` or ``adaptive_average`` (the average case has no
    solver variant), and the family itself for a measure that has no mode (``relative_flatness``)."""
    if family == "geodesic":
        return f"geodesic_{metric}_{mode}"
    if family == "adaptive":
        return f"adaptive_{variant}_{mode}" if mode == "worst" else "adaptive_average"
    return family


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        shown = " or ".join(", ".join(repr(a) for a in allowed).rsplit(", ", 1))
        raise ValueError(f"{name} must be {shown}, got {value!r}.")


def _integral(value: Any) -> bool:
    """An integer, numpy's included; not a bool (an int subclass: ``steps=True`` would silently mean 1 step)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _finite_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


@dataclass(frozen=True)
class RunSettings:
    """Every setting that determines a measurement, checked when it is made (numpy scalars are accepted and stored
    as plain Python numbers, e.g. ``np.int64(20)``).

    ``options`` is None for adaptive sharpness, whose ``variant`` is then its solver (``None``: the default one);
    ``variant`` is None for geodesic sharpness."""

    rho: float
    mode: Mode = MODE
    steps: Steps = STEPS
    seed: int = SEED
    params: Params = PARAMS
    n_samples: int = N_SAMPLES
    tol: float = CONVERGENCE_TOL
    max_steps: int = AUTO_MAX_STEPS
    options: SpaceOptions | None = None
    step_normalization: StepNormalization = STEP_NORMALIZATION
    variant: Variant | None = None
    #: How the worst case's step runs (:mod:`hf_geosharp.engine.capture`); it changes no number beyond rounding,
    #: so results do not record it.
    compile: str = COMPILE

    def __post_init__(self) -> None:
        auto = isinstance(self.steps, str) and self.steps == "auto"
        if not _finite_real(self.rho) or self.rho <= 0:
            raise ValueError(f"rho must be a positive finite number, got {self.rho!r}.")
        _choice("mode", self.mode, MODES)
        if not auto and (not _integral(self.steps) or self.steps < 1):
            raise ValueError(f"steps must be a positive integer or 'auto', got {self.steps!r}.")
        if not _integral(self.n_samples) or self.n_samples < 1:
            raise ValueError(f"n_samples must be a positive integer, got {self.n_samples!r}.")
        if not _integral(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
            raise ValueError(f"tol must be a finite number >= 0, got {tol!r}.")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {self.max_steps!r}.")
        options = self.options
        if options is not None:
            _choice("metric", options.metric, METRICS)
            _choice("ball", options.ball, BALLS)
            if not _finite_real(options.epsilon) or options.epsilon < 0:
                raise ValueError(f"epsilon must be a finite number >= 0, got {options.epsilon!r}.")
            options = dataclasses.replace(options, epsilon=float(options.epsilon))
        _choice("step_normalization", self.step_normalization, STEP_NORMALIZATIONS)
        variant = ADAPTIVE_VARIANT if options is None and self.variant is None else self.variant
        if variant is not None:
            _choice("variant", variant, VARIANTS)
        _choice("params", self.params, PARAMS_CHOICES)
        capture_choice(self.compile)
        plain = dict(rho=float(self.rho), steps=self.steps if auto else int(self.steps),
                     n_samples=int(self.n_samples), seed=int(self.seed), options=options, variant=variant)
        for name, value in plain.items():  # frozen: the checked values replace the given ones
            object.__setattr__(self, name, value)

    @property
    def measure(self) -> str:
        """The engine's name of what these settings measure (``SharpnessResult.measure``)."""
        if self.options is not None:
            return measure_name("geodesic", self.mode, metric=self.options.metric)
        return measure_name("adaptive", self.mode, variant=self.variant)

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
        return {**common, "metric": o.metric, "ball": o.ball, "epsilon": o.epsilon, "second_order": o.second_order,
                "riemannian_norm": o.riemannian_norm, "horizontal_projection": o.horizontal_projection,
                "elementwise_curvature": o.elementwise_curvature, "step_normalization": self.step_normalization}

    @property
    def starts(self) -> int:
        """How many starts must agree for a worst case to count as converged: two under ``steps="auto"`` with the
        clean solver (it restarts), one otherwise."""
        return 2 if self.steps == "auto" and self.variant != "as23" else 1


def config_keys() -> tuple[str, ...]:
    """Every key :meth:`RunSettings.config` can carry, geodesic and adaptive, in its order: what a face that shows
    the settings of results (model cards) reads, derived from the one place that writes them."""
    geodesic = RunSettings(rho=1.0, options=SpaceOptions()).config()
    return tuple(dict.fromkeys([*geodesic, *RunSettings(rho=1.0).config()]))
