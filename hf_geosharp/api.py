"""Public entry points: :func:`geodesic_sharpness` and :func:`adaptive_sharpness`.

Each freezes its settings into a :class:`~hf_geosharp.engine.settings.RunSettings` (which checks them) and hands the
model to the runner (:mod:`hf_geosharp.engine.runner`); the model is used as a function of the perturbation and
restored exactly afterwards (:mod:`hf_geosharp.engine.model_function.objective`). Results are
:class:`~hf_geosharp.engine.result.SharpnessResult`. The defaults are :mod:`hf_geosharp.engine.defaults`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from .engine.defaults import (
    ADAPTIVE_VARIANT,
    ELEMENTWISE_CURVATURE,
    EPSILON,
    METRIC,
    MODE,
    N_SAMPLES,
    PARAMS,
    RHO,
    SEED,
    STEP_NORMALIZATION,
    STEPS,
)
from .engine.geometry.elementwise import Curvature
from .engine.geometry.gl_quotient import Metric
from .engine.model_function.objective import LossFn
from .engine.result import NotConvergedWarning, SharpnessResult, collected_convergence_notes
from .engine.runner import run
from .engine.settings import Mode, Params, RunSettings, Steps, Variant
from .engine.solvers.apgd import AUTO_MAX_STEPS, CONVERGENCE_TOL, StepNormalization
from .engine.space.perturbation_space import SpaceOptions
from .symmetry.base import SymmetryMap

__all__ = ["NotConvergedWarning", "SharpnessResult", "adaptive_sharpness", "collected_convergence_notes",
           "geodesic_sharpness"]


def geodesic_sharpness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    rho: float = RHO,
    metric: Metric = METRIC,
    mode: Mode = MODE,
    steps: Steps = STEPS,
    seed: int = SEED,
    epsilon: float = EPSILON,
    loss_fn: LossFn | None = None,
    accelerator: Any = None,
    progress: bool = True,
    symmetry_map: SymmetryMap | None = None,
    params: Params = PARAMS,
    n_samples: int = N_SAMPLES,
    second_order: bool = True,
    riemannian_norm: bool = True,
    horizontal_projection: bool = True,
    elementwise_curvature: Curvature = ELEMENTWISE_CURVATURE,
    step_normalization: StepNormalization = STEP_NORMALIZATION,
    tol: float = CONVERGENCE_TOL,
    max_steps: int = AUTO_MAX_STEPS,
) -> SharpnessResult:
    """Geodesic sharpness (da Silva, Dangel & Oore, ICML 2025): sharpness on the quotient by the attention symmetries.

    Perturbations are horizontal (orthogonal to the GL(h) orbits of every QK and VO head pair), bounded in the
    Riemannian norm ``||xi||_g <= rho`` and applied along second-order geodesics; all other parameters are perturbed
    as in adaptive sharpness. The number is invariant under ``gs.reparametrize(model)``, also with the default
    ``epsilon`` (the relaxation is built to transform with the group; docs/method.md).

    Args:
        model: any ``nn.Module``; restored exactly afterwards (weights, ``requires_grad``, ``.grad``, train/eval mode).
            It runs in eval mode; activation checkpointing that stays on there must be the non-reentrant kind.
        batches: iterable of dicts accepted by ``model(**batch)`` with labels (loss = ``outputs.loss``), or anything
            ``loss_fn`` accepts. Each batch is solved separately and the values are averaged.
        rho: radius of the geodesic ball.
        metric: ``"inv"`` (paper Eq. 9) or ``"mix"`` (Eq. 10).
        mode: ``"worst"`` (Auto-PGD, ``steps`` iterations) or ``"average"`` (``n_samples`` Gaussian directions).
        steps: solver iterations per batch (worst case), exactly that many from one start as in AS23;
            ``converged`` then certifies that the best point is stationary (Frank-Wolfe gap at most ``tol``). Or
            ``"auto"``: continue until the best point is stationary, then start again from the antipode (and, if
            they disagree, from points near the best one; where they found several maxima, also from two random
            points) until two starts agree within ``tol``, within ``max_steps`` steps (docs/method.md,
            "Convergence"). There ``converged`` certifies a stationary point that two starts agree on: a local
            maximum, not necessarily the global one. ``res.certificate`` says whether within ``tol`` or only within
            the loss's floating-point resolution (``"certified_at_precision"``).
        seed: seeds the average-case samples (per batch, independent of the process that solves it).
        epsilon: relative, group-covariant rank relaxation of ``G^T G`` and ``H^T H`` (about ``epsilon`` relative
            to each head's own spectrum); 0 for the exact metric (then rank-deficient heads are refused).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` when the model's own loss is not the one wanted.
        accelerator: an ``accelerate.Accelerator``: batches are sharded over its processes and gathered, so every
            process returns the full result. Move the model to ``accelerator.device`` first; do not DDP-wrap it.
        progress: show a progress bar.
        symmetry_map: where the pairs are; default ``gs.map_symmetries(model)``.
        params: ``"all"`` (default, as in AS23) or ``"trainable"`` (e.g. only LoRA adapters).
        n_samples: directions per batch (average case).
        second_order, riemannian_norm, horizontal_projection: ablation switches (paper App. G).
        elementwise_curvature: geodesic for non-attention parameters (``"none"``: first order, as the paper).
        step_normalization: ``"riemannian"`` (invariant, default), ``"euclidean"`` or ``"none"``.
        tol: relative tolerance of the convergence certificate: the Frank-Wolfe gap at the best point, and the
            agreement of two starts under ``steps="auto"``; a ``NotConvergedWarning`` says when it does not hold
            (``res.converged``, ``res.stationarity_gap``, ``res.convergence_note``).
        max_steps: step budget of ``steps="auto"``.
    """
    options = SpaceOptions(metric, epsilon, second_order, riemannian_norm, horizontal_projection, elementwise_curvature)
    settings = RunSettings(rho, mode, steps, seed, params, n_samples, tol, max_steps, options, step_normalization)
    return run(model, batches, settings, loss_fn=loss_fn, accelerator=accelerator, progress=progress,
               symmetry_map=symmetry_map)


def adaptive_sharpness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    rho: float = RHO,
    mode: Mode = MODE,
    steps: Steps = STEPS,
    seed: int = SEED,
    variant: Variant = ADAPTIVE_VARIANT,
    loss_fn: LossFn | None = None,
    accelerator: Any = None,
    progress: bool = True,
    params: Params = PARAMS,
    n_samples: int = N_SAMPLES,
    tol: float = CONVERGENCE_TOL,
    max_steps: int = AUTO_MAX_STEPS,
) -> SharpnessResult:
    """Adaptive sharpness (Kwon et al. 2021; Andriushchenko et al. 2023):
    ``max_{||delta / |w| || <= rho} L(w + delta) - L(w)``.

    ``variant="clean"`` (default) runs the same solver as :func:`geodesic_sharpness` on the elementwise metric (one
    forward per step) and reaches the maximum of the definition. ``"as23"`` reproduces the reference code
    (``m_apgd_l2``, adaptive) quirks included, for comparison with published numbers; its fixed points are not the
    maximiser's, so it can stall several percent below the maximum (docs/method.md). Arguments as in
    :func:`geodesic_sharpness`.
    """
    settings = RunSettings(rho, mode, steps, seed, params, n_samples, tol, max_steps, variant=variant)
    return run(model, batches, settings, loss_fn=loss_fn, accelerator=accelerator, progress=progress)
